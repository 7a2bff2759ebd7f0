"""The trainer's loop in this process, as tests and benches drive it: a tiny configuration, one rank of a
two-rank group on loopback, and what a run left in its storage."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdp_trainer.contract import MANIFEST_FILE, CheckpointManifest, ProgressRecord, TrainerConfig
from fsdp_trainer.launch import LoopInput
from fsdp_trainer.loop import train_loop
from tests.support.manifests import tiny_qwen2

TINY_QWEN2 = tiny_qwen2(vocab_size=64)


def config(storage: Path | str, seed: int = 3, max_steps: int = 4) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "runName": "tiny",
            "namespace": "team-a",
            "model": {"fromConfig": TINY_QWEN2},
            "training": {
                "maxSteps": max_steps,
                "microBatchSize": 2,
                "sequenceLength": 16,
                "seed": seed,
                "logEvery": 1,
            },
            "data": {"source": "synthetic", "evalFraction": 0},
            "checkpoint": {"storagePath": str(storage), "everySteps": 2, "exportModel": False},
            "network": {"bandwidthProbeMb": 0},
        }
    )


def train(trainer: TrainerConfig, submission_id: str) -> None:
    train_loop(LoopInput(trainer=trainer, submission_id=submission_id).model_dump(mode="json"))


def as_rank_of_two(rank: int, port: int) -> None:
    """This process as one of two ranks of a torchrun-style group on loopback (a spawned test process)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def history(run: Path) -> list[list[ProgressRecord]]:
    """Each attempt's records, attempts in time order."""
    return [
        [ProgressRecord.model_validate_json(line) for line in path.read_text().splitlines()]
        for path in sorted((run / "metrics").glob("*.jsonl"))
    ]


def manifests(run: Path) -> list[CheckpointManifest]:
    return [
        CheckpointManifest.model_validate_json(path.read_text())
        for path in sorted(run.glob(f"checkpoint_*/{MANIFEST_FILE}"))
    ]


def losses(records: list[Any]) -> dict[int, float]:
    return {
        r.step: r.loss
        for r in records
        if r.phase in ("training", "finished") and r.loss is not None and r.step
    }
