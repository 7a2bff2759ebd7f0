"""What a pass is given: the observation the glue gathers (observe.py), reduced from the RayCluster, its pods,
Ray's job, S3 and Kueue, and what the glue must gather for the run's phase."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fsdp_operator.api import (
    FINISHED_PHASES,
    FSDPTrainingRunSpec,
    FSDPTrainingRunStatus,
    Phase,
    ProvisioningStatus,
)
from fsdp_operator.fabric import LabelBudget
from fsdp_operator.jobs import JobObservation
from fsdp_operator.kueue import WorkloadObservation
from fsdp_operator.preflight import PreflightResult
from fsdp_trainer.contract import CheckpointRef, MlflowRunRef, ProgressRecord, RankStacks

RAY_ACTIVE_JOB_STATES = ("PENDING", "RUNNING")
ZONE_LABEL = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class ClusterObservation:
    ready: bool
    message: str
    deleting: bool = False  # has a deletionTimestamp: never used again, waited for, then recreated
    drift: str | None = None  # how it differs from what the run needs (edited by hand)
    suspended: bool = False  # spec.suspend: Kueue has not admitted it, or took the admission back
    zone: str | None = None  # the workers' zone as their node selector pins it (Kueue's flavor, or ours)
    replica_failure: str | None = None  # KubeRay could not create or delete a pod (its ReplicaFailure)
    head_ready: bool = False  # KubeRay's HeadPodReady
    # KubeRay's count of ready worker pods, and of the workers its spec asks for (status.readyWorkerReplicas,
    # desiredWorkerReplicas), from the same reconcile as its conditions.
    ready_workers: int = 0
    desired_workers: int = 0

    @property
    def every_worker_ready(self) -> bool:
        return self.ready_workers >= self.desired_workers


@dataclass(frozen=True)
class PodProblem:
    """A head or worker container that cannot start (ImagePullBackOff, CreateContainerConfigError, ...), or a
    pod no node can be added for."""

    reason: str
    message: str
    # Fails the run at once rather than after podErrorTimeoutSeconds: Karpenter has weighed every NodePool.
    at_once: bool = False


@dataclass(frozen=True)
class PodsProgress:
    """How far a RayCluster's pods have come: each count only grows while they come up."""

    pods: int
    placed: int  # bound to a node
    started: int  # a container created, so its image is on the node
    ready: int
    pulls: tuple[str, ...] = ()  # "pulling image X on node Y" with the pull's start, for pods pulling now
    pulling_since: dt.datetime | None = None  # the oldest of those pulls' starts

    def ahead_of(self, before: ProvisioningStatus) -> bool:
        """Further than `before` in any count, or pulling an image it was not."""
        now = (self.placed, self.started, self.ready, len(self.pulls))
        then = (before.pods_placed, before.pods_started, before.pods_ready, before.pods_pulling)
        return any(a > b for a, b in zip(now, then, strict=True))


@dataclass(frozen=True)
class OomKill:
    """A Ray container the kernel killed at its memory limit (the pod's last state says when)."""

    finished_at: dt.datetime
    message: str


