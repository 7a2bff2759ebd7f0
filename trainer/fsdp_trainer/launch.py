"""What a launcher (Ray's driver, torchrun, plain `python`) hands every worker's loop. Light on purpose, and
imports nothing of the loop: the Ray job's driver imports this, and the loop imports it to read its input."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fsdp_trainer.contract import AttemptInfo, TrainerConfig


class LoopInput(BaseModel):
    """What the launcher hands every worker."""

    trainer: TrainerConfig
    submission_id: str
    attempt: AttemptInfo = Field(default_factory=AttemptInfo)
