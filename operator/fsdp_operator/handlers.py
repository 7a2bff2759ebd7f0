"""Kopf glue: gather observations, call the pure `reconcile`, carry out its actions, patch /status.

Every handler funnels into `reconcile_run`, which is idempotent: children have deterministic names and
are created only when absent, so a replayed event, a timer racing an update handler, or an operator
restarted halfway never creates a second RayCluster.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections import defaultdict
from typing import Any, cast

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from fsdp_operator import api, builder, preflight
from fsdp_operator.reconcile import (
    ClusterObservation,
    Decision,
    Observation,
    needs_preflight,
    observe_cluster,
    reconcile,
)
from fsdp_operator.settings import Settings

log = logging.getLogger("fsdp_operator")
RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"


class Kube:
    """The few Kubernetes calls the operator makes, on one API client."""

    def __init__(self) -> None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.custom = client.CustomObjectsApi()
        self.core = client.CoreV1Api()

    def get_raycluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = self.custom.get_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name
            )
            return cast(dict[str, Any], found)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def create_raycluster(self, manifest: dict[str, Any]) -> None:
        namespace = manifest["metadata"]["namespace"]
        try:
            self.custom.create_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, manifest
            )
        except ApiException as error:
            if error.status != 409:  # created by a concurrent reconcile: same name, same run
                raise

    def delete_raycluster(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name, propagation_policy="Foreground"
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def get_run(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = self.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name
            )
            return cast(dict[str, Any], found)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def patch_run_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"status": status}
        )

    def nodes_and_pods(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        api_client = self.core.api_client
        nodes = api_client.sanitize_for_serialization(self.core.list_node().items)
        pods = api_client.sanitize_for_serialization(
            self.core.list_pod_for_all_namespaces(
                field_selector="status.phase!=Succeeded,status.phase!=Failed"
            ).items
        )
        return nodes, pods


def _run_preflight(
    kube: Kube, settings: Settings, spec: api.FSDPTrainingRunSpec
) -> preflight.PreflightResult:
    if spec.preflight.scale_from_zero:
        import boto3

        ec2 = boto3.client("ec2", region_name=settings.aws_region, endpoint_url=settings.aws_endpoint_url)
        return preflight.check_instance_type(
            spec, preflight.ec2_instance_type_facts(ec2, spec.cluster.instance_type)
        )
    nodes, pods = kube.nodes_and_pods()
    return preflight.check_nodes(spec, preflight.free_worker_nodes(spec, nodes, pods))


def _cluster_observation(raycluster: dict[str, Any] | None, uid: str) -> ClusterObservation | None:
    if raycluster is None:
        return None
    owners = raycluster["metadata"].get("ownerReferences", [])
    if not any(o.get("uid") == uid for o in owners):
        raise kopf.PermanentError(
            f"RayCluster {raycluster['metadata']['name']} exists and is not owned by this run; "
            "rename the run or delete that RayCluster"
        )
    return observe_cluster(raycluster)


def _status_patch(old: dict[str, Any], new: api.FSDPTrainingRunStatus) -> dict[str, Any]:
    """A merge patch from the current status to the new one; keys that became empty are removed (null)."""
    rendered = new.model_dump(mode="json", by_alias=True, exclude_none=True)
    patch: dict[str, Any] = {k: v for k, v in rendered.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in rendered})
    return patch


_locks: dict[str, threading.Lock] = defaultdict(threading.Lock)


def reconcile_run(kube: Kube, settings: Settings, body: kopf.Body) -> Decision | None:
    """One pass per run at a time, on the run as stored now (not the event's snapshot); the status is
    written inside the same lock, so the next pass always starts from this one's result."""
    meta = body["metadata"]
    with _locks[meta["uid"]]:
        fresh = kube.get_run(meta["namespace"], meta["name"])
        if fresh is None or fresh["metadata"]["uid"] != meta["uid"]:
            return None  # deleted (or re-created under the same name: that object gets its own passes)
        return _reconcile_locked(kube, settings, body, fresh)


def _reconcile_locked(kube: Kube, settings: Settings, body: kopf.Body, fresh: dict[str, Any]) -> Decision:
    meta = fresh["metadata"]
    run = builder.RunRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    old_status = dict(fresh.get("status") or {})
    try:
        spec = api.FSDPTrainingRunSpec.model_validate(fresh["spec"])
        status = api.FSDPTrainingRunStatus.model_validate(old_status)
    except ValidationError as error:
        # The CRD schema should make this unreachable; if not, say which field and stop.
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(error)[:1000])
        raise kopf.PermanentError(f"invalid FSDPTrainingRun: {error}") from error

    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    cluster_name = builder.ray_cluster_name(run.name)
    cluster = _cluster_observation(kube.get_raycluster(run.namespace, cluster_name), run.uid)
    result = (
        _run_preflight(kube, settings, spec) if needs_preflight(status, cluster is not None, now) else None
    )
    decision = reconcile(
        spec, status, Observation(now=now, generation=meta["generation"], cluster=cluster, preflight=result)
    )

    image = spec.image or settings.default_image
    if decision.create_cluster:
        kube.create_raycluster(builder.build_raycluster(spec, run, image, decision.status.zone))
    if cluster is not None or decision.create_cluster:
        decision.status.ray_cluster_name = cluster_name
        decision.status.image.requested = image
    if decision.delete_cluster:
        kube.delete_raycluster(run.namespace, cluster_name)
    status_patch = _status_patch(old_status, decision.status)
    if status_patch:
        kube.patch_run_status(run.namespace, run.name, status_patch)
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        log.info("%s/%s %s: %s", run.namespace, run.name, event.reason, event.message)
    return decision


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Registers the handlers on `registry`; `settings` fixes the observation interval."""
    kube = Kube()
    resource = (api.GROUP, api.VERSION, api.PLURAL)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # Same credentials as the kubernetes client: in-cluster service account, else KUBECONFIG.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations, out of the status schema we own.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=api.GROUP, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{api.GROUP}/finalizer"
        settings.posting.level = logging.WARNING

    @kopf.on.create(*resource, registry=registry)
    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    def on_change(body: kopf.Body, **_: Any) -> None:
        reconcile_run(kube, settings, body)

    @kopf.timer(*resource, interval=settings.observe_interval_seconds, registry=registry)
    def on_timer(body: kopf.Body, **_: Any) -> None:
        reconcile_run(kube, settings, body)
