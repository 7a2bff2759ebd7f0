"""The run's state machine as a pure function: (spec, status, what was observed) -> new status and actions.

Kopf handlers gather observations (all I/O, each bounded by a timeout), call `reconcile`, write the new
status conditionally on the resourceVersion they read, and only then carry out the actions. So the status
always records an intent (the attempt number, its submission id, the cluster and zone) before its side
effect happens: a replayed event, a stale pass or a second operator process loses the status write and never
acts, and an action that fails becomes an observation of the next pass.

    Pending --preflight ok--> Provisioning --KubeRay ready--> ClusterReady --submit--> Running --> Succeeded
       ^  |                        |   (provisioning timeout: back to Pending or Failed)        |
       |  +--preflight Fail policy--> Failed <--permanent failure / restarts exhausted---------+
       |                            Restarting <--retryable failure (job failed, lost, hung, cluster lost)
    Suspended                         +--backoff over, old job ended, cluster ready--> Running (attempt+1)

With a Kueue queue (spec.cluster.queueName) Kueue admits instead of the preflight: Pending creates the
RayCluster suspended and the run is Queued; Kueue unsuspending it is the admission (-> Provisioning), and
Kueue suspending it again is a preemption: the job is stopped and the run is Queued again, without spending
a restart; the next admission resumes from the latest checkpoint.

A pass absorbs the facts first (progress, checkpoints, storage, transport, a changed image request, the pods'
health), then runs the guards (suspended, deadline, cluster being deleted, pods that never started,
provisioning timeout: each decides the pass or changes nothing), then one step function for the phase. Every
status field is set here, from the observation: the glue only writes what this returns.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fsdp_operator import api, conditions, fabric, goodput, hangs
from fsdp_operator.api import FSDPTrainingRunSpec, FSDPTrainingRunStatus, Phase
from fsdp_operator.bounds import CONTROL_CHARACTERS, TRUNCATED, bounded_text
from fsdp_operator.builder import uses_efa
from fsdp_operator.jobs import ENDED_JOB_STATUSES, JobObservation
from fsdp_operator.kueue import WorkloadObservation
from fsdp_operator.preflight import (
    NAMESPACE_RUN_LIMIT,
    WAITING_FOR_EARLIER_RUN,
    WORKER_FITS_NO_NODE,
    PreflightResult,
)
from fsdp_operator.recovery import REASON_BY_KIND, Failure, backoff_seconds, classify
from fsdp_operator.tenancy import NOT_ALLOWED
from fsdp_trainer.contract import (
    LOGS_DIR,
    MAX_URI,
    RUN_RECORD_FILE,
    CheckpointRef,
    ErrorKind,
    FabricReport,
    ForensicsRequest,
    MlflowRunRef,
    ProgressRecord,
    RankStacks,
    RestartEntry,
    SlowFabricPolicy,
    Transport,
    TransportReport,
    Versions,
    forensics_dir,
)

RECENT_CHECKPOINTS = 5
FORENSICS_POLL_SECONDS = 5.0  # the ranks look for a request every 5 s (fsdp_trainer.forensics)
STILL_ENDING_REQUEUE_SECONDS = 5.0  # a stopped job or a deleted cluster is usually gone within seconds
RAY_ACTIVE_JOB_STATES = ("PENDING", "RUNNING")
# Ray's memory monitor's verdict on a task or actor it killed near the node's (the pod's) memory limit.
RAY_MEMORY_MONITOR_KILL = re.compile(r"OutOfMemoryError|killed due to the node running low on memory")
ZONE_LABEL = "topology.kubernetes.io/zone"
# What the trainer writes (progress.json, mlflow.json: the tenant's code writes them) enters the status
# bounded: free text (a version, a transport evidence line) is cut to MAX_TRAINER_TEXT characters ending in
# TRUNCATED, evidence beyond MAX_EVIDENCE_LINES lines is counted in a last line; values that are only useful
# whole (the exported model's URI, the MLflow run's ids) are refused beyond their bound and left out; counts
# are clamped to what the CRD's int64 holds, non-finite numbers are left out.
MAX_TRAINER_TEXT = 256
MAX_EVIDENCE_LINES = 8
MAX_TRAINER_URI = MAX_URI
MAX_MLFLOW_ID = 256
MAX_COUNT = 2**63 - 1


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


@dataclass(frozen=True)
class PodProblem:
    """A head or worker container that cannot start (ImagePullBackOff, CreateContainerConfigError, ...)."""

    reason: str
    message: str


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
    unschedulable: tuple[str, ...] = ()  # pods waiting for a node, with the scheduler's message
    scale_up: str | None = None  # an autoscaler adding a node for one of them, in its words
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


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class DriverLog:
    """An ended job's driver log, to keep in S3 under its attempt before the cluster that has it may go."""

    submission_id: str
    node_id: str
    attempt: int


@dataclass
class Decision:
    status: FSDPTrainingRunStatus
    create_cluster: bool = False
    delete_cluster: bool = False
    submit_attempt: int | None = None  # submit status.jobSubmissionId (recorded in the status first)
    stop_job: str | None = None  # submission id to stop
    keep_driver_log: DriverLog | None = None  # before stopping or deleting anything
    request_forensics: ForensicsRequest | None = None  # written under the run's prefix after the status
    avoid_node: api.AvoidedNode | None = None  # label the node a fabric check found slow (fabric.py)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None


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
    )


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


INVALID_SPEC = "InvalidSpec"


def refused_spec(
    status: api.FSDPTrainingRunStatus, message: str, now: dt.datetime, generation: int | None
) -> api.FSDPTrainingRunStatus:
    """The status of a run the apiserver admitted but the operator's models refuse: a bound no CRD schema
    can state (fromConfig's size and depth). Failed, naming the field; nothing is built from such a spec,
    and a cluster it already has is left as it is (nothing can be derived from a spec that does not parse)."""
    new = status.model_copy(deep=True)
    for type_, ok in ((conditions.FAILED, True), (conditions.FINISHED, True), (conditions.SUCCEEDED, False)):
        new.conditions = conditions.set_condition(
            new.conditions, type_, ok, INVALID_SPEC, message, now, generation
        )
    if new.phase != Phase.FAILED:
        new.phase_transition_time = now
    new.phase, new.message = Phase.FAILED, conditions.bounded(" ".join(message.split()))
    new.observed_generation = generation
    new.next_check_time = None
    return new


def creates_cluster_next(
    spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, cluster_exists: bool
) -> bool:
    """A run whose next step is a RayCluster (through preflight or Kueue): what it asks of its namespace is
    checked first (tenancy.py), every time: a grant the platform withdraws holds from the next cluster on."""
    return not spec.suspend and status.phase in (None, Phase.PENDING, Phase.SUSPENDED) and not cluster_exists


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


def comparable_image_ids(image_ids: tuple[str, ...]) -> tuple[str, ...]:
    """The registry digests (repo@sha256:...) among the pods' image IDs, when there are any. A node reports
    one image either way: by its registry digest, or by its bare config digest (sha256:..., for an image with
    no registry digest, or before the runtime has recorded it); the two forms never compare equal, so mixing
    them would see one image as two and recreate a cluster for ever."""
    digests = tuple(image_id for image_id in image_ids if "@" in image_id)
    return digests or image_ids


