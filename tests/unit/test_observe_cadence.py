"""A quiet running run is observed less often, and still within its bounds: a hang is declared at most a
quarter of hangTimeoutSeconds (or one observe interval) after it is due, a failure or a new checkpoint of a
quiet run seen within MAX_STRETCH observe intervals. Driven as kopf's timer drives it, one tick per observe
interval, on the test's clock."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from fsdp_operator.cadence import MAX_STRETCH, PROGRESS_ANSWERS, Cadence
from fsdp_operator.jobs import JobObservation
from fsdp_trainer.contract import ProgressRecord
from tests.support.clock import Clock

BASE = 15.0  # the default observe interval
EPOCH = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)


def record(step: int, written_at: float, step_seconds: float) -> ProgressRecord:
    return ProgressRecord(
        run_name="r",
        phase="training",
        step=step,
        max_steps=1000,
        step_time_seconds=step_seconds,
        updated_at=EPOCH + dt.timedelta(seconds=written_at),
    )


def observed_at(
    clock: Clock, until: float, progress_at: Callable[[float], ProgressRecord], hang_timeout: float
) -> list[float]:
    """The times the timer observes the run, ticking every BASE seconds until `until`."""
    cadence, passes = Cadence(), []
    while clock.now < until:
        clock.now += BASE
        if cadence.due():
            now = clock()
            passes.append(now)
            cadence.observed(progress_at(now), now, BASE, hang_timeout, quiet=True)
    return passes


def test_a_run_of_ten_minute_steps_is_observed_a_quarter_as_often_and_a_hang_still_within_bound() -> None:
    clock, step_seconds, hang = Clock(start=0.0), 600.0, 1800.0
    hung_at = 3 * step_seconds  # its last record: step 3; none after

    def progress_at(now: float) -> ProgressRecord:
        step = int(min(now, hung_at) // step_seconds)
        return record(step, step * step_seconds, step_seconds)

    passes = observed_at(clock, hung_at + hang + 600, progress_at, hang)
    ticks = (hung_at + hang + 600) / BASE
    assert len(passes) <= ticks / 3, f"{len(passes)} passes of {ticks:.0f} ticks"
    declared = next(t for t in passes if t - hung_at > hang)  # liveness: no new record for over the timeout
    assert declared - (hung_at + hang) <= MAX_STRETCH * BASE, (
        f"hang declared {declared - hung_at - hang}s late"
    )
    # Each new step is seen within the same bound (a new checkpoint, a failure of a quiet run alike).
    for change in (step_seconds, 2 * step_seconds, hung_at):
        seen = next(t for t in passes if t >= change)
        assert seen - change <= MAX_STRETCH * BASE, f"the change at {change}s seen {seen - change}s later"


def test_at_the_least_hang_timeout_every_tick_still_observes() -> None:
    clock = Clock(start=0.0)
    quiet = record(1, 0.0, 600.0)
    passes = observed_at(clock, 600.0, lambda now: quiet, hang_timeout=60.0)
    assert len(passes) == 600.0 / BASE  # a quarter of 60 s is one tick: a hang declared as soon as before


def test_a_run_whose_passes_matter_keeps_the_base_interval() -> None:
    cadence, quiet = Cadence(), record(1, 0.0, 600.0)
    for tick in range(20):
        assert cadence.due()
        cadence.observed(quiet, tick * BASE, BASE, 1800.0, quiet=False)


SUBMISSION = "run-0f1e2d3c-1"


def training(written_at: float, submission: str = SUBMISSION, phase: str = "training") -> ProgressRecord:
    return ProgressRecord(
        run_name="r",
        phase=phase,  # type: ignore[arg-type]
        submission_id=submission,
        step=5,
        max_steps=100,
        updated_at=EPOCH + dt.timedelta(seconds=written_at),
    )


def test_ray_is_asked_for_a_running_job_only_when_the_trainers_record_cannot_answer() -> None:
    cadence = Cadence()
    wall = EPOCH + dt.timedelta(seconds=100)
    # Nothing known from Ray yet: ask.
    assert cadence.job_answered_by(SUBMISSION, training(95), wall, 100.0, BASE) is None
    running = JobObservation(SUBMISSION, "RUNNING")
    cadence.job_asked(running, 100.0)
    # This attempt's trainer wrote a training record 25 s ago (under two intervals): Ray's last answer stands.
    later = wall + dt.timedelta(seconds=15)
    assert cadence.job_answered_by(SUBMISSION, training(90), later, 115.0, BASE) is running
    # Whatever the record cannot vouch for is asked: a record too old (a trainer that died stops writing),
    # another attempt's, one that says the trainer ended, a job Ray did not last call running.
    assert cadence.job_answered_by(SUBMISSION, training(84), later, 115.0, BASE) is None
    assert (
        cadence.job_answered_by(SUBMISSION, training(110, submission="run-0f1e2d3c-0"), later, 115.0, BASE)
        is None
    )
    assert cadence.job_answered_by(SUBMISSION, training(110, phase="failed"), later, 115.0, BASE) is None
    assert cadence.job_answered_by(SUBMISSION, None, later, 115.0, BASE) is None
    cadence.job_asked(JobObservation(SUBMISSION, "PENDING"), 115.0)
    assert cadence.job_answered_by(SUBMISSION, training(110), later, 116.0, BASE) is None


def test_a_trainer_that_dies_is_seen_within_two_intervals_and_ray_is_asked_every_two_minutes_anyway() -> None:
    """On the test's clock: a pass every interval, the trainer writing every 10 s until it dies at 300 s."""
    cadence, asked = Cadence(), []
    died = 300.0
    for tick in range(1, 60):
        now = tick * BASE
        last_write = min(now - now % 10, died)
        job = cadence.job_answered_by(
            SUBMISSION, training(last_write), EPOCH + dt.timedelta(seconds=now), now, BASE
        )
        if job is None:
            asked.append(now)
            cadence.job_asked(JobObservation(SUBMISSION, "RUNNING" if now < died else "FAILED"), now)
    # While it trains, Ray is asked every JOB_ASKED_AT_LEAST intervals (120 s), not every 15 s.
    before = [t for t in asked if t < died]
    assert before == [15.0, 135.0, 255.0], before
    # Dead at 300 s: the pass that would have seen it at once (315 s) and PROGRESS_ANSWERS intervals more at
    # most; here its last record, written as it died, is too old for an answer from 330 s.
    seen = min(t for t in asked if t >= died)
    assert seen <= died + (1 + PROGRESS_ANSWERS) * BASE and seen == 330.0, seen
