"""What a launcher (Ray's driver, torchrun, plain `python`) hands every worker's loop, and the entry point Ray
Train pickles by reference. Light on purpose: the driver imports this, not the loop, so the Ray job's driver
process never imports transformers (about 5 CPU-seconds and 180 MB at each attempt's start); only the
workers that train do."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from fsdp_trainer.contract import AttemptInfo, TrainerConfig


class LoopInput(BaseModel):
    """What the launcher hands every worker."""

    trainer: TrainerConfig
    submission_id: str
    attempt: AttemptInfo = Field(default_factory=AttemptInfo)


def ray_train_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function: the training loop, imported on the worker."""
    from fsdp_trainer.loop import train_loop

    train_loop(config)
