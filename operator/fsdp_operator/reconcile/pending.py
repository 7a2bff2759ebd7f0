"""Pending: a run waits for its RayCluster to be created, by the preflight's verdict on the capacity (or by
Kueue, queueing.py), after what it asks of its namespace is checked."""

from __future__ import annotations

import datetime as dt

from fsdp_operator import api, conditions
from fsdp_operator.api import Phase
from fsdp_operator.preflight import (
    NAMESPACE_RUN_LIMIT,
    NOT_LAUNCHABLE,
    WAITING_FOR_EARLIER_RUN,
    WORKER_FITS_NO_NODE,
)
from fsdp_operator.reconcile.provisioning import not_allowed, pods_healthy
from fsdp_operator.reconcile.queueing import enqueue
from fsdp_operator.reconcile.state import PassState


def pending(state: PassState) -> None:
    new, obs = state.new, state.obs
    if obs.refusals:  # nothing is created with powers the namespace's users were not given
        not_allowed(state)
        return
    if state.spec.cluster.queue_name is not None:
        enqueue(state, state.spec.cluster.queue_name)
        return
    result = obs.preflight
    if result is None:  # not due for a re-check yet
        if new.next_check_time is not None:
            state.requeue(max((new.next_check_time - obs.now).total_seconds(), 1.0))
        return
    if result.ok:
        state.condition(conditions.PREFLIGHT, True, result.reason, result.message)
        new.zone = result.zone
        new.next_check_time = None
        state.start_active()
        new.image.requested = new.image.requested or obs.requested_image
        state.create_cluster()
        message = "RayCluster created; waiting for KubeRay"
        state.condition(conditions.CLUSTER_READY, False, "Creating", message)
        pods_healthy(state)  # in this write, not the next pass's: none can be stuck before any exists
        # One Event for both (an Event is a request): the Preflight condition keeps the placement.
        state.event(False, "ClusterCreated", f"preflight passed ({result.message}); {message}")
        state.transition(Phase.PROVISIONING, "ClusterCreated", message, announce=False)
        return
    previous = conditions.condition(new.conditions, conditions.PREFLIGHT)
    if previous is None or previous.reason != result.reason or previous.status != "False":
        state.event(True, result.reason, result.message)
    state.condition(conditions.PREFLIGHT, False, result.reason, result.message)
    # Nodes the group adds have the same shape; no NodePool or node group can make one (as Karpenter's own
    # refusal, found before any pod): no waiting.
    if result.reason in (WORKER_FITS_NO_NODE, NOT_LAUNCHABLE):
        state.finish(Phase.FAILED, result.reason, result.message)
        return
    if (
        state.spec.preflight.on_insufficient_capacity == api.PreflightPolicy.FAIL
        and result.reason != NAMESPACE_RUN_LIMIT  # a team's limit is no lack of capacity: its turn comes
    ):
        state.finish(Phase.FAILED, "PreflightFailed", f"preflight failed: {result.message}")
        return
    # The preflight reason's Warning above already says why.
    state.transition(Phase.PENDING, "Waiting", f"waiting for capacity: {result.message}", announce=False)
    if result.reason == WAITING_FOR_EARLIER_RUN:
        # Its turn comes with the earlier run's admission, which the next pass sees in the cache: check
        # again then, not a whole recheckSeconds later (runs created together would all wait a minute).
        new.next_check_time = None
        return
    new.next_check_time = obs.now + dt.timedelta(seconds=state.spec.preflight.recheck_seconds)
    state.requeue(state.spec.preflight.recheck_seconds)
