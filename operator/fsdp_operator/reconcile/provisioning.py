"""Provisioning: the RayCluster is created and KubeRay starts its pods. Whether they can start and be placed
(PodsHealthy, PodsScheduled, in every phase with a cluster), the provisioning timeout, a cluster not ready or
gone, and one edited by hand."""

from __future__ import annotations

import datetime as dt

from fsdp_operator import api, conditions
from fsdp_operator.api import Phase
from fsdp_operator.reconcile.observation import ClusterObservation, PodProblem
from fsdp_operator.reconcile.running import running
from fsdp_operator.reconcile.state import PassState
from fsdp_operator.recovery import Failure
from fsdp_operator.tenancy import NOT_ALLOWED


def bringing_up(state: PassState) -> bool:
    """A RayCluster on its way to ready for the run's next attempt: the first (Provisioning), or one recreated
    or whose head restarts while the run is Restarting, which gets the same bound and attempts as the first
    (its progress, its timeout), not an unbounded wait."""
    phase, cluster = state.new.phase, state.obs.cluster
    if phase == Phase.PROVISIONING:
        return True
    return phase == Phase.RESTARTING and cluster is not None and not cluster.ready


def pods_that_cannot_start(state: PassState) -> tuple[PodProblem, ...]:
    """Pods KubeRay cannot create (a ResourceQuota exceeded, a service account that does not exist, an
    admission webhook's refusal: its ReplicaFailure), then containers that cannot start."""
    failure = state.obs.cluster.replica_failure if state.obs.cluster else None
    reason = failure.split(":", 1)[0] if failure else ""
    if failure is None or not reason.startswith("FailedCreate"):  # not a failed deletion
        return state.obs.pod_problems
    return (PodProblem(reason, f"KubeRay cannot create a pod: {failure}"), *state.obs.pod_problems)


def absorb_pods_health(state: PassState) -> None:
    """PodsHealthy from the cluster's pods: False with the first reasons while any cannot start (also the
    message of a provisioning run), and a pass due when podErrorTimeoutSeconds would be over."""
    problems = pods_that_cannot_start(state)
    if state.obs.cluster is None:
        return
    if not problems:
        pods_healthy(state)
        return
    message = "; ".join(p.message for p in problems[:3])
    if not state.condition_is(conditions.PODS_HEALTHY, "False"):
        state.event(True, problems[0].reason, message)
    state.condition(conditions.PODS_HEALTHY, False, problems[0].reason, message)
    if bringing_up(state):
        state.say(f"waiting for KubeRay: {message}")
    since = state.condition_is(conditions.PODS_HEALTHY, "False")
    limit = state.spec.recovery.pod_error_timeout_seconds
    state.requeue(max(limit - state.seconds_since(since.last_transition_time if since else None), 1.0))


def absorb_scheduling(state: PassState) -> None:
    """PodsScheduled=False with the scheduler's message (and an autoscaler's) while Ray pods wait for a
    node (also the message of a provisioning run); True again once they are placed. Not set for runs
    never short of one."""
    if state.obs.cluster is None:
        return
    waiting = state.obs.unschedulable
    if not waiting:
        if state.condition_is(conditions.PODS_SCHEDULED, "False"):
            state.condition(conditions.PODS_SCHEDULED, True, "Scheduled", "every Ray pod has a node")
        return
    message = f"{len(waiting)} pod(s) wait for a node: " + "; ".join(waiting[:2])
    if not state.obs.scale_up:
        reason = "Unschedulable"
    else:
        reason = "ScaleUpDelayed" if state.obs.scale_up_delayed else "WaitingForScaleUp"
    if state.reason_of(conditions.PODS_SCHEDULED) != reason:
        state.event(True, reason, message)
    state.condition(conditions.PODS_SCHEDULED, False, reason, message)
    if bringing_up(state):
        state.say(f"waiting for KubeRay: {message}")