def submission_id(prefix: str, attempt: int) -> str:
    return f"{prefix}-{attempt}"


class _Pass:
    """One reconcile pass: the new status under construction and the actions decided so far."""

    def __init__(self, spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, obs: Observation) -> None:
        self.spec, self.obs, self.old = spec, obs, status
        self.new = status.model_copy(deep=True)
        self.new.observed_generation = obs.generation
        self.decision = Decision(status=self.new)

    def event(self, warning: bool, reason: str, message: str) -> None:
        self.decision.events.append(Event("Warning" if warning else "Normal", reason, message))

    def condition(self, type_: str, ok: bool | Literal["Unknown"], reason: str, message: str) -> None:
        self.new.conditions = conditions.set_condition(
            self.new.conditions, type_, ok, reason, message, self.obs.now, self.obs.generation
        )

    def condition_is(self, type_: str, status: str) -> api.Condition | None:
        found = conditions.condition(self.new.conditions, type_)
        return found if found is not None and found.status == status else None

    def reason_of(self, type_: str) -> str | None:
        found = conditions.condition(self.new.conditions, type_)
        return found.reason if found else None

    def transition(
        self, phase: Phase, reason: str, message: str, warning: bool = False, announce: bool = True
    ) -> None:
        if self.new.phase != phase:
            if announce:
                self.event(warning, reason, message)
            self.new.phase_transition_time = self.obs.now
        self.new.phase = phase
        self.say(message)

    def say(self, message: str) -> None:
        """The run's message, on one line: `kubectl get` shows only the first line of a cell (KubeRay's and
        the trainer's errors span several)."""
        self.new.message = conditions.bounded(" ".join(message.split()))

    def requeue(self, seconds: float) -> None:
        current = self.decision.requeue_after
        self.decision.requeue_after = seconds if current is None else min(current, seconds)

    def seconds_since(self, moment: dt.datetime | None) -> float:
        return 0.0 if moment is None else (self.obs.now - moment).total_seconds()

    # -- facts that hold in every phase (never the phase itself) ---------------------------------------------

    def absorb(self) -> None:
        obs, new = self.obs, self.new
        progress = obs.progress
        if progress is not None:
            stage = progress.stage if progress.phase == "starting" else None
            same_stage = stage is not None and stage == new.progress.stage
            new.progress = api.ProgressStatus(  # rounded: `kubectl get` prints numbers in full
                stage=stage,
                stage_since=(new.progress.stage_since if same_stage else progress.updated_at)
                if stage
                else None,
                step=_count(progress.step),
                max_steps=_count(progress.max_steps),
                loss=_round(progress.loss, 4),
                eval_loss=_round(progress.eval_loss, 4),
                eval_perplexity=_round(progress.eval_perplexity, 2),
                tokens_per_second=_round(progress.tokens_per_second, 1),
                mfu=_round(progress.mfu, 4),
                # The size that trains: a restarting group's setup heartbeats are not a resize yet.
                world_size=_count(progress.world_size)
                if progress.phase in ("training", "finished")
                else new.progress.world_size,
                non_finite_steps=_count(progress.non_finite_steps) or None,
                updated_at=progress.updated_at,
            )
            self.absorb_resize(new.progress.world_size)
            new.record.versions = bounded_versions(progress.versions)
            new.record.exported_model_uri = (
                _whole(progress.exported_model_uri, MAX_TRAINER_URI) or new.record.exported_model_uri
            )
            if progress.transport is not None:
                self.absorb_transport(progress)
            if progress.fabric is not None and progress.submission_id == new.job_submission_id:
                self.absorb_fabric(progress.fabric)
        if obs.checkpoints:
            new.checkpoints.latest = obs.checkpoints[-1]
            new.checkpoints.recent = list(reversed(obs.checkpoints[-RECENT_CHECKPOINTS:]))
        if obs.storage_read:
            self.absorb_storage()

    def absorb_resize(self, world_size: int | None) -> None:
        """An elastic run's attempt that Ray Train resized (a node lost, or back): a history entry with the
        size it ran at until then. Not a restart: nothing is counted against maxRestarts."""
        before, progress = self.old.progress, self.obs.progress
        if (
            progress is None
            or progress.phase != "training"
            or world_size is None
            or before.world_size is None
            or world_size == before.world_size
            or progress.submission_id != self.new.job_submission_id
            or before.updated_at is None
            or self.new.attempt_time is None
            or before.updated_at < self.new.attempt_time  # the size shown was the previous attempt's
        ):
            return
        message = f"Ray Train resized the workers from {before.world_size} to {world_size} training processes"
        entry = RestartEntry(
            time=self.obs.now,
            reason="Resized",
            message=message,
            resumed_from_step=progress.resumed_from_step,
            world_size=before.world_size,
        )
        self.new.restarts.history = [*self.new.restarts.history, entry][-api.RESTART_HISTORY_IN_STATUS :]
        self.event(False, "Resized", message)

    def absorb_storage(self) -> None:
        error = self.obs.storage_error
        if error is None:
            self.condition(
                conditions.STORAGE_READABLE, True, "Readable", "progress and checkpoints are readable"
            )
            return
        message = f"cannot read progress and checkpoints, so hang detection waits: {error}"
        reason = self.obs.storage_error_reason
        if self.reason_of(conditions.STORAGE_READABLE) != reason or not self.condition_is(
            conditions.STORAGE_READABLE, "False"
        ):
            self.event(True, "StorageUnreadable" if reason == "StorageError" else reason, message)
        self.condition(conditions.STORAGE_READABLE, False, reason, message)

    def absorb_transport(self, progress: ProgressRecord) -> None:
        assert progress.transport is not None
        self.new.transport = bounded_transport(progress.transport)
        fell_back = uses_efa(self.spec) and progress.transport.observed == Transport.SOCKET
        if fell_back:
            fallen = self.new.transport.fallback_pods
            pods = f" (on {', '.join(fallen)})" if fallen else ""
            message = f"NCCL used TCP sockets{pods} although the workers have EFA: " + "; ".join(
                self.new.transport.evidence[:2]
            )
            if not self.condition_is(conditions.TRANSPORT_DEGRADED, "True"):
                self.event(True, "TransportDegraded", message)
            self.condition(conditions.TRANSPORT_DEGRADED, True, "SocketFallback", message)
        else:
            observed = Transport(progress.transport.observed).value
            self.condition(conditions.TRANSPORT_DEGRADED, False, "AsExpected", f"NCCL transport: {observed}")

    def absorb_fabric(self, report: FabricReport) -> None:
        """The attempt's fabric check: its figures in status.fabric and FabricVerified."""
        new = self.new
        avoided = new.fabric.avoided_nodes if new.fabric is not None else []
        new.fabric = api.FabricStatus(
            attempt=new.attempt, report=fabric.bounded_report(report), avoided_nodes=avoided
        )
        ok, reason, message = fabric.verdict(new.fabric.report)
        if not ok and not self.condition_is(conditions.FABRIC_VERIFIED, "False"):
            self.event(True, reason, message)
        self.condition(conditions.FABRIC_VERIFIED, ok, reason, message)

    def avoiding_slow_node(self, failure: Failure) -> Failure:
        """A failed fabric check under network.slowFabric avoidNode, with one node to blame: the node is
        labelled (recorded here, done by the actions before the cluster is deleted) and the attempt restarts
        on a new cluster whose workers avoid it. Otherwise the failure stands, saying why no node was."""
        new, obs = self.new, self.obs
        if failure.reason != REASON_BY_KIND[ErrorKind.FABRIC]:
            return failure
        checked = new.fabric if new.fabric is not None and new.fabric.attempt == new.attempt else None
        node = fabric.node_to_avoid(checked.report, obs.pod_nodes) if checked is not None else None
        if self.spec.network.slow_fabric != SlowFabricPolicy.AVOID_NODE or checked is None or node is None:
            why = (
                "network.slowFabric is fail"
                if self.spec.network.slow_fabric != SlowFabricPolicy.AVOID_NODE
                else "no node to avoid: the slow links share no single pod the operator saw placed"
            )
            return dataclasses.replace(failure, message=f"{failure.message} ({why})")
        why = f"{obs.run_uri} attempt {new.attempt}: {checked.report.message}"
        avoided = api.AvoidedNode(node=node, labelled_at=obs.now, why=conditions.bounded(why))
        checked.avoided_nodes = [*checked.avoided_nodes, avoided][-api.MAX_AVOIDED_NODES :]
        self.decision.avoid_node = avoided
        self.decision.delete_cluster = True
        self.event(
            True, "SlowNodeAvoided", f"node {node} labelled {fabric.DEGRADED_LABEL}: {checked.report.message}"
        )
        return Failure(
            False,
            failure.reason,
            f"{failure.message}; node {node} labelled {fabric.DEGRADED_LABEL}, the next attempt's workers "
            "avoid it",
        )

    def absorb_pods_image(self) -> None:
        """The digest the pods run, once the cluster is past provisioning (ready, or given up): while it
        provisions, pods start one by one, and pinning the first one's would cost a status write alone."""
        if self.obs.pod_image_ids and self.new.phase != Phase.PROVISIONING:
            self.absorb_image(set(comparable_image_ids(self.obs.pod_image_ids)))

    def absorb_image(self, image_ids: set[str]) -> None:
        image = self.new.image
        if len(image_ids) > 1:
            message = "pods ran different images: " + ", ".join(sorted(image_ids))
            if image.consistent is not False:
                self.event(True, "ImageMismatch", message)
            image.consistent = False
            self.condition(conditions.IMAGE_CONSISTENT, False, "PodsDisagree", message)
            return
        (image_id,) = image_ids
        if image.digest is None:
            self.event(False, "ImagePinned", f"pods run {image_id}; every later attempt uses this digest")
        elif image.digest != image_id and image.consistent is not False:
            self.event(True, "ImageChanged", f"pods run {image_id}, not the pinned {image.digest}")
        image.digest = image.digest or image_id
        image.consistent = image.digest == image_id
        self.condition(
            conditions.IMAGE_CONSISTENT,
            image.consistent,
            "PodsAgree" if image.consistent else "DigestChanged",
            f"head and workers run {image_id}",
        )

    # -- actions ---------------------------------------------------------------------------------------------

    def start_active(self) -> None:
        self.new.active_since = self.new.active_since or self.obs.now
        self.new.start_time = self.new.start_time or self.obs.now

    def stop_active(self) -> None:
        if self.new.active_since is not None:
            self.new.active_seconds += int(self.seconds_since(self.new.active_since))
            self.new.active_since = None

    def submit(self, after: str = "") -> None:
        """Records attempt N+1 and its submission id; the glue submits it after this status is written.
        `after` leads the JobSubmitted Event's message: what else this pass saw (the cluster became ready)."""
        new, obs = self.new, self.obs
        mismatch = self.checkpoint_mismatch()
        if mismatch:
            self.finish(Phase.FAILED, "CheckpointMismatch", mismatch)
            return
        new.attempt += 1
        new.job_submission_id = submission_id(obs.submission_prefix, new.attempt)
        new.attempt_time = obs.now
        new.next_check_time = None
        self.decision.submit_attempt = new.attempt
        resumed = new.checkpoints.latest.step if new.checkpoints.latest else None
        message = f"attempt {new.attempt} submitted" + (f", resuming from step {resumed}" if resumed else "")
        # The phase moves to Running once Ray reports the job; until then the submission is owed.
        self.condition(conditions.JOB_RUNNING, "Unknown", "Submitted", f"{message}; waiting for Ray")
        self.event(False, "JobSubmitted", after + message)
        self.say(message)

    def checkpoint_mismatch(self) -> str | None:
        obs, latest = self.obs, self.obs.checkpoints[-1] if self.obs.checkpoints else None
        if latest is None or obs.expected_fingerprint is None or self.spec.checkpoint.resume != "auto":
            return None
        if obs.latest_checkpoint_fingerprint == obs.expected_fingerprint:
            return None
        found = obs.latest_checkpoint_fingerprint or "none (written by an older trainer)"
        return (
            f"the newest checkpoint under this run's prefix ({latest.uri}, step {latest.step}) was written "
            "by "
            f"another configuration: fingerprint {found}, this run's is {obs.expected_fingerprint} (model, "
            "tokenizer, sequence length, seed or data differ). It is never loaded: use another run name or "
            "storagePath, or set checkpoint.resume to never"
        )

    def finish(self, phase: Phase, reason: str, message: str) -> None:
        succeeded = phase == Phase.SUCCEEDED
        if not succeeded and self.new.phase in api.ACTIVE_PHASES and self.new.job_submission_id:
            self.decision.stop_job = self.new.job_submission_id  # a no-op for a job that ended itself
        if not succeeded:
            self.condition(conditions.FAILED, True, reason, message)
        self.condition(conditions.JOB_RUNNING, False, reason, message)
        self.condition(conditions.SUCCEEDED, succeeded, reason, message)
        self.condition(conditions.FINISHED, True, "Succeeded" if succeeded else "Failed", message)
        self.transition(phase, reason, message, warning=not succeeded)
        self.new.completion_time = self.obs.now
        self.new.next_check_time = None
        self.stop_active()
        if self.spec.cleanup_policy == api.CleanupPolicy.DELETE_CLUSTER and self.obs.cluster is not None:
            self.decision.delete_cluster = True

    def fail_attempt(self, failure: Failure) -> None:
        """A failed attempt: Failed when permanent or out of restarts, else Restarting after a backoff. An
        attempt lost with a disrupted pod (preempted, evicted, drained) restarts without spending a restart,
        as a Job's podFailurePolicy ignores DisruptionTarget."""
        new, recovery, disruption = self.new, self.spec.recovery, self.obs.disruption
        if failure.permanent:
            named = failure.message.startswith(failure.reason)  # the trainer's errors name their kind
            self.finish(
                Phase.FAILED,
                failure.reason,
                failure.message if named else f"{failure.reason}: {failure.message}",
            )
            return
        if disruption is None and new.restarts.count >= recovery.max_restarts:
            self.finish(
                Phase.FAILED,
                "RestartsExhausted",
                f"{failure.reason} after {new.restarts.count} restarts "
                f"(maxRestarts {recovery.max_restarts}): {failure.message}",
            )
            return
        if new.job_submission_id:
            self.decision.stop_job = new.job_submission_id  # it may still run (hang, cluster edited)
        delay = backoff_seconds(recovery.backoff_seconds, new.restarts.count)
        resumed = new.checkpoints.latest.step if new.checkpoints.latest else None
        if disruption is None:
            new.restarts.count += 1
            reason, why = failure.reason, failure.message
            counted = f"restart {new.restarts.count}/{recovery.max_restarts}"
        else:
            new.restarts.preemptions += 1
            reason, why = "Preempted", f"{failure.reason} after {disruption}: {failure.message}"
            counted = (
                f"restart after a disruption (not counted; {new.restarts.count}/{recovery.max_restarts} used)"
            )
            self.event(True, "Preempted", why)
        entry = RestartEntry(
            time=self.obs.now,
            reason=reason,
            message=conditions.bounded(why),
            resumed_from_step=resumed,
            world_size=new.progress.world_size,
        )
        new.restarts.history = [*new.restarts.history, entry][-api.RESTART_HISTORY_IN_STATUS :]
        new.next_check_time = self.obs.now + dt.timedelta(seconds=delay)
        self.requeue(delay)
        message = f"{counted} in {delay}s after {reason}: {why}; resuming from " + (
            f"step {resumed}" if resumed is not None else "the start"
        )
        self.condition(conditions.JOB_RUNNING, False, failure.reason, failure.message)
        self.transition(Phase.RESTARTING, "Restarting", message, warning=True)

    # -- guards ----------------------------------------------------------------------------------------------

    def run(self) -> Decision:
        self.keep_driver_log()
        self.absorb()
        if self.new.phase not in api.FINISHED_PHASES:
            self.decide()
        self.absorb_pods_image()
        self.absorb_record()
        obs = self.obs
        created = obs.created or obs.now
        self.new.goodput = goodput.account(
            self.spec, self.old, self.new, obs.progress, obs.now, created, obs.instance_hour_price
        )
        return self.decision

    def decide(self) -> None:
        """The guards, each of which either decides the pass or changes nothing, then the phase's step."""
        if self.spec.suspend:
            self.suspend()
            return
        if self.new.phase == Phase.SUSPENDED:
            self.condition(conditions.SUSPENDED, False, "Resumed", "spec.suspend is false")
        self.absorb_image_request()
        if self.deadline_passed() or self.cluster_deleting():
            return
        self.absorb_pods_health()
        self.absorb_scheduling()
        if self.pods_never_started() or self.provisioning_timed_out():
            return
        self.step()

    def keep_driver_log(self) -> None:
        """An ended job's driver log is kept once, under the attempt that ran it (the status as read)."""
        job = self.obs.job
        if (
            job is not None
            and job.status in ENDED_JOB_STATUSES
            and job.driver_node_id
            and job.submission_id != self.obs.archived_driver_log
        ):
            self.decision.keep_driver_log = DriverLog(job.submission_id, job.driver_node_id, self.new.attempt)

    def absorb_record(self) -> None:
        """Where the run's records are, and what a submission of this pass ships."""
        new, obs = self.new, self.obs
        if obs.cluster_name is not None and (self.decision.create_cluster or obs.cluster is not None):
            new.ray_cluster_name = obs.cluster_name
        if obs.run_uri is not None:
            new.record.uri = f"{obs.run_uri}/{RUN_RECORD_FILE}"
            new.record.logs_uri = f"{obs.run_uri}/{LOGS_DIR}"
        if obs.mlflow_run is not None and self.mlflow_run_is_plausible(obs.mlflow_run):
            new.record.mlflow_run = api.MlflowRunStatus.of(obs.mlflow_run)
        if self.decision.submit_attempt is not None and obs.package_sha256 is not None:
            new.record.package_sha256 = obs.package_sha256

    def mlflow_run_is_plausible(self, ref: MlflowRunRef) -> bool:
        """mlflow.json links the status to the tracking server the spec names, with ids of a sane size;
        any other (a tenant's own mlflow.json pointing elsewhere) is left out of the status."""
        mlflow = self.spec.tracking.mlflow
        return (
            mlflow is not None
            and ref.tracking_uri == mlflow.tracking_uri
            and all(_whole(v, MAX_MLFLOW_ID) for v in (ref.experiment_id, ref.run_id))
        )

    def suspend(self) -> None:
        new = self.new
        if new.phase in api.ACTIVE_PHASES and new.job_submission_id:
            self.decision.stop_job = new.job_submission_id
        if self.obs.cluster is not None and not self.obs.cluster.deleting:
            self.decision.delete_cluster = True
        self.condition(
            conditions.SUSPENDED, True, "SuspendedBySpec", "spec.suspend is true; checkpoints are kept"
        )
        self.condition(
            conditions.CLUSTER_READY, False, "Suspended", "the RayCluster is deleted while suspended"
        )
        self.condition(conditions.JOB_RUNNING, False, "Suspended", "the job is stopped while suspended")
        self.transition(
            Phase.SUSPENDED, "Suspended", "suspended: job stopped, cluster deleted, checkpoints kept"
        )
        new.next_check_time = None
        self.stop_active()

    def absorb_image_request(self) -> None:
        """A new spec.image (allowed only while no cluster exists) drops the digest pinned for the old one."""
        image, requested = self.new.image, self.obs.requested_image
        waiting = self.new.phase not in api.ACTIVE_PHASES
        if requested and image.requested and image.requested != requested and waiting:
            if image.digest:
                self.event(
                    False,
                    "ImageRequestChanged",
                    f"image {requested} requested; the digest pinned for {image.requested} "
                    f"({image.digest}) is dropped and the next pull is pinned",
                )
            self.new.image = api.ImageStatus(requested=requested)

    def deadline_passed(self) -> bool:
        deadline, new = self.spec.active_deadline_seconds, self.new
        # Runs started before active time was recorded count from their start.
        since = new.active_since or (new.start_time if new.phase in api.ACTIVE_PHASES else None)
        active = new.active_seconds + self.seconds_since(since)
        if deadline is None or active <= deadline:
            return False
        self.finish(
            Phase.FAILED,
            "DeadlineExceeded",
            f"active for {int(active)}s, longer than activeDeadlineSeconds ({deadline}s)",
        )
        return True

    def cluster_deleting(self) -> bool:
        """A RayCluster being deleted is never used: wait until it is gone, then the phase step recreates."""
        cluster = self.obs.cluster
        if cluster is None or not cluster.deleting:
            return False
        self.condition(
            conditions.CLUSTER_READY, False, "ClusterDeleting", "waiting for the old RayCluster to go"
        )
        if self.new.phase == Phase.RUNNING:  # deleted under a running job: that attempt is over
            self.fail_attempt(
                Failure(False, "ClusterLost", "the RayCluster is being deleted while the job ran")
            )
        self.requeue(STILL_ENDING_REQUEUE_SECONDS)
        return True

    def pods_that_cannot_start(self) -> tuple[PodProblem, ...]:
        """Pods KubeRay cannot create (a ResourceQuota exceeded, a service account that does not exist, an
        admission webhook's refusal: its ReplicaFailure), then containers that cannot start."""
        failure = self.obs.cluster.replica_failure if self.obs.cluster else None
        reason = failure.split(":", 1)[0] if failure else ""
        if failure is None or not reason.startswith("FailedCreate"):  # not a failed deletion
            return self.obs.pod_problems
        return (PodProblem(reason, f"KubeRay cannot create a pod: {failure}"), *self.obs.pod_problems)

    def absorb_pods_health(self) -> None:
        """PodsHealthy from the cluster's pods: False with the first reasons while any cannot start (also the
        message of a provisioning run), and a pass due when podErrorTimeoutSeconds would be over."""
        problems = self.pods_that_cannot_start()
        if self.obs.cluster is None:
            return
        if not problems:
            self.pods_healthy()
            return
        message = "; ".join(p.message for p in problems[:3])
        if not self.condition_is(conditions.PODS_HEALTHY, "False"):
            self.event(True, problems[0].reason, message)
        self.condition(conditions.PODS_HEALTHY, False, problems[0].reason, message)
        if self.new.phase == Phase.PROVISIONING:
            self.say(f"waiting for KubeRay: {message}")
        since = self.condition_is(conditions.PODS_HEALTHY, "False")
        limit = self.spec.recovery.pod_error_timeout_seconds
        self.requeue(max(limit - self.seconds_since(since.last_transition_time if since else None), 1.0))

    def absorb_scheduling(self) -> None:
        """PodsScheduled=False with the scheduler's message (and an autoscaler's) while Ray pods wait for a
        node (also the message of a provisioning run); True again once they are placed. Not set for runs
        never short of one."""
        if self.obs.cluster is None:
            return
        waiting = self.obs.unschedulable
        if not waiting:
            if self.condition_is(conditions.PODS_SCHEDULED, "False"):
                self.condition(conditions.PODS_SCHEDULED, True, "Scheduled", "every Ray pod has a node")
            return
        message = f"{len(waiting)} pod(s) wait for a node: " + "; ".join(waiting[:2])
        reason = "WaitingForScaleUp" if self.obs.scale_up else "Unschedulable"
        if self.reason_of(conditions.PODS_SCHEDULED) != reason:
            self.event(True, reason, message)
        self.condition(conditions.PODS_SCHEDULED, False, reason, message)
        if self.new.phase == Phase.PROVISIONING:
            self.say(f"waiting for KubeRay: {message}")

    def pods_never_started(self) -> bool:
        """Pods that could not start for podErrorTimeoutSeconds fail the run."""
        stuck = self.condition_is(conditions.PODS_HEALTHY, "False")
        limit = self.spec.recovery.pod_error_timeout_seconds
        problems = self.pods_that_cannot_start()
        if self.obs.cluster is None or not problems or stuck is None:
            return False
        if self.seconds_since(stuck.last_transition_time) < limit:
            return False
        first, message = problems[0], "; ".join(p.message for p in problems[:3])
        self.finish(Phase.FAILED, first.reason, f"pods could not start for {limit}s: {message}")
        self.decision.delete_cluster = True  # nothing ran; the GPUs go back whatever cleanupPolicy says
        return True

    def pods_healthy(self) -> None:
        self.condition(conditions.PODS_HEALTHY, True, "PodsStarting", "no pod is stuck starting")

    def provisioning_timed_out(self) -> bool:
        new, limit = self.new, self.spec.recovery.provisioning_timeout_seconds
        if new.phase != Phase.PROVISIONING or self.seconds_since(new.phase_transition_time) < limit:
            return False
        message = f"the RayCluster was not ready within provisioningTimeoutSeconds ({limit}s)"
        waiting = self.obs.unschedulable
        if waiting:  # the why first: messages are bounded
            message += f": {len(waiting)} pod(s) had no node: {waiting[0]}"
        if self.obs.cluster is not None:
            message += f"; KubeRay: {self.obs.cluster.message}"
            self.decision.delete_cluster = True
        new.provisioning_timeouts += 1
        attempts = self.spec.recovery.provisioning_attempts
        if self.spec.preflight.on_insufficient_capacity == api.PreflightPolicy.FAIL:
            self.finish(Phase.FAILED, "ProvisioningTimeout", message)
            return True
        if new.provisioning_timeouts >= attempts:
            given_up = f"RayCluster {new.provisioning_timeouts} of recovery.provisioningAttempts {attempts}"
            self.finish(Phase.FAILED, "ProvisioningTimeout", f"{message} ({given_up})")
            return True
        self.stop_active()
        self.condition(conditions.PREFLIGHT, False, "ProvisioningTimeout", message)
        self.condition(conditions.CLUSTER_READY, False, "ProvisioningTimeout", message)
        new.next_check_time = self.obs.now + dt.timedelta(seconds=self.spec.preflight.recheck_seconds)
        self.transition(Phase.PENDING, "ProvisioningTimeout", f"{message}; waiting for capacity again", True)
        self.requeue(self.spec.preflight.recheck_seconds)
        return True

    # -- the phases ------------------------------------------------------------------------------------------

    def step(self) -> Decision:
        new, cluster = self.new, self.obs.cluster
        if new.phase in (None, Phase.PENDING, Phase.SUSPENDED):
            if cluster is not None:
                # Intent is recorded before creation, so a cluster here is one being given up (suspend,
                # provisioning timeout) whose deletion has not started yet.
                self.decision.delete_cluster = True
                self.requeue(STILL_ENDING_REQUEUE_SECONDS)
                return self.decision
            return self.pending()
        if cluster is None:
            return self.without_cluster()
        if self.spec.cluster.queue_name is not None:
            if cluster.suspended:
                return self.queued()
            if new.phase == Phase.QUEUED:
                self.admitted()
        if cluster.drift and new.phase in (Phase.CLUSTER_READY, Phase.RUNNING, Phase.RESTARTING):
            return self.cluster_modified(cluster.drift)
        if not cluster.ready:
            if cluster.replica_failure:
                self.condition(conditions.CLUSTER_READY, False, "ReplicaFailure", cluster.replica_failure)
            elif new.phase != Phase.PROVISIONING:
                # While it provisions, "Creating" stands: KubeRay's progress notes would each cost a status
                # write and tell a user nothing the RayCluster does not; pods that cannot start have
                # PodsHealthy, and a timeout quotes KubeRay's note.
                self.condition(conditions.CLUSTER_READY, False, "RayClusterNotReady", cluster.message)
            if new.phase == Phase.CLUSTER_READY:
                self.transition(
                    Phase.PROVISIONING, "ClusterNotReady", f"RayCluster not ready: {cluster.message}", True
                )
            if new.phase == Phase.RUNNING:
                self.running()  # the job may still be fine (a worker pod restarting) or already lost
            return self.decision
        if new.phase in (Phase.PROVISIONING, Phase.CLUSTER_READY) and self.pods_disagree():
            return self.decision
        self.condition(
            conditions.CLUSTER_READY, True, "RayClusterReady", "KubeRay reports the RayCluster ready"
        )
        became_ready = new.phase == Phase.PROVISIONING
        if became_ready:
            # Announced by the submission's Event when this pass submits (one Event, not two, a moment apart).
            self.transition(Phase.CLUSTER_READY, "ClusterReady", "RayCluster is ready", announce=False)
        if self.awaiting_submission():
            if became_ready:
                self.event(False, "ClusterReady", "RayCluster is ready")
            self.confirm_submission()
        elif new.phase == Phase.CLUSTER_READY:
            self.submit(after="RayCluster is ready; " if became_ready else "")
        elif new.phase == Phase.RESTARTING:
            self.restarting()
        elif new.phase == Phase.RUNNING:
            self.running()
        return self.decision

    def pods_disagree(self) -> bool:
        """Pods of a new cluster that pulled different images for one tag (nodes holding different copies of a
        republished tag: different NCCL builds in one job): before any job runs, the cluster is recreated on
        the digest most of them run, pinned for every later attempt."""
        ids = comparable_image_ids(self.obs.pod_image_ids)
        submitted = self.new.job_submission_id is not None and self.new.phase == Phase.CLUSTER_READY
        if len(set(ids)) < 2 or submitted:
            return False
        chosen = max(sorted(set(ids)), key=ids.count)
        message = f"pods pulled different images ({', '.join(sorted(set(ids)))}): recreating on {chosen}"
        self.event(True, "ImageMismatch", message)
        self.new.image.digest, self.new.image.consistent = chosen, None
        self.condition(conditions.IMAGE_CONSISTENT, False, "Recreating", message)
        self.condition(conditions.CLUSTER_READY, False, "ImageMismatch", message)
        self.transition(Phase.PROVISIONING, "ImageMismatch", message, announce=False)
        self.decision.delete_cluster = True
        self.requeue(STILL_ENDING_REQUEUE_SECONDS)
        return True

    def pending(self) -> Decision:
        new, obs = self.new, self.obs
        if obs.refusals:  # nothing is created with powers the namespace's users were not given
            self.finish(Phase.FAILED, NOT_ALLOWED, "; ".join(obs.refusals))
            return self.decision
        if self.spec.cluster.queue_name is not None:
            return self.enqueue(self.spec.cluster.queue_name)
        result = obs.preflight
        if result is None:  # not due for a re-check yet
            if new.next_check_time is not None:
                self.requeue(max((new.next_check_time - obs.now).total_seconds(), 1.0))
            return self.decision
        if result.ok:
            self.condition(conditions.PREFLIGHT, True, result.reason, result.message)
            new.zone = result.zone
            new.next_check_time = None
            self.start_active()
            new.image.requested = new.image.requested or obs.requested_image
            self.decision.create_cluster = True
            message = "RayCluster created; waiting for KubeRay"
            self.condition(conditions.CLUSTER_READY, False, "Creating", message)
            self.pods_healthy()  # in this write, not the next pass's: none can be stuck before any exists
            # One Event for both (an Event is a request): the Preflight condition keeps the placement.
            self.event(False, "ClusterCreated", f"preflight passed ({result.message}); {message}")
            self.transition(Phase.PROVISIONING, "ClusterCreated", message, announce=False)
            return self.decision
        previous = conditions.condition(new.conditions, conditions.PREFLIGHT)
        if previous is None or previous.reason != result.reason or previous.status != "False":
            self.event(True, result.reason, result.message)
        self.condition(conditions.PREFLIGHT, False, result.reason, result.message)
        if result.reason == WORKER_FITS_NO_NODE:  # nodes the group adds have the same shape: no waiting
            self.finish(Phase.FAILED, result.reason, result.message)
            return self.decision
        if (
            self.spec.preflight.on_insufficient_capacity == api.PreflightPolicy.FAIL
            and result.reason != NAMESPACE_RUN_LIMIT  # a team's limit is no lack of capacity: its turn comes
        ):
            self.finish(Phase.FAILED, "PreflightFailed", f"preflight failed: {result.message}")
            return self.decision
        # The preflight reason's Warning above already says why.
        self.transition(Phase.PENDING, "Waiting", f"waiting for capacity: {result.message}", announce=False)
        if result.reason == WAITING_FOR_EARLIER_RUN:
            # Its turn comes with the earlier run's admission, which the next pass sees in the cache: check
            # again then, not a whole recheckSeconds later (runs created together would all wait a minute).
            new.next_check_time = None
            return self.decision
        new.next_check_time = obs.now + dt.timedelta(seconds=self.spec.preflight.recheck_seconds)
        self.requeue(self.spec.preflight.recheck_seconds)
        return self.decision

    # -- Kueue --------------------------------------------------------------------------------------------

    def enqueue(self, queue: str) -> Decision:
        """Kueue decides admission: the RayCluster is created suspended in the queue, and the run waits."""
        new = self.new
        new.image.requested = new.image.requested or self.obs.requested_image
        new.start_time = new.start_time or self.obs.now
        new.next_check_time = None
        new.zone = None  # Kueue's flavor chooses it
        self.decision.create_cluster = True
        self.condition(
            conditions.PREFLIGHT, True, "DelegatedToKueue", f"Kueue admits the run through LocalQueue {queue}"
        )
        self.condition(
            conditions.QUEUE_ADMITTED, "Unknown", "Queued", "RayCluster created suspended; waiting for Kueue"
        )
        self.transition(
            Phase.QUEUED, "Queued", f"queued in LocalQueue {queue}: waiting for Kueue to admit the RayCluster"
        )
        return self.decision

    def queued(self) -> Decision:
        """The RayCluster is suspended: not admitted yet, or admitted and then preempted."""
        new, obs, workload = self.new, self.obs, self.obs.workload
        if new.phase in api.ACTIVE_PHASES:
            self.preempted()
        elif obs.job is not None and obs.job.status in RAY_ACTIVE_JOB_STATES:
            self.decision.stop_job = obs.job.submission_id  # the stop at the preemption did not take
        queue = self.spec.cluster.queue_name
        if workload is None:
            why = (
                f"no Kueue Workload for the RayCluster yet (Kueue, with its ray.io/raycluster integration, "
                f"creates one for the LocalQueue {queue})"
            )
            self.condition(conditions.QUEUE_ADMITTED, "Unknown", "NoWorkload", why)
        else:
            why = f"{workload.reason}: {workload.message}"
            self.condition(conditions.QUEUE_ADMITTED, False, workload.reason, workload.message)
            new.queue = (new.queue or api.QueueStatus()).model_copy(update={"workload": workload.name})
        self.say(f"queued in LocalQueue {queue}: {why}")
        return self.decision

    def preempted(self) -> None:
        """Kueue took the capacity back: stop the job, keep the checkpoints, queue again; no restart spent."""
        new, workload = self.new, self.obs.workload
        if new.job_submission_id:
            self.decision.stop_job = new.job_submission_id  # a no-op for a job that ended with its pods
        why = f"{workload.reason}: {workload.message}" if workload else "Kueue suspended the RayCluster"
        resumed = new.checkpoints.latest.step if new.checkpoints.latest else None
        new.restarts.preemptions += 1
        entry = RestartEntry(
            time=self.obs.now, reason="Preempted", message=conditions.bounded(why), resumed_from_step=resumed
        )
        new.restarts.history = [*new.restarts.history, entry][-api.RESTART_HISTORY_IN_STATUS :]
        new.zone = None
        self.stop_active()
        self.condition(conditions.JOB_RUNNING, False, "Preempted", why)
        self.condition(conditions.CLUSTER_READY, False, "SuspendedByKueue", why)
        resumes = f"step {resumed}" if resumed is not None else "the start"
        self.transition(
            Phase.QUEUED,
            "Preempted",
            f"preempted by Kueue ({why}); the job is stopped, checkpoints are kept, and the run resumes from "
            f"{resumes} when Kueue admits it again (no restart is spent)",
            warning=True,
        )

    def admitted(self) -> None:
        """Kueue unsuspended the RayCluster: the run holds its quota from now on."""
        new, cluster, workload = self.new, self.obs.cluster, self.obs.workload
        assert cluster is not None
        new.zone = cluster.zone
        self.start_active()
        where = ""
        if workload is not None:
            new.queue = api.QueueStatus(
                workload=workload.name,
                cluster_queue=workload.cluster_queue,
                flavors=list(workload.flavors),
                admitted_time=self.obs.now,
            )
            where = (
                f" by ClusterQueue {workload.cluster_queue} ({', '.join(workload.flavors) or 'no flavor'})"
            )
        message = f"admitted by Kueue{where}; waiting for KubeRay"
        self.condition(conditions.QUEUE_ADMITTED, True, "Admitted", message)
        self.condition(conditions.CLUSTER_READY, False, "Creating", message)
        self.transition(Phase.PROVISIONING, "Admitted", message)

    def without_cluster(self) -> Decision:
        """No RayCluster although the run is active: created by the glue right after the intent was written
        (Provisioning), or lost (deleted by hand, namespace trouble): (re)create it in the same zone."""
        new, obs = self.new, self.obs
        self.decision.create_cluster = True
        if obs.action_error:
            if (
                not self.condition_is(conditions.CLUSTER_READY, "False")
                or self.reason_of(conditions.CLUSTER_READY) != "CreateFailed"
            ):
                self.event(True, "ClusterCreateFailed", obs.action_error)
            self.condition(conditions.CLUSTER_READY, False, "CreateFailed", obs.action_error)
        if new.phase == Phase.RUNNING:
            self.fail_attempt(Failure(False, "ClusterLost", "the RayCluster was deleted while the job ran"))
            self.decision.create_cluster = self.decision.status.phase == Phase.RESTARTING
        elif self.condition_is(conditions.CLUSTER_READY, "True") and not obs.action_error:
            self.condition(conditions.CLUSTER_READY, False, "ClusterLost", "the RayCluster disappeared")
            self.event(True, "ClusterRecreated", "RayCluster recreated after it disappeared")
        return self.decision

    def cluster_modified(self, drift: str) -> Decision:
        """A RayCluster edited by hand (fewer workers, another image) cannot run the attempt as recorded:
        stop the job, delete the cluster, and restart on a fresh one."""
        if self.reason_of(conditions.CLUSTER_READY) != "ClusterModified":
            self.event(True, "ClusterModified", f"the RayCluster no longer matches the run: {drift}")
        self.condition(conditions.CLUSTER_READY, False, "ClusterModified", drift)
        self.decision.delete_cluster = True
        if self.new.phase == Phase.RESTARTING:
            if self.new.job_submission_id:
                self.decision.stop_job = self.new.job_submission_id
            return self.decision
        self.fail_attempt(Failure(False, "ClusterModified", drift))
        return self.decision

    def restarting(self) -> None:
        new, obs = self.new, self.obs
        if new.next_check_time is not None and new.next_check_time > obs.now:
            self.requeue((new.next_check_time - obs.now).total_seconds())
            return
        previous = obs.job
        if new.job_submission_id and (previous is None or previous.status in RAY_ACTIVE_JOB_STATES):
            # Never two attempts at once: the replaced job must be seen ended (or unknown to Ray) first.
            if previous is not None:
                self.decision.stop_job = new.job_submission_id
            if obs.dashboard_error:
                self.condition(conditions.JOB_RUNNING, "Unknown", "DashboardUnreachable", obs.dashboard_error)
            else:
                self.condition(
                    conditions.JOB_RUNNING,
                    False,
                    "WaitingForPreviousAttempt",
                    f"attempt {new.attempt} ({new.job_submission_id}) has not ended yet",
                )
            self.requeue(STILL_ENDING_REQUEUE_SECONDS)
            if self.unobservable_too_long():
                self.fail_attempt(self.unobservable_failure())
            return
        self.submit()

    def running(self) -> None:
        new, obs, job = self.new, self.obs, self.obs.job
        if job is None:  # Ray did not answer: the head may be restarting; only the timeouts decide
            if obs.dashboard_error:
                self.condition(conditions.JOB_RUNNING, "Unknown", "DashboardUnreachable", obs.dashboard_error)
            self.check_liveness()
            return
        if job.status is None:
            self.fail_attempt(
                Failure(False, "JobLost", f"Ray no longer knows job {job.submission_id} (head restarted?)")
            )
        elif job.status in RAY_ACTIVE_JOB_STATES:
            self.condition(conditions.JOB_RUNNING, True, job.status.capitalize(), job.message or job.status)
            self.check_liveness()
        elif job.status == "SUCCEEDED":
            step = new.progress.step if new.progress else None
            self.finish(Phase.SUCCEEDED, "Completed", f"training finished at step {step}")
        else:
            failure = self.oom_killed() or classify(job.message, job.logs_tail, obs.progress, job.start_time)
            self.fail_attempt(self.avoiding_slow_node(failure))

    def oom_killed(self) -> Failure | None:
        """The attempt's failure when a process of it was killed at its pod's memory limit: a Ray container
        the kernel OOMKilled, or a worker Ray's memory monitor killed first (it kills at 95 % of the limit,
        so the container survives and only Ray's error tells). Permanent unless the attempt trained past the
        step it resumed from (memory pressure a restart may not meet again), as for the trainer's own
        OutOfMemory."""
        since, job, record = self.new.attempt_time, self.obs.job, self.attempt_progress()
        kills = [k.message for k in self.obs.oom_kills if since is None or k.finished_at >= since]
        if not kills and job is not None:
            texts = [job.message or "", job.logs_tail or "", (record.error if record else None) or ""]
            kills = [
                line.strip()[:500]
                for text in texts
                for line in text.splitlines()
                if RAY_MEMORY_MONITOR_KILL.search(line)
            ]
        if not kills:
            return None
        progressed = record is not None and record.step > (record.resumed_from_step or 0)
        hint = "raise spec.cluster.memory (or spec.cluster.head.memory) or lower spec.training.microBatchSize"
        return Failure(not progressed, "OOMKilled", f"{kills[0]}; {hint}")

    def awaiting_submission(self) -> bool:
        """The attempt is recorded but Ray has not reported its job yet: the submission is owed."""
        owed = self.new.phase in (Phase.CLUSTER_READY, Phase.RESTARTING) and self.new.job_submission_id
        return bool(owed) and self.reason_of(conditions.JOB_RUNNING) in ("Submitted", "SubmissionFailed")

    def confirm_submission(self) -> None:
        """Running once Ray reports the recorded job; else submit it again under the same id (Ray takes an id
        at most once), within setupTimeoutSeconds."""
        new, obs, job = self.new, self.obs, self.obs.job
        if job is not None and job.status is not None:
            message = f"attempt {new.attempt}: Ray job {job.submission_id} is {job.status}"
            self.transition(Phase.RUNNING, "JobRunning", message)
            self.running()
            return
        limit = self.spec.recovery.setup_timeout_seconds
        error = obs.action_error or obs.dashboard_error
        if self.seconds_since(new.attempt_time) > limit:
            self.fail_attempt(
                Failure(False, "SubmissionFailed", f"Ray did not take the job within {limit}s: {error}")
            )
            return
        if error:
            if self.reason_of(conditions.JOB_RUNNING) != "SubmissionFailed":
                self.event(True, "SubmissionFailed", error)
            self.condition(conditions.JOB_RUNNING, "Unknown", "SubmissionFailed", error)
        if job is not None:  # Ray answered and has no such job: submit (again)
            self.decision.submit_attempt = new.attempt
        self.requeue(STILL_ENDING_REQUEUE_SECONDS)

    def attempt_progress(self) -> ProgressRecord | None:
        """The progress record of the current attempt, if it wrote one (older trainers name no submission)."""
        record, new = self.obs.progress, self.new
        if record is None:
            return None
        if record.submission_id is not None:
            return record if record.submission_id == new.job_submission_id else None
        return record if new.attempt_time is None or record.updated_at >= new.attempt_time else None

    def check_liveness(self) -> None:
        """Setup timeout until the attempt's first training record (heartbeats keep it alive), then the hang
        timeout; neither while progress cannot be read, nor after the trainer's final record while Ray cannot
        be asked, but a run that can be observed neither in S3 nor in Ray for longer than the hang timeout is
        restarted."""
        new, obs, recovery = self.new, self.obs, self.spec.recovery
        if obs.storage_error is not None:
            if obs.job is None and self.unobservable_too_long():
                self.fail_attempt(self.unobservable_failure())
            return
        record = self.attempt_progress()
        if record is not None and record.phase == "finished" and obs.job is None:
            # The trainer is done and silent on purpose; only Ray can tell how its job ended, and Ray cannot
            # be asked now. Restarting for that silence would train a finished run again.
            self.requeue(STILL_ENDING_REQUEUE_SECONDS)
            return
        started = obs.job.start_time if obs.job else None
        if record is not None and record.phase != "starting":
            quiet, limit, reason = (
                self.seconds_since(record.updated_at),
                recovery.hang_timeout_seconds,
                "Hang",
            )
            what = f"no progress for more than hangTimeoutSeconds ({limit}s) after step {record.step}"
        else:
            marks = [t for t in (new.attempt_time, started, record.updated_at if record else None) if t]
            quiet = self.seconds_since(max(marks)) if marks else 0.0
            limit, reason = recovery.setup_timeout_seconds, "SetupTimeout"
            stage = record.stage if record else None
            what = f"no trainer heartbeat for more than setupTimeoutSeconds ({limit}s) before step 1" + (
                f" (last stage: {stage})" if stage else " (no heartbeat yet)"
            )
            in_stage = self.seconds_since(new.progress.stage_since) if stage else 0.0
            if in_stage > limit:  # heartbeats go on while a setup collective hangs: bound each stage too
                quiet, what = in_stage, f"setup stage {stage} took longer than setupTimeoutSeconds ({limit}s)"
        if quiet <= limit:
            self.requeue(max(limit - quiet, 1.0))
        elif not self.collecting_forensics(reason, what):
            self.fail_attempt(Failure(False, reason, what + self.suspect_named()))

    def collecting_forensics(self, reason: str, what: str) -> bool:
        """Before a hung attempt is stopped: every rank is asked for its stacks (an object under the run's
        prefix that each rank's watcher reads) and given recovery.forensicsSeconds to answer. True while
        that wait goes on."""
        new, obs, wait = self.new, self.obs, self.spec.recovery.forensics_seconds
        found = new.forensics
        if wait == 0 or (found is not None and found.attempt == new.attempt and found.concluded_at):
            return False
        if found is None or found.attempt != new.attempt:
            new.forensics = api.ForensicsStatus(
                attempt=new.attempt,
                reason=reason,
                requested_at=obs.now,
                uri=f"{obs.run_uri}/{forensics_dir(new.attempt)}",
                world_size=new.progress.world_size,
            )
            self.decision.request_forensics = ForensicsRequest(
                attempt=new.attempt, reason=reason, requested_at=obs.now
            )
            self.say(f"{what}; asking every rank for its stacks before stopping the attempt")
            self.event(True, "CollectingForensics", f"{what}; asking every rank for its stacks")
            self.requeue(FORENSICS_POLL_SECONDS)
            return True
        found.ranks_answered = obs.forensics_answered
        if obs.forensics_answers is None:  # not all in, and the wait not over
            self.requeue(FORENSICS_POLL_SECONDS)
            return True
        found.concluded_at = obs.now
        found.suspect = hangs.suspect(list(obs.forensics_answers), found.world_size)
        return False

    def suspect_named(self) -> str:
        found = self.new.forensics
        if found is None or found.attempt != self.new.attempt or found.concluded_at is None:
            return ""
        answered = f"; {found.ranks_answered} of {found.world_size or '?'} ranks' stacks in {found.uri}"
        suspect = found.suspect
        if suspect is None:
            return answered
        where = ", ".join(
            part
            for part in (suspect.pod and f"pod {suspect.pod}", suspect.node and f"node {suspect.node}")
            if part
        )
        return (
            f"; suspect rank {suspect.rank}" + (f" ({where})" if where else "") + f": {suspect.why}{answered}"
        )

    def unobservable_too_long(self) -> bool:
        bound = self.spec.recovery.hang_timeout_seconds
        storage = self.condition_is(conditions.STORAGE_READABLE, "False")
        dashboard = conditions.condition(self.new.conditions, conditions.JOB_RUNNING)
        dashboard_down = dashboard is not None and dashboard.reason == "DashboardUnreachable"
        if storage is None or not dashboard_down or dashboard is None:
            return False
        since = max(storage.last_transition_time, dashboard.last_transition_time)
        return self.seconds_since(since) > bound

    def unobservable_failure(self) -> Failure:
        bound = self.spec.recovery.hang_timeout_seconds
        return Failure(
            False,
            "Unobservable",
            f"neither progress in S3 nor the job in Ray could be read for more than {bound}s: "
            f"{self.obs.storage_error}; {self.obs.dashboard_error}",
        )


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _count(value: int) -> int:
    return min(max(value, 0), MAX_COUNT)


