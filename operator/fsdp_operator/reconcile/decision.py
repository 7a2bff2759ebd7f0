"""What a pass decides: the new status, and the actions the glue carries out once that status is written."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fsdp_operator import api
from fsdp_operator.api import FSDPTrainingRunStatus
from fsdp_trainer.contract import ForensicsRequest


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class DriverLog:
    """An ended job's driver log, to keep in S3 under its attempt before the cluster that has it may go."""

    submission_id: str
    node_id: str
    attempt: int


@dataclass
class Decision:
    status: FSDPTrainingRunStatus
    create_cluster: bool = False
    delete_cluster: bool = False
    submit_attempt: int | None = None  # submit status.jobSubmissionId (recorded in the status first)
    stop_job: str | None = None  # submission id to stop
    keep_driver_log: DriverLog | None = None  # before stopping or deleting anything
    request_forensics: ForensicsRequest | None = None  # written under the run's prefix after the status
    avoid_node: api.AvoidedNode | None = None  # label the node a fabric check found slow (fabric.py)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None

    @property
    def acts(self) -> bool:
        """Whether the pass does anything beyond writing the status: an action or an Event."""
        return bool(
            self.create_cluster
            or self.delete_cluster
            or self.submit_attempt is not None
            or self.stop_job
            or self.keep_driver_log
            or self.request_forensics
            or self.avoid_node
            or self.events
        )
