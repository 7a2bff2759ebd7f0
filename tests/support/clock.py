"""A clock that moves only when a test moves it."""

from __future__ import annotations


class Clock:
    """The probes' clock: moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# How long a thread or the event loop gets to do what takes it milliseconds: a bound on being scheduled at
# all, never a measure of the probes' timing (that is the test clock's).
SCHEDULED = 30.0
