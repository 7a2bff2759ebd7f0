"""Queued: with a Kueue queue (spec.cluster.queueName) Kueue admits instead of the preflight. The RayCluster
is created suspended in the queue; Kueue unsuspending it is the admission (-> Provisioning), and Kueue
suspending it again is a preemption: the job is stopped and the run is Queued again, without spending a
restart."""

from __future__ import annotations

from fsdp_operator import api, conditions
from fsdp_operator.api import Phase
from fsdp_operator.reconcile.observation import RAY_ACTIVE_JOB_STATES
from fsdp_operator.reconcile.state import PREEMPTED, PassState
from fsdp_trainer.contract import RestartEntry


def enqueue(state: PassState, queue: str) -> None:
    """Kueue decides admission: the RayCluster is created suspended in the queue, and the run waits."""
    new = state.new
    new.image.requested = new.image.requested or state.obs.requested_image
    new.start_time = new.start_time or state.obs.now
    new.next_check_time = None
    new.zone = None  # Kueue's flavor chooses it
    state.create_cluster()
    state.condition(
        conditions.PREFLIGHT, True, "DelegatedToKueue", f"Kueue admits the run through LocalQueue {queue}"
    )
    state.condition(
        conditions.QUEUE_ADMITTED, "Unknown", "Queued", "RayCluster created suspended; waiting for Kueue"
    )
    state.transition(
        Phase.QUEUED, "Queued", f"queued in LocalQueue {queue}: waiting for Kueue to admit the RayCluster"
    )


def queued(state: PassState) -> None:
    """The RayCluster is suspended: not admitted yet, or admitted and then preempted."""
    new, obs, workload = state.new, state.obs, state.obs.workload
    if new.phase in api.ACTIVE_PHASES:
        preempted(state)
    elif obs.job is not None and obs.job.status in RAY_ACTIVE_JOB_STATES:
        state.decision.stop_job = obs.job.submission_id  # the stop at the preemption did not take
    queue = state.spec.cluster.queue_name
    if workload is None:
        why = (
            f"no Kueue Workload for the RayCluster yet (Kueue, with its ray.io/raycluster integration, "
            f"creates one for the LocalQueue {queue})"
        )
        state.condition(conditions.QUEUE_ADMITTED, "Unknown", "NoWorkload", why)
    else:
        why = f"{workload.reason}: {workload.message}"
        state.condition(conditions.QUEUE_ADMITTED, False, workload.reason, workload.message)
        new.queue = (new.queue or api.QueueStatus()).model_copy(update={"workload": workload.name})
    state.say(f"queued in LocalQueue {queue}: {why}")


def preempted(state: PassState) -> None:
    """Kueue took the capacity back: stop the job, keep the checkpoints, queue again; no restart spent."""
    new, workload = state.new, state.obs.workload
    if new.job_submission_id:
        state.decision.stop_job = new.job_submission_id  # a no-op for a job that ended with its pods
    why = f"{workload.reason}: {workload.message}" if workload else "Kueue suspended the RayCluster"
    resumed = new.checkpoints.latest.step if new.checkpoints.latest else None
    new.restarts.preemptions += 1
    entry = RestartEntry(
        time=state.obs.now, reason=PREEMPTED, message=conditions.bounded(why), resumed_from_step=resumed
    )
    new.restarts.history = [*new.restarts.history, entry][-api.RESTART_HISTORY_IN_STATUS :]
    new.zone = None
    state.stop_active()
    state.condition(conditions.JOB_RUNNING, False, PREEMPTED, why)
    state.condition(conditions.CLUSTER_READY, False, "SuspendedByKueue", why)
    resumes = f"step {resumed}" if resumed is not None else "the start"
    state.transition(
        Phase.QUEUED,
        PREEMPTED,
        f"preempted by Kueue ({why}); the job is stopped, checkpoints are kept, and the run resumes from "
        f"{resumes} when Kueue admits it again (no restart is spent)",
        warning=True,
    )


def admitted(state: PassState) -> None:
    """Kueue unsuspended the RayCluster: the run holds its quota from now on."""
    new, cluster, workload = state.new, state.obs.cluster, state.obs.workload
    assert cluster is not None
    new.zone = cluster.zone
    state.start_active()
    where = ""
    if workload is not None:
        new.queue = api.QueueStatus(
            workload=workload.name,
            cluster_queue=workload.cluster_queue,
            flavors=list(workload.flavors),
            admitted_time=state.obs.now,
        )
        where = f" by ClusterQueue {workload.cluster_queue} ({', '.join(workload.flavors) or 'no flavor'})"
    message = f"admitted by Kueue{where}; waiting for KubeRay"
    state.condition(conditions.QUEUE_ADMITTED, True, "Admitted", message)
    state.condition(conditions.CLUSTER_READY, False, "Creating", message)
    state.transition(Phase.PROVISIONING, "Admitted", message)
