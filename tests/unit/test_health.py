"""Probes: /healthz fails when the handler pool is stuck; /readyz tells a working leader or standby. The
probes over HTTP are tests/cluster/test_health_probes.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from fsdp_operator import health
from fsdp_operator.health import Health, liveness, readiness
from tests.support.clock import SCHEDULED, Clock
from tests.support.waiting import wait_until


@pytest.mark.parametrize(
    ("leading", "started", "silent_for", "ready"),
    [
        (True, True, None, True),
        (True, False, 1.0, False),  # elected, kopf not started yet
        (False, False, 2.0, True),  # a standby that reaches the apiserver
        (False, False, health.APISERVER_SILENCE + 1, False),
        (False, False, None, False),  # a standby that never reached it
    ],
    ids=["leader", "leader-starting", "standby", "standby-cut-off", "standby-never-connected"],
)
def test_readiness(leading: bool, started: bool, silent_for: float | None, ready: bool) -> None:
    assert readiness(leading, started, silent_for)[0] is ready


def test_liveness_fails_once_a_no_op_waited_longer_than_the_limit() -> None:
    assert liveness(9.9, pool_timeout=10)[0] and not liveness(10.1, pool_timeout=10)[0]


def test_a_frozen_event_loop_is_seen_from_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the test clock: a loop blocked for less than LOOP_STALL_LIMIT is fine, longer is stalled."""
    monkeypatch.setattr(health, "LOOP_TICK", 0.01)
    clock = Clock()
    state = Health(executor=ThreadPoolExecutor(1), clock=clock)
    assert state.loop_stall() is None  # not ticking yet: nothing to judge
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    blocking, released = threading.Event(), threading.Event()

    def block() -> None:  # a handler that blocks the loop
        blocking.set()
        released.wait(SCHEDULED)

    try:
        ticking = asyncio.run_coroutine_threadsafe(state.tick_forever(), loop)
        wait_until("the loop to tick", lambda: state.loop_ticked_at, timeout=SCHEDULED, interval=0.01)
        clock.now += health.LOOP_STALL_LIMIT + 5
        wait_until("a tick at the new time", lambda: state.loop_ticked_at == clock.now, SCHEDULED, 0.01)
        assert state.loop_stall() is None  # ticking along, however long it has run
        loop.call_soon_threadsafe(block)
        assert blocking.wait(SCHEDULED)
        blocked_at = clock.now
        clock.now = blocked_at + health.LOOP_STALL_LIMIT - 0.5
        assert state.loop_stall() is None
        clock.now = blocked_at + health.LOOP_STALL_LIMIT + 2
        assert state.loop_stall() == f"event loop stalled for {health.LOOP_STALL_LIMIT + 2:.0f}s"
        released.set()
        wait_until("the loop to tick again", lambda: state.loop_stall() is None, SCHEDULED, 0.01)
        ticking.cancel()
        concurrent.futures.wait([ticking], timeout=SCHEDULED)
    finally:
        released.set()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=SCHEDULED)
        loop.close()
