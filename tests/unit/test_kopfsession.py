"""kopf's session: the credentials kopf would use, with a bounded connection pool; the operator's own clients'
pools."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kopf
import pytest
from kopf._cogs.structs.references import Resource
from kopf._core.actions import invocation
from kubernetes.config import kube_config

from fsdp_operator import builder, handlers, kopfsession
from fsdp_operator.kube import Kube
from fsdp_operator.settings import Settings


def test_the_pool_holds_every_watch_stream_and_a_few_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    found = kopf.ConnectionInfo(server="https://10.0.0.1:443", scheme="Bearer", token="abc", insecure=True)
    monkeypatch.setattr(kopf, "login_via_client", lambda **_: found)

    async def log_in() -> Any:
        credentials = await kopfsession.login(["team-a", "team-b"], 4, logger=None)
        assert isinstance(credentials, kopf.AiohttpSession)
        session = credentials.aiohttp_session
        try:
            return credentials.server, session.connector.limit, dict(session.headers)  # type: ignore[union-attr]
        finally:
            await session.close()

    server, limit, headers = asyncio.run(log_in())
    assert server == "https://10.0.0.1:443"
    # Four watches per namespace (runs, RayClusters, pods, NetworkPolicies), nodes cluster-wide, eight for
    # requests.
    assert limit == 4 * 2 + 1 + 8 == kopfsession.connection_limit(["team-a", "team-b"], 4)
    assert headers["Authorization"] == "Bearer abc"
    assert kopfsession.connection_limit([], 3) == 3 + 1 + 8


@pytest.fixture
def kubeconfig(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A kubeconfig of a server nobody listens on, as the kubernetes client's default: clients are built,
    no request is made."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    # The kubernetes client reads $KUBECONFIG once, at import.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


@pytest.mark.usefixtures("kubeconfig")
def test_the_operators_pool_has_a_connection_for_every_watch_it_registers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A watch added to the handlers but not to the pool's count takes the request slots: every patch and
    Event then waits behind the watches until it times out (a 200-run load stalled this way)."""
    found = kopf.ConnectionInfo(server="https://127.0.0.1:1", scheme="Bearer", token="t", insecure=True)
    monkeypatch.setattr(kopf, "login_via_client", lambda **_: found)
    namespaces = ["team-a", "team-b", "team-c"]
    registry = kopf.OperatorRegistry()
    handlers.register(registry, Settings(watch_namespaces=namespaces), ThreadPoolExecutor(1))

    # kopf's registries of handlers by kind (indexes, events, timers, changes): which resources it watches.
    kinds = (registry._indexing, registry._watching, registry._spawning, registry._changing)
    watched = {(h.selector.group, h.selector.any_name) for kind in kinds for h in kind.get_all_handlers()}
    namespaced = watched - {("", "nodes")}
    [login] = [h for h in registry._activities.get_all_handlers() if h.activity == "authentication"]

    async def limit() -> int:
        credentials = await login.fn(logger=None)
        try:
            return int(credentials.aiohttp_session.connector.limit)
        finally:
            await credentials.aiohttp_session.close()

    assert len(namespaced) == 4, namespaced  # runs, RayClusters, pods, NetworkPolicies
    assert asyncio.run(limit()) == len(namespaced) * len(namespaces) + 1 + kopfsession.REQUEST_CONNECTIONS


@pytest.mark.usefixtures("kubeconfig")
def test_the_operators_clients_keep_a_connection_for_every_handler_thread() -> None:
    """With fewer pooled connections than threads, each request past the pool opens a connection (and a TLS
    handshake) and throws it away: thousands a minute at 1,000 runs. The Kubernetes client's pool is five per
    CPU of the node, botocore's 10, whatever the threads."""
    settings = Settings(worker_threads=48)
    kube = Kube(connections=settings.worker_threads)
    assert kube.api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] == 48
    assert handlers.aws_config(settings).max_pool_connections == 48


