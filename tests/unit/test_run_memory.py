"""What the operator remembers of a run between passes lives in one object per run, gone in one removal."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest

from fsdp_operator import api, builder
from fsdp_operator.context import Context
from fsdp_operator.runmemory import PULL_READ_EVERY_SECONDS, Pull, PullsRead, RunMemory
from fsdp_operator.settings import Settings
from fsdp_trainer.contract import RunRecord

SPEC = api.FSDPTrainingRunSpec.model_validate(
    {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}}
)
RUN = builder.RunRef(name="r", namespace="team-a", uid="uid-r")


def test_forgetting_a_run_is_one_removal_of_everything_kept_about_it() -> None:
    ctx = Context(settings=Settings(), kube=cast(Any, None), s3=None, ec2=lambda: None, package_sha256="x")
    body = {"metadata": {"uid": RUN.uid, "resourceVersion": "1"}, "status": {}}
    ctx.storage(SPEC, RUN)
    ctx.runs.wrote(RUN.uid, "1", {"metadata": {"uid": RUN.uid, "resourceVersion": "2"}})
    memory = ctx.runs.of(RUN.uid)
    memory.action_error, memory.archived_driver_log, memory.created = "boom", "r-1", (0.0, 1)
    memory.written_record = cast(RunRecord, object())
    memory.cadence.ticks_to_skip = 3
    memory.figures_written_at = 12.5
    ctx.runs.refused(RUN.uid, "2")
    memory.pulls.of("r-head", 0.0, lambda pod: ("2026-12-07T00:00:00Z", "ray"))
    fresh = RunMemory()
    remembered = [
        f.name for f in dataclasses.fields(RunMemory) if getattr(memory, f.name) != getattr(fresh, f.name)
    ]
    assert set(remembered) == {f.name for f in dataclasses.fields(RunMemory)}  # every kind of memory was set
    assert ctx.runs.newest(body) is not body

    ctx.runs.forget(RUN.uid)

    assert RUN.uid not in ctx.runs
    assert ctx.runs.newest(body) is body
    again = ctx.runs.of(RUN.uid)
    assert all(
        getattr(again, f.name) == getattr(fresh, f.name)
        for f in dataclasses.fields(RunMemory)
        if f.name != "lock"
    )
    assert again.lock is not memory.lock


def test_a_waiting_pods_pull_is_read_once_an_interval_and_a_failed_read_is_not_kept() -> None:
    """At 1,000 runs every Provisioning pass listed the Events of each pod placed and not started: 5.8
    requests per run to start, each a scan of the namespace's Events. The pull read is what the next passes
    show, until it is PULL_READ_EVERY_SECONDS old."""
    pulls, asked = PullsRead(), []
    pulling = ("2026-12-07T00:00:00Z", "public.ecr.aws/deep-learning-containers/ray:2.58")

    def read(pod: str) -> Pull:
        asked.append(pod)
        return pulling

    def unreadable(pod: str) -> Pull:
        raise TimeoutError(pod)

    passes = [0.0, 15.0, PULL_READ_EVERY_SECONDS - 0.1]
    assert [pulls.of("w-1", at, read) for at in passes] == [pulling] * 3
    assert asked == ["w-1"]
    assert pulls.of("w-1", PULL_READ_EVERY_SECONDS, read) == pulling
    assert asked == ["w-1", "w-1"]
    with pytest.raises(TimeoutError):
        pulls.of("w-2", 40.0, unreadable)
    assert pulls.of("w-2", 41.0, read) == pulling  # read again at the next pass, not the failure kept
    assert asked == ["w-1", "w-1", "w-2"]
    pulls.of("w-3", 100.0, read)
    assert set(pulls.read) == {"w-3"}  # pods not asked about for an interval (started, gone) are forgotten
