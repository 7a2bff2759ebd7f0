"""The per-worker loop on real text (one CPU process, a tiny Qwen2, the byte-level tokenizer, the stdlib
docstring corpus): it evaluates on the held-out shards, and a run resumed from a checkpoint trains on the
same samples as an uninterrupted one, so its losses match step for step."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_trainer.contract import ProgressRecord, TrainerConfig
from tests.support.corpus import CORPUS
from tests.support.trainer_runs import TINY_QWEN2, config, history, train


def real_text(storage: Path, max_steps: int) -> TrainerConfig:
    trainer = config(storage, max_steps=max_steps).model_dump(by_alias=True)
    trainer["model"] = {"fromConfig": {**TINY_QWEN2, "vocab_size": 320}, "tokenizer": "byte-level"}
    trainer["data"] = {"source": str(CORPUS), "evalFraction": 0.05, "evalEvery": 3, "evalBatches": 2}
    # A learning rate independent of maxSteps, so a shorter first run trains exactly as the longer one.
    trainer["training"].update(schedule="constant", warmupSteps=0)
    return TrainerConfig.model_validate(trainer)


def losses(records: list[ProgressRecord]) -> dict[int, float]:
    return {r.step: r.loss for r in records if r.phase == "training" and r.step and r.loss is not None}


def test_a_resumed_run_on_real_text_trains_on_the_same_samples(tmp_path: Path) -> None:
    train(real_text(tmp_path / "straight", max_steps=6), "job-1")
    (straight,) = history(tmp_path / "straight" / "team-a" / "tiny")
    train(real_text(tmp_path / "resumed", max_steps=4), "job-1")  # checkpoints at steps 2 and 4
    train(real_text(tmp_path / "resumed", max_steps=6), "job-2")
    first, resumed = history(tmp_path / "resumed" / "team-a" / "tiny")

    assert resumed[-1].phase == "finished" and resumed[-1].resumed_from_step == 4
    assert sorted(losses(resumed)) == [5, 6]
    assert losses(first) | losses(resumed) == pytest.approx(losses(straight), abs=1e-5)
    evaluated = [r for r in straight if r.eval_loss is not None]
    assert evaluated and evaluated[0].step == 3, "evalEvery 3"
    assert len({r.eval_loss for r in evaluated}) == 2, "at step 3 and at the end"