HELD_SECONDS = 6.0


@pytest.mark.usefixtures("kubeconfig")
def test_indexes_and_events_that_need_no_pass_take_no_handler_thread() -> None:
    """kopf updates its copy of a run (what the next pass starts from) once the run's event has been through
    the indexes. As sync functions they queued for a handler thread behind every pass under way: at 1,000 runs
    that copy fell minutes behind and most status writes were refused (409) and read again. With the pool's
    only thread held by a pass, every index, a pod's and a node's event, and a RayCluster's first sight still
    complete, through kopf's own invocation."""
    pool = ThreadPoolExecutor(1)
    held = threading.Event()
    pool.submit(held.wait)  # a pass waiting on S3, for HELD_SECONDS
    release = threading.Timer(HELD_SECONDS, held.set)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, Settings(watch_namespaces=["team-a"]), pool)
    settings = kopf.OperatorSettings()
    settings.execution.executor = pool
    meta = {"namespace": "team-a", "uid": "u-1", "labels": {builder.LABEL_MANAGED_BY: builder.MANAGER}}
    bodies = {
        "fsdptrainingruns": {"metadata": {**meta, "name": "r"}, "spec": {}, "status": {"phase": "Running"}},
        "rayclusters": {"metadata": {**meta, "name": "c", "generation": 1}, "spec": {}, "status": {}},
        "pods": {
            "metadata": {**meta, "name": "p", "labels": {**meta["labels"], builder.LABEL_RAY_CLUSTER: "c"}},
            "spec": {"nodeName": "n", "containers": [{"name": "ray-worker"}]},
            "status": {"phase": "Running"},
        },
        "nodes": {"metadata": {"name": "n", "uid": "n-1", "labels": {}}, "spec": {}, "status": {}},
    }
    event_handlers = [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]

    async def through_kopf() -> dict[str, float]:
        took = {}
        for handler in event_handlers:
            if handler.selector.any_name == "networkpolicies":
                continue  # restores a policy through the API: a pass's kind of work, in a thread
            body = kopf.Body(bodies[handler.selector.any_name])
            kwargs = {"body": body, "type": "MODIFIED", "event": {"type": "MODIFIED", "object": body}}
            started = time.monotonic()
            await invocation.invoke(handler.fn, settings=settings, kwargs=kwargs)
            took[str(handler.id)] = time.monotonic() - started
        return took

    release.start()
    try:
        took = asyncio.run(through_kopf())
    finally:
        release.cancel()
        held.set()
        pool.shutdown()
    assert len(took) == 10, took  # seven indexes; the events of pods, nodes and RayClusters
    waited = {handler: round(seconds, 1) for handler, seconds in took.items() if seconds > HELD_SECONDS / 2}
    assert not waited, f"waited for the pass's thread (seconds): {waited}"


@pytest.mark.usefixtures("kubeconfig")
def test_only_the_operators_rayclusters_are_streamed_to_it() -> None:
    """Beside 1,000 RayJobs the operator received every event of their 1,000 RayClusters too (a kopf worker
    and its memory each) only for its handlers to drop them; the apiserver selects its own now. Pods stay
    whole: preflight counts other workloads' accelerator pods."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, Settings(watch_namespaces=["team-a"]), ThreadPoolExecutor(1))
    settings = kopf.OperatorSettings()
    for startup in registry._activities.get_all_handlers():
        if startup.activity == "startup" and startup.id == "register.<locals>.configure":
            startup.fn(settings=settings)

    def selected(group: str, version: str, plural: str) -> list[str]:
        resource = Resource(group, version, plural, namespaced=True)
        return sorted(settings.watching.label_selectors.collect(resource))

    assert selected("ray.io", "v1", "rayclusters") == [f"{builder.LABEL_MANAGED_BY}={builder.MANAGER}"]
    assert selected("", "v1", "pods") == []
    assert selected("fsdp.training.dev", "v1alpha1", "fsdptrainingruns") == []
