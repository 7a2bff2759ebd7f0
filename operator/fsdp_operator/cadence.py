"""How often the timer observes a running run: every observe interval while its progress changes; less
often once it has been quiet for QUIET_PASSES passes (nothing new is read from a run that writes nothing),
within two bounds that keep what the status promises:

- a hang is declared at most hangTimeoutSeconds / HANG_SHARE (or one observe interval, if longer) after it
  is due: a pass comes at least that often; and
- a quiet run's failure, end or new checkpoint is seen within MAX_STRETCH observe intervals (60 s by
  default).

Only the timer's passes are skipped: a change of the run's spec or of its RayCluster is acted on at once.

Nor is Ray's dashboard asked for a running job at every pass: while the trainer's own progress record, written
by this attempt within PROGRESS_ANSWERS intervals, says it is training, the job is running as Ray last said.
A trainer that dies stops writing, so its record goes stale and Ray is asked: a failure is seen at most
PROGRESS_ANSWERS intervals later than at every pass (30 s by default, within the 60 s above), and Ray is asked
at least every JOB_ASKED_AT_LEAST intervals all the same."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from fsdp_operator.jobs import JobObservation
from fsdp_trainer.contract import ProgressRecord

QUIET_PASSES = 3  # passes without a change of progress before the interval grows
PROGRESS_ANSWERS = 2  # observe intervals a training record answers for the job's state
JOB_ASKED_AT_LEAST = 8  # observe intervals (2 minutes by default)
MAX_STRETCH = 4  # the longest interval, in observe intervals
HANG_SHARE = 4  # and at most this part of the hang timeout


def observe_interval(
    base: float, unchanged_passes: int, quiet_seconds: float, step_seconds: float | None, hang_timeout: float
) -> float:
    """Seconds to the next timer pass of a running run whose progress has been unchanged for
    `unchanged_passes` passes and `quiet_seconds`. Nothing new is expected before about one step after the
    last change, and a run quiet for long is likely to stay so: up to the longer of those (half the quiet
    time), never beyond the bounds above, never below `base`."""
    if unchanged_passes < QUIET_PASSES:
        return base
    longest = max(base, min(base * MAX_STRETCH, hang_timeout / HANG_SHARE))
    expected = (step_seconds or 0.0) - quiet_seconds
    return min(longest, max(base, expected, quiet_seconds / 2))


@dataclass
class Cadence:
    """One run's timer: the progress it last saw, since when, and the timer ticks to let pass unobserved."""

    progress: ProgressRecord | None = None
    changed_at: float = 0.0
    unchanged_passes: int = 0
    ticks_to_skip: int = 0
    job: JobObservation | None = None  # as Ray last answered, and when (monotonic seconds)
    job_asked_at: float = 0.0

    def due(self) -> bool:
        """At a timer tick: whether this one observes the run (else one tick fewer is left to skip)."""
        if self.ticks_to_skip > 0:
            self.ticks_to_skip -= 1
            return False
        return True

    def observed(
        self, progress: ProgressRecord | None, now: float, base: float, hang_timeout: float, quiet: bool
    ) -> None:
        """After a pass read `progress` at `now` (monotonic seconds). `quiet` is False for a run whose every
        pass matters (not running, a read that failed, forensics under way): it keeps the base interval."""
        if progress != self.progress or not quiet:
            self.progress, self.changed_at, self.unchanged_passes = progress, now, 0
        else:
            self.unchanged_passes += 1
        step = progress.step_time_seconds if progress is not None else None
        interval = observe_interval(base, self.unchanged_passes, now - self.changed_at, step, hang_timeout)
        self.ticks_to_skip = max(0, int(interval / base + 1e-9) - 1)  # whole ticks, never past the interval

    def job_answered_by(
        self, submission: str, progress: ProgressRecord | None, wall: dt.datetime, now: float, base: float
    ) -> JobObservation | None:
        """The job's state without asking Ray: what Ray last said of `submission` (RUNNING), while this
        attempt's trainer wrote a training record within PROGRESS_ANSWERS intervals of `wall` and Ray was
        asked within JOB_ASKED_AT_LEAST intervals of `now`. None: ask Ray."""
        known = self.job
        running = known is not None and known.submission_id == submission and known.status == "RUNNING"
        training = (
            progress is not None
            and progress.submission_id == submission
            and progress.phase == "training"
            and (wall - progress.updated_at).total_seconds() < PROGRESS_ANSWERS * base
        )
        recent = now - self.job_asked_at < JOB_ASKED_AT_LEAST * base
        return known if running and training and recent else None

    def job_asked(self, job: JobObservation, now: float) -> None:
        self.job, self.job_asked_at = job, now
