"""The background store behind the progress record, the rank logs and MLflow tracking."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fsdp_trainer.background import BackgroundStore
from tests.support.clock import WAIT, Clock

pytestmark = pytest.mark.unit


class Owner:
    """A value stored by a BackgroundStore, with every write recorded and the writes under test control."""

    def __init__(self, interval_seconds: float = 3600.0, **options: Any) -> None:
        self.value = 0
        self.written: list[int] = []
        self.reported: list[Exception] = []
        self.fail_with: Exception | None = None
        self.writing = threading.Event()  # set while a write is in progress
        self.release = threading.Event()  # writes wait for it
        self.release.set()
        self.thread_name = f"test-store-{id(self)}"
        self.store = BackgroundStore(
            self.thread_name,
            lambda: self.value,
            self.write,
            self.reported.append,
            interval_seconds,
            **options,
        )
        self.store.start()

    def set(self, value: int) -> None:
        with self.store.lock:
            self.value = value
            self.store.changed()

    def thread_alive(self) -> bool:
        return any(thread.name == self.thread_name for thread in threading.enumerate())

    def write(self, value: int) -> None:
        self.writing.set()
        try:
            assert self.release.wait(WAIT)
            if self.fail_with is not None:
                raise self.fail_with
            self.written.append(value)
        finally:
            self.writing.clear()


@pytest.fixture
def owner() -> Iterator[Owner]:
    made = Owner()
    yield made
    made.release.set()
    made.store.close(timeout=WAIT)


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(call()), daemon=True)
    thread.start()
    return thread, results


def eventually(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "not within the wait"
        time.sleep(0.005)


def test_flush_waits_until_the_version_it_asked_for_is_written(owner: Owner) -> None:
    owner.release.clear()
    owner.set(1)
    flushing, results = in_thread(owner.store.flush)
    assert owner.writing.wait(WAIT), "a flush makes the write due at once, whatever the interval"
    flushing.join(0.2)
    assert flushing.is_alive(), "the flush returned before its version was written"
    owner.release.set()
    flushing.join(WAIT)
    assert results == [None] and owner.written == [1]


def test_changes_during_a_write_go_out_together_and_only_the_newest_is_written(owner: Owner) -> None:
    owner.release.clear()
    owner.set(1)
    owner.store.request()
    assert owner.writing.wait(WAIT)
    for value in range(2, 50):  # while the first write is in flight
        owner.set(value)
    flushing, results = in_thread(owner.store.flush)
    owner.release.set()
    flushing.join(WAIT)
    assert results == [None]
    assert owner.written == [1, 49], "one write for the changes made meanwhile, of the newest value"


def test_routine_writes_wait_for_the_interval_without_another_change() -> None:
    """On the store's clock, which only the test moves: a change soon after a write is written once the
    interval has passed, though nothing wakes the thread (the change woke it while the interval had not
    passed)."""
    clock = Clock()
    owner = Owner(interval_seconds=0.25, clock=clock)
    try:
        owner.set(1)
        eventually(lambda: owner.written == [1])  # the first change after a quiet spell goes out at once
        owner.set(2)
        # Three looks: a write decided on the first would be done by the third (it reads the clock once more
        # as it begins).
        for move in (0.0, 0.25 - 2**-10):  # unmoved, then just before the interval has passed (exact sums)
            clock.now += move
            looked = clock.read_again(3)
            assert owner.written == [1], f"written again {move} s after the write, within the interval"
            assert looked, "the store stopped looking at its clock while a change waited"
        clock.now += 2**-10
        eventually(lambda: owner.written == [1, 2])
    finally:
        owner.store.close(timeout=WAIT)


def test_a_failed_write_is_reported_counted_and_answered_to_the_flush() -> None:
    clock = Clock()
    owner = Owner(interval_seconds=0.25, clock=clock)
    try:
        owner.fail_with = OSError("storage down")
        owner.set(1)
        assert owner.store.flush() is owner.fail_with
        assert owner.store.flush() is owner.fail_with, "a flush asks again at once"
        assert owner.reported == [owner.fail_with] * 2
        assert owner.store.failures_in_a_row == 2
        looked = clock.read_again(3)  # on the clock the test has not moved: the interval never passes
        assert len(owner.reported) == 2, "retried before the interval: a failure retried in a busy loop"
        assert looked, "the store stopped looking at its clock while a change waited"
        owner.fail_with = None
        assert owner.store.flush() is None and owner.written == [1]
        assert owner.store.failures_in_a_row == 0
    finally:
        owner.store.close(timeout=WAIT)


def test_no_write_begins_within_the_retry_time_after_a_failure_even_when_asked() -> None:
    clock = Clock()
    owner = Owner(interval_seconds=0.0, retry_seconds=0.25, clock=clock)
    try:
        owner.fail_with = OSError("server down")
        owner.set(1)
        eventually(lambda: len(owner.reported) == 1)
        owner.fail_with = None
        owner.store.request()
        owner.set(2)
        for move in (0.0, 0.25 - 2**-10):  # unmoved, then just before the retry time has passed (exact sums)
            clock.now += move
            looked = clock.read_again(3)
            assert owner.written == [] and len(owner.reported) == 1, f"written again {move} s after a failure"
            assert looked, "the store stopped looking at its clock while a change waited"
    finally:
        owner.store.close(timeout=WAIT)
    assert owner.written == [2], "closing writes at once, retry time or not"


def test_close_writes_what_is_pending_once_and_stops_the_thread(owner: Owner) -> None:
    owner.set(7)
    owner.store.close()
    assert owner.written == [7]
    assert not owner.thread_alive(), "close joins the thread"
    assert owner.store.flush() is None, "a flush after close returns"


def test_close_gives_up_after_one_failed_write(owner: Owner) -> None:
    owner.fail_with = OSError("storage down")
    owner.set(1)
    owner.store.close(timeout=WAIT)
    assert owner.reported == [owner.fail_with]
    assert not owner.thread_alive()


def test_close_waits_at_most_its_timeout_for_a_write_that_hangs(owner: Owner) -> None:
    """Told by the order of events, not by seconds: close returns while the write still hangs (it hangs
    until the test releases it, WAIT at most, far beyond the timeout)."""
    owner.release.clear()
    owner.set(1)
    owner.store.request()
    assert owner.writing.wait(WAIT)
    owner.store.close(timeout=0.2)
    assert owner.writing.is_set() and owner.written == [], "close waited for the hung write to end"
    assert owner.thread_alive(), "the thread is left to its write, not waited for"


def test_an_unchanged_state_is_written_again_only_while_a_heartbeat_is_due() -> None:
    """On the store's clock, which only the test moves: an unchanged state is written once the heartbeat
    is due, and no more once there is none, however long it stays unchanged."""
    beating = True
    clock = Clock()
    owner = Owner(heartbeat_seconds=lambda: 0.25 if beating else None, clock=clock)
    try:
        eventually(lambda: len(owner.written) == 1)  # never written: due at once
        for move in (0.0, 0.25 - 2**-10):  # unmoved, then just before the heartbeat is due (exact sums)
            clock.now += move
            looked = clock.read_again(3)
            assert len(owner.written) == 1, f"written again {move} s after, before the heartbeat was due"
            assert looked, "the store stopped looking at its clock while a heartbeat was due"
        clock.now += 2**-10
        eventually(lambda: len(owner.written) == 2)
        with owner.store.lock:
            beating = False
            clock.now += 10**6  # past any interval
        for _ in range(
            3
        ):  # three looks: with nothing due the thread waits for a change, so the test wakes it
            with owner.store.lock:
                reads = clock.reads
                owner.store.lock.notify_all()
            assert clock.read_again(1, since=reads), "the store never looked at its clock again"
        assert owner.written == [0, 0], "an unchanged state written without a heartbeat due"
    finally:
        owner.store.close(timeout=WAIT)
