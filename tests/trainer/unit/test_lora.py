"""LoRA (issue 48 item 4), the trainer's loop in one CPU process on a chat corpus: only the adapter trains
(the pretrained weights stay bit-identical), its checkpoints hold the adapter and its optimizer state only
(under 1 % of a full fine-tune's for the tiny model), a resumed run trains exactly as an uninterrupted one,
the merged export loads in transformers with the logits of base + adapter (peft), and a new run can start
from the exported adapter."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM

from fsdp_trainer import adapter, data, distributed, optim
from fsdp_trainer.contract import AdapterSpec, ProgressRecord, TrainerConfig
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.model import byte_level_tokenizer
from fsdp_trainer.sharded_model import build_sharded_model
from tests.support.corpus import write_chat_jsonl
from tests.support.manifests import CHATML
from tests.support.tiny_model import tiny_lm
from tests.support.trainer_runs import config, history, train

ADAPTER = {"rank": 1, "alpha": 2, "targetModules": ["q_proj", "v_proj"], "exportMerged": True}
SIZES = {"hidden_size": 64, "intermediate_size": 256, "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny "pretrained" model in a directory, as model.source reads one."""
    directory = tmp_path_factory.mktemp("pretrained")
    tiny_lm(seed=1, **SIZES).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", 300)


def chat_run(
    storage: Path, pretrained: Path, corpus: Path, max_steps: int, lora: bool = True
) -> TrainerConfig:
    trainer = config(storage, max_steps=max_steps).model_dump(by_alias=True)
    trainer["model"] = {"source": str(pretrained), "tokenizer": "byte-level"}
    trainer["fsdp"] = {"mixedPrecision": "fp32", **({"adapter": ADAPTER} if lora else {})}
    trainer["data"] = {
        "source": str(corpus),
        "format": "messages",
        "chatTemplate": CHATML,
        "evalFraction": 0.1,
        "evalBatches": 2,
        "evalEvery": 2,
    }
    trainer["training"].update(sequenceLength=128, schedule="constant", warmupSteps=0, learningRate=1e-2)
    trainer["checkpoint"].update(exportModel=True)
    return TrainerConfig.model_validate(trainer)


def losses(records: list[ProgressRecord]) -> dict[int, float]:
    return {r.step: r.loss for r in records if r.phase == "training" and r.step and r.loss is not None}


