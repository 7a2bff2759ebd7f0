"""A background thread that stores the newest state of something (the progress record, a rank's log, the
MLflow buffer), so the thread that changes it never waits for storage.

Changes are counted in versions: a store takes a snapshot of the state (under the lock) and writes it
(outside it); once the write succeeds, every version up to the snapshot's is stored. Only the newest state
is ever written: changes made while a write is in flight go out with the next one. Routine stores are at
least `interval_seconds` apart; `request` makes the next store due at once and `flush` also waits for it.
A failed write is reported, counted and retried at the next routine store (not before `retry_seconds`);
it is never raised in the thread, so storage can never stop training.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

Snapshot = TypeVar("Snapshot")


class BackgroundStore(Generic[Snapshot]):
    """Writes `snapshot()` with `write` in a thread named `name`, whenever the state has changed.

    The owner guards its state with `lock`, calls `changed` after every change, and `start` once it can be
    called back. `snapshot` is called with the lock held, `write` and `report_failure` without it.
    `heartbeat_seconds`, when given, is asked (with the lock held) how long an unchanged state may go
    unwritten: None for as long as it stays unchanged.
    """

    def __init__(
        self,
        name: str,
        snapshot: Callable[[], Snapshot],
        write: Callable[[Snapshot], None],
        report_failure: Callable[[Exception], None],
        interval_seconds: float,
        retry_seconds: float = 0.0,
        heartbeat_seconds: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lock = threading.Condition()  # reentrant: the owner may hold it while calling `changed`
        self._clock = clock  # seconds, for the interval, the retry time and the heartbeat
        self._snapshot, self._write, self._report_failure = snapshot, write, report_failure
        self._interval_seconds, self._retry_seconds = interval_seconds, retry_seconds
        self._heartbeat_seconds = heartbeat_seconds
        self._version = 0  # of the newest state
        self._stored_version = 0
        self._urgent_version = 0  # the newest version `request` or `flush` asked for
        self._last_attempt = -math.inf  # the clock's time the last write began
        self._last_failed = False
        self._failures = 0  # every failed write, for the flushes that wait
        self._last_error: Exception | None = None
        self._closed = False
        self._stopped = False
        self.failures_in_a_row = 0  # the thread's alone: `report_failure` and `write` may read it
        self.cpu_seconds = 0.0  # the thread's CPU time, once it has ended
        self._thread = threading.Thread(target=self._store_forever, name=name, daemon=True)

    def start(self) -> None:
        """Starts the thread: once the owner is complete, since the thread calls back into it."""
        self._thread.start()

    @property
    def pending(self) -> bool:
        """Whether the state has changed since it was last stored (read it with the lock held)."""
        return self._version > self._stored_version

    def changed(self) -> None:
        """Counts a change of the state (call it with the lock held, or let it take the lock)."""
        with self.lock:
            if not self.pending:  # wakes a thread waiting for a change; with one pending, it waits timed
                self.lock.notify_all()
            self._version += 1

    def request(self) -> None:
        """Makes a store of the state as it is now due at once, without waiting for it."""
        with self.lock:
            self._urgent_version = self._version
            self.lock.notify_all()

    def flush(self) -> Exception | None:
        """Stores the state as it is now and waits until it is stored (None), a write fails (its error) or
        the thread has stopped."""
        with self.lock:
            target, failures = self._version, self._failures
            self._urgent_version = target
            self.lock.notify_all()
            self.lock.wait_for(
                lambda: self._stored_version >= target or self._failures > failures or self._stopped
            )
            return None if self._stored_version >= target else self._last_error

    def close(self, timeout: float | None = None) -> None:
        """Stores what is pending (one attempt) and stops the thread, waiting at most `timeout` seconds."""
        with self.lock:
            self._closed = True
            self.lock.notify_all()
        self._thread.join(timeout)

    def _store_forever(self) -> None:
        closing_attempted = False
        while True:
            with self.lock:
                # Recomputed after every wake-up: a change can make a write due later, not only at once.
                wait = self._seconds_until_due()
                while wait != 0.0 and not self._closed:
                    self.lock.wait(wait)
                    wait = self._seconds_until_due()
                if self._closed and (closing_attempted or not self.pending):
                    break
                closing_attempted = self._closed
                version = self._version
                self._last_attempt = self._clock()
                snapshot = self._snapshot()
            try:
                self._write(snapshot)
            except Exception as error:
                self.failures_in_a_row += 1
                self._report_failure(error)  # before a waiting flush wakes: the report comes first
                with self.lock:
                    self._failures += 1
                    self._last_error = error
                    self._last_failed = True
                    self._urgent_version = self._stored_version  # the waiter has its answer: no busy retry
                    self.lock.notify_all()
            else:
                self.failures_in_a_row = 0
                with self.lock:
                    self._stored_version = max(self._stored_version, version)
                    self._last_failed = False
                    self.lock.notify_all()
        self.cpu_seconds = time.thread_time()
        with self.lock:
            self._stopped = True
            self.lock.notify_all()

    def _seconds_until_due(self) -> float | None:
        """Seconds until a write is due, 0 when it is, None while none will be until something changes
        (called with the lock held)."""
        since = self._clock() - self._last_attempt
        if self.pending:
            urgent = self._urgent_version > self._stored_version
            wait = 0.0 if urgent else self._interval_seconds
            if self._last_failed:
                wait = max(wait, self._retry_seconds)
            return max(0.0, wait - since)
        heartbeat = self._heartbeat_seconds() if self._heartbeat_seconds is not None else None
        return None if heartbeat is None else max(0.0, heartbeat - since)