@dataclass(frozen=True)
class Observation:
    now: dt.datetime
    generation: int
    cluster: ClusterObservation | None  # None: no RayCluster of this run exists
    preflight: PreflightResult | None = None  # computed only when `needs_preflight` says so
    refusals: tuple[str, ...] = ()  # what the run asks that its namespace does not grant (tenancy.py)
    job: JobObservation | None = None  # status.jobSubmissionId's job, when Ray answered
    dashboard_error: str | None = None  # why Ray could not be asked about the job
    progress: ProgressRecord | None = None
    checkpoints: tuple[CheckpointRef, ...] = ()
    latest_checkpoint_fingerprint: str | None = None  # of checkpoints[-1], as its manifest records it
    expected_fingerprint: str | None = None  # this run's; None skips the check
    storage_read: bool = False  # progress and checkpoints were looked for in S3 this pass
    storage_error: str | None = None  # why they could not be read
    # StorageError, or RecordTooLarge: an object under the run's prefix beyond the operator's cap
    storage_error_reason: str = "StorageError"
    pod_image_ids: tuple[str, ...] = ()  # containerStatuses[].imageID of the head and worker pods
    pod_problems: tuple[PodProblem, ...] = ()
    pod_nodes: Mapping[str, str] = field(default_factory=dict)  # the run's Ray pods' nodes, by pod name
    # How many nodes a failed fabric check may still label (fabric.py); None: the platform turned it off.
    fabric_labels: LabelBudget | None = None
    unschedulable: tuple[str, ...] = ()  # pods waiting for a node, with the scheduler's message
    scale_up: str | None = None  # an autoscaler adding a node for one of them (or held back), in its words
    scale_up_delayed: bool = False  # held back for now (a group at its maximum, in backoff, a pool's limits)
    pods_progress: PodsProgress | None = None  # the RayCluster's pods coming up
    oom_kills: tuple[OomKill, ...] = ()
    requested_image: str | None = None  # spec.image or the operator's default
    submission_prefix: str = "run"  # submission ids are <prefix>-<attempt>
    action_error: str | None = None  # why an action of the previous pass failed
    workload: WorkloadObservation | None = None  # Kueue's Workload of the RayCluster, read while queued
    # A head or worker pod of this attempt taken away (condition DisruptionTarget: preempted, evicted,
    # drained), as "pod <name> (<reason>: <message>)".
    disruption: str | None = None
    mlflow_run: MlflowRunRef | None = None  # mlflow.json, read while active with tracking on
    cluster_name: str | None = None  # the RayCluster's name (status.rayClusterName once one is created)
    run_uri: str | None = None  # the run's S3 prefix: run.json and the logs are under it
    package_sha256: str | None = None  # the trainer package a submission ships
    archived_driver_log: str | None = None  # the last ended job whose driver log is already kept in S3
    created: dt.datetime | None = None  # the run's creationTimestamp; None: now (goodput counts from there)
    # While hang forensics wait (status.forensics not concluded): the ranks' answers found, and once all
    # are in or the wait is over, the answers read.
    forensics_answered: int = 0
    forensics_answers: tuple[RankStacks, ...] | None = None
    instance_hour_price: float | None = None  # USD per instance-hour of its type, if the platform set one


def observe_cluster(raycluster: dict[str, Any], drift: str | None = None) -> ClusterObservation:
    """Ready while the head is: KubeRay v1.5 sets RayClusterProvisioned once, when every pod is first ready,
    and never sets it (or the deprecated `state: ready`) back; HeadPodReady follows the head pod, so a head
    that crashed after that is seen."""
    status = raycluster.get("status") or {}
    by_type = {c.get("type"): c for c in status.get("conditions", [])}
    provisioned = by_type.get("RayClusterProvisioned", {}).get("status") == "True"
    head_ready = by_type.get("HeadPodReady", {}).get("status") == "True"
    ready = provisioned and head_ready
    message = "; ".join(
        f"{t}={c.get('status')}" + (f" ({c['message']})" if c.get("message") else "")
        for t, c in by_type.items()
    )
    failure = by_type.get("ReplicaFailure", {})
    deleting = bool(raycluster.get("metadata", {}).get("deletionTimestamp"))
    spec = raycluster.get("spec") or {}
    suspended = bool(spec.get("suspend"))
    selectors = [
        (group.get("template", {}).get("spec", {}).get("nodeSelector") or {})
        for group in spec.get("workerGroupSpecs", [])
    ]
    zones = {selector.get(ZONE_LABEL) for selector in selectors} - {None}
    return ClusterObservation(
        ready=ready and not deleting and not suspended,
        message=message or "no status yet",
        deleting=deleting,
        drift=drift,
        suspended=suspended,
        zone=zones.pop() if len(zones) == 1 else None,
        replica_failure=_replica_failure(failure) if failure.get("status") == "True" else None,
        head_ready=head_ready,
        ready_workers=int(status.get("readyWorkerReplicas") or 0),
        desired_workers=int(status.get("desiredWorkerReplicas") or 0),
    )