def tensor_bytes(checkpoint: Path) -> int:
    """The bytes of the tensors a checkpoint holds (weights and optimizer state), from DCP's metadata. The
    rest (the data streams' cursors, the RNG states, the metadata itself: about 130 kB here) is the same
    for any model, and at the tiny model's 140 k weights it would be most of the adapter's checkpoint."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    return sum(
        math.prod(entry.size) * entry.properties.dtype.itemsize
        for entry in metadata.state_dict_metadata.values()
        if isinstance(entry, TensorStorageMetadata)
    )


def test_a_lora_run_checkpoints_resumes_and_exports_only_the_adapter(
    tmp_path: Path, pretrained: Path, corpus: Path
) -> None:
    train(chat_run(tmp_path / "straight", pretrained, corpus, max_steps=6), "job-1")
    (straight,) = history(tmp_path / "straight" / "team-a" / "tiny")
    train(chat_run(tmp_path / "resumed", pretrained, corpus, max_steps=4), "job-1")  # checkpoints at 2, 4
    train(chat_run(tmp_path / "resumed", pretrained, corpus, max_steps=6), "job-2")
    first, resumed = history(tmp_path / "resumed" / "team-a" / "tiny")
    assert resumed[-1].phase == "finished" and resumed[-1].resumed_from_step == 4
    assert losses(first) | losses(resumed) == pytest.approx(losses(straight), abs=1e-6), "resumed exactly"
    assert losses(straight)[6] < losses(straight)[1], "the adapter learns"
    evaluated = [r.eval_loss for r in straight if r.eval_loss is not None]
    assert len(evaluated) >= 3 and evaluated[-1] < evaluated[0], "the held-out loss on the answers falls"
    finished = straight[-1]
    adapter_weights = 2 * (64 * 1 + 1 * 64) + 2 * (
        64 * 1 + 1 * 32
    )  # rank 1 on q_proj (64x64), v_proj (32x64)
    assert finished.adapter_bytes == 4 * adapter_weights
    assert finished.training_data is not None
    assert (finished.training_data.format, finished.training_data.learned) == ("messages", "assistant turns")

    train(chat_run(tmp_path / "full", pretrained, corpus, max_steps=2, lora=False), "job-1")
    run = tmp_path / "straight" / "team-a" / "tiny"
    lora_checkpoint = tensor_bytes(min(run.glob("checkpoint_*")))
    full_checkpoint = tensor_bytes(min((tmp_path / "full" / "team-a" / "tiny").glob("checkpoint_*")))
    assert lora_checkpoint < 0.01 * full_checkpoint, (lora_checkpoint, full_checkpoint)

    # The adapter as peft reads it, and the merged model as transformers does: the same logits.
    saved = load_file(run / "adapter" / adapter.ADAPTER_WEIGHTS)
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(pretrained).eval()(input_ids=tokens).logits
        base = AutoModelForCausalLM.from_pretrained(pretrained)
        with_adapter = PeftModel.from_pretrained(base, run / "adapter").eval()  # peft's own loading
        merged = AutoModelForCausalLM.from_pretrained(run / "model").eval()
        expected = with_adapter(input_ids=tokens).logits
        assert not torch.allclose(expected, base_logits), "the adapter changes the logits"
        torch.testing.assert_close(merged(input_ids=tokens).logits, expected, rtol=1e-4, atol=1e-5)

    # A fine-tune from the exported adapter starts from it: one step at a negligible learning rate exports
    # the same merged model.
    follow = chat_run(tmp_path / "follow", pretrained, corpus, max_steps=1).model_dump(by_alias=True)
    follow["fsdp"]["adapter"]["initFrom"] = str(run / "adapter")
    follow["training"]["learningRate"] = 1e-12
    train(TrainerConfig.model_validate(follow), "job-1")
    followed = AutoModelForCausalLM.from_pretrained(tmp_path / "follow" / "team-a" / "tiny" / "model").eval()
    with torch.no_grad():
        torch.testing.assert_close(followed(input_ids=tokens).logits, expected, rtol=1e-4, atol=1e-5)


def test_training_an_adapter_leaves_the_pretrained_weights_bit_identical(
    tmp_path: Path, pretrained: Path, corpus: Path
) -> None:
    trainer = chat_run(tmp_path, pretrained, corpus, max_steps=3)
    runtime = distributed.start(use_gpu=False)
    try:
        sharded = build_sharded_model(
            trainer, AutoModelForCausalLM.from_pretrained(pretrained).config, runtime, "load"
        )
        lm = sharded.lm
        optimizer = optim.build_optimizer(lm, trainer.training)
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        names = {id(p): name for name, p in lm.named_parameters()}
        assert {names[i] for i in in_optimizer} == {
            n for n, p in lm.named_parameters() if adapter.is_adapter_weight(n)
        }
        before = {n: p.detach().full_tensor().clone() for n, p in lm.named_parameters()}
        datasets = data.build_datasets(trainer.data, byte_level_tokenizer(), 320, 128, seed=0, streams=2)
        loader = data.BatchLoader(datasets.train, data.BatchLayout(1, 2, 1), 0, runtime.device)
        for _ in range(3):
            optim.accumulate_gradients(lm, sharded.root, list(loader.next_step()), True)
            optimizer.step()
            optimizer.zero_grad()
        after = {n: p.detach().full_tensor() for n, p in lm.named_parameters()}
    finally:
        distributed.stop(runtime)
    frozen = [n for n in before if not adapter.is_adapter_weight(n)]
    assert all(torch.equal(before[n], after[n]) for n in frozen), "bit-identical"
    assert all(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n), "the adapter trained"
    files = load_file(pretrained / "model.safetensors")
    assert all(
        torch.equal(after[n], files[adapter.pretrained_name(n)])
        for n in frozen
        if adapter.pretrained_name(n) in files
    )


def test_an_adapter_without_peft_is_a_configuration_error_naming_the_requirement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where Ray could not install peft (no package index, an image without it) the run fails once, saying
    what it needs, not a ModuleNotFoundError retried as a runtime failure."""
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"fsdp\.adapter needs peft==0\.21\.2"):
        adapter.inject(tiny_lm(), AdapterSpec())
