"""Proof that the local cluster is the real thing: apiserver, scheduler, garbage collector, KWOK, KubeRay."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tests.support.kube import kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.paths import state_dir
from tests.support.waiting import wait_until

IMAGE = "public.ecr.aws/deep-learning-containers/ray:2.58.0-gpu-py312-cu130-ubuntu22.04-ec2"


def raycluster(name: str, workers: int, gpus: int) -> dict[str, Any]:
    def container(resources: dict[str, Any]) -> dict[str, Any]:
        return {"name": "ray", "image": IMAGE, "resources": {"requests": resources, "limits": resources}}

    gpu = {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": "1"}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "rayVersion": "2.58.0",
            "headGroupSpec": {
                "rayStartParams": {"num-gpus": "0"},
                "template": {
                    "spec": {
                        "nodeSelector": {"eks.amazonaws.com/nodegroup": "system"},
                        "containers": [container({"cpu": "2", "memory": "8Gi"})],
                    }
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": workers,
                    "minReplicas": workers,
                    "maxReplicas": workers,
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [container(gpu)]}},
                }
            ],
        },
    }


def test_server_is_a_real_kubernetes_with_rbac(local_cluster: LocalCluster) -> None:
    version = kubectl_json("version")
    assert re.fullmatch(r"v1\.35\.\d+", version["serverVersion"]["gitVersion"]), version
    assert version["clientVersion"]["gitVersion"] == version["serverVersion"]["gitVersion"]
    # RBAC is on: a service account with no bindings may not list secrets.
    denied = kubectl(
        "auth", "can-i", "list", "secrets", "--as=system:serviceaccount:default:default", check=False
    )
    assert denied.stdout.strip() == "no"


def _ours(pid: int) -> bool:
    """Started by cluster-up: in the session of one of its daemons, or a kwokctl component run from $STATE."""
    daemons = {int(f.read_text()) for f in (state_dir() / "pids").glob("*.pid")}
    try:
        return os.getsid(pid) in daemons or str(state_dir()) in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:  # gone meanwhile
        return False


def test_every_server_of_the_local_cluster_listens_on_loopback_or_its_pod_segment_only(
    local_cluster: LocalCluster,
) -> None:
    listeners = []  # (address, port, process name)
    ss = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    for line in ss.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if _ours(int(pid)):
                listeners.append((host.strip("[]"), int(port), name))
    expected = {
        urlparse(local_cluster.env["RAY_DASHBOARD_URL"]).port,
        urlparse(local_cluster.s3_endpoint).port,
        int(local_cluster.env["RAY_GCS_ADDRESS"].rpartition(":")[2]),
        urlparse(kubectl_json("config", "view", "--minify")["clusters"][0]["cluster"]["server"]).port,
    }
    assert expected <= {port for _, port, _ in listeners}, f"not all our servers were found in {listeners}"

    def ours_to_listen_on(host: str) -> bool:
        """Loopback, or the pod segment the real node's bridge makes (198.18.0.0/15, the project's own)."""
        if host in ("*", "0.0.0.0", "::"):
            return False
        address = ipaddress.ip_address(host.partition("%")[0])
        address = getattr(address, "ipv4_mapped", None) or address
        return address.is_loopback or address in ipaddress.ip_network("198.18.0.0/15")

    assert [entry for entry in listeners if not ours_to_listen_on(entry[0])] == []


def test_fake_gpu_node_groups_have_the_shape_of_eks_node_groups(local_cluster: LocalCluster) -> None:
    selector = "type=kwok,node.kubernetes.io/instance-type=g6.12xlarge"  # the real node is tested on its own
    nodes = kubectl_json("get", "nodes", "-l", selector)["items"]
    groups: dict[str, set[tuple[str, str]]] = {}
    for node in nodes:
        labels, allocatable = node["metadata"]["labels"], node["status"]["allocatable"]
        groups.setdefault(labels["eks.amazonaws.com/nodegroup"], set()).add(
            (labels["topology.kubernetes.io/zone"], allocatable["ephemeral-storage"])
        )
        assert (allocatable["nvidia.com/gpu"], allocatable["vpc.amazonaws.com/efa"]) == ("4", "1")
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]
    assert len(nodes) == 5
    # Large root volumes in two zones; in a third, a group left at EKS's default 20 GiB disk.
    assert groups == {
        "gpu-g6": {("us-west-2a", "500Gi"), ("us-west-2b", "500Gi")},
        "gpu-g6-default-disk": {("us-west-2d", "17Gi")},
    }


def test_kuberay_reconciles_a_raycluster_onto_gpu_nodes(namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(raycluster("sample", workers=2, gpus=4)))

    def pods_running() -> list[dict[str, Any]] | None:
        pods = kubectl_json("get", "pods", "-n", namespace, "-l", "ray.io/cluster=sample")["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        return pods if len(pods) == 3 and len(running) == 3 else None

    pods = wait_until("head and 2 worker pods Running", pods_running, timeout=90)
    by_type = {p["metadata"]["labels"]["ray.io/node-type"]: p for p in pods}
    assert by_type["head"]["spec"]["nodeName"] == "system-0"
    workers = [p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    worker_nodes = {p["spec"]["nodeName"] for p in workers}
    assert len(worker_nodes) == 2 and all(n.startswith("gpu-") for n in worker_nodes)
    # The KWOK stage records what a kubelet would: the image digest that ran.
    for pod in pods:
        image_id = pod["status"]["containerStatuses"][0]["imageID"]
        assert re.fullmatch(r"public\.ecr\.aws/deep-learning-containers/ray@sha256:[0-9a-f]{64}", image_id)

    def cluster_ready() -> dict[str, Any] | None:
        status = kubectl_json("get", "raycluster", "sample", "-n", namespace).get("status", {})
        return status if status.get("state") == "ready" and status.get("readyWorkerReplicas") == 2 else None

    status = wait_until("RayCluster state ready with 2 ready workers", cluster_ready, timeout=90)
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["HeadPodReady"] == "True" and conditions["RayClusterProvisioned"] == "True"


def test_pod_asking_for_too_many_gpus_stays_pending_unschedulable(namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "greedy"},
        "spec": {
            "containers": [{"name": "c", "image": IMAGE, "resources": {"limits": {"nvidia.com/gpu": "8"}}}]
        },
    }
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def unschedulable() -> dict[str, Any] | None:
        status = kubectl_json("get", "pod", "greedy", "-n", namespace)["status"]
        scheduled = [c for c in status.get("conditions", []) if c["type"] == "PodScheduled"]
        return scheduled[0] if scheduled and scheduled[0].get("reason") == "Unschedulable" else None

    condition = wait_until("PodScheduled=False reason Unschedulable", unschedulable, timeout=60)
    assert condition["status"] == "False"
    assert "Insufficient nvidia.com/gpu" in condition["message"]
    assert kubectl_json("get", "pod", "greedy", "-n", namespace)["status"]["phase"] == "Pending"


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(namespace: str) -> None:
    kubectl("create", "configmap", "owner", "-n", namespace)
    owner_uid = kubectl_json("get", "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}],
        },
    }
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(dependent))
    kubectl("delete", "configmap", "owner", "-n", namespace)

    def dependent_gone() -> bool:
        return kubectl("get", "configmap", "dependent", "-n", namespace, check=False).returncode != 0

    wait_until("the dependent ConfigMap to be garbage-collected", dependent_gone, timeout=60)


def test_apiserver_rejects_an_object_that_violates_the_crd_schema(namespace: str) -> None:
    bad = raycluster("bad", workers=1, gpus=4)
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    result = kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode != 0
    assert "spec.workerGroupSpecs[0].replicas" in result.stderr, result.stderr
    assert kubectl("get", "raycluster", "bad", "-n", namespace, check=False).returncode != 0
