"""Whether a running attempt is alive: the setup timeout until its first training record, then the hang
timeout; before a hung attempt is stopped, every rank's stacks (hang forensics); and a run that can be
observed neither in S3 nor in Ray."""

from __future__ import annotations

from fsdp_operator import api, conditions, hangs
from fsdp_operator.reconcile.state import STILL_ENDING_REQUEUE_SECONDS, PassState
from fsdp_operator.recovery import Failure
from fsdp_trainer.contract import ForensicsRequest, ProgressRecord, forensics_dir

FORENSICS_POLL_SECONDS = 5.0  # the ranks look for a request every 5 s (fsdp_trainer.forensics)


def attempt_progress(state: PassState) -> ProgressRecord | None:
    """The progress record of the current attempt, if it wrote one (older trainers name no submission)."""
    record, new = state.obs.progress, state.new
    if record is None:
        return None
    if record.submission_id is not None:
        return record if record.submission_id == new.job_submission_id else None
    return record if new.attempt_time is None or record.updated_at >= new.attempt_time else None


def check_liveness(state: PassState) -> None:
    """Setup timeout until the attempt's first training record (heartbeats keep it alive), then the hang
    timeout; neither while progress cannot be read, nor after the trainer's final record while Ray cannot
    be asked, but a run that can be observed neither in S3 nor in Ray for longer than the hang timeout is
    restarted."""
    new, obs, recovery = state.new, state.obs, state.spec.recovery
    if obs.storage_error is not None:
        if obs.job is None and unobservable_too_long(state):
            state.fail_attempt(unobservable_failure(state))
        return
    record = attempt_progress(state)
    if record is not None and record.phase == "finished" and obs.job is None:
        # The trainer is done and silent on purpose; only Ray can tell how its job ended, and Ray cannot
        # be asked now. Restarting for that silence would train a finished run again.
        state.requeue(STILL_ENDING_REQUEUE_SECONDS)
        return
    started = obs.job.start_time if obs.job else None
    if record is not None and record.phase != "starting":
        quiet, limit, reason = (
            state.seconds_since(record.updated_at),
            recovery.hang_timeout_seconds,
            "Hang",
        )
        what = f"no progress for more than hangTimeoutSeconds ({limit}s) after step {record.step}"
    else:
        marks = [t for t in (new.attempt_time, started, record.updated_at if record else None) if t]
        quiet = state.seconds_since(max(marks)) if marks else 0.0
        limit, reason = recovery.setup_timeout_seconds, "SetupTimeout"
        stage = record.stage if record else None
        what = f"no trainer heartbeat for more than setupTimeoutSeconds ({limit}s) before step 1" + (
            f" (last stage: {stage})" if stage else " (no heartbeat yet)"
        )
        in_stage = state.seconds_since(new.progress.stage_since) if stage else 0.0
        if in_stage > limit:  # heartbeats go on while a setup collective hangs: bound each stage too
            quiet, what = in_stage, f"setup stage {stage} took longer than setupTimeoutSeconds ({limit}s)"
    if quiet <= limit:
        state.requeue(max(limit - quiet, 1.0))
    elif not collecting_forensics(state, reason, what):
        state.fail_attempt(Failure(False, reason, what + suspect_named(state)))


def collecting_forensics(state: PassState, reason: str, what: str) -> bool:
    """Before a hung attempt is stopped: every rank is asked for its stacks (an object under the run's
    prefix that each rank's watcher reads) and given recovery.forensicsSeconds to answer. True while
    that wait goes on."""
    new, obs, wait = state.new, state.obs, state.spec.recovery.forensics_seconds
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
        state.decision.request_forensics = ForensicsRequest(
            attempt=new.attempt, reason=reason, requested_at=obs.now
        )
        state.say(f"{what}; asking every rank for its stacks before stopping the attempt")
        state.event(True, "CollectingForensics", f"{what}; asking every rank for its stacks")
        state.requeue(FORENSICS_POLL_SECONDS)
        return True
    found.ranks_answered = obs.forensics_answered
    if obs.forensics_answers is None:  # not all in, and the wait not over
        state.requeue(FORENSICS_POLL_SECONDS)
        return True
    found.concluded_at = obs.now
    found.suspect = hangs.suspect(list(obs.forensics_answers), found.world_size)
    found.nccl_hang_detector = hangs.nccl_hang_detector(list(obs.forensics_answers))
    return False


def suspect_named(state: PassState) -> str:
    found = state.new.forensics
    if found is None or found.attempt != state.new.attempt or found.concluded_at is None:
        return ""
    answered = f"; {found.ranks_answered} of {found.world_size or '?'} ranks' stacks in {found.uri}"
    detector = found.nccl_hang_detector
    if detector is not None and detector.confirmed:
        answered += f"; NCCL RAS: {detector.finding or 'a hang confirmed'} ({detector.uri})"
    suspect = found.suspect
    if suspect is None:
        return answered
    where = ", ".join(
        part
        for part in (suspect.pod and f"pod {suspect.pod}", suspect.node and f"node {suspect.node}")
        if part
    )
    return f"; suspect rank {suspect.rank}" + (f" ({where})" if where else "") + f": {suspect.why}{answered}"


def unobservable_too_long(state: PassState) -> bool:
    bound = state.spec.recovery.hang_timeout_seconds
    storage = state.condition_is(conditions.STORAGE_READABLE, "False")
    dashboard = conditions.condition(state.new.conditions, conditions.JOB_RUNNING)
    dashboard_down = dashboard is not None and dashboard.reason == "DashboardUnreachable"
    if storage is None or not dashboard_down or dashboard is None:
        return False
    since = max(storage.last_transition_time, dashboard.last_transition_time)
    return state.seconds_since(since) > bound


def unobservable_failure(state: PassState) -> Failure:
    bound = state.spec.recovery.hang_timeout_seconds
    return Failure(
        False,
        "Unobservable",
        f"neither progress in S3 nor the job in Ray could be read for more than {bound}s: "
        f"{state.obs.storage_error}; {state.obs.dashboard_error}",
    )
