"""Runs the real node cannot start, said in the run's status: a worker disk larger than the node's (an EKS
node on its default 20 GiB root volume, which the real node's allocatable copies), a Secret that does not
exist, and a worker whose `ray start` exits at once. The kubelet, not a stand-in, reports the last two."""

from __future__ import annotations

import re
import time
from typing import Any

from fsdp_operator import quantity, tenancy
from tests.support.kube import grant, kubectl_json
from tests.support.operator_process import OperatorProcess
from tests.support.real_node import RealNode, real_pods_run
from tests.support.reliability import Recorder
from tests.support.runs import conditions_of, rayclusters, run_of, run_summary, wait_for_phase
from tests.support.waiting import wait_until


def test_the_real_node_offers_what_an_eks_node_on_a_20_gib_root_volume_offers(
    real_node: RealNode,
) -> None:
    allocatable = kubectl_json("get", "node", real_node.name)["status"]["allocatable"]["ephemeral-storage"]
    # The kubelet takes its 5% eviction threshold of the disk with a rounding of its own: bytes apart.
    assert abs(quantity.whole(allocatable) - 17 * 2**30) < 2**20, allocatable


def test_a_worker_disk_the_real_node_cannot_hold_fails_at_once_naming_it(
    namespace: str, proxied_operator: OperatorProcess
) -> None:
    started = time.monotonic()
    run = real_pods_run(namespace, **{"cluster.ephemeralStorage": "20Gi"})["metadata"]["name"]
    failed = wait_for_phase(namespace, run, "Failed", timeout=60)
    print(f"Failed {time.monotonic() - started:.1f}s after apply")
    reason = conditions_of(failed)["Failed"]
    assert reason["reason"] == "WorkerFitsNoNode", reason
    # 17Gi less the bytes of the kubelet's rounding: "17.0Gi".
    assert re.search(
        r"20Gi ephemeral-storage per worker, at most 17(\.0)?Gi ephemeral-storage on a node",
        reason["message"],
    ), reason
    assert "diskSize is 20 GiB" in reason["message"] and "instance store" in reason["message"]
    assert rayclusters(namespace) == []


def test_a_secret_that_does_not_exist_is_named_from_the_workers_and_fails_the_run_within_the_bound(
    namespace: str, proxied_operator: OperatorProcess
) -> None:
    """The kubelet refuses to start a container whose env names a missing Secret; in a worker that is
    KubeRay's init container first (it copies the worker's env), which only initContainerStatuses show."""
    bound = 30
    grant(namespace, tenancy.SECRETS, "no-such-secret")  # granted, but nobody has created it
    changes: dict[str, Any] = {
        "cluster.workers": 1,
        "runtimeEnv.secretEnv": {"HF_TOKEN": {"name": "no-such-secret", "key": "token"}},
        "recovery.podErrorTimeoutSeconds": bound,
    }
    started = time.monotonic()
    run = real_pods_run(namespace, **changes)["metadata"]["name"]

    def worker_init_refused() -> dict[str, Any] | None:
        pods = kubectl_json("get", "pods", "-n", namespace, "-l", "ray.io/node-type=worker")["items"]
        for pod in pods:
            for status in pod["status"].get("initContainerStatuses") or []:
                waiting = status.get("state", {}).get("waiting") or {}
                if waiting.get("reason") == "CreateContainerConfigError":
                    return dict(waiting)
        return None

    seen = wait_until("the worker's init container refused by the kubelet", worker_init_refused, timeout=180)
    assert "no-such-secret" in seen.get("message", ""), seen
    shown = wait_until(
        "PodsHealthy False naming the missing Secret",
        lambda: (
            (c := conditions_of(run_of(namespace, run)).get("PodsHealthy")) and c["status"] == "False" and c
        ),
        timeout=60,
    )
    print(f"the missing Secret named in the status {time.monotonic() - started:.1f}s after apply")
    assert shown["reason"] == "CreateContainerConfigError" and "no-such-secret" in shown["message"], shown
    assert "no-such-secret" in run_of(namespace, run)["status"]["message"]
    failed = wait_for_phase(namespace, run, "Failed", timeout=bound + 120)
    assert conditions_of(failed)["Failed"]["reason"] == "CreateContainerConfigError"
    wait_until("the RayCluster deleted", lambda: not rayclusters(namespace), timeout=120)


