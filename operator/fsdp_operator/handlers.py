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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from fsdp_operator import api, builder, conditions, preflight, submission
from fsdp_operator.jobs import Jobs, dashboard_url
from fsdp_operator.reconcile import (
    ClusterObservation,
    Decision,
    Event,
    Observation,
    job_to_observe,
    needs_preflight,
    observe_cluster,
    reconcile,
)
from fsdp_operator.records import RunStorage
from fsdp_operator.settings import Settings
from fsdp_trainer.contract import CheckpointRef, RunRecord, run_prefix

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

    def pod_image_ids(self, namespace: str, cluster_name: str) -> tuple[str, ...]:
        """imageID of every running Ray container of the cluster: the digest that actually ran."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"ray.io/cluster={cluster_name}").items
        return tuple(
            status.image_id
            for pod in pods
            for status in ((pod.status and pod.status.container_statuses) or [])
            if status.image_id and status.name in ("ray-head", "ray-worker")
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


@dataclass
class Context:
    """Clients shared by every pass of the operator."""

    settings: Settings
    kube: Kube
    s3: Any
    ec2: Any
    package_sha256: str = field(default_factory=submission.package_sha256)
    locks: dict[str, threading.Lock] = field(default_factory=lambda: defaultdict(threading.Lock))
    job_clients: dict[str, Jobs] = field(default_factory=dict)
    written_records: dict[str, RunRecord] = field(default_factory=dict)  # run uid -> run.json as last written

    def jobs(self, namespace: str, cluster_name: str) -> Jobs:
        configuration = self.kube.core.api_client.configuration
        address = dashboard_url(self.settings, namespace, cluster_name, configuration.host)
        if address not in self.job_clients:
            token = (configuration.api_key or {}).get("authorization")
            self.job_clients[address] = Jobs(address, headers={"Authorization": token} if token else None)
        return self.job_clients[address]

    def storage(self, spec: api.FSDPTrainingRunSpec, run: builder.RunRef) -> RunStorage | None:
        if not spec.checkpoint.storage_path.startswith("s3://"):
            return None  # a local path lives on the single worker; the operator cannot read it
        return RunStorage(self.s3, run_prefix(spec.checkpoint.storage_path, run.namespace, run.name))


def _run_preflight(ctx: Context, spec: api.FSDPTrainingRunSpec) -> preflight.PreflightResult:
    if spec.preflight.scale_from_zero:
        facts = preflight.ec2_instance_type_facts(ctx.ec2, spec.cluster.instance_type)
        return preflight.check_instance_type(spec, facts)
    nodes, pods = ctx.kube.nodes_and_pods()
    return preflight.check_nodes(spec, preflight.free_worker_nodes(spec, nodes, pods))


def reconcile_run(ctx: Context, body: Mapping[str, Any]) -> Decision | None:
    """One pass per run at a time, on the run as stored now (not the event's snapshot); the status is
    written inside the same lock, so the next pass always starts from this one's result."""
    meta = body["metadata"]
    with ctx.locks[meta["uid"]]:
        fresh = ctx.kube.get_run(meta["namespace"], meta["name"])
        if (
            fresh is None
            or fresh["metadata"]["uid"] != meta["uid"]
            or fresh["metadata"].get("deletionTimestamp")
        ):
            return None  # deleted (or re-created under the same name: that object gets its own passes)
        return _reconcile_locked(ctx, fresh)


def _parse(
    body: kopf.Body, fresh: dict[str, Any]
) -> tuple[api.FSDPTrainingRunSpec, api.FSDPTrainingRunStatus]:
    try:
        return (
            api.FSDPTrainingRunSpec.model_validate(fresh["spec"]),
            api.FSDPTrainingRunStatus.model_validate(fresh.get("status") or {}),
        )
    except ValidationError as error:
        # The CRD schema should make this unreachable; if not, say which field and stop.
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(error)[:1000])
        raise kopf.PermanentError(f"invalid FSDPTrainingRun: {error}") from error


