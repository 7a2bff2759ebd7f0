"""One pass in order: the facts absorbed first, then the guards (suspended, deadline, cluster being deleted,
pods that never started, provisioning timeout: each decides the pass or changes nothing), then the step of
the run's phase, which the phase modules take."""

from __future__ import annotations

import datetime as dt

from fsdp_operator import api, conditions, goodput
from fsdp_operator.api import FSDPTrainingRunSpec, FSDPTrainingRunStatus, Phase
from fsdp_operator.reconcile.decision import Decision
from fsdp_operator.reconcile.images import absorb_image_request, absorb_pods_image, pods_disagree
from fsdp_operator.reconcile.observation import Observation
from fsdp_operator.reconcile.pending import pending
from fsdp_operator.reconcile.provisioning import (
    absorb_pods_health,
    absorb_provisioning_progress,
    absorb_scheduling,
    cluster_modified,
    cluster_not_ready,
    pods_never_started,
    provisioning_timed_out,
    without_cluster,
)
from fsdp_operator.reconcile.queueing import admitted, queued
from fsdp_operator.reconcile.running import (
    awaiting_submission,
    confirm_submission,
    restarting,
    running,
    submit,
)
from fsdp_operator.reconcile.state import STILL_ENDING_REQUEUE_SECONDS, PassState
from fsdp_operator.reconcile.trainer_records import absorb_record, absorb_trainer_records, keep_driver_log
from fsdp_operator.recovery import Failure

INVALID_SPEC = "InvalidSpec"


def reconcile(spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, obs: Observation) -> Decision:
    state = PassState(spec, status, obs)
    keep_driver_log(state)
    absorb_trainer_records(state)
    if state.new.phase not in api.FINISHED_PHASES:
        decide(state)
    absorb_pods_image(state)
    absorb_record(state)
    created = obs.created or obs.now
    state.new.goodput = goodput.account(
        spec, status, state.new, obs.progress, obs.now, created, obs.instance_hour_price
    )
    return state.decision


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


def decide(state: PassState) -> None:
    """The guards, each of which either decides the pass or changes nothing, then the phase's step."""
    if state.spec.suspend:
        suspend(state)
        return
    if state.new.phase == Phase.SUSPENDED:
        state.condition(conditions.SUSPENDED, False, "Resumed", "spec.suspend is false")
    absorb_image_request(state)
    if deadline_passed(state) or cluster_deleting(state):
        return
    absorb_provisioning_progress(state)
    absorb_pods_health(state)
    absorb_scheduling(state)
    if pods_never_started(state) or provisioning_timed_out(state):
        return
    step(state)


def suspend(state: PassState) -> None:
    new = state.new
    if new.phase in api.ACTIVE_PHASES and new.job_submission_id:
        state.decision.stop_job = new.job_submission_id
    if state.obs.cluster is not None and not state.obs.cluster.deleting:
        state.decision.delete_cluster = True
    state.condition(
        conditions.SUSPENDED, True, "SuspendedBySpec", "spec.suspend is true; checkpoints are kept"
    )
    if state.condition_is(conditions.FAILED, "Unknown"):  # a held failure (hold_final_failure) is moot
        state.condition(conditions.FAILED, False, "SuspendedBySpec", "suspended while a failure was held")
    state.condition(conditions.CLUSTER_READY, False, "Suspended", "the RayCluster is deleted while suspended")
    state.condition(conditions.JOB_RUNNING, False, "Suspended", "the job is stopped while suspended")
    state.transition(
        Phase.SUSPENDED, "Suspended", "suspended: job stopped, cluster deleted, checkpoints kept"
    )
    new.next_check_time = None
    state.stop_active()


def deadline_passed(state: PassState) -> bool:
    deadline, new = state.spec.active_deadline_seconds, state.new
    # Runs started before active time was recorded count from their start.
    since = new.active_since or (new.start_time if new.phase in api.ACTIVE_PHASES else None)
    active = new.active_seconds + state.seconds_since(since)
    if deadline is None or active <= deadline:
        return False
    state.finish(
        Phase.FAILED,
        "DeadlineExceeded",
        f"active for {int(active)}s, longer than activeDeadlineSeconds ({deadline}s)",
    )
    return True


def cluster_deleting(state: PassState) -> bool:
    """A RayCluster being deleted is never used: wait until it is gone, then the phase step recreates."""
    cluster = state.obs.cluster
    if cluster is None or not cluster.deleting:
        return False
    state.condition(
        conditions.CLUSTER_READY, False, "ClusterDeleting", "waiting for the old RayCluster to go"
    )
    if state.new.phase == Phase.RUNNING:  # deleted under a running job: that attempt is over
        state.fail_attempt(Failure(False, "ClusterLost", "the RayCluster is being deleted while the job ran"))
    state.requeue(STILL_ENDING_REQUEUE_SECONDS)
    return True


def step(state: PassState) -> None:
    """The step of the run's phase, from what the RayCluster is: none, queued, edited, not ready, ready."""
    new, cluster = state.new, state.obs.cluster
    if new.phase in (None, Phase.PENDING, Phase.SUSPENDED):
        if cluster is not None:
            # Intent is recorded before creation, so a cluster here is one being given up (suspend,
            # provisioning timeout) whose deletion has not started yet.
            state.decision.delete_cluster = True
            state.requeue(STILL_ENDING_REQUEUE_SECONDS)
            return
        pending(state)
        return
    if new.phase == Phase.RESTARTING:  # whatever the cluster is: its pods may be the ones that went
        state.recount_as_preemption()
        if state.failure_held():
            return
    if cluster is None:
        without_cluster(state)
        return
    if state.spec.cluster.queue_name is not None:
        if cluster.suspended:
            queued(state)
            return
        if new.phase == Phase.QUEUED:
            admitted(state)
    if cluster.drift and new.phase in (Phase.CLUSTER_READY, Phase.RUNNING, Phase.RESTARTING):
        cluster_modified(state, cluster.drift)
        return
    if not cluster.ready:
        cluster_not_ready(state, cluster)
        return
    if new.phase in (Phase.PROVISIONING, Phase.CLUSTER_READY) and pods_disagree(state):
        return
    state.condition(conditions.CLUSTER_READY, True, "RayClusterReady", "KubeRay reports the RayCluster ready")
    became_ready = new.phase == Phase.PROVISIONING
    if became_ready:
        # Announced by the submission's Event when this pass submits (one Event, not two, a moment apart).
        state.transition(Phase.CLUSTER_READY, "ClusterReady", "RayCluster is ready", announce=False)
    if awaiting_submission(state):
        if became_ready:
            state.event(False, "ClusterReady", "RayCluster is ready")
        confirm_submission(state)
    elif new.phase == Phase.CLUSTER_READY:
        submit(state, after="RayCluster is ready; " if became_ready else "")
    elif new.phase == Phase.RESTARTING:
        restarting(state)
    elif new.phase == Phase.RUNNING:
        running(state)