def ready_for_a_job(
    cluster: ClusterObservation, spec: FSDPTrainingRunSpec, phase: Phase | None, ready_workers: int
) -> ClusterObservation:
    """Whether a run's cluster can take its job. While the run provisions, KubeRay's RayClusterProvisioned is
    not enough: KubeRay (v1.6.2, calculateStatus) sets it once and for good when every pod in its cache is
    running and ready, without counting them, so a reconcile whose cache holds the ready head and not yet the
    workers sets it with every worker unschedulable (seen on a loaded machine: the job was submitted and the
    run said nothing of the workers' "Insufficient cpu"). Its count of ready workers, from the same
    reconcile, must reach the workers asked for too; an elastic run's minWorkers are enough
    (ready_for_elastic)."""
    if phase == Phase.PROVISIONING and cluster.ready and not cluster.every_worker_ready:
        cluster = dataclasses.replace(
            cluster,
            ready=False,
            message=f"KubeRay reports the RayCluster provisioned with {cluster.ready_workers} of "
            f"{cluster.desired_workers} workers ready",
        )
    return ready_for_elastic(cluster, spec, ready_workers)


def ready_for_elastic(
    cluster: ClusterObservation, spec: FSDPTrainingRunSpec, ready_workers: int
) -> ClusterObservation:
    """An elastic run's cluster is ready for a job once its head is and cluster.minWorkers workers are:
    KubeRay's RayClusterProvisioned waits for every pod, and the others may wait hours for nodes (Ray Train
    grows onto them when they come)."""
    fewest, workers = spec.cluster.min_workers, spec.cluster.workers
    if (
        cluster.ready
        or fewest is None
        or fewest >= workers
        or not cluster.head_ready
        or cluster.deleting
        or cluster.suspended
        or ready_workers < fewest
    ):
        return cluster
    return dataclasses.replace(
        cluster,
        ready=True,
        message=f"the head and {ready_workers} of {workers} workers are ready (cluster.minWorkers {fewest})",
    )


def _replica_failure(condition: dict[str, Any]) -> str:
    """KubeRay's ReplicaFailure as "<reason>: <why>": its message joins errors one per line, the first being
    the reason again (FailedCreateHeadPod, then the apiserver's refusal)."""
    reason = str(condition.get("reason") or "ReplicaFailure")
    lines = [line.strip() for line in str(condition.get("message") or "").splitlines() if line.strip()]
    return f"{reason}: {'; '.join(lines[1:] if lines[:1] == [reason] else lines)}"


def creates_cluster_next(
    spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, cluster_exists: bool
) -> bool:
    """A run that may build a RayCluster this pass: its first (through preflight or Kueue) or one rebuilt
    after a loss. What it asks of its namespace is checked first (tenancy.py), every time: a grant the
    platform withdraws holds from the next cluster on, the first or a rebuilt one."""
    return not spec.suspend and status.phase not in FINISHED_PHASES and not cluster_exists


def needs_preflight(
    spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, cluster_exists: bool, now: dt.datetime
) -> bool:
    waiting = not spec.suspend and status.phase in (None, Phase.PENDING, Phase.SUSPENDED)
    due = status.next_check_time is None or status.next_check_time <= now
    return waiting and not cluster_exists and due and spec.cluster.queue_name is None


def needs_workload(
    spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, cluster: ClusterObservation | None
) -> bool:
    """Kueue's Workload is read while the run waits for it: queued, or just suspended by it."""
    return (
        spec.cluster.queue_name is not None
        and cluster is not None
        and (cluster.suspended or status.phase == Phase.QUEUED)
    )


def job_to_observe(status: FSDPTrainingRunStatus) -> str | None:
    """The submission whose state the next pass needs: the running one, one recorded but not yet seen in Ray,
    or the one a restart replaces."""
    watched = (Phase.CLUSTER_READY, Phase.RUNNING, Phase.RESTARTING, Phase.QUEUED)
    return status.job_submission_id if status.phase in watched else None
