"""The Kubernetes API as the client reaches it: the user's kubeconfig (its context, namespace and credential
plugins, as kubectl uses them) or, inside a pod, the pod's service account. Every failure is turned into one
of the errors a notebook user can act on. The kubernetes package is imported when a Cluster is made: the
kubectl plugin shares this package's readers and reads runs through kubectl instead."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fsdp_client.errors import (
    ClientError,
    CrdNotInstalled,
    InvalidSpec,
    NamespaceNotGranted,
    NoClusterAccess,
    RunExists,
    RunNotFound,
)
from fsdp_operator.api import GROUP, PLURAL, VERSION

REQUEST_TIMEOUT_SECONDS = 30
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
T = TypeVar("T")


def _one_line(text: str) -> str:
    return " ".join(text.split())


class Cluster:
    """The FSDPTrainingRun API of one cluster, as one identity, with a default namespace."""

    def __init__(
        self, namespace: str | None = None, context: str | None = None, kubeconfig: str | None = None
    ) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        # Read now, not when kubernetes was imported (its default is the KUBECONFIG of that moment).
        path = kubeconfig or os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
        in_pod = "KUBERNETES_SERVICE_HOST" in os.environ and SERVICE_ACCOUNT_NAMESPACE.exists()
        try:
            if not in_pod or kubeconfig or os.environ.get("KUBECONFIG"):
                config.load_kube_config(path, context, client_configuration=configuration)
                contexts, active = config.list_kube_config_contexts(path)
                chosen = next((c for c in contexts if c["name"] == context), active) if context else active
                default_namespace = chosen["context"].get("namespace") or "default"
            else:
                config.load_incluster_config(client_configuration=configuration)
                default_namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        except (config.ConfigException, OSError) as error:
            raise NoClusterAccess(
                f"no cluster access: {_one_line(str(error)) or type(error).__name__}: set KUBECONFIG (or "
                "pass kubeconfig= and context=) to a kubeconfig for the cluster that runs the operator"
            ) from error
        self.server: str = configuration.host
        self.namespace = namespace or default_namespace
        self.api = client.CustomObjectsApi(client.ApiClient(configuration))

    def call(self, verb: str, namespace: str, name: str | None, request: Callable[[Any], T]) -> T:
        """One request, `verb` the RBAC verb it needs (for the error), `name` the run it is about."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return request(self.api)
        except ApiException as error:
            raise self._refusal(error, verb, namespace, name) from error
        except HTTPError as error:
            raise NoClusterAccess(
                f"no cluster access: cannot reach the apiserver at {self.server} ({type(error).__name__}): "
                "check the kubeconfig's context, the network or VPN, and that the cluster is up"
            ) from error

    def _refusal(self, error: Any, verb: str, namespace: str, name: str | None) -> ClientError:
        try:
            status = json.loads(error.body or "{}")
        except ValueError:
            status = {}
        said = _one_line(str(status.get("message") or error.reason or ""))
        where = f"{namespace}/{name}" if name else namespace
        if error.status == 401:
            return NoClusterAccess(
                f"no cluster access: the apiserver at {self.server} refused your credentials (401): refresh "
                "them (on EKS: aws eks update-kubeconfig --name CLUSTER) and make a new Client"
            )
        if error.status == 403 and "denied" in said:  # an admission policy or webhook, not RBAC
            return InvalidSpec(f"the cluster refused run {where}: {said}")
        if error.status == 403:
            return NamespaceNotGranted(
                f"namespace {namespace} not granted: you may not {verb} FSDPTrainingRuns there ({said}): ask "
                "your platform team for the edit role in it (view, to read), or use a namespace you have"
            )
        if error.status == 404 and not self._api_installed():
            return CrdNotInstalled(
                f"the cluster at {self.server} has no FSDPTrainingRun API ({PLURAL}.{GROUP} is not "
                "installed): install the fsdp-operator chart there, or use the kubeconfig context of the "
                "cluster that has it"
            )
        if error.status == 404:
            return RunNotFound(f"no run {where}: Client.list() shows the runs in a namespace")
        if error.status == 409 and verb == "create":
            return RunExists(f"a run {where} exists already: pick another name, or delete it first")
        if error.status in (400, 422):
            return InvalidSpec(f"the cluster refused run {where}: {said}")
        return ClientError(f"{verb} {where}: the apiserver said {error.status}: {said}")

    def _api_installed(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            self.api.get_api_resources(GROUP, VERSION, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True