def _whole(value: str | None, limit: int) -> str | None:
    """A value that means something only whole: kept if within `limit` and plain, else refused (None)."""
    if value is None or len(value) > limit or CONTROL_CHARACTERS.search(value):
        return None
    return value


def bounded_versions(versions: Versions) -> Versions:
    fields = versions.model_dump()
    return Versions(**{k: None if v is None else bounded_text(v, 128) for k, v in fields.items()})


def bounded_transport(report: TransportReport) -> TransportReport:
    lines = [bounded_text(line, MAX_TRAINER_TEXT) for line in report.evidence[:MAX_EVIDENCE_LINES]]
    if len(report.evidence) > MAX_EVIDENCE_LINES:
        lines.append(f"{TRUNCATED} {len(report.evidence) - MAX_EVIDENCE_LINES} more lines")
    bandwidth = report.bus_bandwidth_gbps
    return TransportReport(
        observed=report.observed,
        evidence=lines,
        bus_bandwidth_gbps=bandwidth if bandwidth is None or math.isfinite(bandwidth) else None,
        fallback_pods=[bounded_text(pod, 253) for pod in report.fallback_pods[:MAX_EVIDENCE_LINES]],
    )


def reconcile(spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, obs: Observation) -> Decision:
    return _Pass(spec, status, obs).run()
