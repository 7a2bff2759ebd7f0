"""The real Kueue (tests/kueue.py) admits, queues and preempts RayClusters shaped like the operator's on the
fake GPU nodes; KubeRay then creates the admitted clusters' pods. Each test prints what Kueue wrote (the
Workload's conditions and admission), the facts the operator's Kueue support reads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.kube import delete_namespace, kubectl, kubectl_json
from tests.support.kueue import (
    GPU_INSTANCE_TYPE,
    LABEL_INSTANCE_TYPE,
    LABEL_ZONE,
    SYSTEM_INSTANCE_TYPE,
    KueueProcess,
    conditions,
    kueue_fixture,  # noqa: F401  (the `kueue` session fixture)
    raycluster,
    unique,
    workload_of,
)
from tests.support.waiting import wait_until

ZONE = "us-west-2a"
LOCAL_QUEUES = "localqueues.v1beta2.kueue.x-k8s.io"


@pytest.fixture
def queues(kueue: KueueProcess) -> Iterator[dict[str, str]]:
    """A GPU flavor (g6.12xlarge), a system flavor for heads, and a ClusterQueue with 8 GPUs of quota; they
    are deleted with the session's Kueue objects (tests/kueue.py), while Kueue releases their finalizers."""
    names = {"gpu": unique("g6"), "system": unique("system"), "cq": unique("cq")}
    kueue.gpu_flavor(names["gpu"])
    kueue.system_flavor(names["system"])
    kueue.cluster_queue(names["cq"], gpus=8, gpu_flavor=names["gpu"], system_flavor=names["system"])
    kueue.wait_queue_active(names["cq"])
    yield names


@pytest.fixture(autouse=True)
def kueue_log_on_failure(kueue: KueueProcess) -> Iterator[None]:
    start = kueue.log.stat().st_size if kueue.log.exists() else 0
    yield
    with kueue.log.open(errors="replace") as log:
        log.seek(start)
        print(f"--- Kueue log during the test ({kueue.log}) ---\n{log.read()[-12000:]}")


def create(namespace: str, manifest: dict[str, Any]) -> None:
    kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))


