"""Every rank's generators seeded from the run's seed and the rank (issue 34 item 4): whatever the process
drew before, training starts from the same torch and Python streams in every run with that seed, and ranks
draw different ones (dropout masks)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_trainer import checkpoint
from fsdp_trainer.loop import Session, Trainer
from tests.support.trainer_runs import config, train


def draws() -> tuple[list[float], list[float]]:
    return torch.rand(4).tolist(), [random.random() for _ in range(4)]


def seeded(value: int) -> tuple[list[float], list[float]]:
    checkpoint.seed_generators(value)
    return draws()


def test_ranks_draw_their_own_streams_the_same_in_every_run() -> None:
    streams = [seeded(checkpoint.rank_seed(3, rank)) for rank in (0, 1, 0)]
    assert streams[0] == streams[2]
    assert streams[0][0] != streams[1][0] and streams[0][1] != streams[1][1]


@pytest.mark.parametrize("before", [1, 2])
def test_training_starts_from_the_runs_seeded_streams_whatever_was_drawn_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: int
) -> None:
    torch.manual_seed(before)
    random.seed(before)
    seen: list[Any] = []

    def first_draws(self: Trainer, session: Session) -> None:
        seen.append(draws())

    monkeypatch.setattr(Trainer, "train", first_draws)
    train(config(tmp_path, seed=3, max_steps=1), "job-1")
    assert seen == [seeded(checkpoint.rank_seed(3, 0))]
