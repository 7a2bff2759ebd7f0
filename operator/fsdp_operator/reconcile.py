"""The run's state machine as a pure function: (spec, status, what was observed) -> new status and actions.

Kopf handlers only gather observations, call `reconcile`, and carry out the returned actions. Everything
here is deterministic in its inputs, so every transition is unit-tested without a cluster.

    Pending --preflight ok--> Provisioning --KubeRay ready--> ClusterReady --submit--> Running --> Succeeded
       |                            ^                                                    |
       +--preflight Fail policy--> Failed <--permanent failure / restarts exhausted-----+
                                    Restarting <--retryable failure (job failed, lost, hung, cluster lost)
                                        +--backoff elapsed, cluster ready--> Running (attempt + 1, resumes)
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Literal

from fsdp_operator import api, conditions
from fsdp_operator.api import FSDPTrainingRunSpec, FSDPTrainingRunStatus, Phase
from fsdp_operator.builder import uses_efa
from fsdp_operator.jobs import JobObservation
from fsdp_operator.preflight import PreflightResult
from fsdp_operator.recovery import Failure, backoff_seconds, classify
from fsdp_trainer.contract import CheckpointRef, ProgressRecord, RestartEntry, Transport

RECENT_CHECKPOINTS = 5


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
    job: JobObservation | None = None  # the current attempt's job, when one was submitted and Ray answered
    dashboard_error: str | None = None  # why Ray could not be asked about the job
    progress: ProgressRecord | None = None
    checkpoints: tuple[CheckpointRef, ...] = ()
    storage_read: bool = False  # progress and checkpoints were looked for in S3 this pass
    storage_error: str | None = None  # why they could not be read
    pod_image_ids: tuple[str, ...] = ()  # containerStatuses[].imageID of the head and worker pods


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
    submit_attempt: int | None = None  # submit this attempt's job (status.attempt is already set to it)
    # The status and events as they stood before the submission, for when it cannot be made.
    status_if_submit_fails: FSDPTrainingRunStatus | None = None
    events_if_submit_fails: list[Event] = field(default_factory=list)
    stop_job: str | None = None  # submission id to stop
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


def needs_preflight(
    spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, cluster_exists: bool, now: dt.datetime
) -> bool:
    waiting = not spec.suspend and status.phase in (None, Phase.PENDING, Phase.SUSPENDED)
    due = status.next_check_time is None or status.next_check_time <= now
    return waiting and not cluster_exists and due


def job_to_observe(status: FSDPTrainingRunStatus) -> str | None:
    """The submission whose state the next pass needs, if any."""
    return status.job_submission_id if status.phase == Phase.RUNNING else None


class _Pass:
    """One reconcile pass: the new status under construction and the actions decided so far."""

    def __init__(self, spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, obs: Observation) -> None:
        self.spec, self.obs = spec, obs
        self.new = status.model_copy(deep=True)
        self.new.observed_generation = obs.generation
        self.decision = Decision(status=self.new)

    def event(self, warning: bool, reason: str, message: str) -> None:
        self.decision.events.append(Event("Warning" if warning else "Normal", reason, message))

    def condition(self, type_: str, ok: bool | Literal["Unknown"], reason: str, message: str) -> None:
        self.new.conditions = conditions.set_condition(
            self.new.conditions, type_, ok, reason, message, self.obs.now, self.obs.generation
        )

    def transition(self, phase: Phase, reason: str, message: str, warning: bool = False) -> None:
        if self.new.phase != phase:
            self.event(warning, reason, message)
        self.new.phase = phase
        self.new.message = message

    # -- observations that hold in every phase ------------------------------------------------------------

    def absorb(self) -> None:
        obs, new = self.obs, self.new
        progress = obs.progress
        if progress is not None:
            new.progress = api.ProgressStatus(  # rounded: `kubectl get` prints numbers in full
                step=progress.step,
                max_steps=progress.max_steps,
                loss=_round(progress.loss, 4),
                eval_loss=_round(progress.eval_loss, 4),
                eval_perplexity=_round(progress.eval_perplexity, 2),
                tokens_per_second=_round(progress.tokens_per_second, 1),
                mfu=_round(progress.mfu, 4),
                updated_at=progress.updated_at,
            )
            new.record.versions = progress.versions
            new.record.exported_model_uri = progress.exported_model_uri or new.record.exported_model_uri
            if progress.transport is not None:
                self.absorb_transport(progress)
        if obs.checkpoints:
            new.checkpoints.latest = obs.checkpoints[-1]
            new.checkpoints.recent = list(reversed(obs.checkpoints[-RECENT_CHECKPOINTS:]))
        if obs.pod_image_ids:
            self.absorb_image(set(obs.pod_image_ids))
        if obs.storage_read:
            self.absorb_storage()

    def absorb_storage(self) -> None:
        error = self.obs.storage_error
        if error is None:
            self.condition(
                conditions.STORAGE_READABLE, True, "Readable", "progress and checkpoints are readable"
            )
            return
        message = f"cannot read progress and checkpoints, so hang detection waits: {error}"
        previous = conditions.condition(self.new.conditions, conditions.STORAGE_READABLE)
        if previous is None or previous.status != "False":
            self.event(True, "StorageUnreadable", message)
        self.condition(conditions.STORAGE_READABLE, False, "StorageError", message)

    def absorb_transport(self, progress: ProgressRecord) -> None:
        assert progress.transport is not None
        self.new.transport = progress.transport
        fell_back = uses_efa(self.spec) and progress.transport.observed == Transport.SOCKET
        was_degraded = conditions.is_true(self.new.conditions, conditions.TRANSPORT_DEGRADED)
        if fell_back:
            message = "NCCL used TCP sockets although the workers have EFA: " + "; ".join(
                progress.transport.evidence[:2]
            )
            if not was_degraded:
                self.event(True, "TransportDegraded", message)
            self.condition(conditions.TRANSPORT_DEGRADED, True, "SocketFallback", message)
        else:
            observed = Transport(progress.transport.observed).value
            self.condition(conditions.TRANSPORT_DEGRADED, False, "AsExpected", f"NCCL transport: {observed}")

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
        elif image.digest != image_id:
            self.event(True, "ImageChanged", f"pods run {image_id}, not the pinned {image.digest}")
        image.digest = image.digest or image_id
        image.consistent = image.digest == image_id
        self.condition(
            conditions.IMAGE_CONSISTENT,
            image.consistent,
            "PodsAgree" if image.consistent else "DigestChanged",
            f"head and workers run {image_id}",
        )

    # -- actions --------------------------------------------------------------------------------------------

    def submit(self) -> None:
        new = self.new
        self.decision.status_if_submit_fails = new.model_copy(deep=True)
        self.decision.events_if_submit_fails = list(self.decision.events)
        new.attempt += 1
        new.next_check_time = None
        new.start_time = new.start_time or self.obs.now
        self.decision.submit_attempt = new.attempt
        resumed = new.checkpoints.latest.step if new.checkpoints.latest else None
        message = f"attempt {new.attempt} submitted" + (f", resuming from step {resumed}" if resumed else "")
        self.condition(conditions.JOB_RUNNING, True, "Submitted", message)
        self.transition(Phase.RUNNING, "JobSubmitted", message)

    def finish(self, phase: Phase, reason: str, message: str) -> None:
        succeeded = phase == Phase.SUCCEEDED
        self.condition(conditions.JOB_RUNNING, False, reason, message)
        self.condition(conditions.SUCCEEDED if succeeded else conditions.FAILED, True, reason, message)
        self.transition(phase, reason, message, warning=not succeeded)
        self.new.completion_time = self.obs.now
        self.new.next_check_time = None
        if self.spec.cleanup_policy == api.CleanupPolicy.DELETE_CLUSTER and self.obs.cluster is not None:
            self.decision.delete_cluster = True

    def fail_attempt(self, failure: Failure) -> None:
        """A failed attempt: Failed when permanent or out of restarts, else Restarting after a backoff."""
        new, recovery = self.new, self.spec.recovery
        if failure.permanent:
            self.finish(Phase.FAILED, failure.reason, f"{failure.reason}: {failure.message}")
            return
        if new.restarts.count >= recovery.max_restarts:
            self.finish(
                Phase.FAILED,
                "RestartsExhausted",
                f"{failure.reason} after {new.restarts.count} restarts "
                f"(maxRestarts {recovery.max_restarts}): {failure.message}",
            )
            return
        delay = backoff_seconds(recovery.backoff_seconds, new.restarts.count)
        resumed = new.checkpoints.latest.step if new.checkpoints.latest else None
        new.restarts.count += 1
        new.restarts.history.append(
            RestartEntry(
                time=self.obs.now, reason=failure.reason, message=failure.message, resumed_from_step=resumed
            )
        )
        new.next_check_time = self.obs.now + dt.timedelta(seconds=delay)
        self.decision.requeue_after = delay
        message = (
            f"restart {new.restarts.count}/{recovery.max_restarts} in {delay}s after {failure.reason}: "
            f"{failure.message}; resuming from " + (f"step {resumed}" if resumed is not None else "the start")
        )
        self.condition(conditions.JOB_RUNNING, False, failure.reason, failure.message)
        self.transition(Phase.RESTARTING, "Restarting", message, warning=True)

    # -- the phases ---------------------------------------------------------------------------------------

    def run(self) -> Decision:
        new, obs, spec = self.new, self.obs, self.spec
        self.absorb()
        if new.phase in api.FINISHED_PHASES:
            return self.decision
        if spec.suspend:
            return self.suspend()
        if new.phase == Phase.SUSPENDED:
            self.condition(conditions.SUSPENDED, False, "Resumed", "spec.suspend is false")
        if self.deadline_passed():
            return self.decision
        if obs.cluster is None:
            return self.without_cluster()
        if new.phase in (None, Phase.PENDING, Phase.SUSPENDED):
            # Created by an earlier pass whose status write was lost (e.g. the operator restarted in between).
            new.phase = Phase.PROVISIONING
        if not obs.cluster.ready:
            self.condition(conditions.CLUSTER_READY, False, "RayClusterNotReady", obs.cluster.message)
            if new.phase == Phase.CLUSTER_READY:
                self.transition(
                    Phase.PROVISIONING,
                    "ClusterNotReady",
                    f"RayCluster not ready: {obs.cluster.message}",
                    True,
                )
            if new.phase == Phase.RUNNING:
                self.running()  # the job may still be fine (a worker pod restarting) or already lost
            return self.decision
        self.condition(
            conditions.CLUSTER_READY, True, "RayClusterReady", "KubeRay reports the RayCluster ready"
        )
        if new.phase == Phase.PROVISIONING:
            self.transition(Phase.CLUSTER_READY, "ClusterReady", "RayCluster is ready")
        if new.phase == Phase.CLUSTER_READY:
            self.submit()
        elif new.phase == Phase.RESTARTING:
            if new.next_check_time is None or new.next_check_time <= obs.now:
                self.submit()
            else:
                self.decision.requeue_after = (new.next_check_time - obs.now).total_seconds()
        elif new.phase == Phase.RUNNING:
            self.running()
        return self.decision

    def suspend(self) -> Decision:
        new = self.new
        if new.phase == Phase.RUNNING and new.job_submission_id:
            self.decision.stop_job = new.job_submission_id
        if self.obs.cluster is not None:
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
        return self.decision

    def deadline_passed(self) -> bool:
        deadline, started = self.spec.active_deadline_seconds, self.new.start_time
        if deadline is None or started is None or (self.obs.now - started).total_seconds() <= deadline:
            return False
        if self.new.phase == Phase.RUNNING and self.new.job_submission_id:
            self.decision.stop_job = self.new.job_submission_id
        self.finish(
            Phase.FAILED, "DeadlineExceeded", f"active for longer than activeDeadlineSeconds ({deadline}s)"
        )
        return True

    def without_cluster(self) -> Decision:
        new, obs = self.new, self.obs
        if new.phase in api.ACTIVE_PHASES:
            # The cluster vanished under a live run: recreate it where it was (same zone, same name).
            self.decision.create_cluster = True
            self.condition(
                conditions.CLUSTER_READY, False, "ClusterLost", "the RayCluster disappeared; recreating it"
            )
            if new.phase == Phase.RUNNING:
                # A job that somehow outlived its cluster must not write next to the next attempt.
                self.decision.stop_job = new.job_submission_id
                self.fail_attempt(
                    Failure(False, "ClusterLost", "the RayCluster was deleted while the job ran")
                )
                self.decision.create_cluster = self.decision.status.phase == Phase.RESTARTING
            else:
                self.event(True, "ClusterRecreated", "RayCluster recreated after it disappeared")
            return self.decision
        result = obs.preflight
        if result is None:  # not due for a re-check yet
            if new.next_check_time is not None:
                self.decision.requeue_after = max((new.next_check_time - obs.now).total_seconds(), 1.0)
            return self.decision
        if result.ok:
            self.condition(conditions.PREFLIGHT, True, result.reason, result.message)
            new.zone = result.zone
            new.next_check_time = None
            self.decision.create_cluster = True
            self.event(False, "PreflightPassed", result.message)
            self.transition(Phase.PROVISIONING, "ClusterCreated", "RayCluster created; waiting for KubeRay")
            return self.decision
        previous = conditions.condition(new.conditions, conditions.PREFLIGHT)
        if previous is None or previous.reason != result.reason or previous.status != "False":
            self.event(True, result.reason, result.message)
        self.condition(conditions.PREFLIGHT, False, result.reason, result.message)
        if self.spec.preflight.on_insufficient_capacity == api.PreflightPolicy.FAIL:
            self.finish(Phase.FAILED, "PreflightFailed", f"preflight failed: {result.message}")
            return self.decision
        new.next_check_time = obs.now + dt.timedelta(seconds=self.spec.preflight.recheck_seconds)
        new.phase = Phase.PENDING
        new.message = f"waiting for capacity: {result.message}"
        self.decision.requeue_after = self.spec.preflight.recheck_seconds
        return self.decision

    def running(self) -> None:
        new, obs, job = self.new, self.obs, self.obs.job
        if job is None:  # Ray did not answer: the head may be restarting; only the hang timeout decides
            if obs.dashboard_error:
                self.condition(conditions.JOB_RUNNING, "Unknown", "DashboardUnreachable", obs.dashboard_error)
            self.check_hang()
            return
        if job.status is None:
            self.fail_attempt(
                Failure(False, "JobLost", f"Ray no longer knows job {job.submission_id} (head restarted?)")
            )
        elif job.status in ("PENDING", "RUNNING"):
            self.check_hang()
        elif job.status == "SUCCEEDED":
            step = new.progress.step if new.progress else None
            self.finish(Phase.SUCCEEDED, "Completed", f"training finished at step {step}")
        else:
            self.fail_attempt(classify(job.message, job.logs_tail, obs.progress, job.start_time))

    def check_hang(self) -> None:
        new, obs = self.new, self.obs
        if obs.storage_error is not None:
            return  # progress cannot be seen: stopping a job that may be healthy would cost its work
        job_start = obs.job.start_time if obs.job else None
        submitted = conditions.condition(new.conditions, conditions.JOB_RUNNING)
        progressed = new.progress.updated_at if obs.progress else None
        marks = [t for t in (progressed, job_start, submitted and submitted.last_transition_time) if t]
        last_sign_of_life = max(marks) if marks else None
        timeout = self.spec.recovery.hang_timeout_seconds
        if last_sign_of_life is not None and (obs.now - last_sign_of_life).total_seconds() > timeout:
            if new.job_submission_id:
                self.decision.stop_job = new.job_submission_id
            self.fail_attempt(
                Failure(False, "Hang", f"no progress for more than hangTimeoutSeconds ({timeout}s)")
            )


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def reconcile(spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, obs: Observation) -> Decision:
    return _Pass(spec, status, obs).run()