def _observe(
    ctx: Context,
    run: builder.RunRef,
    spec: api.FSDPTrainingRunSpec,
    status: api.FSDPTrainingRunStatus,
    generation: int,
) -> Observation:
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    cluster_name = builder.ray_cluster_name(run.name)
    cluster = _cluster_observation(ctx.kube.get_raycluster(run.namespace, cluster_name), run.uid)
    preflight_result = (
        _run_preflight(ctx, spec) if needs_preflight(spec, status, cluster is not None, now) else None
    )
    active = status.phase in api.ACTIVE_PHASES  # finished, pending or suspended runs have nothing new to read
    job, dashboard_error = None, None
    watched = job_to_observe(status)
    if watched:
        try:
            job = ctx.jobs(run.namespace, cluster_name).observe(watched)
        except Exception as error:  # the head may be down or restarting; the state machine decides
            dashboard_error = f"{type(error).__name__}: {error}"
    progress, checkpoints, storage_error = None, tuple[CheckpointRef, ...](), None
    storage = ctx.storage(spec, run) if active else None
    if storage is not None:
        try:
            progress, checkpoints = storage.progress(), tuple(storage.complete_checkpoints())
        except Exception as error:  # storage trouble must not stop the state machine: a condition says so
            storage_error = f"{storage.uri}: {type(error).__name__}: {error}"[:500]
    return Observation(
        now=now,
        generation=generation,
        cluster=cluster,
        preflight=preflight_result,
        job=job,
        dashboard_error=dashboard_error,
        progress=progress,
        checkpoints=checkpoints,
        storage_read=storage is not None,
        storage_error=storage_error,
        pod_image_ids=ctx.kube.pod_image_ids(run.namespace, cluster_name) if cluster and active else (),
    )


def _reconcile_locked(ctx: Context, fresh: dict[str, Any]) -> Decision:
    body = kopf.Body(cast(Any, fresh))  # what Events point at
    meta = fresh["metadata"]
    run = builder.RunRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    spec, status = _parse(body, fresh)
    obs = _observe(ctx, run, spec, status, generation=meta["generation"])
    decision = reconcile(spec, status, obs)
    new = decision.status

    cluster_name = builder.ray_cluster_name(run.name)
    requested = spec.image or ctx.settings.default_image
    if decision.stop_job:
        try:
            ctx.jobs(run.namespace, cluster_name).stop(decision.stop_job)
        except Exception as error:  # a lost or restarting head has no job left to stop
            log.warning("%s/%s: could not stop job %s: %s", run.namespace, run.name, decision.stop_job, error)
    if decision.delete_cluster:
        ctx.kube.delete_raycluster(run.namespace, cluster_name)
    if decision.create_cluster:
        # After the first pull every attempt runs the pinned digest, even if the tag has moved since.
        image = new.image.digest or requested
        ctx.kube.create_raycluster(builder.build_raycluster(spec, run, image, new.zone))
    if decision.submit_attempt is not None:
        _submit(ctx, run, spec, decision, obs)
    new = decision.status  # the submission may have fallen back to the status before it
    if obs.cluster is not None or decision.create_cluster:
        new.ray_cluster_name = cluster_name
        new.image.requested = requested

    old_status = dict(fresh.get("status") or {})
    if _status_patch(old_status, new):
        _write_run_record(ctx, run, spec, new)  # sets status.record.uri, so the patch is computed after it
        ctx.kube.patch_run_status(run.namespace, run.name, _status_patch(old_status, new))
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        log.info("%s/%s %s: %s", run.namespace, run.name, event.reason, event.message)
    return decision


def _submit(
    ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, decision: Decision, obs: Observation
) -> None:
    """Submits the decided attempt; when Ray cannot take it, the run stays where it was, saying why."""
    assert decision.submit_attempt is not None
    submission_id = submission.submission_id(run, decision.submit_attempt)
    config = submission.trainer_config(spec, run, cpu_only=ctx.settings.trainer_device == "cpu")
    try:
        ctx.jobs(run.namespace, builder.ray_cluster_name(run.name)).submit(
            submission_id,
            submission.entrypoint(config, submission_id),
            submission.runtime_env(spec),
            metadata={"run": run.name, "namespace": run.namespace, "attempt": str(decision.submit_attempt)},
        )
    except Exception as error:  # e.g. the dashboard is not reachable yet; the next pass tries again
        assert decision.status_if_submit_fails is not None
        new = decision.status = decision.status_if_submit_fails
        decision.events = decision.events_if_submit_fails
        reason, message = "SubmissionFailed", f"{type(error).__name__}: {error}"[:500]
        previous = conditions.condition(new.conditions, conditions.JOB_RUNNING)
        if previous is None or previous.reason != reason:
            decision.events.append(Event("Warning", reason, message))
        new.conditions = conditions.set_condition(
            new.conditions, conditions.JOB_RUNNING, False, reason, message, obs.now, obs.generation
        )
    else:
        decision.status.job_submission_id = submission_id
        decision.status.record.package_sha256 = ctx.package_sha256


