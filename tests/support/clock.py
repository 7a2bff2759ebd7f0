"""A clock that moves only when a test moves it."""

from __future__ import annotations

import threading

WAIT = 10.0  # seconds a test waits for something that takes milliseconds


class Clock:
    """Moved only by the test (`clock.now += ...`); counts the reads of it, so that a test can wait until the
    code under test has looked at it again."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now, self.reads = start, 0
        self.read = threading.Condition()

    def __call__(self) -> float:
        with self.read:
            self.reads += 1
            self.read.notify_all()
            return self.now

    def read_again(self, times: int, since: int | None = None) -> bool:
        """Whether the clock was read `times` more times (than now, or than `since` reads) within WAIT (each
        read decides whether something is due)."""
        with self.read:
            until = (self.reads if since is None else since) + times
            return self.read.wait_for(lambda: self.reads >= until, WAIT)


# How long a thread or the event loop gets to do what takes it milliseconds: a bound on being scheduled at
# all, never a measure of the probes' timing (that is the test clock's).
SCHEDULED = 30.0
