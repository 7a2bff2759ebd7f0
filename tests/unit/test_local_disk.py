"""A worker's disk request defaults to what it writes: sized by the model, not a flat 200Gi that no default
EKS node offers, nor a flat size a 70B checkpoint overflows."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_operator import api, builder, localdisk
from tests.support.manifests import tiny_qwen2

GIB = 2**30
RUN = builder.RunRef(name="run", namespace="team-a", uid="0f1e2d3c-0000-4000-8000-000000000001")


def spec(model: dict[str, Any], **cluster: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {"model": model, "checkpoint": {"storagePath": "s3://b/p"}, "cluster": cluster}
    )


@pytest.mark.parametrize(
    ("source", "parameters"),
    [
        ("Qwen/Qwen2.5-1.5B", 1_500_000_000),
        ("meta-llama/Llama-3.1-8B-Instruct", 8_000_000_000),
        ("meta-llama/Llama-3.1-70B", 70_000_000_000),
        ("HuggingFaceTB/SmolLM2-360M", 360_000_000),
        ("mistralai/Mixtral-8x7B-v0.1", 56_000_000_000),  # eight experts of 7B: an upper bound
        ("Qwen/Qwen3-30B-A3B", 30_000_000_000),  # the total, not the active parameters
        ("s3://models/Qwen2.5-7B/", 7_000_000_000),
        ("openai-community/gpt2", None),
    ],
)
def test_the_size_in_a_models_name(source: str, parameters: int | None) -> None:
    assert localdisk.parameter_count(spec({"source": source}).model) == parameters


def test_the_size_of_a_model_from_its_config_is_counted_as_transformers_builds_it() -> None:
    """Qwen2.5-1.5B's config: 1,543,714,304 parameters as transformers reports them, less the 1,024-wide
    attention biases this count leaves out (0.02%)."""
    config = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    counted = localdisk.parameter_count(spec({"fromConfig": config}).model)
    assert counted is not None and abs(counted - 1_543_714_304) / 1_543_714_304 < 0.001
    assert (
        localdisk.parameter_count(spec({"fromConfig": {"model_type": "qwen2", "hidden_size": "x"}}).model)
        is None
    )


def test_the_default_covers_a_whole_checkpoint_copied_on_resume_and_the_download() -> None:
    disk = spec({"source": "meta-llama/Llama-3.1-70B"}).worker_disk()
    assert disk.resume_copy == 70 * 10**9 * 12 and disk.model_cache == 70 * 10**9 * 2
    assert disk.size >= (disk.resume_copy + disk.model_cache) * localdisk.HEADROOM
    assert spec({"source": "Qwen/Qwen2.5-1.5B"}).worker_ephemeral_storage() == "33Gi"
    # Random initialisation downloads nothing: the tiny demo's workers ask for little more than Ray's share.
    tiny = spec({"fromConfig": tiny_qwen2()}).worker_disk()
    assert tiny.model_cache == 0 and tiny.size == localdisk.RAY_ALLOWANCE + GIB


def test_what_the_spec_sets_wins_and_an_unknown_size_keeps_the_old_default() -> None:
    assert spec({"source": "Qwen/Qwen2.5-1.5B"}, ephemeralStorage="50Gi").worker_ephemeral_storage() == "50Gi"
    assert spec({"source": "org/unnamed"}).worker_ephemeral_storage() == "200Gi"
    manifest = builder.build_raycluster(
        spec({"source": "Qwen/Qwen2.5-1.5B"}), RUN, "image", zone="us-west-2a"
    )
    worker = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "33Gi"
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "33Gi"}} in worker["volumes"]
