"""ClusterReady, Running and Restarting: an attempt is submitted, confirmed once Ray reports its job, and
followed until the job ends (succeeded, or failed: out of memory, a slow fabric, the trainer's error); a
restart waits for its backoff and for the replaced job to end."""

from __future__ import annotations

import dataclasses
import re

from fsdp_operator import api, conditions, fabric
from fsdp_operator.api import Phase
from fsdp_operator.reconcile.liveness import (
    attempt_progress,
    check_liveness,
    unobservable_failure,
    unobservable_too_long,
)
from fsdp_operator.reconcile.observation import RAY_ACTIVE_JOB_STATES
from fsdp_operator.reconcile.state import STILL_ENDING_REQUEUE_SECONDS, PassState
from fsdp_operator.recovery import REASON_BY_KIND, Failure, classify
from fsdp_trainer.contract import ErrorKind, ProgressRecord, SlowFabricPolicy

# Ray's memory monitor's verdict on a task or actor it killed near the node's (the pod's) memory limit.
RAY_MEMORY_MONITOR_KILL = re.compile(r"OutOfMemoryError|killed due to the node running low on memory")


def submission_id(prefix: str, attempt: int) -> str:
    return f"{prefix}-{attempt}"


def submit(state: PassState, after: str = "") -> None:
    """Records attempt N+1 and its submission id; the glue submits it after this status is written.
    `after` leads the JobSubmitted Event's message: what else this pass saw (the cluster became ready)."""
    new, obs = state.new, state.obs
    mismatch = checkpoint_mismatch(state)
    if mismatch:
        state.finish(Phase.FAILED, "CheckpointMismatch", mismatch)
        return
    new.attempt += 1
    new.job_submission_id = submission_id(obs.submission_prefix, new.attempt)
    new.attempt_time = obs.now
    new.next_check_time = None
    state.decision.submit_attempt = new.attempt
    resumed = new.checkpoints.latest.step if new.checkpoints.latest else None
    message = f"attempt {new.attempt} submitted" + (f", resuming from step {resumed}" if resumed else "")
    # The phase moves to Running once Ray reports the job; until then the submission is owed.
    state.condition(conditions.JOB_RUNNING, "Unknown", "Submitted", f"{message}; waiting for Ray")
    state.event(False, "JobSubmitted", after + message)
    state.say(message)


def checkpoint_mismatch(state: PassState) -> str | None:
    obs, latest = state.obs, state.obs.checkpoints[-1] if state.obs.checkpoints else None
    if latest is None or obs.expected_fingerprint is None or state.spec.checkpoint.resume != "auto":
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


def awaiting_submission(state: PassState) -> bool:
    """The attempt is recorded but Ray has not reported its job yet: the submission is owed."""
    owed = state.new.phase in (Phase.CLUSTER_READY, Phase.RESTARTING) and state.new.job_submission_id
    return bool(owed) and state.reason_of(conditions.JOB_RUNNING) in ("Submitted", "SubmissionFailed")


def confirm_submission(state: PassState) -> None:
    """Running once Ray reports the recorded job; else submit it again under the same id (Ray takes an id
    at most once), within setupTimeoutSeconds."""
    new, obs, job = state.new, state.obs, state.obs.job
    if job is not None and job.status is not None:
        message = f"attempt {new.attempt}: Ray job {job.submission_id} is {job.status}"
        state.transition(Phase.RUNNING, "JobRunning", message)
        running(state)
        return
    limit = state.spec.recovery.setup_timeout_seconds
    error = obs.action_error or obs.dashboard_error
    if state.seconds_since(new.attempt_time) > limit:
        state.fail_attempt(
            Failure(False, "SubmissionFailed", f"Ray did not take the job within {limit}s: {error}")
        )
        return
    if error:
        if state.reason_of(conditions.JOB_RUNNING) != "SubmissionFailed":
            state.event(True, "SubmissionFailed", error)
        state.condition(conditions.JOB_RUNNING, "Unknown", "SubmissionFailed", error)
    if job is not None:  # Ray answered and has no such job: submit (again)
        state.decision.submit_attempt = new.attempt
    state.requeue(STILL_ENDING_REQUEUE_SECONDS)


def restarting(state: PassState) -> None:
    new, obs = state.new, state.obs
    if new.next_check_time is not None and new.next_check_time > obs.now:
        state.requeue((new.next_check_time - obs.now).total_seconds())
        return
    previous = obs.job
    if new.job_submission_id and (previous is None or previous.status in RAY_ACTIVE_JOB_STATES):
        # Never two attempts at once: the replaced job must be seen ended (or unknown to Ray) first.
        if previous is not None:
            state.decision.stop_job = new.job_submission_id
        if obs.dashboard_error:
            state.condition(conditions.JOB_RUNNING, "Unknown", "DashboardUnreachable", obs.dashboard_error)
        else:
            state.condition(
                conditions.JOB_RUNNING,
                False,
                "WaitingForPreviousAttempt",
                f"attempt {new.attempt} ({new.job_submission_id}) has not ended yet",
            )
        state.requeue(STILL_ENDING_REQUEUE_SECONDS)
        if unobservable_too_long(state):
            state.fail_attempt(unobservable_failure(state))
        return
    submit(state)


