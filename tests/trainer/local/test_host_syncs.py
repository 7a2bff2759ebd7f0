"""No host sync per training step (issue 47 item 5): the loss, the gradient norm and the decision to skip a
non-finite step stay on the device, and the host reads a step's values only at logging and checkpoint
steps; the skip decision of any other step is read once the next step is queued. Counted in one CPU process
(gloo, a tiny Qwen2) by the reads of values the current step computed (tests/support/host_reads.py); the
same run still counts every applied update in its schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_trainer import data
from fsdp_trainer.contract import TrainerConfig
from fsdp_trainer.optim import lr_factor
from tests.support.host_reads import StepHostReads
from tests.support.trainer_runs import config, history, train

LOG_EVERY, SAVE_EVERY, STEPS = 3, 6, 7


def quiet(storage: Path) -> TrainerConfig:
    """Logs at steps 3, 6 and 7 (the last), saves at 6 and 7."""
    trainer = config(storage, max_steps=STEPS)
    return trainer.model_copy(
        update={
            "training": trainer.training.model_copy(update={"log_every": LOG_EVERY}),
            "checkpoint": trainer.checkpoint.model_copy(update={"every_steps": SAVE_EVERY}),
        }
    )


def test_only_logging_and_checkpoint_steps_read_the_steps_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = StepHostReads()
    next_step = data.BatchLoader.next_step

    def marked(loader: data.BatchLoader) -> object:
        if not reads.per_step:  # counted from the first step on: setup swaps tensors, which a mode disturbs
            reads.__enter__()
        reads.new_step()
        return next_step(loader)

    monkeypatch.setattr(data.BatchLoader, "next_step", marked)
    try:
        train(quiet(tmp_path), "job-1")
    finally:
        if reads.per_step:
            reads.__exit__(None, None, None)

    per_step = dict(enumerate(reads.per_step, start=1))
    quiet_steps = {step: count for step, count in per_step.items() if step not in (3, 6, 7)}
    assert len(per_step) == STEPS
    assert quiet_steps == dict.fromkeys(quiet_steps, 0), per_step
    assert all(per_step[step] > 0 for step in (3, 6, 7)), (
        f"the counter sees the logging steps' reads: {per_step}"
    )
    # Step 7 trained at the rate after 6 schedule steps: the updates whose decision was read late counted.
    trainer = quiet(tmp_path)
    [records] = history(tmp_path / "team-a" / "tiny")
    last = [record for record in records if record.step == STEPS and record.learning_rate is not None][-1]
    expected = trainer.training.learning_rate * lr_factor(STEPS - 1, trainer.training)
    assert last.learning_rate == pytest.approx(expected)
