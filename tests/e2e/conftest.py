"""Fixtures of the end-to-end tier: the test bucket with its corpus, and the operator as the demo runs it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.support.demo import BUCKET, CHAT_CORPUS, CORPUS, lifecycle_env
from tests.support.karpenter import Karpenter, running_karpenter
from tests.support.kube import delete_namespace, fresh_namespace, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.operator_process import OperatorProcess, operator_watching
from tests.support.paths import REPO, cluster_settings
from tests.support.real_node import OPERATOR_NAMESPACE, RealNode, chart_identity


@pytest.fixture(scope="session")
def s3(local_cluster: LocalCluster) -> Any:
    client = boto3.client("s3", endpoint_url=local_cluster.s3_endpoint)
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    client.upload_file(str(REPO / "examples" / "data" / "stdlib-docstrings.jsonl"), BUCKET, CORPUS)
    client.upload_file(str(REPO / "examples" / "data" / "stdlib-chat.jsonl"), BUCKET, CHAT_CORPUS)
    return client


@pytest.fixture
def lifecycle_operator(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator as the demo runs it, observing every 2 s."""
    with operator_watching(namespace, lifecycle_env(local_cluster), tmp_path / "operator.log") as proc:
        yield proc


@pytest.fixture
def ec2_operator(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator with the local EC2 and Auto Scaling APIs (moto), for scale-from-zero preflight, and not
    the local Ray head: these runs are never meant to train (their jobs would take the shared head's CPUs)."""
    endpoint = {"FSDP_OPERATOR_AWS_ENDPOINT_URL": local_cluster.s3_endpoint}
    with operator_watching(namespace, endpoint, tmp_path / "operator.log") as proc:
        yield proc


@pytest.fixture
def karpenter(local_cluster: LocalCluster, tmp_path: Path) -> Iterator[Karpenter]:
    """Real Karpenter (its KWOK provider) with NodePools for EKS GPU types and Ray heads; the nodes it made
    are gone afterwards, and its log's tail is shown when the test fails."""
    with running_karpenter(local_cluster, tmp_path / "karpenter") as running:
        yield running


@pytest.fixture
def second_namespace(namespace: str) -> Iterator[str]:
    """Another team's namespace beside the test's, with no grants."""
    name = f"{namespace}-b"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        delete_namespace(name)


@pytest.fixture(scope="module")
def real_node(local_cluster: LocalCluster) -> RealNode:
    name = local_cluster.env["FSDP_REAL_NODE"]
    node = kubectl_json("get", "node", name)
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}.get("Ready")
    assert ready == "True", f"the real node {name} is not Ready: {node['status']['conditions']}"
    [node_dir] = cluster_settings("NODE_DIR")
    return RealNode(
        name=name,
        containerd_socket=f"{node_dir}/containerd.sock",
        host_address=local_cluster.env["FSDP_HOST_POD_ADDRESS"],
        pod_s3_endpoint=local_cluster.env["FSDP_POD_S3_ENDPOINT"],
        image=local_cluster.env["FSDP_DLC_IMAGE"],
    )


@pytest.fixture
def ray_pod_env(real_node: RealNode) -> dict[str, str]:
    """The operator's ray-pod-env for proxied_operator's runs (a module overrides it to change what pods
    get)."""
    return real_node.pod_env


@contextlib.contextmanager
def proxied_operator_for(
    namespace: str, local_cluster: LocalCluster, real_node: RealNode, into: Path, ray_pod_env: dict[str, str]
) -> Iterator[OperatorProcess]:
    """The operator outside the cluster, in service-proxy mode, holding only the chart's RBAC."""
    identity = chart_identity(namespace, into / "chart", local_cluster)
    env = {
        **identity.env,
        "KUBECONFIG": str(identity.kubeconfig),
        "FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE": "service-proxy",
        # The apiserver's proxied connections come from the host's end of the pod segment.
        "FSDP_OPERATOR_DASHBOARD_INGRESS_CIDRS": f"{real_node.host_address}/32",
        "FSDP_OPERATOR_LEASE_NAMESPACE": OPERATOR_NAMESPACE,
        "FSDP_OPERATOR_DEFAULT_IMAGE": real_node.image,
        "FSDP_OPERATOR_RAY_IMAGE_PULL_POLICY": "IfNotPresent",  # the node has the image; no registry here
        "FSDP_OPERATOR_RAY_POD_ENV": json.dumps(ray_pod_env),
        "FSDP_OPERATOR_TRAINER_DEVICE": "cpu",
        "FSDP_OPERATOR_AWS_ENDPOINT_URL": local_cluster.s3_endpoint,
        "FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS": "3",
    }
    proc = OperatorProcess(namespace=namespace, env=env, log=into / "operator.log").start()
    try:
        yield proc
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=120s", check=False)
        proc.stop()
        cluster_scoped = [o for o in identity.objects if o["kind"].startswith("Cluster")]
        for obj in cluster_scoped:
            kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found", check=False)
        print(f"--- operator log ({proc.log}) ---\n{proc.log.read_text()[-8000:]}")


@pytest.fixture
def proxied_operator(
    namespace: str,
    crd_installed: None,
    s3: Any,
    local_cluster: LocalCluster,
    real_node: RealNode,
    ray_pod_env: dict[str, str],
    tmp_path: Path,
) -> Iterator[OperatorProcess]:
    with proxied_operator_for(namespace, local_cluster, real_node, tmp_path, ray_pod_env) as proc:
        yield proc


@pytest.fixture(scope="module")
def shared_namespace(local_cluster: LocalCluster) -> Iterator[str]:
    """A namespace for the tests of a module that share one run (each RayCluster start on the real node costs
    minutes of its 2 CPUs), made as each test's own is."""
    with fresh_namespace() as name:
        yield name


@pytest.fixture(scope="module")
def shared_proxied_operator(
    shared_namespace: str,
    crd_installed: None,
    s3: Any,
    local_cluster: LocalCluster,
    real_node: RealNode,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    into = tmp_path_factory.mktemp("shared-operator")
    with proxied_operator_for(shared_namespace, local_cluster, real_node, into, real_node.pod_env) as proc:
        yield proc
