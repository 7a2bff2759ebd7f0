"""A quiet running run is observed less often, and still within its bounds: a hang is declared at most a
quarter of hangTimeoutSeconds (or one observe interval) after it is due, a failure or a new checkpoint of a
quiet run seen within MAX_STRETCH observe intervals. Driven as kopf's timer drives it, one tick per observe
interval, on the test's clock."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from fsdp_operator.cadence import MAX_STRETCH, Cadence
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