def pods_never_started(state: PassState) -> bool:
    """Pods that could not start for podErrorTimeoutSeconds fail the run; one no NodePool can take at once."""
    stuck = state.condition_is(conditions.PODS_HEALTHY, "False")
    limit = state.spec.recovery.pod_error_timeout_seconds
    problems = pods_that_cannot_start(state)
    if state.obs.cluster is None or not problems or stuck is None:
        return False
    refused = next((p for p in problems if p.at_once), None)
    if refused is not None:
        state.finish(Phase.FAILED, refused.reason, f"no node can be added for a Ray pod: {refused.message}")
        state.decision.delete_cluster = True
        return True
    if state.seconds_since(stuck.last_transition_time) < limit:
        return False
    first, message = problems[0], "; ".join(p.message for p in problems[:3])
    state.finish(Phase.FAILED, first.reason, f"pods could not start for {limit}s: {message}")
    state.decision.delete_cluster = True  # nothing ran; the GPUs go back whatever cleanupPolicy says
    return True


def pods_healthy(state: PassState) -> None:
    state.condition(conditions.PODS_HEALTHY, True, "PodsStarting", "no pod is stuck starting")


def absorb_provisioning_progress(state: PassState) -> None:
    """status.provisioning while the run provisions: its pods' counts, and lastProgressTime moved on when one
    grows or a pull begins; the run's message says how far they are (a problem or a wait for a node, absorbed
    next, says more). Cleared in every other phase."""
    new, seen = state.new, state.obs.pods_progress
    if not bringing_up(state):
        new.provisioning = None
        return
    if seen is None or state.obs.cluster is None:
        return
    before = new.provisioning or api.ProvisioningStatus(last_progress_time=new.phase_transition_time)
    moved = seen.ahead_of(before)
    new.provisioning = api.ProvisioningStatus(
        pods=seen.pods,
        pods_placed=seen.placed,
        pods_pulling=len(seen.pulls),
        pods_started=seen.started,
        pods_ready=seen.ready,
        last_progress_time=state.obs.now if moved else before.last_progress_time,
    )
    counts = f"{seen.placed}/{seen.pods} pods placed, {seen.started} started, {seen.ready} ready"
    if seen.pulls:
        minutes = int(state.seconds_since(seen.pulling_since) // 60)
        counts += f"; {seen.pulls[0]} for {minutes}m" + (
            f" (and {len(seen.pulls) - 1} more)" if seen.pulls[1:] else ""
        )
    state.say(f"waiting for KubeRay: {counts}")


def provisioning_timed_out(state: PassState) -> bool:
    """No progress for provisioningTimeoutSeconds: counted from the pods' last progress (status.provisioning),
    so a slow pull or a node being added is not a timeout, and a cluster still coming up is never deleted."""
    new, limit = state.new, state.spec.recovery.provisioning_timeout_seconds
    progressed = new.provisioning.last_progress_time if new.provisioning else None
    since = max(filter(None, (new.phase_transition_time, progressed)), default=None)
    if not bringing_up(state) or state.seconds_since(since) < limit:
        return False
    message = f"the RayCluster was not ready within provisioningTimeoutSeconds ({limit}s)"
    if (
        progressed is not None
        and new.phase_transition_time is not None
        and progressed > new.phase_transition_time
    ):
        message += " of its pods' last progress"
    waiting = state.obs.unschedulable
    if waiting:  # the why first: messages are bounded
        message += f": {len(waiting)} pod(s) had no node: {waiting[0]}"
    if state.obs.cluster is not None:
        message += f"; KubeRay: {state.obs.cluster.message}"
        state.decision.delete_cluster = True
    new.provisioning_timeouts += 1
    attempts = state.spec.recovery.provisioning_attempts
    if state.spec.preflight.on_insufficient_capacity == api.PreflightPolicy.FAIL:
        state.finish(Phase.FAILED, "ProvisioningTimeout", message)
        return True
    if new.provisioning_timeouts >= attempts:
        given_up = f"RayCluster {new.provisioning_timeouts} of recovery.provisioningAttempts {attempts}"
        state.finish(Phase.FAILED, "ProvisioningTimeout", f"{message} ({given_up})")
        return True
    state.stop_active()
    state.condition(conditions.PREFLIGHT, False, "ProvisioningTimeout", message)
    state.condition(conditions.CLUSTER_READY, False, "ProvisioningTimeout", message)
    new.next_check_time = state.obs.now + dt.timedelta(seconds=state.spec.preflight.recheck_seconds)
    state.transition(Phase.PENDING, "ProvisioningTimeout", f"{message}; waiting for capacity again", True)
    state.requeue(state.spec.preflight.recheck_seconds)
    return True


def cluster_not_ready(state: PassState, cluster: ClusterObservation) -> None:
    """A RayCluster that exists but is not ready: still provisioning, or no longer ready under a run."""
    new = state.new
    if cluster.replica_failure:
        state.condition(conditions.CLUSTER_READY, False, "ReplicaFailure", cluster.replica_failure)
    elif new.phase != Phase.PROVISIONING:
        # While it provisions, "Creating" stands: KubeRay's progress notes would each cost a status
        # write and tell a user nothing the RayCluster does not; pods that cannot start have
        # PodsHealthy, and a timeout quotes KubeRay's note.
        state.condition(conditions.CLUSTER_READY, False, "RayClusterNotReady", cluster.message)
    if new.phase == Phase.CLUSTER_READY:
        state.transition(
            Phase.PROVISIONING, "ClusterNotReady", f"RayCluster not ready: {cluster.message}", True
        )
    if new.phase == Phase.RUNNING:
        running(state)  # the job may still be fine (a worker pod restarting) or already lost


def without_cluster(state: PassState) -> None:
    """No RayCluster although the run is active: created by the glue right after the intent was written
    (Provisioning), or lost (deleted by hand, namespace trouble): (re)create it in the same zone."""
    new, obs = state.new, state.obs
    if obs.refusals:  # what the spec asks now, against the grants as they are now: nothing ungranted is built
        not_allowed(state)
        return
    state.create_cluster()
    if obs.action_error:
        if (
            not state.condition_is(conditions.CLUSTER_READY, "False")
            or state.reason_of(conditions.CLUSTER_READY) != "CreateFailed"
        ):
            state.event(True, "ClusterCreateFailed", obs.action_error)
        state.condition(conditions.CLUSTER_READY, False, "CreateFailed", obs.action_error)
    if new.phase == Phase.RUNNING:
        state.fail_attempt(Failure(False, "ClusterLost", "the RayCluster was deleted while the job ran"))
        if state.decision.status.phase == Phase.RESTARTING:
            state.create_cluster()
    elif state.condition_is(conditions.CLUSTER_READY, "True") and not obs.action_error:
        state.condition(conditions.CLUSTER_READY, False, "ClusterLost", "the RayCluster disappeared")
        state.event(True, "ClusterRecreated", "RayCluster recreated after it disappeared")


def not_allowed(state: PassState) -> None:
    """The run asks for what its namespace does not grant (tenancy.py): Failed, naming each field, and no
    RayCluster built."""
    state.finish(Phase.FAILED, NOT_ALLOWED, "; ".join(state.obs.refusals))


def cluster_modified(state: PassState, drift: str) -> None:
    """A RayCluster edited by hand (fewer workers, another image) cannot run the attempt as recorded:
    stop the job, delete the cluster, and restart on a fresh one."""
    if state.reason_of(conditions.CLUSTER_READY) != "ClusterModified":
        state.event(True, "ClusterModified", f"the RayCluster no longer matches the run: {drift}")
    state.condition(conditions.CLUSTER_READY, False, "ClusterModified", drift)
    state.decision.delete_cluster = True
    if state.new.phase == Phase.RESTARTING:
        if state.new.job_submission_id:
            state.decision.stop_job = state.new.job_submission_id
        return
    state.fail_attempt(Failure(False, "ClusterModified", drift))
