"""Liveness and readiness over HTTP, answered from the operator's own event loop.

/healthz (liveness): a stuck event loop never answers, so the probe times out; and kopf runs every sync
handler in one thread pool, so a pool whose threads all hang (on a call without a timeout) freezes every run:
a no-op submitted to that pool that has not run within `pool_timeout` fails the check, and the kubelet
restarts the container.
/readyz (readiness): the leader once kopf has started; a standby while it can reach the apiserver.
A leader whose event loop stalls longer than LOOP_STALL_LIMIT gives up leadership without waiting for the
kubelet (see `loop_stall`), since a frozen loop runs no watch, timer or handler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from aiohttp import web

POOL_TIMEOUT = 10.0  # a no-op waiting longer than this in the handler pool means the pool is stuck
POOL_PROBE_INTERVAL = 2.0  # how often a no-op is sent through the pool
APISERVER_SILENCE = 15.0  # a standby is ready while the apiserver answered it within this many seconds
LOOP_TICK = 1.0  # how often the event loop records that it runs
LOOP_STALL_LIMIT = 10.0  # a loop that has not ticked for this long is stuck


def liveness(pool_waiting_for: float, pool_timeout: float) -> tuple[bool, str]:
    if pool_waiting_for > pool_timeout:
        return False, f"handler pool stuck: a no-op has waited {pool_waiting_for:.0f}s for a thread"
    return True, "event loop and handler pool respond"


def readiness(leading: bool, operator_started: bool, apiserver_silent_for: float | None) -> tuple[bool, str]:
    """Ready: the leader with kopf started, or a standby that heard from the apiserver recently."""
    if leading:
        return (True, "leader, handlers running") if operator_started else (False, "leader, kopf starting")
    if apiserver_silent_for is not None and apiserver_silent_for <= APISERVER_SILENCE:
        return True, "standby, apiserver reachable"
    silence = "never" if apiserver_silent_for is None else f"not for {apiserver_silent_for:.0f}s"
    return False, f"standby, apiserver answered {silence}"


def _nothing() -> None:
    """The no-op sent through the handler pool."""


@dataclass
class Health:
    """What the probes report; the operator's main loop sets `leading` and `last_apiserver_contact`."""

    executor: Executor
    pool_timeout: float = POOL_TIMEOUT
    probe_interval: float = POOL_PROBE_INTERVAL
    clock: Callable[[], float] = time.monotonic
    leading: bool = False
    last_apiserver_contact: Callable[[], float | None] = lambda: None
    operator_started: asyncio.Event | None = None  # kopf's ready_flag
    pool_probe_sent_at: float | None = None  # set while a no-op waits in the pool
    loop_ticked_at: float | None = None  # when the event loop last ran `tick_forever`

    def loop_stall(self) -> str | None:
        """Why the event loop counts as stuck, or None while it ticks (or before it started ticking)."""
        ticked = self.loop_ticked_at
        stalled_for = 0.0 if ticked is None else self.clock() - ticked
        return f"event loop stalled for {stalled_for:.0f}s" if stalled_for > LOOP_STALL_LIMIT else None

    async def tick_forever(self) -> None:
        while True:
            self.loop_ticked_at = self.clock()
            await asyncio.sleep(LOOP_TICK)

    def live(self) -> tuple[bool, str]:
        sent = self.pool_probe_sent_at
        return liveness(0.0 if sent is None else self.clock() - sent, self.pool_timeout)

    def ready(self) -> tuple[bool, str]:
        contact = self.last_apiserver_contact()
        started = self.operator_started is not None and self.operator_started.is_set()
        return readiness(self.leading, started, None if contact is None else self.clock() - contact)

    async def probe_pool_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.pool_probe_sent_at = self.clock()
            try:
                await loop.run_in_executor(self.executor, _nothing)
            except RuntimeError:  # the pool was shut down: the operator is stopping
                return
            self.pool_probe_sent_at = None
            await asyncio.sleep(self.probe_interval)

    def app(self) -> web.Application:
        async def healthz(_: web.Request) -> web.Response:
            ok, why = self.live()
            return web.Response(status=200 if ok else 500, text=why + "\n")

        async def readyz(_: web.Request) -> web.Response:
            ok, why = self.ready()
            return web.Response(status=200 if ok else 503, text=why + "\n")

        async def probing_the_pool(_: web.Application) -> AsyncIterator[None]:
            probe = asyncio.create_task(self.probe_pool_forever(), name="handler pool probe")
            yield
            probe.cancel()

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.cleanup_ctx.append(probing_the_pool)
        return app


async def serve(health: Health, host: str, port: int) -> web.AppRunner:
    """Starts the probe server, which sends its no-ops through the pool until the runner's cleanup()."""
    return await start_site(health.app(), host, port)


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serves `app` on host:port until the runner's cleanup(); an address in use raises OSError."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner
