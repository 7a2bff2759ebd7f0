"""A pass reads kopf's indexes from a handler thread while kopf's event loop changes them: the read must not
fail. Under the 1,000-run load a pass's admission failed with "dictionary changed size during iteration"
(and was retried a minute later) while runs were being created."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest
from kopf._core.engines.indexing import Index

from fsdp_operator.kube import Indexes
from fsdp_operator.runmemory import RunMemories

READS = 3_000


@pytest.fixture
def switching_often() -> Iterator[None]:
    """Threads switch every microsecond instead of every 5 ms, so that a read that is not atomic meets a
    change in a few reads instead of a few thousand."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def churning(change: Callable[[int], None]) -> tuple[threading.Thread, threading.Event]:
    """A thread that calls change(0), change(1), ... until the event is set."""
    stop = threading.Event()

    def loop() -> None:
        i = 0
        while not stop.is_set():
            change(i)
            i += 1

    return threading.Thread(target=loop, daemon=True), stop


@pytest.mark.usefixtures("switching_often")
def test_every_run_of_an_index_changing_meanwhile_is_read_without_error() -> None:
    index: Index[tuple[str, str], dict[str, int]] = Index()
    steady = 200
    for i in range(steady):  # runs that stay: every read must see each of them
        index._replace(("steady", str(i)), {("ns", f"steady-{i}"): {"steady": i}})

    def change(i: int) -> None:  # runs created and deleted, as kopf's watch does on the loop's thread
        key = ("churn", str(i % 50))
        if i % 2:
            index._discard(key)
        else:
            index._replace(key, {("ns", f"churn-{i % 50}"): {"churn": i}})

    thread, stop = churning(change)
    thread.start()
    try:
        for _ in range(READS):
            values = Indexes.all(index)
            assert sorted(v["steady"] for v in values if "steady" in v) == list(range(steady))
    finally:
        stop.set()
        thread.join(timeout=10)


@pytest.mark.usefixtures("switching_often")
def test_a_status_write_is_remembered_while_other_runs_are_first_seen() -> None:
    memories = RunMemories()

    def change(i: int) -> None:  # the timer's tick, on the loop, meets a run for the first time
        memories.of(f"new-{i % 100}")
        memories.forget(f"new-{(i + 50) % 100}")

    for i in range(32):  # more than are remembered freely, so that each write walks every run's memory
        memories.wrote(f"run-{i}", "1", {"metadata": {"resourceVersion": "2"}})
    thread, stop = churning(change)
    thread.start()
    try:
        for i in range(READS):
            memories.wrote(f"run-{i % 32}", str(i), {"metadata": {"resourceVersion": str(i + 1)}})
    finally:
        stop.set()
        thread.join(timeout=10)
