"""What saves apiserver requests while runs start: a queued pass starts from the run the pass before it
stored, RayCluster events start a pass only when something a pass acts on changed, and a run starts in three
status writes and four Events; and what saves memory: runs and RayClusters kept without managedFields."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fsdp_operator import api, builder, conditions
from fsdp_operator.jobs import JobObservation
from fsdp_operator.preflight import PreflightResult
from fsdp_operator.reconcile import ClusterObservation, Observation, observe_cluster, reconcile
from fsdp_operator.runmemory import RunMemories
from fsdp_operator.watched import cluster_reaction, kept


def run(version: str, phase: str) -> dict[str, Any]:
    return {"metadata": {"uid": "u", "resourceVersion": version}, "status": {"phase": phase}}


def test_a_pass_starts_from_our_last_write_until_kopfs_copy_of_the_run_shows_it() -> None:
    runs = RunMemories()
    first = run("10", "Pending")
    assert runs.newest(first) is first  # nothing written yet
    runs.wrote("u", "10", run("11", "Provisioning"))
    assert runs.newest(first)["metadata"]["resourceVersion"] == "11"
    runs.wrote("u", "11", run("12", "ClusterReady"))
    # Any version our writes replaced gives the last stored; a version they did not make is kept as it is.
    assert runs.newest(first)["status"]["phase"] == "ClusterReady"
    assert runs.newest(run("11", "Provisioning"))["status"]["phase"] == "ClusterReady"
    other = run("13", "ClusterReady")  # written by someone else (kopf's annotations, a user) after ours
    assert runs.newest(other) is other
    assert runs.of("u").written is None  # kopf's copy moved past our write: it is not kept for nothing
    # A write from it was refused and the next one stored 15: kopf's copy, still at 13 minutes later (at 1,000
    # runs its copies lagged 152 s at the median), starts from 15, not from another refusal.
    runs.refused("u", "13")
    runs.wrote("u", "14", run("15", "Running"))
    assert runs.newest(other)["metadata"]["resourceVersion"] == "15"
    # kopf's copy shows our write: the write is forgotten (a run kept once, in kopf's index).
    shown = run("15", "Running")
    assert runs.newest(shown) is shown
    assert runs.of("u").written is None
    runs.wrote("u", "15", run("16", "Running"))
    runs.forget("u")
    assert runs.newest(first) is first


def raycluster(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "c", "namespace": "n", "generation": 1}, "spec": {}, "status": status}


def test_raycluster_progress_notes_do_not_start_a_pass_readiness_does() -> None:
    empty = cluster_reaction(raycluster())
    provisioning = cluster_reaction(
        raycluster(
            conditions=[
                {"type": "HeadPodReady", "status": "False"},
                {"type": "RayClusterProvisioned", "status": "False"},
            ]
        )
    )
    head_up = cluster_reaction(
        raycluster(
            conditions=[
                {"type": "HeadPodReady", "status": "True"},
                {"type": "RayClusterProvisioned", "status": "False"},
            ]
        )
    )
    ready = cluster_reaction(
        raycluster(
            state="ready",
            conditions=[
                {"type": "HeadPodReady", "status": "True"},
                {"type": "RayClusterProvisioned", "status": "True"},
            ],
        )
    )
    assert empty == provisioning == head_up != ready
    edited = raycluster()
    edited["metadata"]["generation"] = 2
    assert cluster_reaction(edited) != empty  # a spec edit (drift) is acted on at once
    going = raycluster()
    going["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert cluster_reaction(going) != empty


def test_a_run_starts_in_three_status_writes_whatever_kuberay_notes_while_it_provisions() -> None:
    """Each pass whose status differs from the stored one is a status write: from create to Running, the
    intent to create, the intent to submit (with the pinned image), Running; KubeRay's progress notes and the
    pods' image IDs seen while the cluster provisions change nothing."""
    spec = api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}}
    )
    digest = "ray@sha256:" + "a" * 64
    start = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)
    ok = PreflightResult(True, "CapacityAvailable", "fits in us-west-2a", zone="us-west-2a")
    notes = [
        "no status yet",
        "HeadPodReady=False; RayClusterProvisioned=False (RayCluster Pods are being provisioned)",
        "HeadPodReady=True; RayClusterProvisioned=False (RayCluster Pods are being provisioned)",
    ]
    passes = [Observation(now=start, generation=1, cluster=None, preflight=ok)]
    passes += [
        Observation(
            now=start + dt.timedelta(seconds=15 * (i + 1)),
            generation=1,
            cluster=ClusterObservation(ready=False, message=note),
            pod_image_ids=(digest,) * i,
        )
        for i, note in enumerate(notes)
    ]
    ready = ClusterObservation(ready=True, message="HeadPodReady=True; RayClusterProvisioned=True")
    at = start + dt.timedelta(seconds=60)
    passes += [
        Observation(now=at, generation=1, cluster=ready, pod_image_ids=(digest,) * 3, submission_prefix="r"),
        Observation(now=at, generation=1, cluster=ready, pod_image_ids=(digest,) * 3, job=None),
        Observation(
            now=at + dt.timedelta(seconds=5),
            generation=1,
            cluster=ready,
            pod_image_ids=(digest,) * 3,
            job=JobObservation("r-1", "RUNNING"),
        ),
    ]
    status, writes, events = api.FSDPTrainingRunStatus(), [], []
    for observation in passes:
        decision = reconcile(spec, status, observation)
        if decision.status != status:
            writes.append(decision.status.phase)
        events += [e.reason for e in decision.events]
        status = decision.status
    assert writes == [api.Phase.PROVISIONING, api.Phase.CLUSTER_READY, api.Phase.RUNNING]
    assert events == ["ClusterCreated", "JobSubmitted", "ImagePinned", "JobRunning"]  # KubeRay posts four too
    assert status.image.digest == digest and conditions.is_true(status.conditions, conditions.PODS_HEALTHY)


