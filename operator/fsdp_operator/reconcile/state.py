"""One pass's state: the new status under construction and the actions decided so far, with the primitives
every phase uses (conditions, Events, the phase's transition, the requeue, a finished run, a failed
attempt)."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from fsdp_operator import api, conditions, drainwindow
from fsdp_operator.api import FSDPTrainingRunSpec, FSDPTrainingRunStatus, Phase
from fsdp_operator.reconcile.decision import Decision, Event
from fsdp_operator.reconcile.observation import Observation
from fsdp_operator.recovery import Failure, backoff_seconds
from fsdp_trainer.contract import RestartEntry

# restarts.history reasons that spend no restart: a disruption, and an elastic run's change of size
PREEMPTED, RESIZED = "Preempted", "Resized"
STILL_ENDING_REQUEUE_SECONDS = 5.0  # a stopped job or a deleted cluster is usually gone within seconds
# How long a failure past maxRestarts waits for its attempt's disruption: a node's taint or a pod's
# DisruptionTarget reaches the operator by a watch, seconds after the kubelet or Karpenter writes it.
FINAL_FAILURE_HOLD_SECONDS = 30


class PassState:
    """One reconcile pass: the spec and observation it decides from, the status as read (`old`), the new
    status (`new`) and the decision that carries it."""

    def __init__(self, spec: FSDPTrainingRunSpec, status: FSDPTrainingRunStatus, obs: Observation) -> None:
        self.spec, self.obs, self.old = spec, obs, status
        self.new = status.model_copy(deep=True)
        self.new.observed_generation = obs.generation
        self.decision = Decision(status=self.new)

    def create_cluster(self) -> None:
        """Decides the RayCluster's creation, its worker pods' drain window recorded first (the cluster is
        built, and later compared, with it)."""
        self.decision.create_cluster = True
        estimate = drainwindow.estimated_save_seconds(self.spec)
        self.new.drain_seconds = drainwindow.window(self.new.checkpoints.recent, estimate)

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

    def start_active(self) -> None:
        self.new.active_since = self.new.active_since or self.obs.now
        self.new.start_time = self.new.start_time or self.obs.now

    def stop_active(self) -> None:
        if self.new.active_since is not None:
            self.new.active_seconds += int(self.seconds_since(self.new.active_since))
            self.new.active_since = None

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
            self.hold_final_failure(failure)
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
            reason, why = PREEMPTED, f"{failure.reason} after {disruption}: {failure.message}"
            counted = (
                f"restart after a disruption (not counted; {new.restarts.count}/{recovery.max_restarts} used)"
            )
            self.event(True, PREEMPTED, why)
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

    def hold_final_failure(self, failure: Failure) -> None:
        """A failure past maxRestarts waits FINAL_FAILURE_HOLD_SECONDS for its attempt's disruption before
        it ends the run: a job's error can reach the operator before the node's taint or the pod's
        DisruptionTarget does, and a preemption must not spend the last restart (issue 49). The Failed
        condition is Unknown meanwhile and carries the failure; `failure_held` decides."""
        new = self.new
        if new.job_submission_id:
            self.decision.stop_job = new.job_submission_id
        if self.condition_is(conditions.FAILED, "Unknown") is not None:
            return  # already held: a second failure of the same attempt neither extends nor replaces it
        self.condition(conditions.FAILED, "Unknown", failure.reason, failure.message)
        self.condition(conditions.JOB_RUNNING, False, failure.reason, failure.message)
        new.next_check_time = self.obs.now + dt.timedelta(seconds=FINAL_FAILURE_HOLD_SECONDS)
        self.requeue(FINAL_FAILURE_HOLD_SECONDS)
        self.transition(
            Phase.RESTARTING,
            "Restarting",
            f"maxRestarts ({self.spec.recovery.max_restarts}) spent; {failure.reason}: {failure.message}; "
            f"failing in {FINAL_FAILURE_HOLD_SECONDS}s unless the attempt's node turns out to be going away",
            warning=True,
        )

    def failure_held(self) -> bool:
        """While Restarting on a held failure (hold_final_failure): a disruption seen since makes it a
        preemption, which restarts as any does; at the hold's end it fails the run. True while the hold
        decides this pass (still holding, or the run failed)."""
        held = self.condition_is(conditions.FAILED, "Unknown")
        if held is None:
            return False
        failure = Failure(False, held.reason, held.message)
        if self.obs.disruption is not None:
            self.condition(conditions.FAILED, False, PREEMPTED, f"{failure.reason} came with a disruption")
            self.fail_attempt(failure)
            return False
        if self.new.next_check_time is not None and self.new.next_check_time > self.obs.now:
            self.requeue((self.new.next_check_time - self.obs.now).total_seconds())
            return True
        restarts, most = self.new.restarts.count, self.spec.recovery.max_restarts
        self.finish(
            Phase.FAILED,
            "RestartsExhausted",
            f"{failure.reason} after {restarts} restarts (maxRestarts {most}): {failure.message}",
        )
        return True

    def recount_as_preemption(self) -> None:
        """While Restarting: the failure was counted before its attempt's disruption was seen (a job's
        error travels faster than a node's taint or a pod's DisruptionTarget reaches the operator). The
        restart it spent is given back and recorded as a preemption, once."""
        new, disruption = self.new, self.obs.disruption
        history = new.restarts.history
        last = history[-1] if history else None
        if (
            disruption is None
            or last is None
            or last.reason in (PREEMPTED, RESIZED)
            or new.restarts.count == 0
        ):
            return
        if new.attempt_time is not None and last.time < new.attempt_time:
            return  # that restart was of an earlier attempt
        new.restarts.count -= 1
        new.restarts.preemptions += 1
        why = f"{last.reason} after {disruption}: {last.message}"
        history[-1] = last.model_copy(update={"reason": PREEMPTED, "message": conditions.bounded(why)})
        self.event(True, PREEMPTED, f"{why} (the restart it had counted is not spent)")
