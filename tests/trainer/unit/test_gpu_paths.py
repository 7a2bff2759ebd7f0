"""What the trainer does differently on GPUs, checked on CPU: the FSDP unit layout of tied and untied
models and its mixed-precision policy (torchtitan's), a graph break under fsdp.compile, the refusal to
train on the CPU when GPUs were asked for, the NCCL socket interface, rotary frequencies after meta-device
initialisation, and the attention term of the FLOPs count against torchtitan's."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

from fsdp_trainer import distributed, model, parallelize, transport
from fsdp_trainer.contract import FsdpSpec, ModelSpec, NetworkSpec, Versions
from fsdp_trainer.errors import DeviceError, ErrorKind, classify
from fsdp_trainer.metrics import flops_per_token
from tests.support.manifests import tiny_qwen2
from tests.support.paths import REPO
from tests.support.tiny_model import tiny_lm

TINY_QWEN2 = tiny_qwen2(vocab_size=64)


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(tied: bool, spec: FsdpSpec | None = None) -> Any:
    lm = tiny_lm(vocab_size=64, tie_word_embeddings=tied)
    mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=1), "cpu")
    parallelize.parallelize(lm, spec or FsdpSpec(), mesh, torch.float32)
    return lm


def own_parameters(lm: Any, unit: Any) -> set[str]:
    """The parameters an FSDP unit gathers (its group's), by their names in the model."""
    names = {id(parameter): name for name, parameter in lm.named_parameters()}
    group = unit._get_fsdp_state()._fsdp_param_group
    return set() if group is None else {names[id(param.sharded_param)] for param in group.fsdp_params}


def test_an_untied_model_shards_its_embedding_alone_and_the_norm_with_the_head(one_rank: None) -> None:
    lm = sharded(tied=False)
    embedding, norm, head = lm.model.embed_tokens, lm.model.norm, lm.lm_head
    assert isinstance(embedding, FSDPModule) and isinstance(norm, FSDPModule) and isinstance(head, FSDPModule)
    assert own_parameters(lm, embedding) == {"model.embed_tokens.weight"}
    assert norm._get_fsdp_state() is head._get_fsdp_state(), "one unit: one all-gather, one reduce-scatter"
    assert own_parameters(lm, norm) == {"model.norm.weight", "lm_head.weight"}
    assert own_parameters(lm, lm) == set(), "the root holds nothing of its own"
    assert norm._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None, "kept for backward"


def test_a_tied_model_keeps_its_embedding_and_norm_in_the_root(one_rank: None) -> None:
    lm = sharded(tied=True)
    assert not isinstance(lm.model.embed_tokens, FSDPModule)
    assert own_parameters(lm, lm) == {"model.embed_tokens.weight", "model.norm.weight"}


def test_layers_get_their_inputs_uncast_as_torchtitan_does(one_rank: None) -> None:
    lm = sharded(tied=False)
    states = {id(m._get_fsdp_state()): m._get_fsdp_state() for m in lm.modules() if isinstance(m, FSDPModule)}
    assert len(states) == 2 + 2 + 1  # two layers, the embedding, [norm, head], the root
    assert all(not state._mp_policy.cast_forward_inputs for state in states.values())


class ActivationWithAGraphBreak(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return F.silu(x)


def test_a_graph_break_under_compile_fails_the_first_forward(one_rank: None) -> None:
    lm = tiny_lm(vocab_size=64)

    for layer in parallelize.decoder_layers(lm):
        layer.mlp.act_fn = ActivationWithAGraphBreak()
    mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=1), "cpu")
    parallelize.parallelize(lm, FsdpSpec(compile=True), mesh, torch.float32)
    batch = torch.randint(0, 64, (1, 8))
    with pytest.raises(torch._dynamo.exc.Unsupported):
        lm(input_ids=batch, labels=batch)


def test_gpus_asked_for_without_cuda_are_refused_not_trained_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CPU-only here, on a GPU host too
    with pytest.raises(DeviceError, match="GPUs were asked for") as refused:
        distributed.start(use_gpu=True)
    assert not dist.is_initialized(), "refused before any process group exists"
    assert classify(refused.value) == ErrorKind.RUNTIME, "another node may have a working driver"


