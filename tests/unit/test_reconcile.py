"""State machine transitions of a run, without a cluster."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fsdp_operator import api, conditions
from fsdp_operator.preflight import WAITING_FOR_EARLIER_RUN, PreflightResult
from fsdp_operator.reconcile import (
    INVALID_SPEC,
    ClusterObservation,
    Observation,
    needs_preflight,
    observe_cluster,
    reconcile,
    refused_spec,
)

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
OK = PreflightResult(True, "CapacityAvailable", "fits in us-west-2a", zone="us-west-2a")
FULL = PreflightResult(False, "InsufficientCapacity", "no room")


def spec(**extra: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, **extra}
    )


READY = ClusterObservation(ready=True, message="")


def obs(
    cluster: ClusterObservation | None = None, preflight: PreflightResult | None = None, **more: Any
) -> Observation:
    return Observation(now=NOW, generation=3, cluster=cluster, preflight=preflight, **more)


def test_new_run_with_capacity_creates_the_cluster() -> None:
    decision = reconcile(spec(), api.FSDPTrainingRunStatus(), obs(preflight=OK))
    status = decision.status
    assert decision.create_cluster and status.phase == api.Phase.PROVISIONING and status.zone == "us-west-2a"
    assert status.observed_generation == 3
    pre = conditions.condition(status.conditions, conditions.PREFLIGHT)
    assert pre is not None and pre.status == "True" and pre.observed_generation == 3
    [created] = decision.events  # one Event (a request each) for the preflight and the creation
    assert created.reason == "ClusterCreated" and created.message.startswith("preflight passed (")


def test_no_capacity_waits_and_rechecks_without_a_cluster() -> None:
    decision = reconcile(spec(), api.FSDPTrainingRunStatus(), obs(preflight=FULL))
    assert not decision.create_cluster and decision.status.phase == api.Phase.PENDING
    assert decision.requeue_after == 60
    assert decision.status.next_check_time == NOW + dt.timedelta(seconds=60)
    pre = conditions.condition(decision.status.conditions, conditions.PREFLIGHT)
    assert pre is not None and (pre.status, pre.reason) == ("False", "InsufficientCapacity")
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "InsufficientCapacity")]
    # The same failure again is not a new Warning, and lastTransitionTime stays.
    later = Observation(now=NOW + dt.timedelta(seconds=60), generation=3, cluster=None, preflight=FULL)
    again = reconcile(spec(), decision.status, later)
    assert again.events == []
    pre2 = conditions.condition(again.status.conditions, conditions.PREFLIGHT)
    assert pre2 is not None and pre2.last_transition_time == NOW


def test_a_run_behind_an_earlier_one_checks_again_at_the_next_pass_not_a_minute_later() -> None:
    behind = PreflightResult(
        False, WAITING_FOR_EARLIER_RUN, "ns/first, created earlier, ... is admitted first"
    )
    decision = reconcile(spec(), api.FSDPTrainingRunStatus(), obs(preflight=behind))
    assert decision.status.phase == api.Phase.PENDING and not decision.create_cluster
    assert decision.status.next_check_time is None and decision.requeue_after is None
    assert needs_preflight(spec(), decision.status, cluster_exists=False, now=NOW + dt.timedelta(seconds=2))


def test_no_capacity_with_fail_policy_fails() -> None:
    decision = reconcile(
        spec(preflight={"onInsufficientCapacity": "Fail"}), api.FSDPTrainingRunStatus(), obs(preflight=FULL)
    )
    assert decision.status.phase == api.Phase.FAILED and not decision.create_cluster
    assert conditions.is_true(decision.status.conditions, conditions.FAILED)


def test_preflight_is_only_due_when_waiting_without_a_cluster() -> None:
    waiting = api.FSDPTrainingRunStatus(
        phase=api.Phase.PENDING, next_check_time=NOW + dt.timedelta(seconds=5)
    )
    assert not needs_preflight(spec(), waiting, cluster_exists=False, now=NOW)
    assert needs_preflight(spec(), waiting, cluster_exists=False, now=NOW + dt.timedelta(seconds=5))
    assert not needs_preflight(spec(), api.FSDPTrainingRunStatus(), cluster_exists=True, now=NOW)
    provisioning = api.FSDPTrainingRunStatus(phase=api.Phase.PROVISIONING)
    assert not needs_preflight(spec(), provisioning, cluster_exists=False, now=NOW)
    suspended = api.FSDPTrainingRunStatus(phase=api.Phase.SUSPENDED)
    assert not needs_preflight(spec(suspend=True), suspended, cluster_exists=False, now=NOW)
    assert needs_preflight(spec(), suspended, cluster_exists=False, now=NOW)


def test_ready_cluster_gets_the_first_attempt_recorded_then_submitted() -> None:
    status = api.FSDPTrainingRunStatus(phase=api.Phase.PROVISIONING)
    decision = reconcile(spec(), status, obs(cluster=READY, submission_prefix="run-0f1e2d3c"))
    new = decision.status
    assert decision.submit_attempt == 1 and new.attempt == 1 and new.job_submission_id == "run-0f1e2d3c-1"
    # Running once Ray reports the job; until then the phase stays and the submission is owed.
    assert new.phase == api.Phase.CLUSTER_READY and new.attempt_time == NOW
    assert conditions.is_true(new.conditions, conditions.CLUSTER_READY)
    submitted = conditions.condition(new.conditions, conditions.JOB_RUNNING)
    assert submitted is not None and (submitted.status, submitted.reason) == ("Unknown", "Submitted")
    [submitted_event] = decision.events
    assert submitted_event.reason == "JobSubmitted"
    assert submitted_event.message == "RayCluster is ready; attempt 1 submitted"


def test_a_cluster_where_none_should_be_is_deleted_not_adopted() -> None:
    # The intent (Provisioning) is written before any cluster is created, so a cluster beside a waiting run is
    # one that is being given up (suspend, provisioning timeout).
    decision = reconcile(
        spec(), api.FSDPTrainingRunStatus(), obs(cluster=ClusterObservation(False, "starting"))
    )
    assert decision.delete_cluster and not decision.create_cluster and decision.submit_attempt is None
    assert decision.status.phase is None


def test_vanished_cluster_of_an_active_run_is_recreated() -> None:
    ready = conditions.set_condition([], conditions.CLUSTER_READY, True, "RayClusterReady", "", NOW, 3)
    status = api.FSDPTrainingRunStatus(phase=api.Phase.CLUSTER_READY, zone="us-west-2b", conditions=ready)
    decision = reconcile(spec(), status, obs(cluster=None))
    assert decision.create_cluster and decision.status.zone == "us-west-2b"
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "ClusterRecreated")]


def test_suspend_deletes_the_cluster() -> None:
    status = api.FSDPTrainingRunStatus(phase=api.Phase.CLUSTER_READY)
    decision = reconcile(spec(suspend=True), status, obs(cluster=READY))
    assert decision.delete_cluster and decision.status.phase == api.Phase.SUSPENDED


def test_observe_cluster_reads_kuberay_conditions() -> None:
    ready = {
        "status": {
            "conditions": [
                {"type": "RayClusterProvisioned", "status": "True"},
                {"type": "HeadPodReady", "status": "True"},
            ]
        }
    }
    assert observe_cluster(ready).ready
    assert not observe_cluster(
        {"status": {"conditions": [{"type": "HeadPodReady", "status": "False"}]}}
    ).ready
    assert not observe_cluster({}).ready


def test_a_spec_the_operators_model_refuses_fails_the_run_naming_the_field() -> None:
    """A bound the CRD schema cannot state (fromConfig's size): the run says why in its own status."""
    message = "spec.model.fromConfig: spec.model.fromConfig is nested deeper than 8 levels"
    new = refused_spec(api.FSDPTrainingRunStatus(), message, NOW, 3)
    failed = conditions.condition(new.conditions, conditions.FAILED)
    assert new.phase == api.Phase.FAILED and new.observed_generation == 3 and new.message == message
    assert failed is not None and failed.reason == INVALID_SPEC and failed.message == message
    assert conditions.is_true(new.conditions, conditions.FINISHED)
