"""Leader election: who may act, decided from the Lease alone; never two holders, never a stuck one."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fsdp_operator import leader
from fsdp_operator.leader import Elector, Leadership, Lease, Move, claimed_spec, next_move, released_spec
from tests.support.clock import Clock

NOW = dt.datetime(2026, 11, 30, 5, 0, 0, 250000, tzinfo=dt.UTC)


def lease(holder: str, version: str = "1", transitions: int = 0) -> Lease:
    return Lease(holder, leader.LEASE_DURATION, NOW, transitions, version)


@pytest.mark.parametrize(
    ("current", "unchanged_for", "move"),
    [
        (None, 0, Move.CREATE),
        (lease("me"), 0, Move.RENEW),
        (lease("me"), 60, Move.RENEW),
        (lease(""), 0, Move.ACQUIRE),  # released by its holder
        (lease("other"), 14.9, Move.WAIT),
        (lease("other"), 15, Move.ACQUIRE),  # expired on our clock
    ],
    ids=["absent", "ours", "ours-long-unchanged", "released", "held", "expired"],
)
def test_next_move(current: Lease | None, unchanged_for: float, move: Move) -> None:
    assert next_move(current, "me", unchanged_for) == move


def test_renewal_keeps_acquire_time_and_takeover_counts_a_transition() -> None:
    later = NOW + dt.timedelta(seconds=5)
    renewed = claimed_spec(lease("me", transitions=3), "me", later)
    assert (renewed.acquire_time, renewed.renew_time, renewed.lease_transitions) == (NOW, later, 3)
    taken = claimed_spec(lease("other", transitions=3), "me", later)
    assert (taken.holder_identity, taken.acquire_time, taken.lease_transitions) == ("me", later, 4)
    assert claimed_spec(None, "me", later).lease_transitions == 0
    released = released_spec(lease("me", transitions=3), later)
    assert released.holder_identity is None and released.lease_transitions == 3


def test_times_always_carry_microseconds_as_micro_time_needs() -> None:
    """The apiserver refuses a MicroTime without six fractional digits, and isoformat() drops a zero one."""
    on_the_second = NOW.replace(microsecond=0)
    acquired = claimed_spec(None, "me", on_the_second)
    renewed = claimed_spec(Lease("me", 15, on_the_second, 0, "1"), "me", NOW)
    for sent in (acquired.acquire_time, acquired.renew_time, renewed.acquire_time):
        assert client.ApiClient().sanitize_for_serialization(sent).endswith(".000001+00:00")


class FakeLeases:
    """One Lease with the apiserver's rules: create fails if it exists, replace fails on a stale version."""

    namespace, name = "ops", "fsdp-operator"

    def __init__(self) -> None:
        self.current: Lease | None = None
        self.version = 0
        self.after_read: Callable[[], None] = lambda: None
        self.unreachable = False

    def read(self, timeout: float) -> Lease | None:
        if self.unreachable:
            raise TimeoutError("read timed out")
        seen = self.current
        self.after_read()
        return seen

    def _write(self, spec: client.V1LeaseSpec) -> None:
        self.version += 1
        self.current = Lease(
            spec.holder_identity or "",
            spec.lease_duration_seconds,
            spec.acquire_time,
            spec.lease_transitions,
            str(self.version),
        )

    def create(self, spec: client.V1LeaseSpec, timeout: float) -> None:
        if self.current is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        self._write(spec)

    def replace(self, resource_version: str, spec: client.V1LeaseSpec, timeout: float) -> None:
        if self.current is None or self.current.resource_version != resource_version:
            raise ApiException(status=409, reason="Conflict")
        self._write(spec)


def candidates(store: FakeLeases, clock: Clock, *names: str) -> list[Elector]:
    return [Elector(store, name, clock=clock, wall_clock=lambda: NOW) for name in names]


