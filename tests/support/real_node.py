"""The real node of the local cluster (a kubelet running real containers) as tests drive it, and its runs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support.chart import render
from tests.support.demo import demo_manifest
from tests.support.gitops import gitops_sync
from tests.support.image import service_account_files
from tests.support.kube import kubectl
from tests.support.local_cluster import LocalCluster
from tests.support.paths import REPO

# A real node is slower than KWOK: the image's Ray start, three pods' probes, then training on its 2 CPUs.
RUN_TIMEOUT = 900
OPERATOR_NAMESPACE = "fsdp-real-pods-operator"
CONTAINERS_CONF = str(REPO / "hack" / "containers.conf")

# What an idle Ray node does on its own, less often (the local head, hack/ray-head.sh, does the same): its
# agent's node statistics every 60 s, not 5; its dashboard's own metrics every 60 s, not 5; its log monitor
# lists the log directory once a second, not on each of its 0.1 s rounds (Ray lists it every round while
# under 1,000 files). An idle head's processes: 3.1-3.5 CPU-s a minute by default, 2.6-3.1 with these, a
# median ratio of 0.87 (Ray 2.58 from the DLC's lock, `python bench/ray_idle.py --rounds 2`,
# docs/benchmarks.md "The suite's own time"); the suite's pods and heads idle most of their life. Nothing
# the operator reads comes from them: it asks the job, log and package APIs.
QUIET_RAY = {
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
    "METRICS_RECORD_INTERVAL_S": "60",
    "LOG_NAME_UPDATE_INTERVAL_S": "1",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}


@dataclass(frozen=True)
class RealNode:
    name: str
    containerd_socket: str
    host_address: str  # the host's end of the pod segment: where pods reach S3, and apiserver proxying starts
    pod_s3_endpoint: str
    image: str  # the DLC stand-in, as the node's containerd has it

    @property
    def pod_env(self) -> dict[str, str]:
        """What every Ray container gets (operator setting ray-pod-env): the local S3 and static keys for it,
        no model hub."""
        return {
            **self.pod_env_without_credentials,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
        }

    @property
    def pod_env_without_credentials(self) -> dict[str, str]:
        """ray-pod-env as on an EKS platform that gives pods credentials through their service account (IRSA,
        Pod Identity): where AWS is (the local S3 and STS), no keys."""
        return {
            "AWS_ENDPOINT_URL": self.pod_s3_endpoint,
            "AWS_DEFAULT_REGION": "us-west-2",
            "HF_HUB_OFFLINE": "1",
            # The node is shared by the whole suite: give the dashboard's modules time to start.
            "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "300",
            **QUIET_RAY,
        }


@dataclass(frozen=True)
class ChartIdentity:
    kubeconfig: Path  # the chart's ServiceAccount's token, as an operator outside the cluster would hold it
    env: dict[str, str]  # the chart's settings that name its objects (the Ray token key's Secret)
    objects: list[dict[str, Any]]  # the RBAC objects applied, cluster-scoped ones included


def chart_identity(namespace: str, into: Path, local_cluster: LocalCluster) -> ChartIdentity:
    """Nothing but the chart's RBAC for a release watching `namespace`, applied as the chart renders it."""
    kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    values = {
        "watchNamespaces": [namespace],
        "leaderElection": {"enabled": False},
        "replicaCount": 1,
        "dashboardAddressMode": "service-proxy",  # the proxied operator's: the services/proxy grant
    }
    rendered = render(f"r{namespace[-6:]}", OPERATOR_NAMESPACE, values)
    wanted = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    objects = [o for o in rendered.objects if o["kind"] in wanted]
    kubectl("apply", "--server-side", "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objects))
    pod = rendered.deployment["spec"]["template"]["spec"]
    files = service_account_files(
        local_cluster.kubeconfig, OPERATOR_NAMESPACE, pod["serviceAccountName"], into
    )
    server = yaml.safe_load(Path(local_cluster.kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(files / "ca.crt")}}
        ],
        "users": [{"name": "chart", "user": {"token": (files / "token").read_text()}}],
        "contexts": [{"name": "chart", "context": {"cluster": "local", "user": "chart"}}],
        "current-context": "chart",
    }
    path = into / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e}
    return ChartIdentity(
        path, {"FSDP_OPERATOR_RAY_AUTH_KEY_SECRET": env["FSDP_OPERATOR_RAY_AUTH_KEY_SECRET"]}, objects
    )


def real_pods_run(namespace: str, **changes: Any) -> dict[str, Any]:
    """examples/cpu-demo-real-pods.yaml with the test's data, applied as a GitOps tool applies it."""
    name = f"real-{uuid.uuid4().hex[:6]}"
    manifest = demo_manifest(name, "cpu-demo-real-pods", **{"recovery.backoffSeconds": 2, **changes})
    gitops_sync(namespace, manifest)
    return manifest