def _write_run_record(
    ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, status: api.FSDPTrainingRunStatus
) -> None:
    """run.json next to the checkpoints: the evidence outlives the custom resource."""
    storage = ctx.storage(spec, run)
    if storage is None or status.phase in (None, api.Phase.PENDING):
        return
    record = RunRecord(
        run_name=run.name,
        namespace=run.namespace,
        uid=run.uid,
        image_requested=status.image.requested or spec.image or ctx.settings.default_image,
        image_digest=status.image.digest,
        trainer_package_sha256=status.record.package_sha256,
        versions=status.record.versions,
        config=submission.trainer_config(spec, run, cpu_only=ctx.settings.trainer_device == "cpu"),
        phase=str(status.phase),
        start_time=status.start_time,
        completion_time=status.completion_time,
        checkpoints=list(reversed(status.checkpoints.recent)),
        restarts=status.restarts.history,
        transport=status.transport,
    )
    if status.record.uri and ctx.written_records.get(run.uid) == record:
        return  # progress alone changed: run.json holds no progress, so it stays as written
    try:
        status.record.uri = storage.write_run_record(record)
        ctx.written_records[run.uid] = record
    except Exception as error:  # the bucket may not exist yet; the next pass tries again
        # Once StorageReadable=False says so (with an Event), repeating it every pass is noise.
        readable = conditions.condition(status.conditions, conditions.STORAGE_READABLE)
        level = logging.DEBUG if readable is not None and readable.status == "False" else logging.WARNING
        log.log(level, "%s/%s: cannot write run.json to %s: %s", run.namespace, run.name, storage.uri, error)


def on_delete(ctx: Context, body: kopf.Body) -> None:
    """Stops the job and deletes the cluster; checkpoints and run.json stay in S3. Under the run's lock and on
    the status as stored now: a pass in flight finishes first (a job it just submitted is stopped too), and
    every later pass sees the deletion and does nothing, so none can recreate the cluster."""
    meta = body["metadata"]
    with ctx.locks[meta["uid"]]:
        status = (ctx.kube.get_run(meta["namespace"], meta["name"]) or body).get("status") or {}
        ctx.written_records.pop(meta["uid"], None)
        cluster_name = builder.ray_cluster_name(meta["name"])
        if status.get("phase") == api.Phase.RUNNING and status.get("jobSubmissionId"):
            try:
                ctx.jobs(meta["namespace"], cluster_name).stop(status["jobSubmissionId"])
            except Exception as error:  # a dead head has no job to stop; the cluster goes either way
                log.warning("%s/%s: could not stop job: %s", meta["namespace"], meta["name"], error)
        ctx.kube.delete_raycluster(meta["namespace"], cluster_name)


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Registers the handlers on `registry`; `settings` fixes the observation interval."""
    import boto3

    region, endpoint = settings.aws_region, settings.aws_endpoint_url
    ctx = Context(
        settings=settings,
        kube=Kube(),
        s3=boto3.client("s3", region_name=region, endpoint_url=endpoint),
        ec2=boto3.client("ec2", region_name=region, endpoint_url=endpoint),
    )
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
        reconcile_run(ctx, body)

    def unfinished(status: kopf.Status, **_: Any) -> bool:
        return status.get("phase") not in api.FINISHED_PHASES  # a finished run never changes again

    @kopf.timer(*resource, interval=settings.observe_interval_seconds, when=unfinished, registry=registry)
    def on_timer(body: kopf.Body, **_: Any) -> None:
        reconcile_run(ctx, body)

    @kopf.on.event(
        RAY_GROUP,
        RAY_VERSION,
        RAY_PLURAL,
        labels={builder.LABEL_MANAGED_BY: builder.MANAGER},
        registry=registry,
    )
    def on_raycluster_event(body: kopf.Body, **_: Any) -> None:
        # React to KubeRay at once (e.g. the cluster turning ready) instead of at the next timer tick.
        run_name = body["metadata"].get("labels", {}).get(builder.LABEL_RUN)
        owner = run_name and ctx.kube.get_run(body["metadata"]["namespace"], run_name)
        if owner:
            reconcile_run(ctx, owner)

    @kopf.on.delete(*resource, registry=registry)
    def deleted(body: kopf.Body, **_: Any) -> None:
        on_delete(ctx, body)
