"""Non-finite steps: a step whose loss or gradient norm is inf or NaN on any rank is skipped on every rank (no
update, no schedule step) and counted; training.maxNonFiniteSteps of them in a row fail the attempt
(NonFiniteLoss, permanent); no checkpoint holds the state a non-finite step left, and retention never deletes
the newest checkpoint whose loss was finite. The loop runs in one CPU process (gloo, a tiny Qwen2)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_trainer import data, optim, parallelize
from fsdp_trainer.checkpoint import checkpoint_name, prune
from fsdp_trainer.contract import (
    MANIFEST_FILE,
    PERMANENT_ERROR_KINDS,
    CheckpointManifest,
    ErrorKind,
    FsdpSpec,
    ProgressRecord,
    TrainerConfig,
)
from fsdp_trainer.errors import NonFiniteLossError, classify
from fsdp_trainer.storage import Location
from tests.support.net import free_port
from tests.support.tiny_model import tiny_lm
from tests.support.trainer_runs import config, manifests, train

Poison = Callable[[torch.nn.Module], Callable[[], None]]


def nan_activations(lm: torch.nn.Module) -> Callable[[], None]:
    """NaN out of the embeddings: a NaN loss, and NaN gradients everywhere."""
    hook = lm.get_input_embeddings().register_forward_hook(lambda module, args, output: output * math.nan)
    return hook.remove


def inf_gradient(lm: torch.nn.Module) -> Callable[[], None]:
    """One gradient element overflows after backward; the loss stays finite."""

    def after_backward() -> None:
        grad = next(lm.parameters()).grad
        assert isinstance(grad, DTensor)
        grad.to_local().view(-1)[0] = math.inf

    return after_backward


def poison_steps(monkeypatch: pytest.MonkeyPatch, steps: set[int], poison: Poison = nan_activations) -> None:
    """Makes the given steps (1-based, of a run from scratch) non-finite."""
    accumulate = optim.accumulate_gradients
    calls = 0

    def accumulate_gradients(lm: torch.nn.Module, *args: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls not in steps:
            return accumulate(lm, *args)
        finish = poison(lm)
        loss = accumulate(lm, *args)
        finish()
        return loss

    monkeypatch.setattr(optim, "accumulate_gradients", accumulate_gradients)


def with_limit(trainer: TrainerConfig, max_non_finite_steps: int) -> TrainerConfig:
    training = trainer.training.model_copy(update={"max_non_finite_steps": max_non_finite_steps})
    return trainer.model_copy(update={"training": training})


def progress(run: Path) -> ProgressRecord:
    return ProgressRecord.model_validate_json((run / "progress.json").read_text())


def saved_state(run: Path, step: int) -> dict[str, Any]:
    """The checkpoint of `step` as one plain state dict ({"app": {"model": ..., "optimizer": ...}})."""
    [directory] = run.glob(f"checkpoint_{step:08d}_*")
    target = run.parent / f"state-{step}.pt"
    dcp_to_torch_save(directory, target)
    state: dict[str, Any] = torch.load(target, weights_only=False)
    return state


def tensors(state: Any) -> Iterable[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors(value)


@pytest.mark.parametrize("poison", [nan_activations, inf_gradient], ids=["nan-loss", "inf-gradient"])
def test_a_non_finite_step_is_skipped_counted_and_never_checkpointed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, poison: Poison
) -> None:
    poison_steps(monkeypatch, {2}, poison)  # a checkpoint step (everySteps 2)
    train(config(tmp_path, max_steps=4), "job-1")

    run = tmp_path / "team-a" / "tiny"
    final = progress(run)
    assert (final.phase, final.step, final.non_finite_steps) == ("finished", 4, 1)
    assert [m.step for m in manifests(run)] == [3, 4], "the save due at the skipped step waits for step 3"
    saved = {step: saved_state(run, step)["app"] for step in (3, 4)}
    for step, state in saved.items():
        assert all(bool(torch.isfinite(t).all()) for t in tensors(state["model"])), step
        assert all(bool(torch.isfinite(t).all()) for t in tensors(state["optimizer"])), step
    last = saved[4]
    assert last["scheduler"]["last_epoch"] == 3, "the schedule counts the 3 updates applied"
    adam_steps = {float(s["step"]) for s in last["optimizer"]["state"].values()}
    assert adam_steps == {3.0}, "AdamW never took the skipped step"
    assert last["train"]["step"] == 4 and last["train"]["data_position"] == 4 * 2, (
        "the skipped step took its number and its batch"
    )


def test_steps_not_in_a_row_do_not_fail_the_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    poison_steps(monkeypatch, {2, 4})
    train(with_limit(config(tmp_path, max_steps=5), 2), "job-1")

    run = tmp_path / "team-a" / "tiny"
    final = progress(run)
    assert (final.phase, final.step, final.non_finite_steps) == ("finished", 5, 2)
    assert [m.step for m in manifests(run)] == [3, 5]


def test_max_non_finite_steps_in_a_row_fail_the_attempt_naming_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison_steps(monkeypatch, {3, 4})
    with pytest.raises(NonFiniteLossError) as failed:
        train(with_limit(config(tmp_path, max_steps=6), 2), "job-1")

    message = str(failed.value)
    assert message.startswith("step 4:") and "steps 3-4" in message and "maxNonFiniteSteps 2" in message
    assert classify(failed.value) == ErrorKind.NON_FINITE_LOSS in PERMANENT_ERROR_KINDS
    run = tmp_path / "team-a" / "tiny"
    record = progress(run)
    assert (record.phase, record.error_kind, record.non_finite_steps) == ("failed", "non-finite-loss", 2)
    assert record.error is not None and "NonFiniteLossError: step 4:" in record.error
    assert [m.step for m in manifests(run)] == [2], "nothing saved after the first skipped step"


# ----------------------------------------------------------------------------------------------------------
# Every rank agrees (two gloo ranks)


def check_on_rank(rank: int, port: int, output: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        lm = tiny_lm(vocab_size=64)
        mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=2), "cpu")
        root = parallelize.parallelize(lm, FsdpSpec(), mesh, torch.float32)
        assert isinstance(root, FSDPModule)

        def step(poisoned_rank: int | None, poison: Poison) -> bool:
            batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
            finish = poison(lm) if rank == poisoned_rank else (lambda: None)
            loss = optim.global_loss(
                optim.accumulate_gradients(lm, root, [data.MicroBatch.of_tokens(batch)], True)
            )
            finish()
            norm = optim.clip_gradients(lm.parameters(), 1.0)
            lm.zero_grad(set_to_none=True)
            return not optim.non_finite(loss, norm).item()

        verdicts = {
            "clean": step(None, nan_activations),
            "nan loss on rank 0": step(0, nan_activations),
            "inf gradient shard on rank 1": step(1, inf_gradient),
            "inf loss on rank 1 alone": step(1, inf_loss),
        }
        torch.save(verdicts, output / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def inf_loss(lm: torch.nn.Module) -> Callable[[], None]:
    """An infinite loss on this rank only, whose gradients stay finite (inf is added, not multiplied)."""

    def overflow(module: torch.nn.Module, args: Any, output: Any) -> None:
        output.loss = output.loss + math.inf

    return lm.register_forward_hook(overflow).remove


def test_every_rank_skips_when_any_ranks_loss_or_gradient_is_not_finite(tmp_path: Path) -> None:
    multiprocessing.spawn(check_on_rank, args=(free_port(), tmp_path), nprocs=2)
    verdicts = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    expected = {
        "clean": True,
        "nan loss on rank 0": False,
        "inf gradient shard on rank 1": False,
        "inf loss on rank 1 alone": False,
    }
    assert verdicts == [expected, expected]


# ----------------------------------------------------------------------------------------------------------
# Retention


def write_checkpoint(run: Path, step: int, loss: float | None) -> str:
    name = checkpoint_name(step, "20260101T000000000000")
    files = {".metadata": 10, "__0_0.distcp": 20}
    (run / name).mkdir(parents=True)
    for file, size in files.items():
        (run / name / file).write_bytes(b"x" * size)
    manifest = CheckpointManifest(
        run_name="r",
        step=step,
        loss=loss,
        tokens_seen=step,
        world_size=1,
        created_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        files=files,
    )
    (run / name / MANIFEST_FILE).write_text(manifest.to_json())
    return name


def test_retention_keeps_the_newest_checkpoint_whose_loss_was_finite(tmp_path: Path) -> None:
    losses = {10: 2.5, 20: 2.4, 30: math.nan, 40: math.inf, 50: None}  # stored as null: not known good
    names = {step: write_checkpoint(tmp_path, step, loss) for step, loss in losses.items()}
    prune(Location.parse(str(tmp_path)), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [names[20], names[40], names[50]]

    names[60] = write_checkpoint(tmp_path, 60, 2.3)  # a finite one again: the old one may go
    prune(Location.parse(str(tmp_path)), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [names[50], names[60]]
