"""Inputs for the operator's pure decisions (reconcile, admission): a spec, a status, what a pass observed,
a job, a trainer's progress record, at a fixed time."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fsdp_operator import api
from fsdp_operator.jobs import JobObservation
from fsdp_operator.reconcile import ClusterObservation, Observation
from fsdp_trainer.contract import ProgressRecord

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


READY = ClusterObservation(ready=True, message="")


JOB_ID = "run-0f1e2d3c-1"


def spec(**extra: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, **extra}
    )


def status(phase: api.Phase = api.Phase.RUNNING, **extra: Any) -> api.FSDPTrainingRunStatus:
    fields: dict[str, Any] = {
        "phase": phase,
        "attempt": 1,
        "job_submission_id": JOB_ID,
        "attempt_time": NOW - dt.timedelta(minutes=10),
        "start_time": NOW - dt.timedelta(minutes=12),
        "active_since": NOW - dt.timedelta(minutes=12),
        **extra,
    }
    return api.FSDPTrainingRunStatus(**fields)


def observe(ago: float = 0, **fields: Any) -> Observation:
    base: dict[str, Any] = {"cluster": READY, "submission_prefix": "run-0f1e2d3c"}
    return Observation(now=NOW + dt.timedelta(seconds=ago), generation=1, **{**base, **fields})


def job(state: str | None, started_minutes_ago: float = 9) -> JobObservation:
    return JobObservation(JOB_ID, state, start_time=NOW - dt.timedelta(minutes=started_minutes_ago))


def record(phase: str = "training", seconds_ago: float = 30, **extra: Any) -> ProgressRecord:
    fields: dict[str, Any] = {
        "run_name": "run",
        "phase": phase,
        "submission_id": JOB_ID,
        "step": 20 if phase != "starting" else 0,
        "max_steps": 100,
        "updated_at": NOW - dt.timedelta(seconds=seconds_ago),
        **extra,
    }
    return ProgressRecord(**fields)
