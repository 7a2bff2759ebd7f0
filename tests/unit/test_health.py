"""Probes: /healthz fails when the handler pool is stuck; /readyz tells a working leader or standby."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from fsdp_operator import health
from fsdp_operator.health import Health, liveness, readiness
from tests.harness import free_port, wait_until


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


async def get(url: str) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        return response.status, await response.text()


async def first_answer(url: str, status: int, within: float = 5.0) -> tuple[int, str]:
    """Polls `url` until it answers with `status`; the last answer after `within` seconds otherwise."""
    deadline = time.monotonic() + within
    while True:
        answer = await get(url)
        if answer[0] == status or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.05)


def test_blocked_handler_pool_fails_liveness_and_a_freed_one_passes_again() -> None:
    pool = ThreadPoolExecutor(2)
    released = threading.Event()

    async def scenario() -> list[tuple[int, str]]:
        port = free_port()
        state = Health(executor=pool, pool_timeout=0.3, probe_interval=0.05)
        runner = await health.serve(state, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/healthz"
        try:
            answers = [await get(url)]
            for _ in range(2):  # every handler thread hangs, as on a call without a timeout
                pool.submit(released.wait, 30)
            answers.append(await first_answer(url, 500))
            released.set()
            answers.append(await first_answer(url, 200))
            return answers
        finally:
            await runner.cleanup()

    try:
        healthy, stuck, recovered = asyncio.run(scenario())
    finally:
        released.set()
        pool.shutdown()
    assert healthy[0] == 200 and recovered[0] == 200
    assert stuck[0] == 500 and "handler pool stuck" in stuck[1]


def test_readyz_follows_the_role() -> None:
    async def scenario() -> list[int]:
        port = free_port()
        contact: list[float | None] = [None]
        state = Health(executor=ThreadPoolExecutor(1), operator_started=asyncio.Event())
        state.last_apiserver_contact = lambda: contact[0]
        runner = await health.serve(state, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/readyz"
        try:
            codes = [(await get(url))[0]]  # standby that has not reached the apiserver yet
            contact[0] = time.monotonic()
            codes.append((await get(url))[0])  # standby that has
            state.leading = True
            codes.append((await get(url))[0])  # elected, kopf starting
            assert state.operator_started
            state.operator_started.set()
            codes.append((await get(url))[0])  # leader with handlers running
            return codes
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == [503, 200, 503, 200]


def test_a_frozen_event_loop_is_seen_from_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "LOOP_TICK", 0.02)
    monkeypatch.setattr(health, "LOOP_STALL_LIMIT", 0.3)
    state = Health(executor=ThreadPoolExecutor(1))
    assert state.loop_stall() is None  # not ticking yet: nothing to judge
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        ticking = asyncio.run_coroutine_threadsafe(state.tick_forever(), loop)
        time.sleep(0.5)
        assert state.loop_stall() is None  # ticking along
        loop.call_soon_threadsafe(time.sleep, 1.5)  # a handler that blocks the loop
        time.sleep(0.9)
        assert (state.loop_stall() or "").startswith("event loop stalled for")
        assert wait_until(
            "the loop to tick again", lambda: state.loop_stall() is None, timeout=5, interval=0.05
        )
        ticking.cancel()
        concurrent.futures.wait([ticking], timeout=5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=5)
        loop.close()