def test_a_worker_whose_ray_start_fails_is_named_while_the_cluster_provisions_and_fails_the_run(
    namespace: str, real_node: RealNode, proxied_operator: OperatorProcess, reliability: Recorder
) -> None:
    """A worker memory too small for Ray's object store (at least 75 MiB, 30 % of what the container has
    free): `ray start` exits at once on the worker, every time, as a bad CUDA compatibility step or EFA
    initialisation does, while the head is up. The run is never ready (every worker must be), so before the
    fix it waited out provisioningTimeoutSeconds x provisioningAttempts; now the crash loop is named while the
    run provisions (pod, node, exit code, the last log lines the kubelet kept) and fails the run
    podErrorTimeoutSeconds later."""
    bound = 15
    changes: dict[str, Any] = {
        "cluster.workers": 1,
        "cluster.memory": "256Mi",
        "cluster.shmSize": "64Mi",
        "recovery.podErrorTimeoutSeconds": bound,
    }
    started = time.monotonic()
    run = real_pods_run(namespace, **changes)["metadata"]["name"]

    def worker_looping() -> dict[str, Any] | None:
        pods = kubectl_json("get", "pods", "-n", namespace, "-l", "ray.io/node-type=worker")["items"]
        for pod in pods:
            for status in pod["status"].get("containerStatuses") or []:
                waiting = status.get("state", {}).get("waiting") or {}
                if waiting.get("reason") == "CrashLoopBackOff" and status.get("restartCount", 0) >= 3:
                    return {**status, "pod": pod["metadata"]["name"]}
        return None

    # After the head's start: the worker's failed starts, the kubelet backing off between them.
    looping = wait_until("the worker restarted 3 times, in CrashLoopBackOff", worker_looping, timeout=300)
    looped = time.monotonic()
    ended = looping["lastState"]["terminated"]
    assert ended["reason"] == "Error" and "object store" in ended.get("message", ""), ended  # not OOMKilled

    seen: dict[str, Any] = {}

    def named_while_provisioning() -> dict[str, Any] | None:
        seen.update(run_of(namespace, run))
        healthy = conditions_of(seen).get("PodsHealthy") or {}
        named = healthy.get("status") == "False" and looping["pod"] in healthy.get("message", "")
        return healthy if named and seen["status"]["phase"] == "Provisioning" else None

    try:
        shown = wait_until("PodsHealthy False naming the worker's crash loop", named_while_provisioning, 60)
    except AssertionError as waited:
        raise AssertionError(f"{waited}; the run was at {run_summary(seen)}") from None
    named = time.monotonic()
    assert shown["reason"] == "CrashLoopBackOff", shown
    assert f"on node {real_node.name}, exit code {ended['exitCode']}" in shown["message"], shown
    assert "minimum allowed is 78643200 bytes" in shown["message"], "ray start's own words"
    failed = wait_for_phase(namespace, run, "Failed", timeout=bound + 30)
    reason = conditions_of(failed)["Failed"]
    assert reason["reason"] == "CrashLoopBackOff" and looping["pod"] in reason["message"], reason
    assert failed["status"]["attempt"] == 0, "no job was submitted"
    failed_at = time.monotonic()
    measured = (
        f"named {named - looped:.1f} s after the kubelet's CrashLoopBackOff at 3 restarts "
        f"({named - started:.0f} s after apply); Failed {failed_at - named:.0f} s later"
    )
    reliability.record(
        "A worker's `ray start` exits at once, every time (cluster.memory 256Mi: under Ray's 75 MiB object "
        "store minimum), while its head is up: the cluster never gets ready",
        "the crash loop named in PodsHealthy while the run provisions (pod, node, exit code, Ray's last log "
        f"lines), the run Failed podErrorTimeoutSeconds ({bound} s here) later, no job submitted",
        measured,
    )
    print(measured)
    wait_until("the RayCluster deleted", lambda: not rayclusters(namespace), timeout=120)
