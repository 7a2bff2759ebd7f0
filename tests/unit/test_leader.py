"""Leader election: who may act, decided from the Lease alone; never two holders, never a stuck one."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fsdp_operator import leader
from fsdp_operator.leader import Elector, Leadership, Lease, Move, claimed_spec, next_move, released_spec

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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
    """Election timings scaled down 10x (renewals 25x), so a renew deadline passes in a second."""
    monkeypatch.setattr(leader, "RENEW_INTERVAL", 0.2)
    monkeypatch.setattr(leader, "RETRY_PERIOD", 0.1)
    monkeypatch.setattr(leader, "RENEW_DEADLINE", 1.0)
    monkeypatch.setattr(leader, "WATCHDOG_TICK", 0.02)


def lead(
    store: FakeLeases,
    meanwhile: Callable[[], None],
    watch_for: float = 2.0,
    unable_to_act: Callable[[], str | None] = lambda: None,
) -> tuple[list[str], float]:
    """Acquires, keeps renewing, runs `meanwhile`; returns why the holder stopped acting, and when."""
    (a,) = candidates(store, time.monotonic, "a")
    assert a.try_acquire_or_renew()
    lost: list[str] = []
    stopped = threading.Event()
    started = time.monotonic()
    lost_after = float("inf")

    def on_lost(why: str) -> None:
        nonlocal lost_after
        lost_after = time.monotonic() - started
        lost.append(why)
        stopped.set()

    leadership = Leadership(a, on_lost, unable_to_act).start()
    meanwhile()
    stopped.wait(watch_for)
    leadership.stop()
    return lost, lost_after


fast = pytest.mark.usefixtures("fast_election")


@fast
def test_holder_that_keeps_renewing_keeps_acting() -> None:
    store = FakeLeases()
    lost, _ = lead(store, meanwhile=lambda: None)
    assert (
        lost == []
        and store.current
        and store.current.holder == "a"
        and int(store.current.resource_version) > 3
    )


@fast
def test_holder_stops_acting_at_the_renew_deadline_when_the_apiserver_is_unreachable() -> None:
    store = FakeLeases()
    lost, after = lead(store, meanwhile=lambda: setattr(store, "unreachable", True))
    assert lost and "not renewed" in lost[0] and after < 1.0 + 0.5


@fast
def test_holder_stops_acting_at_the_deadline_even_while_a_call_hangs() -> None:
    store = FakeLeases()
    lost, after = lead(store, meanwhile=lambda: setattr(store, "after_read", lambda: time.sleep(3)))
    assert lost and "not renewed" in lost[0] and after < 1.0 + 0.5


@fast
def test_holder_stops_acting_at_once_when_another_holds_the_lease() -> None:
    store = FakeLeases()
    lost, after = lead(store, meanwhile=lambda: setattr(store, "current", lease("usurper", version="99")))
    assert lost == ["lease taken by usurper"] and after < 1.0


@fast
def test_holder_that_cannot_act_stops_at_once_though_it_could_renew() -> None:
    frozen: list[str] = []
    lost, after = lead(
        FakeLeases(),
        meanwhile=lambda: frozen.append("event loop stalled for 10s"),
        unable_to_act=lambda: frozen[0] if frozen else None,
    )
    assert lost == ["event loop stalled for 10s"] and after < 0.5