def test_one_holder_while_it_renews_and_the_standby_takes_over_once_it_stops() -> None:
    store, clock = FakeLeases(), Clock()
    a, b = candidates(store, clock, "a", "b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    for _ in range(12):  # a minute of renewals every 5 s: b never gets in
        clock.now += leader.RENEW_INTERVAL
        assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    clock.now += leader.LEASE_DURATION - 0.5  # a dies; b has seen the Lease unchanged for 14.5 s
    assert not b.try_acquire_or_renew()
    clock.now += 0.5
    assert b.try_acquire_or_renew() and store.current and store.current.holder == "b"
    assert not a.try_acquire_or_renew() and a.holder == "b"  # a, had it survived, learns it lost


def test_released_lease_is_taken_at_once() -> None:
    store, clock = FakeLeases(), Clock()
    a, b = candidates(store, clock, "a", "b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    assert a.release()
    assert b.try_acquire_or_renew()
    assert not a.release()  # no longer ours: left alone


def test_two_candidates_racing_for_one_expired_lease_give_one_holder() -> None:
    store, clock = FakeLeases(), Clock()
    old, a, b = candidates(store, clock, "old", "a", "b")
    assert old.try_acquire_or_renew() and not a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    clock.now += leader.LEASE_DURATION

    def a_wins_meanwhile() -> None:
        store.after_read = lambda: None
        assert a.try_acquire_or_renew()

    store.after_read = a_wins_meanwhile  # b reads the expired Lease, then a takes it before b writes
    assert not b.try_acquire_or_renew()
    assert store.current and store.current.holder == "a" and store.current.transitions == 1


def test_unreachable_apiserver_is_a_failed_try_not_a_crash() -> None:
    store, clock = FakeLeases(), Clock()
    (a,) = candidates(store, clock, "a")
    store.unreachable = True
    assert not a.try_acquire_or_renew() and a.last_contact is None


@pytest.fixture
def fast_election(monkeypatch: pytest.MonkeyPatch) -> None:
    """The renewer and the watchdog wake every 10 ms of real time; the renew deadline stays 10 s, counted on
    the test's clock, which moves only when the test moves it."""
    monkeypatch.setattr(leader, "RENEW_INTERVAL", 0.01)
    monkeypatch.setattr(leader, "RETRY_PERIOD", 0.01)
    monkeypatch.setattr(leader, "WATCHDOG_TICK", 0.01)


# How long the renewer and the watchdog threads get to do something that takes them 10 ms: a bound on a
# thread being scheduled at all, never a measure of the election's timing (that is the test clock's).
SCHEDULED = 30.0


class Holder:
    """One holder's Leadership on the test clock: when (on that clock) it stopped acting, and why."""

    def __init__(self, store: FakeLeases, unable_to_act: Callable[[], str | None] = lambda: None) -> None:
        self.store, self.clock = store, Clock()
        (self.elector,) = candidates(store, self.clock, "a")
        assert self.elector.try_acquire_or_renew()
        self.lost: list[str] = []
        self.lost_at: float | None = None
        self.stopped = threading.Event()
        self.ticks = 0
        self.ticked = threading.Condition()

        def watched() -> str | None:
            with self.ticked:
                self.ticks += 1
                self.ticked.notify_all()
            return unable_to_act()

        self.leadership = Leadership(self.elector, self.on_lost, watched)

    def on_lost(self, why: str) -> None:
        self.lost_at = self.clock()
        self.lost.append(why)
        self.stopped.set()

    def watchdog_ticks(self, count: int) -> None:
        """Returns once the watchdog has looked at the clock `count` more times."""
        with self.ticked:
            until = self.ticks + count
            assert self.ticked.wait_for(lambda: self.ticks >= until or self.stopped.is_set(), SCHEDULED)

    def renewals(self, count: int) -> None:
        """Returns once the renewer has written the Lease `count` more times."""
        until, deadline = self.store.version + count, time.monotonic() + SCHEDULED
        while self.store.version < until:
            assert time.monotonic() < deadline, f"fewer than {count} renewals"
            time.sleep(0.005)

    def wait_lost(self) -> None:
        assert self.stopped.wait(SCHEDULED), f"still acting at {self.clock() - START:g}s on the test clock"


START = Clock().now


@pytest.fixture
def holder(fast_election: None) -> Iterator[Callable[..., Holder]]:
    started: list[Holder] = []

    def start(store: FakeLeases, unable_to_act: Callable[[], str | None] = lambda: None) -> Holder:
        started.append(Holder(store, unable_to_act))
        started[-1].leadership.start()
        return started[-1]

    yield start
    for each in started:
        each.leadership.stop()


def test_holder_that_keeps_renewing_keeps_acting(holder: Callable[..., Holder]) -> None:
    a = holder(FakeLeases())
    for _ in range(30):  # a minute on the test clock, 2 s at a time, each step renewed
        a.clock.now += 2
        a.renewals(1)
        a.watchdog_ticks(2)
    assert a.lost == [] and a.store.current and a.store.current.holder == "a"


def test_holder_stops_acting_at_the_renew_deadline_when_the_apiserver_is_unreachable(
    holder: Callable[..., Holder],
) -> None:
    a = holder(FakeLeases())
    a.store.unreachable = True
    renewed = a.elector.renewed_at
    a.clock.now = renewed + leader.RENEW_DEADLINE - 0.1
    a.watchdog_ticks(3)
    assert a.lost == [], "stopped before the renew deadline"
    a.clock.now = renewed + leader.RENEW_DEADLINE + 0.1
    a.wait_lost()
    assert "not renewed" in a.lost[0] and a.lost_at == renewed + leader.RENEW_DEADLINE + 0.1


def test_holder_stops_acting_at_the_deadline_even_while_a_call_hangs(holder: Callable[..., Holder]) -> None:
    store = FakeLeases()
    hanging, release = threading.Event(), threading.Event()

    def hang() -> None:
        hanging.set()
        release.wait(SCHEDULED)

    a = holder(store)
    try:
        store.after_read = hang
        assert hanging.wait(SCHEDULED)  # the renewer is inside a read that does not return
        renewed = a.elector.renewed_at
        a.clock.now = renewed + leader.RENEW_DEADLINE - 0.1
        a.watchdog_ticks(3)
        assert a.lost == [], "stopped before the renew deadline"
        a.clock.now = renewed + leader.RENEW_DEADLINE + 0.1
        a.wait_lost()
        assert "not renewed" in a.lost[0] and not release.is_set()  # while the call still hung
    finally:
        release.set()


def test_holder_stops_acting_at_once_when_another_holds_the_lease(holder: Callable[..., Holder]) -> None:
    a = holder(FakeLeases())
    a.store.current = lease("usurper", version="99")
    a.wait_lost()  # the test clock never moved: no deadline passed
    assert a.lost == ["lease taken by usurper"] and a.lost_at == START


def test_holder_that_cannot_act_stops_at_once_though_it_could_renew(holder: Callable[..., Holder]) -> None:
    frozen: list[str] = []
    a = holder(FakeLeases(), unable_to_act=lambda: frozen[0] if frozen else None)
    a.renewals(1)
    frozen.append("event loop stalled for 10s")
    a.wait_lost()
    assert a.lost == ["event loop stalled for 10s"] and a.lost_at == START
