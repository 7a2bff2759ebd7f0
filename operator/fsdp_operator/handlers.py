"""Kopf glue: gather observations, call the pure `reconcile`, write the status, then carry out its actions.

One pass per run at a time (a lock per run in this process; leader election keeps other processes out, and
the conditional status write keeps out any that slip through). A pass:
  1. observes: the run as kopf's cache holds it, its RayCluster and pods from kopf indexes (watches, not
     per-pass GET/LIST), the job from Ray and progress/checkpoints from S3 (each call bounded by a timeout);
  2. decides with `reconcile` (pure);
  3. writes the status with a merge patch conditional on the resourceVersion it read (nothing when nothing
     changed); a conflict means someone else wrote first: re-read and run the pass again;
  4. only then acts (create or delete the RayCluster, stop or submit the job). An action that fails is kept
     as an observation for the next pass.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import functools
import json
import logging
import os
import secrets
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from fsdp_operator import api, builder, conditions, kopfsession, kueue, metrics, preflight, submission
from fsdp_operator.jobs import ENDED_JOB_STATUSES, DashboardAuth, JobObservation, Jobs, dashboard_url
from fsdp_operator.kueue import WorkloadObservation, observe_workload
from fsdp_operator.reconcile import (
    ClusterObservation,
    Decision,
    Observation,
    OomKill,
    PodProblem,
    job_to_observe,
    needs_preflight,
    needs_workload,
    observe_cluster,
    reconcile,
)
from fsdp_operator.records import RunStorage
from fsdp_operator.settings import DashboardAddressMode, Settings
from fsdp_operator.statuspatch import merge_patch
from fsdp_trainer.contract import (
    LOGS_DIR,
    RUN_RECORD_FILE,
    AttemptInfo,
    CheckpointRef,
    RunRecord,
    driver_log_name,
    run_prefix,
)

log = logging.getLogger("fsdp_operator")
RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"
# kopf's waits between retries of a failed API request, watches included: about a minute in all, as kopf's
# default (1, 1, 2, 3, 5, 8, 13, 21), but never more than 5 s apart, so that once an apiserver outage ends the
# watches resume within 5 s, not up to 21 (measured: 20 s to act after a 30 s apiserver kill).
API_RETRY_BACKOFFS = (1, 1, 2, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5)
RAY_AUTH_KEY_FIELD = "key"
RAY_TOKEN_HEADER = "X-Ray-Authorization"  # Ray's header for callers behind a proxy that owns Authorization
API_TIMEOUT = (5.0, 20.0)  # (connect, read) seconds for every apiserver call the handlers make
AWS_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 15, "retries": {"max_attempts": 2}}
# A namespaced operator cannot watch other teams' pods: all pending runs' preflights share one LIST this long.
PODS_SNAPSHOT_SECONDS = 10.0
POD_LIST_PAGE = 250
# A run this process admitted reserves its slots until the view shows it admitted (its status write came back)
# or done with them (finished, suspended); at most this long.
ADMISSION_MEMORY_SECONDS = 120.0
CONFLICT_RETRIES = 3
# Our own status writes are remembered this long (and the last this many versions each replaced), so that a
# pass that waited for the run's lock starts from what the pass before it stored.
WRITTEN_MEMORY_SECONDS = 60.0
# A RayCluster this process created is not created again (Secret, NetworkPolicy, RayCluster: three 409s) by
# passes that come before the index shows it, for at most this long.
CREATED_MEMORY_SECONDS = 30.0
WRITTEN_VERSIONS = 8
USER_AGENT = "fsdp-operator"
# Test hook: SIGKILL this process at a side-effect boundary, e.g. "after-submit" or "after-submit:2".
FAULT_POINT_ENV = "FSDP_OPERATOR_FAULT_POINT"
# Waiting reasons of a container that will not start by itself (kubelet's names).
POD_START_ERRORS = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)
# A container that has crashed this often and waits in CrashLoopBackOff is not coming up by itself (one crash
# and a restart is what a killed process looks like, and KubeRay's pods are restarted in place).
CRASH_LOOP_RESTARTS = 3


class Conflict(Exception):
    """The run changed since it was read: the pass must start again from the stored object."""


class Kube:
    """The few Kubernetes calls the handlers make, on one API client, each with a timeout."""

    def __init__(self) -> None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api_client = client.ApiClient()
        api_client.user_agent = USER_AGENT  # tells the operator's requests apart in audit logs and metrics
        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        # Secrets, NetworkPolicies and pods by path, through the same client: the generated CoreV1Api and
        # NetworkingV1Api modules alone are 23 MiB of the operator's memory, for four calls.

    @property
    def configuration(self) -> Any:
        return self.api_client.configuration

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, Any]] | None = None,
        preload: bool = True,
    ) -> Any:
        """One call by path, as the generated APIs make it (bearer token, timeout); ApiException on errors.
        The decoded JSON, or the raw response with preload=False."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        serialized = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        return self.api_client._call_with_legacy_options(
            serialized, {"200": "object", "201": "object"}, None, preload, API_TIMEOUT, True
        )

    def create_raycluster(self, manifest: dict[str, Any]) -> None:
        namespace = manifest["metadata"]["namespace"]
        try:
            self.custom.create_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, manifest, _request_timeout=API_TIMEOUT
            )
        except ApiException as error:
            if error.status != 409:  # created by an earlier pass: same name, same run
                raise

    def create_if_absent(self, manifest: dict[str, Any]) -> None:
        """A Secret or NetworkPolicy of a run; an existing one of that name is taken as made by an earlier
        pass (its content is derived from the run's name, so an older one says the same)."""
        namespace = manifest["metadata"]["namespace"]
        body = cast(Any, manifest)
        try:
            if manifest["kind"] == "Secret":
                self.request("POST", f"/api/v1/namespaces/{namespace}/secrets", body)
            else:
                self.request(
                    "POST", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies", body
                )
        except ApiException as error:
            if error.status != 409:
                raise

    def ray_auth_key(self, namespace: str, name: str) -> bytes:
        """The key of every run's Ray token, from the operator's own Secret, made on first start. Two replicas
        starting at once: the second create fails (409) and reads the first one's."""
        for _ in range(2):
            try:
                secret = self.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
                return base64.b64decode((secret.get("data") or {})[RAY_AUTH_KEY_FIELD])
            except ApiException as error:
                if error.status != 404:
                    raise
            key = secrets.token_bytes(32)
            body = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": {builder.LABEL_MANAGED_BY: builder.MANAGER},
                },
                "type": "Opaque",
                "data": {RAY_AUTH_KEY_FIELD: base64.b64encode(key).decode()},
            }
            try:
                self.request("POST", f"/api/v1/namespaces/{namespace}/secrets", body)
                return key
            except ApiException as error:
                if error.status != 409:
                    raise
        raise RuntimeError(f"Secret {namespace}/{name} was created and is gone again")

    def delete_raycluster(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                RAY_GROUP,
                RAY_VERSION,
                namespace,
                RAY_PLURAL,
                name,
                propagation_policy="Foreground",
                _request_timeout=API_TIMEOUT,
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def get_run(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = self.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name, _request_timeout=API_TIMEOUT
            )
            return cast(dict[str, Any], found)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def write_status(
        self, namespace: str, name: str, resource_version: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patches /status only if the run is still at `resource_version`; returns the stored run."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": patch}
        try:
            stored = self.custom.patch_namespaced_custom_object_status(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name, body, _request_timeout=API_TIMEOUT
            )
        except ApiException as error:
            if error.status == 409:
                raise Conflict(
                    f"{namespace}/{name} changed since resourceVersion {resource_version}"
                ) from error
            raise
        return cast(dict[str, Any], stored)

    def workloads(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        """Kueue's Workloads of one RayCluster; none where Kueue (its CRD) is not installed."""
        try:
            listed = self.custom.list_namespaced_custom_object(
                kueue.GROUP,
                kueue.VERSION,
                namespace,
                kueue.PLURAL,
                label_selector=f"{kueue.LABEL_JOB_UID}={job_uid}",
                _request_timeout=API_TIMEOUT,
            )
        except ApiException as error:
            if error.status == 404:
                return []
            raise
        return cast(list[dict[str, Any]], cast(dict[str, Any], listed).get("items", []))

    def accelerator_pods(self) -> list[dict[str, Any]]:
        """Pods of every namespace that hold GPUs or EFA, reduced as the pod index reduces them. Read a page
        at a time as plain JSON: a busy cluster's whole pod list decoded at once, as client models, is tens
        of MB that the process keeps long after."""
        found: list[dict[str, Any]] = []
        page_token = None
        while True:
            query: list[tuple[str, Any]] = [
                ("fieldSelector", "status.phase!=Succeeded,status.phase!=Failed"),
                ("limit", POD_LIST_PAGE),
            ]
            if page_token:
                query.append(("continue", page_token))
            response = self.request("GET", "/api/v1/pods", query=query, preload=False)
            page = json.loads(cast(Any, response).data)  # the raw urllib3 response: _preload_content=False
            found += [preflight.placement_of(p) for p in page["items"] if preflight.holds_accelerators(p)]
            page_token = page["metadata"].get("continue")
            if not page_token:
                return found


@dataclass(frozen=True)
class Indexes:
    """kopf's in-memory indexes (its informer cache) as the handlers received them."""

    runs: Any  # (namespace, name) -> run body
    rayclusters: Any  # (namespace, cluster name) -> RayCluster body
    ray_pods: Any  # (namespace, cluster name) -> pod summaries
    nodes: Any = None  # None -> every node
    accelerator_pods: Any = None  # None -> pods bound to a node that request GPUs or EFA (watched namespaces)

    @staticmethod
    def one(index: Any, key: tuple[str, str]) -> Any | None:
        store = index.get(key) if index is not None else None
        return next(iter(store), None) if store else None

    def raycluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        return cast(dict[str, Any] | None, self.one(self.rayclusters, (namespace, name)))

    @staticmethod
    def all(index: Any) -> list[Any]:
        return [value for store in index.values() for value in store] if index is not None else []

    def pods(self, namespace: str, cluster_name: str) -> list[dict[str, Any]]:
        store = self.ray_pods.get((namespace, cluster_name)) if self.ray_pods is not None else None
        return list(store) if store else []


def kept(body: Mapping[str, Any]) -> dict[str, Any]:
    """A run or RayCluster as the operator keeps it (kopf's indexes, its last status write), without what only
    the apiserver and kopf read: managedFields, and the annotations that copy a whole manifest (kubectl's
    last-applied-configuration, kopf's last-handled-configuration). A third or more of each object."""
    meta = dict(body["metadata"])
    meta.pop("managedFields", None)
    image = (meta.pop("annotations", None) or {}).get(builder.ANNOTATION_IMAGE)
    if image is not None:
        meta["annotations"] = {builder.ANNOTATION_IMAGE: image}
    return {**body, "metadata": meta}


def cluster_reaction(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a RayCluster event a pass reacts to at once: readiness as the pass reads it, KubeRay's state
    (failed), suspension, its spec's generation (drift), its deletion."""
    seen = observe_cluster(dict(body))
    state = (body.get("status") or {}).get("state")
    return (body["metadata"].get("generation"), seen.ready, seen.deleting, seen.suspended, state)


def pod_disruption(body: Mapping[str, Any]) -> str | None:
    """Why the pod is being taken away (preempted, evicted, drained), from its DisruptionTarget condition."""
    for condition in (body.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            why = f"{condition.get('reason', 'Disrupted')}: {condition.get('message', '')}".strip(": ")
            return f"pod {body['metadata']['name']} ({why})"
    return None


def _memory_limit(body: Mapping[str, Any], container: str) -> str | None:
    for spec in (body.get("spec") or {}).get("containers") or []:
        if spec.get("name") == container:
            return cast(str | None, ((spec.get("resources") or {}).get("limits") or {}).get("memory"))
    return None


def pod_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a pass needs of a Ray pod: the digests its Ray container ran, why it cannot start (a container
    that cannot, or a head no node can take), and the Ray container's last OOM kill, if any."""
    name = body["metadata"]["name"]
    status_of = body.get("status") or {}
    image_ids, problems, oom_kills = [], [], []
    for status in status_of.get("containerStatuses") or []:
        if status.get("name") not in ("ray-head", "ray-worker"):
            continue
        if status.get("imageID"):
            image_ids.append(status["imageID"])
        waiting = (status.get("state") or {}).get("waiting") or {}
        kill = None
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            terminated = state.get("terminated") or {}
            if terminated.get("reason") == "OOMKilled":
                limit = _memory_limit(body, status["name"])
                kill = (
                    terminated.get("finishedAt") or "",
                    f"container {status['name']} of pod {name} was OOMKilled at its memory limit "
                    f"({limit or 'none set'}, exit code {terminated.get('exitCode')})",
                )
                oom_kills.append(kill)
        reason = str(waiting.get("reason") or "")
        looping = reason == "CrashLoopBackOff" and status.get("restartCount", 0) >= CRASH_LOOP_RESTARTS
        if looping and kill is not None:  # Ray itself does not fit: the reason is the memory limit
            problems.append(("OOMKilled", f"{kill[1]}, {status['restartCount']} times"))
        elif reason in POD_START_ERRORS or looping:
            message = f"pod {name}: {reason}: {waiting.get('message', '')}"
            problems.append((reason, message.strip()))
    head = (body["metadata"].get("labels") or {}).get("ray.io/node-type") == "head"
    for condition in status_of.get("conditions") or []:
        # Workers may wait for GPU nodes being added (scale-from-zero; provisioningTimeoutSeconds bounds it);
        # a head waits for nothing but a CPU node, which a cluster has or never gets.
        if head and condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            problems.append(("HeadUnschedulable", f"pod {name}: {condition.get('message', '')}".strip()))
    return {"name": name, "head": head, "imageIds": image_ids, "problems": problems, "oomKills": oom_kills}


@dataclass
class Context:
    """Clients and per-run memory shared by every pass of the operator."""

    settings: Settings
    kube: Kube
    s3: Any
    ec2: Callable[[], Any]  # the EC2 client
    package_sha256: str = field(default_factory=submission.package_sha256)
    locks: dict[str, threading.Lock] = field(default_factory=lambda: defaultdict(threading.Lock))
    job_clients: dict[tuple[str, DashboardAuth | None], Jobs] = field(default_factory=dict)
    storages: dict[str, RunStorage] = field(default_factory=dict)  # run uid -> its S3 prefix (manifest cache)
    written_records: dict[str, RunRecord] = field(default_factory=dict)  # run uid -> run.json as last written
    archived_driver_log: dict[str, str] = field(default_factory=dict)  # run uid -> last job whose log is kept
    action_errors: dict[str, str] = field(default_factory=dict)  # run uid -> why the last action failed
    admission_lock: threading.Lock = field(default_factory=threading.Lock)
    admitted: dict[str, tuple[float, preflight.Competitor]] = field(default_factory=dict)  # uid -> when, what
    pods_view: tuple[float, list[dict[str, Any]]] | None = None
    queues: dict[str, preflight.Queue] = field(default_factory=dict)  # instance type -> its last placement
    # (placement key, with the pods?) -> the nodes and pods it was built from, and the free nodes
    free_nodes_memo: dict[tuple[str, bool], tuple[list[Any], list[Any], tuple[preflight.NodeFree, ...]]] = (
        field(default_factory=dict)
    )
    placement_keys: dict[int, tuple[api.FSDPTrainingRunSpec, str]] = field(default_factory=dict)
    # run uid -> (when, the versions our own status writes replaced, the run as the last write stored it)
    written: dict[str, tuple[float, tuple[str, ...], dict[str, Any]]] = field(default_factory=dict)
    created: dict[str, tuple[float, int]] = field(default_factory=dict)  # run uid -> when, for which attempt
    # (namespace, RayCluster name) -> what of it a pass reacts to, as last seen in its events
    cluster_seen: dict[tuple[str, str], tuple[Any, ...]] = field(default_factory=dict)
    queue_placements: int = 0  # how many times the whole queue was placed
    admission_cpu_seconds: float = 0.0  # thread CPU time spent deciding admissions
    # run uid -> (generation, its spec as parsed then)
    specs: dict[str, tuple[int | None, api.FSDPTrainingRunSpec | None]] = field(default_factory=dict)
    # (namespace, cluster name) -> when and how a pod of it was last disrupted; the pod itself is soon gone.
    disruptions: dict[tuple[str, str], tuple[dt.datetime, str]] = field(default_factory=dict)
    ray_auth_key: bytes | None = None  # read at start when settings.ray_token_auth

    @property
    def platform(self) -> builder.Platform:
        return builder.pod_platform(self.settings)

    def ray_token(self, namespace: str, cluster_name: str) -> str | None:
        if self.settings.dashboard_address_mode == DashboardAddressMode.OVERRIDE:
            token = self.settings.dashboard_token
            return token.get_secret_value() if token else None
        if not self.settings.ray_token_auth:
            return None
        assert self.ray_auth_key is not None, "read at start"
        return builder.ray_auth_token(self.ray_auth_key, namespace, cluster_name)

    def disruption_since(self, namespace: str, cluster_name: str, since: dt.datetime | None) -> str | None:
        seen = self.disruptions.get((namespace, cluster_name))
        return seen[1] if seen is not None and since is not None and seen[0] >= since else None

    def dashboard_auth(self, namespace: str, cluster_name: str) -> DashboardAuth | None:
        """The run's Ray token in Ray's own header (the apiserver's proxy passes it on and strips
        Authorization). Through that proxy, the operator's own credentials too: its bearer token (refreshed
        by the client's hook), its client certificate, and the cluster's CA."""
        ray_token = self.ray_token(namespace, cluster_name)
        ray_headers = ((RAY_TOKEN_HEADER, f"Bearer {ray_token}"),) if ray_token else ()
        if self.settings.dashboard_address_mode != DashboardAddressMode.SERVICE_PROXY:
            return DashboardAuth(headers=ray_headers) if ray_headers else None
        configuration = self.kube.configuration
        token = configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        cert = (configuration.cert_file, configuration.key_file) if configuration.cert_file else None
        verify: str | bool = configuration.ssl_ca_cert or bool(configuration.verify_ssl)
        headers = ((("Authorization", token),) if token else ()) + ray_headers
        return DashboardAuth(headers=headers, verify=verify, client_cert=cert)

    def jobs(self, namespace: str, cluster_name: str) -> Jobs:
        address = dashboard_url(self.settings, namespace, cluster_name, self.kube.configuration.host)
        key = (address, self.dashboard_auth(namespace, cluster_name))
        if key not in self.job_clients:
            self.job_clients[key] = Jobs(address, key[1])
        return self.job_clients[key]

    def storage(self, spec: api.FSDPTrainingRunSpec, run: builder.RunRef) -> RunStorage:
        uri = run_prefix(spec.checkpoint.storage_path, run.namespace, run.name)
        stored = self.storages.get(run.uid)
        if stored is None or stored.uri != uri:
            stored = self.storages[run.uid] = RunStorage(self.s3, uri)
        return stored

    def nodes_and_pods(self, indexes: Indexes) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Nodes, and the pods that hold GPUs or EFA, from kopf's indexes. An operator that watches only some
        namespaces cannot see other teams' pods by watching, so it LISTs them: once for every pending run's
        preflight within PODS_SNAPSHOT_SECONDS."""
        nodes = list(indexes.all(indexes.nodes))
        if not self.settings.watch_namespaces:
            return nodes, list(indexes.all(indexes.accelerator_pods))
        now = time.monotonic()
        if self.pods_view is None or now - self.pods_view[0] > PODS_SNAPSHOT_SECONDS:
            self.pods_view = (now, self.kube.accelerator_pods())
        return nodes, self.pods_view[1]

    def spec_of(self, run: Mapping[str, Any]) -> api.FSDPTrainingRunSpec | None:
        """Another run's spec, parsed once per generation: admission reads every run's spec in every pass,
        and parsing them all each time was most of a busy minute's garbage. None for a spec that does not
        parse."""
        meta = run["metadata"]
        cached = self.specs.get(meta["uid"])
        if cached is None or cached[0] != meta.get("generation"):
            try:
                spec = api.FSDPTrainingRunSpec.model_validate(run["spec"])
            except ValidationError:
                spec = None
            cached = self.specs[meta["uid"]] = (meta.get("generation"), spec)
        return cached[1]

    def placement_key(self, spec: api.FSDPTrainingRunSpec) -> str:
        """preflight.placement_key of a spec parsed by spec_of, once per spec object."""
        found = self.placement_keys.get(id(spec))
        if found is None or found[0] is not spec:
            if len(self.placement_keys) > 4 * len(self.specs) + 64:
                self.placement_keys.clear()  # of specs long replaced
            found = self.placement_keys[id(spec)] = (spec, preflight.placement_key(spec))
        return found[1]

    def free_nodes(
        self, key: str, spec: api.FSDPTrainingRunSpec, nodes: list[Any], pods: list[Any] | None
    ) -> tuple[preflight.NodeFree, ...]:
        """preflight.free_worker_nodes for a placement (None: on empty nodes), built again only when a node or
        pod object changed: kopf's indexes hold each object until it changes, so identity tells."""
        memo_key = (key, pods is not None)
        found = self.free_nodes_memo.get(memo_key)
        pods = pods or []
        if found is not None and _same_objects(found[0], nodes) and _same_objects(found[1], pods):
            return found[2]
        free = tuple(preflight.free_worker_nodes(spec, nodes, pods))
        self.free_nodes_memo[memo_key] = (nodes, pods, free)
        return free

    def newest(self, run: Mapping[str, Any]) -> Mapping[str, Any]:
        """The run as our own last status write stored it, when `run` is a version that write replaced: a
        pass queued behind another (the per-run lock) holds the body of its event, which that pass's write
        made stale, and would only conflict and read the run again."""
        found = self.written.get(run["metadata"]["uid"])
        return found[2] if found is not None and run["metadata"].get("resourceVersion") in found[1] else run

    def wrote(self, uid: str, replaced: str, stored: dict[str, Any]) -> None:
        now = time.monotonic()
        before = self.written.get(uid)
        replaced_versions = ((before[1] if before else ()) + (replaced,))[-WRITTEN_VERSIONS:]
        self.written[uid] = (now, replaced_versions, stored)
        if len(self.written) > 16 and now - min(w[0] for w in self.written.values()) > WRITTEN_MEMORY_SECONDS:
            for key in [k for k, w in self.written.items() if now - w[0] > WRITTEN_MEMORY_SECONDS]:
                del self.written[key]

    def forget(self, uid: str) -> None:
        self.written.pop(uid, None)
        self.created.pop(uid, None)
        memories = (self.storages, self.written_records, self.archived_driver_log, self.action_errors)
        for memory in (*memories, self.admitted, self.specs):
            memory.pop(uid, None)


def _same_objects(before: list[Any], now: list[Any]) -> bool:
    return len(before) == len(now) and all(a is b for a, b in zip(before, now, strict=True))


def _competitors(
    ctx: Context,
    run: builder.RunRef,
    indexes: Indexes,
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
) -> list[preflight.Competitor]:
    """Every run of the operator that wants existing GPU nodes, this one included: admitted ones with workers
    still to place, and waiting ones (which go first when created earlier, unless they could not fit even on
    empty nodes: those must not hold up everyone behind them)."""
    placed: dict[tuple[str, str], int] = defaultdict(int)
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if labels.get("ray.io/node-type") == "worker" and pod.get("spec", {}).get("nodeName"):
            placed[(pod["metadata"]["namespace"], labels.get(builder.LABEL_RAY_CLUSTER, ""))] += 1
    found: dict[str, preflight.Competitor] = {}
    done_with_slots: set[str] = set()
    # Runs with one placement (instance type, selector, tolerations) see the same nodes: build each list once,
    # and decide once per placement and demand whether a run of it could fit on empty nodes.
    free_now: dict[str, tuple[preflight.NodeFree, ...]] = {}
    free_when_empty: dict[str, tuple[preflight.NodeFree, ...]] = {}
    fits_when_empty: dict[tuple[str, int, int, int, str | None], bool] = {}
    in_index: set[str] = set()
    for other in indexes.all(indexes.runs):
        meta = other["metadata"]
        in_index.add(meta["uid"])
        spec = ctx.spec_of(other)
        if spec is None:
            continue
        status = other.get("status") or {}
        phase = status.get("phase")
        if meta["uid"] != run.uid and (
            phase in api.FINISHED_PHASES or spec.suspend or spec.preflight.scale_from_zero
        ):
            done_with_slots.add(meta["uid"])
            continue
        name = f"{meta['namespace']}/{meta['name']}"
        created = meta.get("creationTimestamp", "")
        if phase in api.ACTIVE_PHASES and meta["uid"] != run.uid:
            cluster = builder.ray_cluster_name(meta["name"])
            found[meta["uid"]] = preflight.Competitor(
                name=name,
                created=created,
                instance_type=spec.cluster.instance_type,
                admitted=True,
                zone=status.get("zone"),
                workers_not_placed=max(spec.cluster.workers - placed[(meta["namespace"], cluster)], 0),
            )
            continue
        key = ctx.placement_key(spec)
        if key not in free_now:
            free_now[key] = ctx.free_nodes(key, spec, nodes, pods)
            free_when_empty[key] = ctx.free_nodes(key, spec, nodes, None)
        cluster_spec = spec.cluster
        demand = (key, cluster_spec.workers, cluster_spec.gpus_per_worker, cluster_spec.efa_per_worker,
                  cluster_spec.zone)  # fmt: skip
        if demand not in fits_when_empty:
            fits_when_empty[demand] = preflight.check_nodes(spec, list(free_when_empty[key])).ok
        found[meta["uid"]] = preflight.Competitor(
            name=name,
            created=created,
            instance_type=spec.cluster.instance_type,
            admitted=False,
            zone=None,
            workers_not_placed=spec.cluster.workers,
            fits_when_empty=fits_when_empty[demand],
            spec=spec,
            free=free_now[key],
        )
    # A run deleted with its finalizer stripped by hand never reaches the delete handler that forgets it.
    for uid in ctx.specs.keys() - in_index - {run.uid}:
        ctx.specs.pop(uid, None)  # the delete handler may forget it meanwhile
    now = time.monotonic()
    for uid, (when, competitor) in list(ctx.admitted.items()):
        if now - when > ADMISSION_MEMORY_SECONDS or uid in done_with_slots:
            del ctx.admitted[uid]
        elif uid != run.uid and (uid not in found or not found[uid].admitted):
            found[uid] = competitor  # admitted by this process; the index has not caught up yet
    return list(found.values())


def _run_preflight(
    ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, created: str, indexes: Indexes
) -> preflight.PreflightResult:
    if spec.preflight.scale_from_zero:
        facts = preflight.ec2_instance_type_facts(ctx.ec2(), spec.cluster.instance_type)
        return preflight.check_instance_type(spec, facts)
    start = time.thread_time()
    nodes, pods = ctx.nodes_and_pods(indexes)
    competitors = _competitors(ctx, run, indexes, nodes, pods)
    name = f"{run.namespace}/{run.name}"
    if not any(c.name == name and not c.admitted for c in competitors):  # not in the index (yet)
        free = ctx.free_nodes(preflight.placement_key(spec), spec, nodes, pods)
        own = preflight.Competitor(
            name, created, spec.cluster.instance_type, False, None, spec.cluster.workers
        )
        competitors.append(dataclasses.replace(own, spec=spec, free=free))
    # One placement of the queue serves every run's pass until the view changes (preflight.Queue).
    instance_type = spec.cluster.instance_type
    queue = ctx.queues.get(instance_type)
    queue = queue.still_holds(competitors) if queue is not None else None
    if queue is None or name not in queue.results:
        queue = preflight.Queue.place(competitors, instance_type)
        ctx.queue_placements += 1
        metrics.QUEUE_PLACEMENTS.inc()
    ctx.queues[instance_type] = queue
    result = queue.results[name]
    if result.ok:
        ctx.admitted[run.uid] = (
            time.monotonic(),
            preflight.Competitor(
                name=name,
                created=created,
                instance_type=instance_type,
                admitted=True,
                zone=result.zone,
                workers_not_placed=spec.cluster.workers,
            ),
        )
    spent = time.thread_time() - start
    ctx.admission_cpu_seconds += spent
    metrics.ADMISSION_CPU.inc(spent)
    return result


@metrics.timed_reconcile
def reconcile_run(ctx: Context, body: Mapping[str, Any], indexes: Indexes) -> Decision | None:
    """One pass on the run as kopf's cache holds it; on a write conflict, again on the stored run."""
    meta = body["metadata"]
    with ctx.locks[meta["uid"]]:
        current: Mapping[str, Any] | None = body
        for _ in range(CONFLICT_RETRIES):
            if current is None or current["metadata"]["uid"] != meta["uid"]:
                return None  # deleted (or re-created under the same name: that object gets its own passes)
            if current["metadata"].get("deletionTimestamp"):
                return None
            current = ctx.newest(current)
            try:
                return _reconcile_once(ctx, dict(current), indexes)
            except Conflict as conflict:
                log.info("%s; reading it again", conflict)
                current = ctx.kube.get_run(meta["namespace"], meta["name"])
        raise kopf.TemporaryError(f"status of {meta['namespace']}/{meta['name']} kept changing", delay=5)


def _parse(
    body: kopf.Body, run: Mapping[str, Any]
) -> tuple[api.FSDPTrainingRunSpec, api.FSDPTrainingRunStatus]:
    try:
        return (
            api.FSDPTrainingRunSpec.model_validate(run["spec"]),
            api.FSDPTrainingRunStatus.model_validate(run.get("status") or {}),
        )
    except ValidationError as error:
        # The CRD schema should make this unreachable; if not, say which field and stop.
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(error)[:1000])
        raise kopf.PermanentError(f"invalid FSDPTrainingRun: {error}") from error


def _requested_image(ctx: Context, spec: api.FSDPTrainingRunSpec) -> str:
    return spec.image or ctx.settings.default_image


def _desired_cluster(
    ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, status: api.FSDPTrainingRunStatus
) -> dict[str, Any]:
    # After the first pull every attempt runs the pinned digest, even if the tag has moved since.
    image = status.image.digest or _requested_image(ctx, spec)
    zone = None if spec.cluster.queue_name else status.zone  # Kueue's flavor pins the zone of a queued run
    return builder.build_raycluster(
        spec, run, image, zone, ray_auth=ctx.settings.ray_token_auth, platform=ctx.platform
    )


def _observe_cluster(
    ctx: Context,
    run: builder.RunRef,
    spec: api.FSDPTrainingRunSpec,
    status: api.FSDPTrainingRunStatus,
    indexes: Indexes,
) -> ClusterObservation | None:
    raycluster = indexes.raycluster(run.namespace, builder.ray_cluster_name(run.name))
    if raycluster is None:
        return None
    owners = raycluster["metadata"].get("ownerReferences", [])
    if not any(o.get("uid") == run.uid for o in owners):
        raise kopf.PermanentError(
            f"RayCluster {raycluster['metadata']['name']} exists and is not owned by this run; "
            "rename the run or delete that RayCluster"
        )
    # Compared with what it was built from: pinning the digest after the first pull is not a change.
    built_with = (raycluster["metadata"].get("annotations") or {}).get(builder.ANNOTATION_IMAGE)
    desired = (
        builder.build_raycluster(
            spec, run, built_with, status.zone, ray_auth=ctx.settings.ray_token_auth, platform=ctx.platform
        )
        if built_with
        else None
    )
    drift = builder.cluster_drift(desired or _desired_cluster(ctx, run, spec, status), raycluster)
    return observe_cluster(raycluster, drift)


def _observe(
    ctx: Context,
    run: builder.RunRef,
    body: Mapping[str, Any],
    spec: api.FSDPTrainingRunSpec,
    status: api.FSDPTrainingRunStatus,
    indexes: Indexes,
) -> Observation:
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    cluster_name = builder.ray_cluster_name(run.name)
    cluster = _observe_cluster(ctx, run, spec, status, indexes)
    preflight_result = None
    if needs_preflight(spec, status, cluster is not None, now):
        with ctx.admission_lock:  # one admission decision at a time, so two runs never split the nodes
            created = body["metadata"].get("creationTimestamp", "")
            preflight_result = _run_preflight(ctx, run, spec, created, indexes)
    workload = _observe_workload(ctx, run, indexes) if needs_workload(spec, status, cluster) else None
    active = status.phase in api.ACTIVE_PHASES  # finished, pending or suspended runs have nothing new to read
    job, dashboard_error = None, None
    watched = job_to_observe(status)
    if watched and not spec.suspend:
        try:
            job = ctx.jobs(run.namespace, cluster_name).observe(watched)
        except Exception as error:  # the head may be down, restarting or black-holed; the machine decides
            dashboard_error = f"{type(error).__name__}: {error}"[:500]
    if job is not None and job.status in ENDED_JOB_STATUSES:
        _archive_driver_log(ctx, run, spec, job, status.attempt)
    progress, latest_fingerprint, storage_error, mlflow_run = None, None, None, None
    checkpoints: tuple[CheckpointRef, ...] = ()
    storage = ctx.storage(spec, run) if active else None
    if storage is not None:
        try:
            progress = storage.progress()
            if spec.tracking.mlflow is not None:
                mlflow_run = storage.mlflow_run()
            stored = storage.complete_checkpoints()
            checkpoints = tuple(s.ref for s in stored)
            latest_fingerprint = stored[-1].fingerprint if stored else None
        except Exception as error:  # storage trouble must not stop the state machine: a condition says so
            storage_error = f"{storage.uri}: {type(error).__name__}: {error}"[:500]
    pods = indexes.pods(run.namespace, cluster_name) if cluster is not None else []
    config = submission.trainer_config(spec, run, cpu_only=ctx.settings.trainer_device == "cpu")
    return Observation(
        now=now,
        generation=body["metadata"]["generation"],
        cluster=cluster,
        preflight=preflight_result,
        job=job,
        dashboard_error=dashboard_error,
        progress=progress,
        checkpoints=checkpoints,
        latest_checkpoint_fingerprint=latest_fingerprint,
        expected_fingerprint=config.resume_fingerprint(),
        storage_read=storage is not None,
        storage_error=storage_error,
        pod_image_ids=tuple(i for pod in pods for i in pod["imageIds"]) if active else (),
        pod_problems=tuple(
            PodProblem(reason, message)
            for pod in pods
            for reason, message in pod["problems"]
            # Workers exit while their head is down (no GCS) and loop until it is back: not a fault of theirs.
            if not (reason == "CrashLoopBackOff" and not pod.get("head") and not (cluster and cluster.ready))
        ),
        oom_kills=tuple(
            OomKill(dt.datetime.fromisoformat(finished), message)
            for pod in pods
            for finished, message in pod.get("oomKills", [])
            if finished
        ),
        requested_image=_requested_image(ctx, spec),
        submission_prefix=submission.submission_prefix(run),
        action_error=ctx.action_errors.pop(run.uid, None),
        workload=workload,
        disruption=ctx.disruption_since(run.namespace, cluster_name, status.attempt_time),
        mlflow_run=mlflow_run,
    )


def _observe_workload(ctx: Context, run: builder.RunRef, indexes: Indexes) -> WorkloadObservation | None:
    raycluster = indexes.raycluster(run.namespace, builder.ray_cluster_name(run.name))
    if raycluster is None:
        return None
    try:
        found = ctx.kube.workloads(run.namespace, raycluster["metadata"]["uid"])
    except Exception as error:  # Kueue's answer only refines the message; the RayCluster's suspend decides
        log.warning("%s/%s: could not read Kueue's Workload: %s", run.namespace, run.name, error)
        return None
    newest = max(found, key=lambda w: w["metadata"].get("creationTimestamp", ""), default=None)
    return observe_workload(newest) if newest is not None else None


def _archive_driver_log(
    ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, job: JobObservation, attempt: int
) -> None:
    """The ended job's driver log next to its ranks' logs, before this pass may delete the cluster that has
    it; once per job. A failure is logged and tried again on the next pass while the head is there."""
    if ctx.archived_driver_log.get(run.uid) == job.submission_id or not job.driver_node_id:
        return
    try:
        text = ctx.jobs(run.namespace, builder.ray_cluster_name(run.name)).driver_log(
            job.submission_id, job.driver_node_id
        )
        ctx.storage(spec, run).write_text(driver_log_name(attempt), text)
    except Exception as error:
        log.warning(
            "%s/%s: could not keep the driver log of %s: %s",
            run.namespace,
            run.name,
            job.submission_id,
            error,
        )
        return
    ctx.archived_driver_log[run.uid] = job.submission_id


def _reconcile_once(ctx: Context, stored: dict[str, Any], indexes: Indexes) -> Decision:
    body = kopf.Body(cast(Any, stored))  # what Events point at
    meta = stored["metadata"]
    run = builder.RunRef(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    spec, status = _parse(body, stored)
    obs = _observe(ctx, run, stored, spec, status, indexes)
    if obs.cluster is not None:
        ctx.created.pop(run.uid, None)  # the index has it: a later loss is recreated at once
    decision = reconcile(spec, status, obs)
    new = decision.status
    cluster_name = builder.ray_cluster_name(run.name)
    if decision.create_cluster or obs.cluster is not None:
        new.ray_cluster_name = cluster_name
    new.record.uri = f"{ctx.storage(spec, run).uri}/{RUN_RECORD_FILE}"
    new.record.logs_uri = f"{ctx.storage(spec, run).uri}/{LOGS_DIR}"
    if obs.mlflow_run is not None:
        new.record.mlflow_run = api.MlflowRunStatus.of(obs.mlflow_run)
    if decision.submit_attempt is not None:
        new.record.package_sha256 = ctx.package_sha256

    # The intent, before any side effect: a stale pass fails here (Conflict) and does nothing.
    old = stored.get("status") or {}
    patch = merge_patch(old, new.model_dump(mode="json", by_alias=True, exclude_none=True))
    if patch:
        stored_now = ctx.kube.write_status(run.namespace, run.name, meta["resourceVersion"], patch)
        ctx.wrote(run.uid, meta["resourceVersion"], kept(stored_now))
        fault_point("after-status-write", new.attempt)
    metrics.record_pass(stored, new, obs.now, (obs.storage_error, obs.dashboard_error, obs.action_error))
    _act(ctx, run, spec, decision)
    if patch:
        _write_run_record(ctx, run, spec, new)
    for event in decision.events:
        kopf.event(body, type=event.type, reason=event.reason, message=conditions.bounded(event.message))
        log.info("%s/%s %s: %s", run.namespace, run.name, event.reason, event.message)
    return decision


def _act(ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, decision: Decision) -> None:
    """Carries out the recorded decision; a failure is remembered for the next pass, which decides."""
    cluster_name = builder.ray_cluster_name(run.name)
    try:
        if decision.stop_job:
            try:
                ctx.jobs(run.namespace, cluster_name).stop(decision.stop_job)
            except Exception as error:  # a lost or unreachable head has no job left to stop for now
                log.warning(
                    "%s/%s: could not stop job %s: %s", run.namespace, run.name, decision.stop_job, error
                )
        if decision.delete_cluster:
            ctx.kube.delete_raycluster(run.namespace, cluster_name)
        if decision.delete_cluster:
            ctx.created.pop(run.uid, None)
        created = ctx.created.get(run.uid)
        attempt = decision.status.attempt
        if decision.create_cluster and not (
            created and created[1] == attempt and time.monotonic() - created[0] < CREATED_MEMORY_SECONDS
        ):
            _create_cluster_guards(ctx, run)
            ctx.kube.create_raycluster(_desired_cluster(ctx, run, spec, decision.status))
            ctx.created[run.uid] = (time.monotonic(), attempt)
            fault_point("after-create-cluster", decision.status.attempt)
        if decision.submit_attempt is not None:
            _submit(ctx, run, spec, decision)
            fault_point("after-submit", decision.submit_attempt)
    except Exception as error:
        message = f"{type(error).__name__}: {error}"[:500]
        ctx.action_errors[run.uid] = message
        log.warning("%s/%s: action failed, the next pass decides: %s", run.namespace, run.name, message)


def restore_network_policy(ctx: Context, deleted: Mapping[str, Any], indexes: Indexes) -> None:
    """A run's NetworkPolicy deleted while its RayCluster runs (by hand, a namespace clean-up) would leave the
    dashboard, whose job API runs code, open to every pod: it is created again at once, with a Warning. Not
    when the run or its cluster is going (the garbage collector deleting it with them)."""
    meta = deleted["metadata"]
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == api.KIND), None)
    if owner is None:
        return
    run = indexes.one(indexes.runs, (meta["namespace"], owner["name"]))
    if run is None or run["metadata"]["uid"] != owner.get("uid") or run["metadata"].get("deletionTimestamp"):
        return
    cluster = indexes.raycluster(meta["namespace"], builder.ray_cluster_name(owner["name"]))
    if cluster is None or cluster["metadata"].get("deletionTimestamp"):
        return
    ref = builder.RunRef(name=owner["name"], namespace=meta["namespace"], uid=owner["uid"])
    settings = ctx.settings
    ctx.kube.create_if_absent(
        builder.build_network_policy(
            ref, settings.lease_namespace, settings.operator_pod_labels, settings.dashboard_ingress_cidrs
        )
    )
    message = f"NetworkPolicy {meta['name']} was deleted while the RayCluster runs; created again"
    kopf.event(kopf.Body(cast(Any, run)), type="Warning", reason="NetworkPolicyRestored", message=message)
    log.warning("%s/%s: %s", meta["namespace"], owner["name"], message)


def _create_cluster_guards(ctx: Context, run: builder.RunRef) -> None:
    """What keeps the run's Ray dashboard (its job API runs code) to the operator: the token Secret its pods
    read, and the NetworkPolicy. Both before the RayCluster, whose pods need the Secret to start."""
    settings = ctx.settings
    token = ctx.ray_token(run.namespace, builder.ray_cluster_name(run.name))
    if settings.ray_token_auth and token:
        ctx.kube.create_if_absent(builder.build_ray_auth_secret(run, token))
    if settings.network_policy:
        ctx.kube.create_if_absent(
            builder.build_network_policy(
                run, settings.lease_namespace, settings.operator_pod_labels, settings.dashboard_ingress_cidrs
            )
        )


def fault_point(name: str, attempt: int) -> None:
    """Dies as SIGKILL would at the named boundary when the test hook asks for it (unset in production)."""
    wanted = os.environ.get(FAULT_POINT_ENV, "")
    if wanted in (name, f"{name}:{attempt}"):
        log.warning("fault point %s (attempt %s): killing the operator", name, attempt)
        os.kill(os.getpid(), signal.SIGKILL)


@metrics.SUBMISSION_DURATION.time()
def _submit(ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, decision: Decision) -> None:
    submission_id = decision.status.job_submission_id
    assert submission_id is not None and decision.submit_attempt is not None
    config = submission.trainer_config(spec, run, cpu_only=ctx.settings.trainer_device == "cpu")
    attempt = AttemptInfo(
        attempt=decision.submit_attempt,
        image_digest=decision.status.image.digest,
        trainer_package_sha256=ctx.package_sha256,
    )
    ctx.jobs(run.namespace, builder.ray_cluster_name(run.name)).submit(
        submission_id,
        submission.entrypoint(config, submission_id, attempt),
        submission.runtime_env(spec),
        metadata={"run": run.name, "namespace": run.namespace, "attempt": str(decision.submit_attempt)},
    )


def _write_run_record(
    ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, status: api.FSDPTrainingRunStatus
) -> None:
    """run.json next to the checkpoints: the evidence outlives the custom resource. It keeps every restart
    (the status keeps the last few), carried over from the run.json this run wrote before."""
    if status.phase in (None, api.Phase.PENDING):
        return
    storage = ctx.storage(spec, run)
    previous = ctx.written_records.get(run.uid)
    try:
        if previous is None:
            stored = storage.read_run_record()
            previous = stored if stored is not None and stored.uid == run.uid else None
        restarts = list(previous.restarts) if previous else []
        restarts += [r for r in status.restarts.history if r not in restarts]
        record = RunRecord(
            run_name=run.name,
            namespace=run.namespace,
            uid=run.uid,
            image_requested=status.image.requested or _requested_image(ctx, spec),
            image_digest=status.image.digest,
            trainer_package_sha256=status.record.package_sha256,
            versions=status.record.versions,
            config=submission.trainer_config(spec, run, cpu_only=ctx.settings.trainer_device == "cpu"),
            phase=str(status.phase),
            start_time=status.start_time,
            completion_time=status.completion_time,
            checkpoints=list(reversed(status.checkpoints.recent)),
            restarts=restarts,
            transport=status.transport,
            logs_uri=status.record.logs_uri,
        )
        if previous == record:
            return  # progress alone changed: run.json holds no progress, so it stays as written
        storage.write_run_record(record)
        ctx.written_records[run.uid] = record
    except Exception as error:  # the bucket may not exist yet; the next change tries again
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
        ctx.forget(meta["uid"])
        cluster_name = builder.ray_cluster_name(meta["name"])
        if status.get("phase") in (api.Phase.RUNNING, api.Phase.RESTARTING) and status.get("jobSubmissionId"):
            try:
                ctx.jobs(meta["namespace"], cluster_name).stop(status["jobSubmissionId"])
            except Exception as error:  # a dead head has no job to stop; the cluster goes either way
                log.warning("%s/%s: could not stop job: %s", meta["namespace"], meta["name"], error)
        ctx.kube.delete_raycluster(meta["namespace"], cluster_name)
    ctx.locks.pop(meta["uid"], None)
    ctx.disruptions.pop((meta["namespace"], cluster_name), None)


def register(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    """Registers the handlers on `registry`; `settings` fixes the observation interval."""
    import boto3
    from botocore.config import Config

    region, endpoint = settings.aws_region, settings.aws_endpoint_url
    bounded = Config(**AWS_TIMEOUTS)  # type: ignore[arg-type]
    ctx = Context(
        settings=settings,
        kube=Kube(),
        s3=boto3.client("s3", region_name=region, endpoint_url=endpoint, config=bounded),
        # Built on first use: only scale-from-zero runs ask EC2, and its service model costs ~16 MB.
        ec2=functools.cache(
            lambda: boto3.client("ec2", region_name=region, endpoint_url=endpoint, config=bounded)
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

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.AiohttpSession | None:
        # Same credentials as the kubernetes client, in a session with a bounded connection pool.
        return await kopfsession.login(settings.watch_namespaces, len(watched_in_each_namespace), **kwargs)

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

    @kopf.index(*resource, id="runs", registry=registry)
    def runs(body: kopf.Body, **_: Any) -> Any:
        return {(body["metadata"]["namespace"], body["metadata"]["name"]): kept(body)}

    @kopf.index(*ray_clusters, labels=ours, id="rayclusters", registry=registry)
    def rayclusters(body: kopf.Body, **_: Any) -> Any:
        return {(body["metadata"]["namespace"], body["metadata"]["name"]): kept(body)}

    @kopf.index(*pods, labels=ours, id="ray_pods", registry=registry)
    def ray_pods(body: kopf.Body, **_: Any) -> Any:
        cluster = (body["metadata"].get("labels") or {}).get(builder.LABEL_RAY_CLUSTER)
        return {(body["metadata"]["namespace"], cluster): pod_summary(body)} if cluster else None

    @kopf.on.event(*pods, labels=ours, registry=registry)
    def on_ray_pod_event(body: kopf.Body, **_: Any) -> None:
        # Remembered here, not read from the index: a disrupted pod is deleted soon after, often before the
        # job it served is seen failing.
        cluster = (body["metadata"].get("labels") or {}).get(builder.LABEL_RAY_CLUSTER)
        disruption = pod_disruption(body)
        if cluster and disruption:
            now = dt.datetime.now(dt.UTC).replace(microsecond=0)
            ctx.disruptions[(body["metadata"]["namespace"], cluster)] = (now, disruption)

    @kopf.index(*all_nodes, id="nodes", registry=registry)
    def nodes(body: kopf.Body, **_: Any) -> Any:
        return {None: preflight.node_facts(body)}

    @kopf.index(*pods, id="accelerator_pods", registry=registry)
    def accelerator_pods(body: kopf.Body, **_: Any) -> Any:
        return {None: preflight.placement_of(body)} if preflight.holds_accelerators(body) else None

    def indexes_of(kwargs: Mapping[str, Any]) -> Indexes:
        # kopf hands each index to handlers as a keyword argument named by the index's id.
        return Indexes(
            nodes=kwargs.get("nodes"),
            accelerator_pods=kwargs.get("accelerator_pods"),
            runs=kwargs.get("runs"),
            rayclusters=kwargs.get("rayclusters"),
            ray_pods=kwargs.get("ray_pods"),
        )

    @kopf.on.create(*resource, registry=registry)
    @kopf.on.resume(*resource, registry=registry)
    @kopf.on.update(*resource, field="spec", registry=registry)
    def on_change(body: kopf.Body, **kwargs: Any) -> None:
        reconcile_run(ctx, body, indexes_of(kwargs))

    def unfinished(status: kopf.Status, **_: Any) -> bool:
        return status.get("phase") not in api.FINISHED_PHASES  # a finished run never changes again

    # First tick one interval in: on.create / on.resume make the first pass (a tick at once would race them
    # with the pre-finalizer body and conflict).
    @kopf.timer(
        *resource,
        interval=settings.observe_interval_seconds,
        initial_delay=settings.observe_interval_seconds,
        when=unfinished,
        registry=registry,
    )
    def on_timer(body: kopf.Body, **kwargs: Any) -> None:
        reconcile_run(ctx, body, indexes_of(kwargs))

    @kopf.on.event(*ray_clusters, labels=ours, registry=registry)
    def on_raycluster_event(body: kopf.Body, type: str | None = None, **kwargs: Any) -> None:
        # React to KubeRay at once (the cluster ready or failed, suspended, edited, deleted) instead of at the
        # next timer tick; not to each of its progress notes while it provisions (a status write each, with
        # nothing a user or a retry needs that the next tick would not write too).
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        seen = cluster_reaction(body)
        before = ctx.cluster_seen.get(key)
        if type == "DELETED":
            ctx.cluster_seen.pop(key, None)
        else:
            ctx.cluster_seen[key] = seen
            # The first sight of one the operator just created (or, after a restart, one on.resume passes
            # over anyway) has nothing to act on unless it is ready or going.
            if seen == before or (before is None and not (seen[1] or seen[2])):
                return
        indexes = indexes_of(kwargs)
        owners = body["metadata"].get("ownerReferences") or []
        name = next((o["name"] for o in owners if o.get("kind") == api.KIND), None)
        owner = indexes.one(indexes.runs, (body["metadata"]["namespace"], name)) if name else None
        if owner and (owner.get("status") or {}).get("phase") not in api.FINISHED_PHASES:
            reconcile_run(ctx, owner, indexes)

    if settings.network_policy:

        @kopf.on.event(*network_policies, labels=ours, registry=registry)
        def on_network_policy_event(body: kopf.Body, type: str | None = None, **kwargs: Any) -> None:
            if type == "DELETED":
                restore_network_policy(ctx, body, indexes_of(kwargs))

    @kopf.on.delete(*resource, registry=registry)
    def deleted(body: kopf.Body, **_: Any) -> None:
        on_delete(ctx, body)