def running(state: PassState) -> None:
    new, obs, job = state.new, state.obs, state.obs.job
    if job is None:  # Ray did not answer: the head may be restarting; only the timeouts decide
        if obs.dashboard_error:
            state.condition(conditions.JOB_RUNNING, "Unknown", "DashboardUnreachable", obs.dashboard_error)
        check_liveness(state)
        return
    if job.status is None:
        state.fail_attempt(
            Failure(False, "JobLost", f"Ray no longer knows job {job.submission_id} (head restarted?)")
        )
    elif job.status in RAY_ACTIVE_JOB_STATES:
        state.condition(conditions.JOB_RUNNING, True, job.status.capitalize(), job.message or job.status)
        state.say(what_the_job_does(new.attempt, job.submission_id, job.status, attempt_progress(state)))
        check_liveness(state)  # a hang, or forensics under way, says so instead
    elif job.status == "SUCCEEDED":
        step = new.progress.step if new.progress else None
        state.finish(Phase.SUCCEEDED, "Completed", f"training finished at step {step}")
    else:
        failure = oom_killed(state) or classify(job.message, job.logs_tail, obs.progress, job.start_time)
        state.fail_attempt(avoiding_slow_node(state, failure))


SAYS_TRAINING = ": training, step "


def says_training(message: object, attempt: object) -> bool:
    """Whether `message` is attempt `attempt`'s message while it trains: its step and loss, figures rather
    than news (statuspatch.figures_wait)."""
    return isinstance(message, str) and message.startswith(f"attempt {attempt}{SAYS_TRAINING}")


def what_the_job_does(
    attempt: int, submission_id: str, job_status: str, record: ProgressRecord | None
) -> str:
    """The run's message while its job is active, as of this pass: training at its step, or setting up at its
    stage, or Ray's state of the job before the trainer has said anything (the message the submission wrote
    stood for the whole run: 'is PENDING' at step 40)."""
    said = f"attempt {attempt}: Ray job {submission_id} is {job_status}"
    if record is None:
        return said
    if record.phase == "training":
        loss = f", loss {record.loss:.4g}" if record.loss is not None else ""
        return f"attempt {attempt}{SAYS_TRAINING}{record.step} of {record.max_steps}{loss}"
    if record.phase == "starting" and record.stage is not None:
        return f"{said}: setting up ({record.stage})"
    return said


def oom_killed(state: PassState) -> Failure | None:
    """The attempt's failure when a process of it was killed at its pod's memory limit: a Ray container
    the kernel OOMKilled, or a worker Ray's memory monitor killed first (it kills at 95 % of the limit,
    so the container survives and only Ray's error tells). Permanent unless the attempt trained past the
    step it resumed from (memory pressure a restart may not meet again), as for the trainer's own
    OutOfMemory."""
    since, job, record = state.new.attempt_time, state.obs.job, attempt_progress(state)
    kills = [k.message for k in state.obs.oom_kills if since is None or k.finished_at >= since]
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


def avoiding_slow_node(state: PassState, failure: Failure) -> Failure:
    """A failed fabric check under network.slowFabric avoidNode, with one node to blame: the node is
    labelled (recorded here, done by the actions before the cluster is deleted) and the attempt restarts
    on a new cluster whose workers avoid it. Otherwise the failure stands, saying why no node was."""
    new, obs = state.new, state.obs
    if failure.reason != REASON_BY_KIND[ErrorKind.FABRIC]:
        return failure
    checked = new.fabric if new.fabric is not None and new.fabric.attempt == new.attempt else None
    node = fabric.node_to_avoid(checked.report, obs.pod_nodes) if checked is not None else None
    if state.spec.network.slow_fabric != SlowFabricPolicy.AVOID_NODE or checked is None or node is None:
        why = (
            "network.slowFabric is fail"
            if state.spec.network.slow_fabric != SlowFabricPolicy.AVOID_NODE
            else "no node to avoid: the slow links share no single pod the operator saw placed"
        )
        return dataclasses.replace(failure, message=f"{failure.message} ({why})")
    budget = obs.fabric_labels
    refused = (
        "the platform turned automatic labelling off (operator setting fabric-label-nodes)"
        if budget is None
        else budget.refusal([a.labelled_at for a in checked.avoided_nodes], obs.now)
    )
    if refused is not None:
        unlabelled = f"{failure.message} (node {node} not labelled: {refused})"
        return dataclasses.replace(failure, message=unlabelled)
    why = f"{obs.run_uri} attempt {new.attempt}: {checked.report.message}"
    avoided = api.AvoidedNode(node=node, labelled_at=obs.now, why=conditions.bounded(why))
    checked.avoided_nodes = [*checked.avoided_nodes, avoided][-api.MAX_AVOIDED_NODES :]
    state.decision.avoid_node = avoided
    state.decision.delete_cluster = True
    state.event(
        True, "SlowNodeAvoided", f"node {node} labelled {fabric.DEGRADED_LABEL}: {checked.report.message}"
    )
    return Failure(
        False,
        failure.reason,
        f"{failure.message}; node {node} labelled {fabric.DEGRADED_LABEL}, the next attempt's workers "
        "avoid it",
    )
