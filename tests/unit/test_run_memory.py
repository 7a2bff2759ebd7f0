"""What the operator remembers of a run between passes lives in one object per run, gone in one removal."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from fsdp_operator import api, builder
from fsdp_operator.context import Context
from fsdp_operator.runmemory import RunMemory
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
