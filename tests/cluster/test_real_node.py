"""The local cluster's real node (hack/real-node.sh): a kubelet that KWOK leaves alone, real containers,
cluster DNS, the pod network, and a host left as it was found."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kube import kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.paths import cluster_settings
from tests.support.probe_pod import run_probe

# The kubelet would set these host-wide; it runs where they read as it wants them, so the host keeps its own.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops")


@pytest.fixture(scope="module")
def node(local_cluster: LocalCluster) -> Iterator[dict[str, Any]]:
    yield kubectl_json("get", "node", local_cluster.env["FSDP_REAL_NODE"])


def test_the_real_node_is_a_kubelet_of_its_own_that_kwok_leaves_alone(node: dict[str, Any]) -> None:
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.35.4" and info["containerRuntimeVersion"].startswith("containerd://")
    assert "kwok.x-k8s.io/node" not in (node["metadata"].get("annotations") or {})
    capacity = node["status"]["capacity"]
    assert (capacity["nvidia.com/gpu"], capacity["vpc.amazonaws.com/efa"]) == ("8", "2")
    labels = node["metadata"]["labels"]
    assert labels["node.kubernetes.io/instance-type"] == "g6.12xlarge"
    assert {"key": "fsdp.training.dev/real-node", "value": "true", "effect": "NoSchedule"} in node["spec"][
        "taints"
    ]


def test_pods_run_for_real_resolve_cluster_names_reach_s3_and_nothing_outside(
    namespace: str, local_cluster: LocalCluster, node: dict[str, Any]
) -> None:
    s3 = local_cluster.env["FSDP_POD_S3_ENDPOINT"]
    command = f"""
import socket, urllib.request
print("uid", open("/proc/self/status").read().split("Uid:")[1].split()[0])
print("dns", socket.gethostbyname("kubernetes.default.svc.cluster.local"))
print("s3", urllib.request.urlopen("{s3}/moto-api/", timeout=10).status)
try:
    socket.create_connection(("10.255.255.53", 53), timeout=5)
    print("outside reached")
except OSError as error:
    print("outside", type(error).__name__, error.errno)
for name in ("example.com", "s3.us-west-2.amazonaws.com"):
    try:
        print(name, "resolved", socket.gethostbyname(name))
    except OSError:
        print(name, "refused")
print("sts", socket.gethostbyname("sts.us-west-2.amazonaws.com"))
"""
    phase, log = run_probe(namespace, local_cluster.env["FSDP_DLC_IMAGE"], node["metadata"]["name"], command)
    assert phase == "Succeeded", log
    assert "dns 198.19." in log  # the kubernetes Service, from the project's own range, by cluster DNS
    assert "s3 200" in log
    assert "outside OSError 101" in log  # Network is unreachable: no route leaves the pod segment
    assert "example.com refused" in log
    # AWS STS's regional name alone, at the host's end of the pod segment (the local STS, over TLS there).
    assert "s3.us-west-2.amazonaws.com refused" in log
    assert f"sts {local_cluster.env['FSDP_HOST_POD_ADDRESS']}\n" in log


def test_the_host_keeps_its_sysctls_and_its_iptables_while_the_node_runs(node: dict[str, Any]) -> None:
    # The node's kubelet, kube-router and pods have run by now (the session's cluster started them).
    [node_dir] = cluster_settings("NODE_DIR")
    before = dict(line.split("=", 1) for line in (Path(node_dir) / "host-sysctls").read_text().split())
    assert set(before) == set(KUBELET_SYSCTLS)
    for name, value in before.items():
        assert Path(f"/proc/sys/{name}").read_text().strip() == value, f"{name} changed on the host"
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    assert "KUBE-" not in rules, [line for line in rules.splitlines() if "KUBE-" in line][:5]
