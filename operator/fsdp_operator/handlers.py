"""Kopf's wiring: the indexes of watched objects, and which events start a pass (runpass.py) or an action.

Handlers are thin: they pick what kopf hands them and call the pass, the actions or the memory of what was
watched; the decisions live in reconcile/, admission.py and preflight.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import functools
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any

import kopf

from fsdp_operator import actions, api, builder, kopfsession, metrics, preflight
from fsdp_operator.admission import Admission
from fsdp_operator.context import Context
from fsdp_operator.disruption import node_going_away, pod_disruption
from fsdp_operator.kube import RAY_GROUP, RAY_PLURAL, RAY_VERSION, Indexes, Kube
from fsdp_operator.runpass import reconcile_run
from fsdp_operator.settings import Settings
from fsdp_operator.watched import cluster_reaction, kept, pod_summary

# kopf's waits between retries of a failed API request, watches included: about a minute in all, as kopf's
# default (1, 1, 2, 3, 5, 8, 13, 21), but never more than 5 s apart, so that once an apiserver outage ends the
# watches resume within 5 s, not up to 21 (measured: 20 s to act after a 30 s apiserver kill).
API_RETRY_BACKOFFS = (1, 1, 2, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5)
AWS_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 15, "retries": {"max_attempts": 2}}


def aws_config(settings: Settings) -> Any:
    """The AWS clients' config: bounded calls, and a connection for each handler thread (botocore keeps 10,
    so that further threads would open and throw away one per call)."""
    from botocore.config import Config

    return Config(**AWS_TIMEOUTS, max_pool_connections=settings.worker_threads)  # type: ignore[arg-type]


async def in_pool(executor: Executor, work: Callable[[], Any]) -> Any:
    """Runs `work` (a pass: blocking calls) in the handler pool, as kopf runs a sync handler: in this task's
    context (kopf.event posts through it), and when the task is cancelled (the operator stopping), only once
    the pass has ended, so that no pass is left running unowned."""
    future = asyncio.get_running_loop().run_in_executor(executor, contextvars.copy_context().run, work)
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as error:
            cancelled = error
    if cancelled is not None:
        raise cancelled
    return future.result()


def register(registry: kopf.OperatorRegistry, settings: Settings, executor: Executor) -> None:
    """Registers the handlers on `registry`; `settings` fixes the observation interval. Passes run in
    `executor`; everything else on kopf's event loop (see `Handler threads` below)."""
    import boto3

    region, endpoint = settings.aws_region, settings.aws_endpoint_url
    bounded = aws_config(settings)
    ctx = Context(
        settings=settings,
        kube=Kube(connections=settings.worker_threads),
        s3=boto3.client("s3", region_name=region, endpoint_url=endpoint, config=bounded),
        # Built on first use: only scale-from-zero runs ask EC2, and its service model costs ~16 MB.
        ec2=functools.cache(
            lambda: boto3.client("ec2", region_name=region, endpoint_url=endpoint, config=bounded)
        ),
        autoscaling=functools.cache(
            lambda: boto3.client("autoscaling", region_name=region, endpoint_url=endpoint, config=bounded)
        ),
    )
    resource = (api.GROUP, api.VERSION, api.PLURAL)
    ray_clusters = (RAY_GROUP, RAY_VERSION, RAY_PLURAL)
    pods, all_nodes = ("", "v1", "pods"), ("", "v1", "nodes")
    network_policies = ("networking.k8s.io", "v1", "networkpolicies")
    ours = {builder.LABEL_MANAGED_BY: builder.MANAGER}
    # kopf holds a watch stream open per resource below in each watched namespace (nodes: one, cluster-wide).
    watched_in_each_namespace = [resource, ray_clusters, pods] + (
        [network_policies] if settings.network_policy else []
    )

    # Handler threads: only what blocks (a pass, an action: network calls) takes one of the pool's threads.
    # The indexes, the timer's "is this run due" and the events that need no pass are async: on the event
    # loop, at once. As sync functions each of them queued for a thread behind every pass under way (two per
    # run event, three per pod event, a tick per run every interval), so that kopf's copy of a run, updated
    # only once its event has been through the indexes, fell minutes behind at 1,000 runs and most status
    # writes were refused (409) on a stale resourceVersion and read again.

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.AiohttpSession | None:
        # Same credentials as the kubernetes client, in a session with a bounded connection pool.
        return await kopfsession.login(settings.watch_namespaces, len(watched_in_each_namespace), **kwargs)

    # (namespace, RayCluster name) -> what of it a pass reacts to, as last seen in its events
    cluster_seen: dict[tuple[str, str], tuple[Any, ...]] = {}
    watch_seconds = settings.watch_timeout_seconds
    watch_deadline = watch_seconds + max(5, watch_seconds // 10)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations, out of the status schema we own.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=api.GROUP, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{api.GROUP}/finalizer"
        # Only the operator's RayClusters, selected by the apiserver: each handler of them filters on this
        # label anyway, and otherwise every RayCluster of the cluster (KubeRay's RayJobs', other teams') is
        # streamed, held by a kopf worker of its own and dropped.
        selector = ",".join(f"{key}={value}" for key, value in ours.items())
        settings.watching.label_selectors[RAY_GROUP, RAY_PLURAL] = selector
        settings.posting.level = logging.WARNING
        # Bounded API calls, and watches renewed every watch_timeout_seconds: the apiserver ends each one
        # then, and a connection that went silent without closing (no FIN, no RST) is dropped by the client a
        # little later, instead of freezing the cache until TCP gives up. A renewal resumes from the last
        # resourceVersion; when etcd has compacted it away (410 Gone), kopf lists again.
        settings.networking.connect_timeout = 10
        settings.networking.request_timeout = 60
        settings.networking.error_backoffs = API_RETRY_BACKOFFS
        settings.watching.connect_timeout = 10
        settings.watching.server_timeout = watch_seconds
        settings.watching.client_timeout = settings.watching.inactivity_timeout = watch_deadline
        # A run's timer is stopped by the status write that finished the run, while that same timer handler
        # is still returning: wait a second for it instead of kopf's 60 s poll, which touches the finished
        # run once more (a patch per finished run, and its timer kept a minute).
        settings.background.instant_exit_timeout = 1.0

    @kopf.on.startup(registry=registry)
    def read_ray_auth_key(**_: Any) -> None:
        if settings.ray_token_auth:
            ctx.ray_auth_key = ctx.kube.ray_auth_key(settings.lease_namespace, settings.ray_auth_key_secret)

    @kopf.on.startup(registry=registry)
    def export_runs(**kwargs: Any) -> None:
        metrics.RUNS.index = kwargs["runs"]  # kopf's live index of the runs: each scrape of /metrics reads it

    def unfinished(status: Mapping[str, Any], **_: Any) -> bool:
        return status.get("phase") not in api.FINISHED_PHASES  # a finished run never changes again

    @kopf.index(*resource, id="runs", registry=registry)
    async def runs(body: kopf.Body, **_: Any) -> Any:
        return {(body["metadata"]["namespace"], body["metadata"]["name"]): kept(body)}

    @kopf.index(*resource, id="active_runs", registry=registry)
    async def active_runs(body: kopf.Body, **_: Any) -> Any:
        return Admission.active_run(body)

    @kopf.index(*resource, id="unfinished_runs", registry=registry)
    async def unfinished_runs(body: kopf.Body, **_: Any) -> Any:
        return {None: body["metadata"]["uid"]} if unfinished(body.get("status") or {}) else None

    @kopf.index(*ray_clusters, labels=ours, id="rayclusters", registry=registry)
    async def rayclusters(body: kopf.Body, **_: Any) -> Any:
        return {(body["metadata"]["namespace"], body["metadata"]["name"]): kept(body)}

    @kopf.index(*pods, labels=ours, id="ray_pods", registry=registry)
    async def ray_pods(body: kopf.Body, **_: Any) -> Any:
        cluster = (body["metadata"].get("labels") or {}).get(builder.LABEL_RAY_CLUSTER)
        return {(body["metadata"]["namespace"], cluster): pod_summary(body)} if cluster else None

    @kopf.on.event(*pods, labels=ours, registry=registry)
    async def on_ray_pod_event(body: kopf.Body, **_: Any) -> None:
        # Remembered here, not read from the index: a disrupted pod is deleted soon after, often before the
        # job it served is seen failing.
        cluster = (body["metadata"].get("labels") or {}).get(builder.LABEL_RAY_CLUSTER)
        disruption = pod_disruption(body)
        if cluster and disruption:
            now = dt.datetime.now(dt.UTC).replace(microsecond=0)
            ctx.disruptions.pod_seen((body["metadata"]["namespace"], cluster), disruption, now)

    @kopf.on.event(*all_nodes, registry=registry)
    async def on_node_event(body: kopf.Body, type: str, **kwargs: Any) -> None:
        # Before its pods are evicted, a node going away is marked (a taint, a cordon, its deletion): the
        # job may fail before the pods' DisruptionTarget is seen, or without one (a spot node reclaimed).
        name = body["metadata"]["name"]
        deleted = f"node {name} (the Node was deleted)" if type == "DELETED" else None
        going_away = node_going_away(body) or deleted
        # Read only for a node going away: every node's status update is an event.
        pods = indexes_of(kwargs).ray_pods if going_away else None
        on_it = [k for k, store in (pods or {}).items() if any(p.get("node") == name for p in store)]
        ctx.disruptions.node_seen(name, going_away, on_it, dt.datetime.now(dt.UTC).replace(microsecond=0))
        if deleted:
            ctx.disruptions.node_gone(name)

    @kopf.index(*all_nodes, id="nodes", registry=registry)
    async def nodes(body: kopf.Body, **_: Any) -> Any:
        return {None: preflight.node_facts(body)}

    @kopf.index(*pods, id="accelerator_pods", registry=registry)
    async def accelerator_pods(body: kopf.Body, **_: Any) -> Any:
        return {None: preflight.placement_of(body)} if preflight.counted_by_preflight(body) else None

    def indexes_of(kwargs: Mapping[str, Any]) -> Indexes:
        # kopf hands each index to handlers as a keyword argument named by the index's id.
        return Indexes(
            nodes=kwargs.get("nodes"),
            accelerator_pods=kwargs.get("accelerator_pods"),
            runs=kwargs.get("runs"),
            active_runs=kwargs.get("active_runs"),
            unfinished_runs=kwargs.get("unfinished_runs"),
            rayclusters=kwargs.get("rayclusters"),
            ray_pods=kwargs.get("ray_pods"),
        )

    @kopf.on.create(*resource, registry=registry)
    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    def on_change(body: kopf.Body, **kwargs: Any) -> None:
        reconcile_run(ctx, body, indexes_of(kwargs))

    # First tick one interval in: on.create / on.resume make the first pass (a tick at once would race them
    # with the pre-finalizer body and conflict).
    @kopf.timer(
        *resource,
        interval=settings.observe_interval_seconds,
        initial_delay=settings.observe_interval_seconds,
        when=unfinished,
        registry=registry,
    )
    async def on_timer(body: kopf.Body, **kwargs: Any) -> None:
        if ctx.runs.of(body["metadata"]["uid"]).cadence.due():  # a quiet run's ticks are fewer (cadence.py)
            await in_pool(executor, functools.partial(reconcile_run, ctx, body, indexes_of(kwargs)))

    @kopf.on.event(*ray_clusters, labels=ours, registry=registry)
    async def on_raycluster_event(body: kopf.Body, type: str | None = None, **kwargs: Any) -> None:
        # React to KubeRay at once (the cluster ready or failed, suspended, edited, deleted) instead of at the
        # next timer tick; not to each of its progress notes while it provisions (a status write each, with
        # nothing a user or a retry needs that the next tick would not write too).
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        seen = cluster_reaction(body)
        before = cluster_seen.get(key)
        if type == "DELETED":
            cluster_seen.pop(key, None)
        else:
            cluster_seen[key] = seen
            # The first sight of one the operator just created (or, after a restart, one on.resume passes
            # over anyway) has nothing to act on unless it is ready or going.
            if seen == before or (before is None and not (seen[1] or seen[2])):
                return
        indexes = indexes_of(kwargs)
        owners = body["metadata"].get("ownerReferences") or []
        name = next((o["name"] for o in owners if o.get("kind") == api.KIND), None)
        owner = indexes.one(indexes.runs, (body["metadata"]["namespace"], name)) if name else None
        if owner and (owner.get("status") or {}).get("phase") not in api.FINISHED_PHASES:
            await in_pool(executor, functools.partial(reconcile_run, ctx, owner, indexes))

    if settings.network_policy:
        # Every policy, not only those labelled ours: one whose labels were edited away is still the run's.
        @kopf.on.event(*network_policies, registry=registry)
        def on_network_policy_event(body: kopf.Body, type: str | None = None, **kwargs: Any) -> None:
            actions.restore_network_policy(ctx, body, type, indexes_of(kwargs))

    @kopf.on.delete(*resource, registry=registry)
    def deleted(body: kopf.Body, **_: Any) -> None:
        actions.delete_run(ctx, body)
