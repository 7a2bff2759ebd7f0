"""The probes served over HTTP (aiohttp on loopback): /healthz fails when the handler pool is stuck;
/readyz tells a working leader or standby."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from fsdp_operator import health
from fsdp_operator.health import Health
from tests.support.clock import SCHEDULED, Clock
from tests.support.net import free_port


async def get(url: str) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        return response.status, await response.text()


async def first_answer(url: str, status: int) -> tuple[int, str]:
    """Polls `url` until it answers with `status`; the last answer after SCHEDULED seconds otherwise."""
    deadline = time.monotonic() + SCHEDULED
    while True:
        answer = await get(url)
        if answer[0] == status or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.05)


class CountingPool(ThreadPoolExecutor):
    """The handler pool, counting the probes' no-ops sent through it."""

    def __init__(self) -> None:
        super().__init__(2)
        self.no_ops = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.no_ops += fn is health._nothing
        return super().submit(fn, *args, **kwargs)


def test_blocked_handler_pool_fails_liveness_and_a_freed_one_passes_again() -> None:
    """On the test clock: a no-op stuck in the pool is fine for pool_timeout, then fails /healthz."""
    pool = CountingPool()
    released, busy = threading.Event(), threading.Semaphore(0)
    clock = Clock()

    def hang() -> None:
        busy.release()
        released.wait(SCHEDULED)

    async def scenario() -> list[tuple[int, str]]:
        port = free_port()
        state = Health(executor=pool, pool_timeout=10, probe_interval=0.01, clock=clock)
        runner = await health.serve(state, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}/healthz"
        try:
            answers = [await get(url)]
            for _ in range(2):  # every handler thread hangs, as on a call without a timeout
                pool.submit(hang)
            for _ in range(2):
                assert await asyncio.to_thread(busy.acquire, timeout=SCHEDULED)
            # The next no-op waits behind them, sent at the clock's time, which has not moved.
            sent_before = pool.no_ops
            while pool.no_ops == sent_before:
                await asyncio.sleep(0.01)
            assert state.pool_probe_sent_at == clock.now
            clock.now += 9.9
            answers.append(await get(url))  # waited less than pool_timeout
            clock.now += 0.2
            answers.append(await get(url))
            released.set()
            answers.append(await first_answer(url, 200))
            return answers
        finally:
            await runner.cleanup()

    try:
        healthy, waiting, stuck, recovered = asyncio.run(scenario())
    finally:
        released.set()
        pool.shutdown()
    assert healthy[0] == 200 and waiting[0] == 200 and recovered[0] == 200, (healthy, waiting, recovered)
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