def test_the_nccl_socket_interface_is_eth0_where_the_pod_has_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    (tmp_path / "lo").mkdir()
    assert "no eth0" in transport.choose_socket_interface(str(tmp_path))
    assert "NCCL_SOCKET_IFNAME" not in os.environ, "no eth0: NCCL's own choice stands"
    (tmp_path / "eth0").mkdir()
    line = transport.choose_socket_interface(str(tmp_path))
    assert line.startswith("NCCL_SOCKET_IFNAME=eth0 (the trainer's default")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "eth0"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ens5")
    assert transport.choose_socket_interface(str(tmp_path)) == "NCCL_SOCKET_IFNAME=ens5 (set for the run)"


@pytest.mark.parametrize("weights", ["initialise", "checkpoint", "load"])
def test_rotary_frequencies_after_meta_initialisation_are_a_fresh_models(
    weights: str, tmp_path: Path
) -> None:
    settings = {**TINY_QWEN2, "rope_theta": 50_000.0, "tie_word_embeddings": False}
    spec = ModelSpec(from_config=settings)
    config = model.model_config(spec, 0, lambda: None)
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.save_pretrained(tmp_path)  # the weights "load" reads
    lm = model.empty_model(config)
    source = ModelSpec(source=str(tmp_path)) if weights == "load" else spec
    model.materialise(lm, torch.device("cpu"), weights, source, 0, 0, 0, lambda: None)  # type: ignore[arg-type]
    expected = dict(fresh.named_buffers())
    assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= expected.keys()
    for name, buffer in lm.named_buffers():
        torch.testing.assert_close(buffer, expected[name], rtol=0, atol=0, msg=name)


def test_the_trainer_requires_transformers_5() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "transformers>=5" in extras["trainer"], "before 5 nothing refills inv_freq after to_empty"


# torchtitan's flavor "0.6B" of Qwen3 (torchtitan/models/qwen3/__init__.py) and Hugging Face's config of it.
QWEN3_06B = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}


def torchtitan_attention_flops(layers: int, heads: int, head_dim: int, sequence_length: int) -> int:
    """torchtitan's term (models/utils.py): 6 * n_layers * n_heads * head_dims * seq_len, where Qwen3 passes
    head_dims = 2 * head_dim (the q/k and the v widths)."""
    return 6 * layers * heads * (2 * head_dim) * sequence_length


@pytest.mark.parametrize("sequence_length", [2048, 4096])
def test_the_flops_attention_term_is_torchtitans_for_qwen3(sequence_length: int) -> None:
    config = model.model_config(ModelSpec(from_config=QWEN3_06B), 0, lambda: None)
    shape = model.model_shape(model.empty_model(config))
    attention = flops_per_token(shape, sequence_length) - 6 * shape.params
    assert attention == torchtitan_attention_flops(28, 16, 128, sequence_length)
    assert attention != 12 * 28 * 1024 * sequence_length, "heads x head_dim is 2048 here, not the hidden 1024"


def test_the_transport_report_records_the_interface_after_nccls_own_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nccl_log = [
        "host:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.2.3<0>",
        "host:1:1 [0] NCCL INFO Using network Socket",
    ]
    monkeypatch.setattr(transport, "own_nccl_log_lines", lambda run_name: nccl_log)
    monkeypatch.setattr(transport.distributed, "all_gather", lambda value: [value])
    monkeypatch.setattr(distributed.Runtime, "backend", property(lambda self: "nccl"))
    runtime = distributed.Runtime("single", 0, 1, 0, 1, torch.device("cpu"))
    chosen = "NCCL_SOCKET_IFNAME=eth0 (the trainer's default where the pod has it, as AWS's)"
    report = transport.measure(NetworkSpec(bandwidth_probe_mb=0), "run", runtime, Versions(), chosen)
    assert report.evidence == ["NET/Socket : Using [0]eth0:10.1.2.3<0>", "Using network Socket", chosen]
