"""A tied weight is stored once in a checkpoint and restored tied (issue 34 item 4): the tiny Qwen2 ties its
output head to its input embedding, as Qwen2.5-1.5B does (0.93 GB of fp32 saved twice before)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint import FileSystemReader

from fsdp_trainer import checkpoint
from fsdp_trainer.loop import Session, Trainer
from tests.support.trainer_runs import config, history, losses, train

EMBEDDING = "app.model.model.embed_tokens.weight"
HEAD = "app.model.lm_head.weight"


def saved_tensors(checkpoint_dir: Path) -> set[str]:
    return set(FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("first_run", ["one-copy", "two-copies"])
def test_a_tied_weight_is_saved_once_and_a_resume_reproduces_the_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_run: str
) -> None:
    if first_run == "two-copies":  # as checkpoints were written before: they still resume
        monkeypatch.setattr(checkpoint, "tied_names", lambda model: {})
    train(config(tmp_path, max_steps=4), "job-1")
    monkeypatch.undo()
    run = tmp_path / "team-a" / "tiny"
    uninterrupted = losses(history(run)[0])
    second = next(run.glob("checkpoint_00000002_*"))
    tensors = saved_tensors(second)
    assert EMBEDDING in tensors
    assert (HEAD in tensors) == (first_run == "two-copies")

    shutil.rmtree(next(run.glob("checkpoint_00000004_*")))
    tied_after_load: list[bool] = []
    finish = Trainer.finish

    def check_tied(self: Trainer, session: Session) -> None:
        lm: Any = session.lm
        tied_after_load.append(lm.lm_head.weight is lm.model.embed_tokens.weight)
        finish(self, session)

    monkeypatch.setattr(Trainer, "finish", check_tied)
    train(config(tmp_path, max_steps=4), "job-2")
    resumed = losses(history(run)[1])
    assert sorted(resumed) == [3, 4] and tied_after_load == [True]
    # One process, the same operations in the same order: the resumed losses are the uninterrupted ones.
    assert [resumed[step] for step in (3, 4)] == [uninterrupted[step] for step in (3, 4)]
    assert HEAD not in saved_tensors(next(run.glob("checkpoint_00000004_*")))