def cluster_of(namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = kubectl_json("get", "raycluster", name, "-n", namespace)
    return found


def pods_of(namespace: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"ray.io/cluster={name}"
    )["items"]
    return items


def admitted_workload(namespace: str, name: str, timeout: float = 90) -> dict[str, Any]:
    def admitted() -> dict[str, Any] | None:
        workload = workload_of(namespace, name)
        if workload and conditions(workload).get("Admitted", {}).get("status") == "True":
            return workload
        return None

    return wait_until(f"Kueue to admit the Workload of RayCluster {namespace}/{name}", admitted, timeout)


def running_pods(namespace: str, name: str, count: int, timeout: float = 90) -> list[dict[str, Any]]:
    def running() -> list[dict[str, Any]] | None:
        pods = pods_of(namespace, name)
        ok = len(pods) == count and all(p.get("status", {}).get("phase") == "Running" for p in pods)
        return pods if ok else None

    return wait_until(f"KubeRay's {count} pods of {namespace}/{name} to run", running, timeout)


def record(what: str, workload: dict[str, Any]) -> None:
    status = {k: v for k, v in workload.get("status", {}).items() if k != "resourceRequests"}
    print(f"--- {what}: Workload {workload['metadata']['name']} ---\n{json.dumps(status, indent=1)}")


def test_a_suspended_raycluster_is_admitted_on_the_gpu_flavor_and_kuberay_creates_its_pods(
    namespace: str,
    kueue: KueueProcess,
    queues: dict[str, str],
) -> None:
    kueue.local_queue(namespace, "team", queues["cq"])
    create(namespace, raycluster("admitted", queue="team", workers=2, zone=ZONE))

    workload = admitted_workload(namespace, "admitted")
    record("admitted", workload)
    found = conditions(workload)
    assert found["QuotaReserved"]["status"] == "True" and found["QuotaReserved"]["reason"] == "QuotaReserved"
    assert found["Admitted"]["status"] == "True"
    assert workload["spec"]["queueName"] == "team"
    assert workload["status"]["admission"]["clusterQueue"] == queues["cq"]
    flavors = {a["name"]: a["flavors"] for a in workload["status"]["admission"]["podSetAssignments"]}
    assert flavors["head"] == dict.fromkeys(("cpu", "memory"), queues["system"])
    assert flavors["gpu-workers"] == dict.fromkeys(
        ("cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa"), queues["gpu"]
    )

    def unsuspended() -> dict[str, Any] | None:
        cluster = cluster_of(namespace, "admitted")
        return cluster if cluster["spec"].get("suspend") is False else None

    cluster = wait_until("Kueue to unsuspend RayCluster admitted", unsuspended, timeout=30)
    head_selector = cluster["spec"]["headGroupSpec"]["template"]["spec"].get("nodeSelector", {})
    worker_selector = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    assert head_selector == {LABEL_INSTANCE_TYPE: SYSTEM_INSTANCE_TYPE}
    assert worker_selector == {LABEL_INSTANCE_TYPE: GPU_INSTANCE_TYPE, LABEL_ZONE: ZONE}

    pods = running_pods(namespace, "admitted", 3)
    nodes = {
        p["metadata"]["labels"]["ray.io/node-type"] + "/" + p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in pods
    }
    assert sorted(n for k, n in nodes.items() if k.startswith("worker/")) == ["gpu-2a-0", "gpu-2a-1"]
    assert [n for k, n in nodes.items() if k.startswith("head/")] == ["system-0"]


def test_a_raycluster_over_the_gpu_quota_stays_suspended_with_the_reason_on_its_workload(
    namespace: str,
    kueue: KueueProcess,
    queues: dict[str, str],
) -> None:
    other = f"{namespace}-b"
    kubectl("create", "namespace", other)
    try:
        kueue.local_queue(namespace, "team", queues["cq"])
        kueue.local_queue(other, "team", queues["cq"])
        create(namespace, raycluster("first", queue="team", workers=2, zone=ZONE))
        admitted_workload(namespace, "first")
        create(other, raycluster("second", queue="team", workers=1, zone="us-west-2b"))

        def pending() -> dict[str, Any] | None:
            workload = workload_of(other, "second")
            reserved = conditions(workload).get("QuotaReserved", {}) if workload else {}
            return workload if reserved.get("status") == "False" and reserved.get("message") else None

        workload = wait_until("the Workload of RayCluster second to report why it waits", pending, timeout=60)
        record("over quota", workload)
        reserved = conditions(workload)["QuotaReserved"]
        assert reserved["reason"] == "Pending"
        assert "insufficient unused quota for nvidia.com/gpu" in reserved["message"], reserved
        assert "Admitted" not in conditions(workload) or conditions(workload)["Admitted"]["status"] == "False"
        assert cluster_of(other, "second")["spec"]["suspend"] is True
        assert pods_of(other, "second") == []

        def counted() -> dict[str, Any] | None:  # Kueue updates a LocalQueue's counts a little later
            found: dict[str, Any] = kubectl_json("get", f"{LOCAL_QUEUES}/team", "-n", other)
            return found if found.get("status", {}).get("pendingWorkloads") == 1 else None

        local_queue = wait_until(f"LocalQueue {other}/team to count a pending workload", counted, timeout=30)
        print(f"--- LocalQueue {other}/team status ---\n{json.dumps(local_queue['status'], indent=1)}")
        summary = kueue.visibility(f"namespaces/{other}/localqueues/team/pendingworkloads")
        print(f"--- visibility API, pending workloads of {other}/team ---\n{json.dumps(summary, indent=1)}")
        [item] = summary["items"]
        assert item["metadata"]["name"] == workload["metadata"]["name"]
        assert item["positionInClusterQueue"] == 0 and item["positionInLocalQueue"] == 0
    finally:
        delete_namespace(other)


def test_a_higher_priority_raycluster_preempts_a_lower_one_which_goes_back_to_suspended(
    namespace: str,
    kueue: KueueProcess,
    queues: dict[str, str],
) -> None:
    low, high = unique("low"), unique("high")
    kueue.priority_class(low, 100)
    kueue.priority_class(high, 1000)
    kueue.local_queue(namespace, "team", queues["cq"])
    create(namespace, raycluster("low", queue="team", workers=2, zone=ZONE, priority_class=low))
    admitted_workload(namespace, "low")
    running_pods(namespace, "low", 3)

    create(namespace, raycluster("high", queue="team", workers=2, zone=ZONE, priority_class=high))
    record("preemptor", admitted_workload(namespace, "high", timeout=120))

    def preempted() -> dict[str, Any] | None:
        workload = workload_of(namespace, "low")
        return (
            workload
            if workload and conditions(workload).get("Preempted", {}).get("status") == "True"
            else None
        )

    workload = wait_until("the Workload of RayCluster low to be preempted", preempted, timeout=60)
    record("preempted", workload)
    found = conditions(workload)
    assert found["Preempted"]["reason"] == "InClusterQueue", found["Preempted"]
    assert found["Evicted"]["status"] == "True" and found["Evicted"]["reason"] == "Preempted", found[
        "Evicted"
    ]
    assert workload["spec"]["priority"] == 100
    wait_until(
        "RayCluster low to be suspended again",
        lambda: cluster_of(namespace, "low")["spec"].get("suspend") is True,
        timeout=30,
    )
    running_pods(namespace, "high", 3)
    wait_until("the pods of RayCluster low to be gone", lambda: not pods_of(namespace, "low"), timeout=60)
