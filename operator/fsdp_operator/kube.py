"""The operator's apiserver client (`Kube`: the few calls the passes make, each bounded by a timeout) and
kopf's in-memory indexes of the objects it watches (`Indexes`)."""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from fsdp_operator import api, builder, kueue, preflight

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"
NODEPOOLS_PATH = "/apis/karpenter.sh/v1/nodepools"  # Karpenter's NodePools: cluster-scoped
DAEMONSETS_PATH = "/apis/apps/v1/daemonsets"  # every namespace's
RAY_AUTH_KEY_FIELD = "key"
API_TIMEOUT = (5.0, 20.0)  # (connect, read) seconds for every apiserver call the operator makes
POD_LIST_PAGE = 250
EVENTS_PER_POD = 100
USER_AGENT = "fsdp-operator"
# The API paths of the objects a run gets beside its RayCluster.
CREATED_KINDS = {
    "Secret": "/api/v1/namespaces/{namespace}/secrets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
    "ResourceClaimTemplate": "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates",
}


class Conflict(Exception):
    """The run changed since it was read: the pass must start again from the stored object."""


class Kube:
    """The few Kubernetes calls the handlers make, on one API client, each with a timeout."""

    def __init__(self, connections: int) -> None:
        """`connections`: the most requests in flight at once (the handler threads). The client's pool is
        otherwise five per CPU of the node, whatever the threads: with fewer, each request past the pool
        opens a connection and a TLS handshake and throws it away (1,000 runs on 2 CPUs: thousands)."""
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        configuration = client.Configuration.get_default_copy()
        configuration.connection_pool_maxsize = connections
        api_client = client.ApiClient(configuration)
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
        content_type: str = "application/json",
    ) -> Any:
        """One call by path, as the generated APIs make it (bearer token, timeout); ApiException on errors.
        The decoded JSON, or the raw response with preload=False."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
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
        """A Secret, NetworkPolicy or ResourceClaimTemplate of a run; an existing one of that name is taken as
        made by an earlier pass (its content is derived from the run, so an older one says the same)."""
        namespace = manifest["metadata"]["namespace"]
        body = cast(Any, manifest)
        try:
            self.request("POST", CREATED_KINDS[manifest["kind"]].format(namespace=namespace), body)
        except ApiException as error:
            if error.status != 409:
                raise

    def put_back(
        self, manifest: dict[str, Any], owner_uid: str, found: Mapping[str, Any] | None = None
    ) -> str | None:
        """Creates the run's object, or puts back one of its name (`found`, as a watch event showed it, or
        as read after a create that found the name taken) that the run does not own (made first by someone
        else) or whose spec differs (edited): the run relies on its content, not on its name. What was put
        back, or None when it was as the run needs it (no request then, given `found`)."""
        meta = manifest["metadata"]
        path = CREATED_KINDS[manifest["kind"]].format(namespace=meta["namespace"])
        if found is None:
            try:
                self.request("POST", path, cast(Any, manifest))
                return None
            except ApiException as error:
                if error.status != 409:
                    raise
            found = self.request("GET", f"{path}/{meta['name']}")
        assert found is not None
        wrong = []
        if not any(o.get("uid") == owner_uid for o in found["metadata"].get("ownerReferences") or []):
            wrong.append("it was not the run's")
        if found.get("spec") != manifest.get("spec"):
            wrong.append("its rules were changed")
        if not wrong:
            return None
        replaced = {**manifest, "metadata": {**meta, "resourceVersion": found["metadata"]["resourceVersion"]}}
        self.request("PUT", f"{path}/{meta['name']}", cast(Any, replaced))
        return " and ".join(wrong)

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

    def delete_raycluster(self, namespace: str, name: str, run_uid: str) -> None:
        """Deletes the run's RayCluster: only one the run owns, and only the object read (a UID
        precondition). Cluster names are hashed: another run's, or a tenant's of that name, stays."""
        path = (RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name)
        try:
            found = cast(
                dict[str, Any],
                self.custom.get_namespaced_custom_object(*path, _request_timeout=API_TIMEOUT),
            )
            owners = found["metadata"].get("ownerReferences") or []
            if not any(owner.get("uid") == run_uid for owner in owners):
                return
            options = client.V1DeleteOptions(
                propagation_policy="Foreground",
                preconditions=client.V1Preconditions(uid=found["metadata"]["uid"]),
            )
            self.custom.delete_namespaced_custom_object(*path, body=options, _request_timeout=API_TIMEOUT)
        except ApiException as error:
            if error.status not in (404, 409):  # gone, or replaced by another object since it was read
                raise

    def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        """A merge patch of a node's metadata (the fabric check's label, fabric.py)."""
        self.request("PATCH", f"/api/v1/nodes/{name}", patch, content_type="application/merge-patch+json")

    def namespace_annotations(self, namespace: str) -> dict[str, str]:
        """The Namespace's annotations: what the platform grants runs there (tenancy.py)."""
        found = self.request("GET", f"/api/v1/namespaces/{namespace}")
        return dict((found.get("metadata") or {}).get("annotations") or {})

    def service_account(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A ServiceAccount (its annotations name the IAM role of the pods running as it); None if absent."""
        try:
            return cast(
                dict[str, Any], self.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
            )
        except ApiException as error:
            if error.status == 404:
                return None
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

    def nodepools(self) -> list[dict[str, Any]] | None:
        """Karpenter's NodePools; None where they cannot be seen: no Karpenter (its CRD answers 404) or no
        permission to list them (the chart grants it)."""
        try:
            found = self.request("GET", NODEPOOLS_PATH)
        except ApiException as error:
            if error.status in (403, 404):
                return None
            raise
        return cast(list[dict[str, Any]], found.get("items") or [])

    def daemonsets(self) -> list[dict[str, Any]] | None:
        """Every namespace's DaemonSets; None where the operator may not list them."""
        try:
            found = self.request("GET", DAEMONSETS_PATH)
        except ApiException as error:
            if error.status == 403:
                return None
            raise
        return cast(list[dict[str, Any]], found.get("items") or [])

    def pod_events(self, namespace: str, pod: str) -> list[dict[str, Any]]:
        """The Events about one pod (the scheduler's, an autoscaler's), at most EVENTS_PER_POD of them."""
        query: list[tuple[str, Any]] = [
            ("fieldSelector", f"involvedObject.kind=Pod,involvedObject.name={pod}"),
            ("limit", EVENTS_PER_POD),
        ]
        found = self.request("GET", f"/api/v1/namespaces/{namespace}/events", query=query)
        return cast(list[dict[str, Any]], found.get("items") or [])

    def accelerator_pods(self) -> list[dict[str, Any]]:
        """Pods of every namespace that preflight counts (GPUs, EFA, DaemonSets'), reduced as the pod index
        reduces them. Read a page at a time as plain JSON: a busy cluster's whole pod list decoded at once, as
        client models, is tens of MB that the process keeps long after."""
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
            found += [preflight.placement_of(p) for p in page["items"] if preflight.counted_by_preflight(p)]
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
    # None -> bound pods requesting GPUs or EFA, and DaemonSets' pods (watched namespaces): preflight's
    accelerator_pods: Any = None
    active_runs: Any = None  # namespace -> uids of its runs whose status shows a cluster held (admission.py)
    unfinished_runs: Any = None  # None -> uids of the runs not finished (statuspatch.figures_every)

    @staticmethod
    def one(index: Any, key: tuple[str, str]) -> Any | None:
        store = index.get(key) if index is not None else None
        return next(iter(store), None) if store else None

    def raycluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        return cast(dict[str, Any] | None, self.one(self.rayclusters, (namespace, name)))

    @staticmethod
    def _stores(index: Any) -> list[Any]:
        """`index`'s stores, read from a pass's thread while kopf's event loop may change it: its keys are
        copied by list(), which walks the dict without running Python code (no thread can switch in), and a
        key whose store went meanwhile is skipped. Iterating it directly raised "dictionary changed size
        during iteration" under load."""
        if index is None:
            return []
        return [store for store in (index.get(key) for key in list(index)) if store]

    @classmethod
    def all(cls, index: Any) -> list[Any]:
        """Every value of `index` (each store copied by list(), as its keys are)."""
        return [value for store in cls._stores(index) for value in list(store)]

    @classmethod
    def count(cls, index: Any) -> int:
        """How many values `index` holds."""
        return sum(len(store) for store in cls._stores(index))

    def pods(self, namespace: str, cluster_name: str) -> list[dict[str, Any]]:
        store = self.ray_pods.get((namespace, cluster_name)) if self.ray_pods is not None else None
        return list(store) if store else []
