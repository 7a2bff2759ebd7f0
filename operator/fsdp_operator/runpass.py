"""The pass: one run, observed -> admitted (when due) -> reconciled -> status written -> acted on.

One pass per run at a time (its memory's lock in this process; leader election keeps other processes out,
and the conditional status write keeps out any that slip through). A pass:
  1. observes (observe.py: reads only) and, when the run waits for GPUs, asks admission (admission.py);
  2. decides with `reconcile` (pure): the new status, every field of it, and the actions;
  3. writes the status with a merge patch conditional on the resourceVersion it read (nothing when nothing
     changed); a conflict means someone else wrote first: re-read and run the pass again;
  4. only then acts (actions.py). An action that fails is kept as an observation for the next pass.
The trainer's config is built once per pass, from the spec it reads.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Mapping
from typing import Any, cast

import kopf
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from fsdp_operator import actions, api, builder, conditions, metrics, submission
from fsdp_operator.context import Context
from fsdp_operator.kube import Conflict, Indexes
from fsdp_operator.observe import observe
from fsdp_operator.reconcile import (
    INVALID_SPEC,
    Decision,
    creates_cluster_next,
    needs_preflight,
    reconcile,
    refused_spec,
)
from fsdp_operator.statuspatch import FIGURES, figures_every, figures_wait, merge_patch
from fsdp_operator.watched import kept

log = logging.getLogger("fsdp_operator")
CONFLICT_RETRIES = 3


@metrics.timed_reconcile
def reconcile_run(ctx: Context, body: Mapping[str, Any], indexes: Indexes) -> Decision | None:
    """One pass on the run as kopf's cache holds it; on a write conflict, again on the stored run."""
    meta = body["metadata"]
    with ctx.runs.of(meta["uid"]).lock:
        current: Mapping[str, Any] | None = body
        for _ in range(CONFLICT_RETRIES):
            if current is None or current["metadata"]["uid"] != meta["uid"]:
                return None  # deleted (or re-created under the same name: that object gets its own passes)
            if current["metadata"].get("deletionTimestamp"):
                return None
            current = ctx.runs.newest(current)
            try:
                return run_pass(ctx, dict(current), indexes)
            except Conflict as conflict:
                log.info("%s; reading it again", conflict)
                ctx.runs.refused(meta["uid"], current["metadata"]["resourceVersion"])
                current = ctx.kube.get_run(meta["namespace"], meta["name"])
        raise kopf.TemporaryError(f"status of {meta['namespace']}/{meta['name']} kept changing", delay=5)


class RefusedSpec(Exception):
    """The run's spec breaks a bound of the operator's models that the CRD schema cannot state."""


def parse(
    body: kopf.Body, run: Mapping[str, Any]
) -> tuple[api.FSDPTrainingRunSpec, api.FSDPTrainingRunStatus]:
    status = api.FSDPTrainingRunStatus.model_validate(run.get("status") or {})
    try:
        return api.FSDPTrainingRunSpec.model_validate(run["spec"]), status
    except ValidationError as error:
        raise RefusedSpec("; ".join(_refusal(e) for e in error.errors()[:5])) from error


def _refusal(error: ErrorDetails) -> str:
    """ "spec.<field>: <why>", or "spec: <why>" where a check spans fields (its message names them)."""
    where = ".".join(["spec", *(str(part) for part in error["loc"])])
    return f"{where}: {error['msg'].removeprefix('Value error, ')}"


def refuse_spec(ctx: Context, body: kopf.Body, stored: Mapping[str, Any], message: str) -> None:
    """Says so in the run's status (once per generation) and in one Event."""
    meta = stored["metadata"]
    status = api.FSDPTrainingRunStatus.model_validate(stored.get("status") or {})
    failed = conditions.condition(status.conditions, conditions.FAILED)
    if (
        failed is not None
        and failed.reason == INVALID_SPEC
        and status.observed_generation == meta.get("generation")
    ):
        return
    new = refused_spec(status, message, dt.datetime.now(dt.UTC), meta.get("generation"))
    patch = merge_patch(
        stored.get("status") or {}, new.model_dump(mode="json", by_alias=True, exclude_none=True)
    )
    ctx.kube.write_status(meta["namespace"], meta["name"], meta["resourceVersion"], patch)
    kopf.event(body, type="Warning", reason=INVALID_SPEC, message=conditions.bounded(message))
    log.warning("%s/%s %s: %s", meta["namespace"], meta["name"], INVALID_SPEC, message)


def run_pass(ctx: Context, stored: dict[str, Any], indexes: Indexes) -> Decision:
    body = kopf.Body(cast(Any, stored))  # what Events point at
    meta = stored["metadata"]
    run = builder.RunRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    try:
        spec, status = parse(body, stored)
    except RefusedSpec as refused:
        refuse_spec(ctx, body, stored, str(refused))
        return Decision(api.FSDPTrainingRunStatus.model_validate(stored.get("status") or {}))
    spec = ctx.sized(spec)
    config = submission.trainer_config(
        spec,
        run,
        cpu_only=ctx.settings.trainer_device == "cpu",
        min_bus_bandwidth_gbps=ctx.settings.fabric_min_bus_bandwidth_gbps,
    )
    # Every size Ray Train may start on, as the trainer will be told (processes per worker: the GPUs, one
    # where the platform trains on CPU): refused now, not at the resize that reaches a size that cannot train.
    unusable = config.unusable_world_sizes()
    if unusable is not None:
        refuse_spec(ctx, body, stored, f"spec: {unusable}")
        return Decision(status)
    obs = observe(ctx, run, stored, spec, status, config, indexes)
    if creates_cluster_next(spec, status, obs.cluster is not None):
        obs = dataclasses.replace(obs, refusals=ctx.refusals(run.namespace, spec))
    if not obs.refusals and needs_preflight(spec, status, obs.cluster is not None, obs.now):
        verdict = ctx.admission.admit(run, spec, meta.get("creationTimestamp", ""), indexes)
        obs = dataclasses.replace(obs, preflight=verdict)
    memory = ctx.runs.of(run.uid)
    memory.action_error = None  # observed: this pass decides on it
    if obs.cluster is not None:
        memory.created = None  # the index has it: a later loss is recreated at once
    decision = reconcile(spec, status, obs)
    new = decision.status

    # The intent, before any side effect: a stale pass fails here (Conflict) and does nothing.
    old = stored.get("status") or {}
    patch = merge_patch(old, new.model_dump(mode="json", by_alias=True, exclude_none=True))
    written = None if memory.figures_written_at is None else time.monotonic() - memory.figures_written_at
    every = figures_every(ctx.settings.observe_interval_seconds, indexes.count(indexes.unfinished_runs))
    if figures_wait(patch, decision.acts, old, written, every):
        patch = {}  # a later pass writes them (statuspatch.figures_every)
    if patch:
        stored_now = ctx.kube.write_status(run.namespace, run.name, meta["resourceVersion"], patch)
        ctx.runs.wrote(run.uid, meta["resourceVersion"], kept(stored_now))
        if patch.keys() & FIGURES:
            memory.figures_written_at = time.monotonic()
        actions.fault_point("after-status-write", new.attempt)
    metrics.record_pass(stored, new, obs.now, (obs.storage_error, obs.dashboard_error, obs.action_error))
    actions.act(ctx, run, spec, config, decision)
    if patch:
        actions.write_run_record(ctx, run, spec, config, new)
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=conditions.bounded(event.message))
        log.info("%s/%s %s: %s", run.namespace, run.name, event.reason, event.message)
    return decision
