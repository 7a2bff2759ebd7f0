"""Runs with a Kueue queue: Kueue admits (no own preflight), Queued says why, and a preemption is a pause."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fsdp_operator import api, builder, conditions
from fsdp_operator.jobs import JobObservation
from fsdp_operator.kueue import WorkloadObservation, observe_workload
from fsdp_operator.reconcile import (
    ClusterObservation,
    Observation,
    needs_preflight,
    observe_cluster,
    reconcile,
)
from fsdp_trainer.contract import CheckpointRef

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
RUN = builder.RunRef(name="llm", namespace="team-a", uid="0f1e2d3c-0000-4000-8000-000000000000")
CKPT = (
    CheckpointRef(uri="s3://b/p/team-a/llm/checkpoint_000020", step=20, time=NOW - dt.timedelta(minutes=1)),
)
NO_QUOTA = WorkloadObservation(
    name="raycluster-llm-3f2a1",
    admitted=False,
    reason="Pending",
    message="couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu in "
    "flavor g6, 8 more needed",
)
ADMITTED = WorkloadObservation(
    name="raycluster-llm-3f2a1",
    admitted=True,
    reason="Admitted",
    message="The workload is admitted",
    cluster_queue="gpus",
    flavors=("head:system", "workers:g6-us-west-2b"),
)
PREEMPTED = WorkloadObservation(
    name="raycluster-llm-3f2a1",
    admitted=False,
    reason="Preempted",
    message="Preempted to accommodate a workload (UID: 77) due to prioritization in the ClusterQueue",
    evicted=True,
)


def spec(**cluster: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"source": "m"},
            "checkpoint": {"storagePath": "s3://b/p"},
            "cluster": {"queueName": "team-a-gpus", **cluster},
        }
    )


def cluster(suspended: bool, ready: bool = False, zone: str | None = None) -> ClusterObservation:
    return ClusterObservation(ready=ready, message="", suspended=suspended, zone=zone)


def observe(**fields: Any) -> Observation:
    return Observation(now=NOW, generation=1, **fields)


def test_a_queued_run_skips_the_preflight_and_creates_its_cluster_suspended_in_the_queue() -> None:
    assert not needs_preflight(spec(), api.FSDPTrainingRunStatus(), cluster_exists=False, now=NOW)
    decision = reconcile(spec(), api.FSDPTrainingRunStatus(), observe(cluster=None))
    assert decision.create_cluster and decision.status.phase == api.Phase.QUEUED
    assert conditions.condition(decision.status.conditions, conditions.PREFLIGHT).reason == "DelegatedToKueue"
    manifest = builder.build_raycluster(spec(workloadPriorityClass="high"), RUN, "img:1", zone=None)
    assert manifest["spec"]["suspend"] is True
    assert manifest["metadata"]["labels"][builder.LABEL_KUEUE_QUEUE] == "team-a-gpus"
    assert manifest["metadata"]["labels"][builder.LABEL_KUEUE_PRIORITY] == "high"
    workers = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "topology.kubernetes.io/zone" not in workers.get("nodeSelector", {})
    plain = api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b"}}
    )
    assert "suspend" not in builder.build_raycluster(plain, RUN, "img:1", zone="us-west-2a")["spec"]


def test_queued_says_why_kueue_holds_it_and_admission_moves_it_on_with_kueues_zone() -> None:
    queued = reconcile(spec(), api.FSDPTrainingRunStatus(), observe(cluster=None)).status
    waiting = reconcile(spec(), queued, observe(cluster=cluster(suspended=True), workload=NO_QUOTA))
    status = waiting.status
    admitted_condition = conditions.condition(status.conditions, conditions.QUEUE_ADMITTED)
    assert status.phase == api.Phase.QUEUED and admitted_condition.status == "False"
    assert (
        admitted_condition.reason == "Pending" and "insufficient unused quota" in admitted_condition.message
    )
    assert "insufficient unused quota for nvidia.com/gpu" in (status.message or "")
    assert status.active_since is None and not waiting.create_cluster and not waiting.delete_cluster

    admitted = reconcile(
        spec(), status, observe(cluster=cluster(False, zone="us-west-2b"), workload=ADMITTED)
    )
    status = admitted.status
    assert status.phase == api.Phase.PROVISIONING and status.zone == "us-west-2b"
    assert conditions.is_true(status.conditions, conditions.QUEUE_ADMITTED)
    assert status.queue is not None and status.queue.cluster_queue == "gpus"
    assert status.queue.flavors == ["head:system", "workers:g6-us-west-2b"]
    assert status.active_since == NOW


def running(**extra: Any) -> api.FSDPTrainingRunStatus:
    return api.FSDPTrainingRunStatus(
        phase=api.Phase.RUNNING,
        attempt=1,
        job_submission_id="run-0f1e2d3c-1",
        active_since=NOW - dt.timedelta(minutes=10),
        zone="us-west-2b",
        checkpoints=api.CheckpointsStatus(latest=CKPT[-1], recent=list(CKPT)),
        **extra,
    )


def test_a_preemption_stops_the_job_queues_the_run_and_spends_no_restart() -> None:
    decision = reconcile(
        spec(),
        running(),
        observe(
            cluster=cluster(suspended=True),
            workload=PREEMPTED,
            job=JobObservation("run-0f1e2d3c-1", "RUNNING"),
            checkpoints=CKPT,
        ),
    )
    status = decision.status
    assert status.phase == api.Phase.QUEUED and decision.stop_job == "run-0f1e2d3c-1"
    assert not decision.delete_cluster, "Kueue owns the suspended cluster; the operator keeps it"
    assert status.restarts.count == 0 and status.restarts.preemptions == 1
    [entry] = status.restarts.history
    assert (
        entry.reason == "Preempted"
        and entry.resumed_from_step == 20
        and "Preempted to accommodate" in entry.message
    )
    assert [e.reason for e in decision.events] == ["Preempted"] and decision.events[0].type == "Warning"
    assert status.active_since is None and status.active_seconds == 600 and status.zone is None
    assert conditions.condition(status.conditions, conditions.QUEUE_ADMITTED).reason == "Preempted"

    # Admitted again: Provisioning, then ClusterReady submits attempt 2, which resumes from step 20.
    again = reconcile(spec(), status, observe(cluster=cluster(False, zone="us-west-2a"), workload=ADMITTED))
    assert again.status.phase == api.Phase.PROVISIONING and again.status.zone == "us-west-2a"
    ready = reconcile(spec(), again.status, observe(cluster=cluster(False, ready=True), checkpoints=CKPT))
    assert ready.submit_attempt == 2 and "resuming from step 20" in (ready.status.message or "")
    assert ready.status.restarts.count == 0


def test_a_job_still_running_after_the_preemption_is_stopped_again_while_queued() -> None:
    preempted = reconcile(spec(), running(), observe(cluster=cluster(True), workload=PREEMPTED)).status
    again = reconcile(
        spec(),
        preempted,
        observe(cluster=cluster(True), workload=PREEMPTED, job=JobObservation("run-0f1e2d3c-1", "RUNNING")),
    )
    assert again.stop_job == "run-0f1e2d3c-1" and again.status.restarts.preemptions == 1


def test_without_a_workload_the_run_says_kueue_has_not_picked_it_up() -> None:
    queued = reconcile(spec(), api.FSDPTrainingRunStatus(), observe(cluster=None)).status
    status = reconcile(spec(), queued, observe(cluster=cluster(True))).status
    condition = conditions.condition(status.conditions, conditions.QUEUE_ADMITTED)
    assert condition.status == "Unknown" and condition.reason == "NoWorkload"
    assert "ray.io/raycluster integration" in condition.message


def test_workloads_read_as_kueue_writes_them() -> None:
    pending = {
        "metadata": {"name": "raycluster-llm-3f2a1"},
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "reason": "Pending",
                    "message": NO_QUOTA.message,
                }
            ]
        },
    }
    assert observe_workload(pending) == NO_QUOTA
    admitted = {
        "metadata": {"name": "raycluster-llm-3f2a1"},
        "status": {
            "admission": {
                "clusterQueue": "gpus",
                "podSetAssignments": [
                    {"name": "head", "flavors": {"cpu": "system", "memory": "system"}},
                    {
                        "name": "workers",
                        "flavors": {"nvidia.com/gpu": "g6-us-west-2b", "cpu": "g6-us-west-2b"},
                    },
                ],
            },
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "reserved"},
                {
                    "type": "Admitted",
                    "status": "True",
                    "reason": "Admitted",
                    "message": "The workload is admitted",
                },
            ],
        },
    }
    assert observe_workload(admitted) == ADMITTED
    evicted = {
        "metadata": {"name": "raycluster-llm-3f2a1"},
        "status": {
            "conditions": [
                {"type": "Admitted", "status": "False", "reason": "NoReservation", "message": "no quota"},
                {"type": "Evicted", "status": "True", "reason": "Preempted", "message": PREEMPTED.message},
            ]
        },
    }
    assert observe_workload(evicted) == PREEMPTED


def test_a_suspended_raycluster_is_never_ready_and_its_worker_zone_is_read_from_the_selector() -> None:
    raycluster = {
        "metadata": {},
        "spec": {
            "suspend": True,
            "workerGroupSpecs": [
                {"template": {"spec": {"nodeSelector": {"topology.kubernetes.io/zone": "b"}}}}
            ],
        },
        "status": {"state": "ready"},
    }
    observed = observe_cluster(raycluster)
    assert observed.suspended and not observed.ready and observed.zone == "b"