def test_kuberay_failing_to_create_a_pod_is_shown_while_the_cluster_provisions() -> None:
    failing = observe_cluster(
        raycluster(
            conditions=[
                {"type": "HeadPodReady", "status": "False"},
                {
                    "type": "ReplicaFailure",
                    "status": "True",
                    "reason": "FailedCreateWorkerPod",
                    "message": 'pods "w" is forbidden: exceeded quota',
                },
            ]
        )
    )
    spec = api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}}
    )
    now = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)
    status = api.FSDPTrainingRunStatus(phase=api.Phase.PROVISIONING, phase_transition_time=now)
    decision = reconcile(spec, status, Observation(now=now, generation=1, cluster=failing))
    ready = conditions.condition(decision.status.conditions, conditions.CLUSTER_READY)
    assert ready is not None and (ready.status, ready.reason) == ("False", "ReplicaFailure")
    assert ready.message == 'FailedCreateWorkerPod: pods "w" is forbidden: exceeded quota'


def test_the_operator_keeps_runs_and_clusters_without_managed_fields_or_manifest_copies() -> None:
    body = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": "c",
            "uid": "u",
            "resourceVersion": "7",
            "managedFields": [{"manager": "kuberay-operator", "fieldsV1": {"f:status": {}}}],
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{...the whole manifest...}",
                "fsdp.training.dev/last-handled-configuration": "{...the whole spec...}",
                builder.ANNOTATION_IMAGE: "repo/ray:tag",
            },
        },
        "spec": {"suspend": False},
        "status": {"state": "ready"},
    }
    stored = kept(body)
    assert stored["metadata"] == {
        "name": "c",
        "uid": "u",
        "resourceVersion": "7",
        "annotations": {builder.ANNOTATION_IMAGE: "repo/ray:tag"},  # what drift is judged against
    }
    assert stored["spec"] == body["spec"] and stored["status"] == body["status"]
    assert "annotations" not in kept({"metadata": {"name": "r", "annotations": {"a": "b"}}})["metadata"]
    assert body["metadata"]["managedFields"]  # the object kopf holds is not changed
