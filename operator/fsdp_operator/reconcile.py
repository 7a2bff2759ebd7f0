"""The run's state machine as a pure function: (spec, status, what was observed) -> new status and actions.

Kopf handlers only gather observations, call `reconcile`, and carry out the returned actions. Everything
here is deterministic in its inputs, so every transition is unit-tested without a cluster.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Literal

from fsdp_operator import api, conditions
from fsdp_operator.api import FSDPTrainingRunSpec, FSDPTrainingRunStatus, Phase
from fsdp_operator.preflight import PreflightResult


@dataclass(frozen=True)
class ClusterObservation:
    ready: bool
    message: str


@dataclass(frozen=True)
class Observation:
    now: dt.datetime
    generation: int
    cluster: ClusterObservation | None  # None: no RayCluster of this run exists
    preflight: PreflightResult | None = None  # computed only when `needs_preflight` says so


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Decision:
    status: FSDPTrainingRunStatus
    create_cluster: bool = False
    delete_cluster: bool = False
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


def observe_cluster(raycluster: dict[str, Any]) -> ClusterObservation:
    """KubeRay v1.5 reports readiness in conditions (state is deprecated but still set)."""
    status = raycluster.get("status") or {}
    by_type = {c.get("type"): c for c in status.get("conditions", [])}
    provisioned = by_type.get("RayClusterProvisioned", {}).get("status") == "True"
    head_ready = by_type.get("HeadPodReady", {}).get("status") == "True"
    ready = (provisioned and head_ready) or status.get("state") == "ready"
    message = "; ".join(
        f"{t}={c.get('status')}" + (f" ({c['message']})" if c.get("message") else "")
        for t, c in by_type.items()
    )
    return ClusterObservation(ready=ready, message=message or "no status yet")


def needs_preflight(status: FSDPTrainingRunStatus, cluster_exists: bool, now: dt.datetime) -> bool:
    waiting = status.phase in (None, Phase.PENDING, Phase.SUSPENDED)
    due = status.next_check_time is None or status.next_check_time <= now
    return waiting and not cluster_exists and due


def reconcile(spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, obs: Observation) -> Decision:
    new = status.model_copy(deep=True)
    new.observed_generation = obs.generation
    decision = Decision(status=new)

    def condition(type_: str, ok: bool, reason: str, message: str) -> None:
        new.conditions = conditions.set_condition(
            new.conditions, type_, ok, reason, message, obs.now, obs.generation
        )

    def transition(phase: Phase, reason: str, message: str, warning: bool = False) -> None:
        if new.phase != phase:
            decision.events.append(Event("Warning" if warning else "Normal", reason, message))
        new.phase = phase
        new.message = message

    if new.phase in api.FINISHED_PHASES:
        return decision

    if spec.suspend:
        if obs.cluster is not None:
            decision.delete_cluster = True
        condition(conditions.SUSPENDED, True, "SuspendedBySpec", "spec.suspend is true; checkpoints are kept")
        condition(conditions.CLUSTER_READY, False, "Suspended", "the RayCluster is deleted while suspended")
        transition(Phase.SUSPENDED, "Suspended", "suspended: cluster deleted, checkpoints kept")
        new.next_check_time = None
        return decision
    if new.phase == Phase.SUSPENDED:
        condition(conditions.SUSPENDED, False, "Resumed", "spec.suspend is false")

    if obs.cluster is None:
        if new.phase in api.ACTIVE_PHASES:
            # The cluster vanished under a live run: recreate it where it was (same zone, same name).
            decision.create_cluster = True
            condition(
                conditions.CLUSTER_READY, False, "ClusterLost", "the RayCluster disappeared; recreating it"
            )
            transition(
                Phase.PROVISIONING, "ClusterRecreated", "RayCluster recreated after it disappeared", True
            )
            return decision
        result = obs.preflight
        if result is None:  # not due for a re-check yet
            decision.requeue_after = _seconds_until(new.next_check_time, obs.now)
            return decision
        if result.ok:
            condition(conditions.PREFLIGHT, True, result.reason, result.message)
            new.zone = result.zone
            new.next_check_time = None
            decision.create_cluster = True
            decision.events.append(Event("Normal", "PreflightPassed", result.message))
            transition(Phase.PROVISIONING, "ClusterCreated", "RayCluster created; waiting for KubeRay")
            return decision
        previous = conditions.condition(new.conditions, conditions.PREFLIGHT)
        if previous is None or previous.reason != result.reason or previous.status != "False":
            decision.events.append(Event("Warning", result.reason, result.message))
        condition(conditions.PREFLIGHT, False, result.reason, result.message)
        if spec.preflight.on_insufficient_capacity == api.PreflightPolicy.FAIL:
            condition(conditions.FAILED, True, result.reason, result.message)
            transition(Phase.FAILED, "PreflightFailed", f"preflight failed: {result.message}", True)
            new.completion_time = obs.now
            return decision
        new.next_check_time = obs.now + dt.timedelta(seconds=spec.preflight.recheck_seconds)
        new.phase = Phase.PENDING
        new.message = f"waiting for capacity: {result.message}"
        decision.requeue_after = spec.preflight.recheck_seconds
        return decision

    if new.phase in (None, Phase.PENDING, Phase.SUSPENDED):
        # Created by an earlier pass whose status write was lost (e.g. the operator restarted in between).
        new.phase = Phase.PROVISIONING
    if obs.cluster.ready:
        condition(conditions.CLUSTER_READY, True, "RayClusterReady", "KubeRay reports the RayCluster ready")
        if new.phase == Phase.PROVISIONING:
            transition(Phase.CLUSTER_READY, "ClusterReady", "RayCluster is ready")
    else:
        condition(conditions.CLUSTER_READY, False, "RayClusterNotReady", obs.cluster.message)
        if new.phase == Phase.CLUSTER_READY:
            transition(
                Phase.PROVISIONING, "ClusterNotReady", f"RayCluster not ready: {obs.cluster.message}", True
            )
    return decision


def _seconds_until(when: dt.datetime | None, now: dt.datetime) -> float | None:
    return None if when is None else max((when - now).total_seconds(), 1.0)
