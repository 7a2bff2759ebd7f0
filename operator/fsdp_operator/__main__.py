"""`python -m fsdp_operator`: run the operator with settings from FSDP_OPERATOR_* variables or flags.

With leader election (the default) a replica waits as a standby until it holds the Lease, runs kopf only while
it holds it, exits at once (code 1, so the Deployment restarts it) when it cannot renew it, and releases it
after a graceful stop so that a rollout hands over without waiting for the Lease to expire.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from pydantic import ValidationError
from pydantic_settings import CliApp

from fsdp_operator import health, leader, metrics
from fsdp_operator.handlers import register
from fsdp_operator.settings import Settings

log = logging.getLogger("fsdp_operator")
# After kopf stops: how long handlers still running may take before we exit anyway. kopf's own stop takes
# about 6 s, so both fit in the pod's default 30 s grace period.
HANDLER_DRAIN_TIMEOUT = 15.0
# The apiserver admits objects nested 10,000 levels deep; Python's JSON decoder stops at the recursion limit
# (1,000), and one such run in a LIST would stop kopf's watch of every run. Decoding, encoding and copying
# 10,000 levels fit in the main thread's stack with this limit.
RECURSION_LIMIT = 25_000


def main(argv: list[str] | None = None) -> None:
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))
    try:
        settings = CliApp.run(Settings, cli_args=sys.argv[1:] if argv is None else argv)
    except ValidationError as error:
        sys.exit(f"fsdp-operator: invalid settings:\n{error}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # per-handler success lines every interval
    sys.exit(asyncio.run(run(settings)))


async def run(settings: Settings) -> int:
    """Serves the probes and runs kopf (as leader when elected); returns the exit code."""
    executor = ThreadPoolExecutor(settings.worker_threads, thread_name_prefix="handler")
    registry = kopf.OperatorRegistry()
    register(registry, settings, executor)

    @kopf.on.startup(registry=registry)
    async def use_our_executor(settings: kopf.OperatorSettings, **_: Any) -> None:
        # The pool the liveness probe checks must be the one kopf runs sync handlers in.
        settings.execution.executor = executor

    state = health.Health(executor=executor, operator_started=asyncio.Event())
    ticking = asyncio.create_task(state.tick_forever(), name="event loop ticks")
    probes = None
    if settings.health_port:
        address = (settings.health_bind_address, settings.health_port)
        try:
            probes = await health.serve(state, *address)
        except OSError as error:
            sys.exit(f"fsdp-operator: cannot serve probes on {address[0]}:{address[1]}: {error.strerror}")
    scrapes = None
    if settings.metrics_port:
        address = (settings.metrics_bind_address, settings.metrics_port)
        try:
            scrapes = await metrics.serve(*address, leading=lambda: state.leading)
        except OSError as error:
            sys.exit(f"fsdp-operator: cannot serve metrics on {address[0]}:{address[1]}: {error.strerror}")
    try:
        if not settings.leader_election:
            state.leading = True
            await operate(settings, registry, state)
            return 0
        return await lead_when_elected(settings, registry, state, executor)
    finally:
        ticking.cancel()
        if probes:
            await probes.cleanup()
        if scrapes:
            await scrapes.cleanup()


async def operate(settings: Settings, registry: kopf.OperatorRegistry, state: health.Health) -> None:
    await kopf.operator(
        registry=registry,
        standalone=True,
        clusterwide=not settings.watch_namespaces,
        namespaces=settings.watch_namespaces,
        ready_flag=state.operator_started,
    )


async def lead_when_elected(
    settings: Settings, registry: kopf.OperatorRegistry, state: health.Health, executor: ThreadPoolExecutor
) -> int:
    """Stands by until elected, then runs kopf; releases the Lease once kopf and its handlers have stopped."""
    elector = leader.Elector(
        leader.LeaseStore(leader.coordination_api(), settings.lease_namespace, settings.lease_name),
        leader.new_identity(),
    )
    state.last_apiserver_contact = lambda: elector.last_contact
    # Lease calls get a thread of their own: a full handler pool must not delay an election.
    lease_calls = ThreadPoolExecutor(1, thread_name_prefix="lease")
    loop = asyncio.get_running_loop()
    terminated = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, terminated.set)  # kopf installs its own once it runs
    log.info("%s stands by for lease %s/%s", elector.identity, settings.lease_namespace, settings.lease_name)
    while not await loop.run_in_executor(lease_calls, elector.try_acquire_or_renew):
        try:
            await asyncio.wait_for(terminated.wait(), timeout=leader.RETRY_PERIOD)
            return 0  # stopped while standing by: nothing to hand over
        except TimeoutError:
            continue
    lease_calls.shutdown()
    if terminated.is_set():  # stopped during the winning call: hand the Lease straight back
        await asyncio.to_thread(elector.release)
        return 0
    leadership = leader.Leadership(
        elector, on_lost=lambda why: exit_now(f"leadership lost ({why})"), unable_to_act=state.loop_stall
    ).start()
    state.leading = True
    exit_code = 0
    try:
        await operate(settings, registry, state)
    except Exception:
        log.exception("kopf stopped with an error")
        exit_code = 1
    state.leading = False
    # Keep renewing until no handler runs, then release: the next leader never overlaps with us.
    drained = asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
    try:
        await asyncio.wait_for(drained, timeout=HANDLER_DRAIN_TIMEOUT)
    except TimeoutError:
        exit_now(f"handlers still running {HANDLER_DRAIN_TIMEOUT:.0f}s after kopf stopped")
    leadership.stop()
    await asyncio.to_thread(elector.release)
    return exit_code


def exit_now(why: str) -> None:
    """Stop acting at once, mid-handler if need be, as controller-runtime does; the pod restarts."""
    log.critical("%s: exiting", why)
    logging.shutdown()
    os._exit(1)


if __name__ == "__main__":
    main()
