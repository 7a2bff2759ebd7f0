"""The memory options through the whole per-worker loop (one CPU process, a tiny Qwen2, synthetic tokens):
a chunked loss and gradients reduced every micro-step train exactly as the defaults do."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer_runs import config, history, train


def step_losses(storage: Path, training: dict[str, object], fsdp: dict[str, object]) -> dict[int, float]:
    trainer = config(storage)
    trainer = trainer.model_copy(
        update={
            "training": trainer.training.model_copy(update={"grad_accumulation": 2, **training}),
            "fsdp": trainer.fsdp.model_copy(update=fsdp),
        }
    )
    train(trainer, "job-1")
    records = history(storage / "team-a" / "tiny")[-1]
    return {r.step: r.loss for r in records if r.phase == "training" and r.step and r.loss is not None}


def test_a_chunked_loss_and_per_micro_step_reduction_train_as_the_defaults_do(tmp_path: Path) -> None:
    defaults = step_losses(tmp_path / "defaults", {}, {})
    with_options = step_losses(
        tmp_path / "options", {"loss_chunk_tokens": 5}, {"reduce_every_micro_step": True}
    )
    assert sorted(defaults) == [1, 2, 3, 4]
    assert with_options == pytest.approx(defaults, rel=1e-5)
