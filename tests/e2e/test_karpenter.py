"""Runs on GPU nodes that real Karpenter adds from zero (its KWOK provider, with each EKS type's allocatable
as Karpenter's AWS provider estimates it before the type has ever launched: tests/support/karpenter.py).

The workers are pinned to Karpenter's GPU NodePool by spec.cluster.nodeSelector (karpenter.sh/nodepool): the
local cluster's fixed g6.12xlarge node groups would take them otherwise.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

from fsdp_operator import builder, quantity
from tests.support.demo import demo_manifest
from tests.support.karpenter import (
    GPU_POOL,
    HEAD_POOL,
    LABEL_NODEPOOL,
    ZONE_WITHOUT_SUBNET,
    Karpenter,
    node_claims,
)
from tests.support.kube import apply, kubectl, kubectl_json
from tests.support.operator_process import OperatorProcess
from tests.support.reliability import Recorder
from tests.support.runs import conditions_of, rayclusters, run_of, run_summary, wait_for_phase
from tests.support.waiting import wait_until

# From Karpenter's FailedScheduling on a worker to the run's Failed condition (both stamped by this machine's
# clock): the operator's 2 s observation and its pass, with room for a loaded machine. Measured 0-1 s (whole
# seconds) at a load average of 78 on 2 cores.
REFUSAL_BOUND = 30
# From a run's creation to Karpenter's refusal: the operator's own start (the test starts it), preflight,
# KubeRay's pods, the scheduler's verdict and Karpenter's batch window (1 s idle, 10 s at most). Measured 16 s
# on a quiet machine, 32-36 s at a load average of 43, half of it the operator's start.
CREATION_TO_REFUSAL_BOUND = 120
# From Karpenter's nomination to the cluster ready: the node class's 15 s registration delay (a GPU instance
# booting), KWOK making the node Ready, Karpenter registering it, the workers bound and started.
SCALE_UP_BOUND = 120
# A restarted operator's podErrorTimeoutSeconds for the head's HeadUnschedulable (300 s by default): the head
# must be seen waiting on its nomination for this long, and a few passes more, after the restart.
RESTART_POD_ERROR_TIMEOUT = 10


def ray_pods(namespace: str, run: str, node_type: str) -> list[dict[str, Any]]:
    cluster = (run_of(namespace, run).get("status") or {}).get("rayClusterName")
    if not cluster:
        return []
    selector = f"ray.io/cluster={cluster},ray.io/node-type={node_type}"
    pods: list[dict[str, Any]] = kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return pods


def karpenter_says(namespace: str, pod: str) -> tuple[str, str] | None:
    """Karpenter's newest event on a pod: (reason, message)."""
    events = kubectl_json("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={pod}")[
        "items"
    ]
    said = [e for e in events if (e.get("source") or {}).get("component") == "karpenter"]
    newest = max(
        said, key=lambda e: e.get("lastTimestamp") or e["metadata"]["creationTimestamp"], default=None
    )
    return (newest["reason"], newest["message"]) if newest else None


def karpenter_verdicts(namespace: str, run: str) -> dict[str, tuple[str, str] | None]:
    """Karpenter's newest word on each of the run's Ray pods, by pod name."""
    found = ray_pods(namespace, run, "worker") + ray_pods(namespace, run, "head")
    return {p["metadata"]["name"]: karpenter_says(namespace, p["metadata"]["name"]) for p in found}


def all_nominated(verdicts: dict[str, tuple[str, str] | None], pods: int) -> bool:
    return len(verdicts) == pods and all(v and v[0] == "Nominated" for v in verdicts.values())


def _stamp(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def karpenter_refused_at(namespace: str, run: str) -> dt.datetime:
    """When Karpenter first said it could make no node for a worker of the run (its FailedScheduling event;
    the event outlives the pod, which the failed run's cluster takes with it)."""
    workers = f"{builder.ray_cluster_name(run)}-{builder.WORKER_GROUP}-"
    events = kubectl_json("get", "events", "-n", namespace, "--field-selector", "reason=FailedScheduling")
    refusals = [
        _stamp(e["firstTimestamp"])
        for e in events["items"]
        if (e.get("source") or {}).get("component") == "karpenter"
        and e["involvedObject"]["name"].startswith(workers)
    ]
    assert refusals, f"no FailedScheduling of Karpenter's on a worker of {run}"
    return min(refusals)


def test_the_default_g6_worker_scales_from_zero_through_karpenter(
    namespace: str, s3: Any, karpenter: Karpenter, lifecycle_operator: OperatorProcess
) -> None:
    """Two workers of g6.12xlarge with every size left to the operator's defaults, and the head, on nodes
    Karpenter adds: each pod gets its Nominated event, a node is made from a NodeClaim, the run shows the wait
    in Karpenter's words and then its cluster ready. Defaults above Karpenter's estimate of the type (memory
    11/12 of 192 GiB = 176Gi, over its 174.7 GiB) never get a node."""
    name = "from-zero"
    on_karpenters_nodes: dict[str, Any] = {
        "preflight.scaleFromZero": True,
        "cluster.nodeSelector": {LABEL_NODEPOOL: GPU_POOL},
        "cluster.head.nodeSelector": {LABEL_NODEPOOL: HEAD_POOL},
    }
    manifest = demo_manifest(name, **on_karpenters_nodes)
    cluster = manifest["spec"]["cluster"]
    assert (cluster.get("instanceType", "g6.12xlarge"), cluster["workers"]) == ("g6.12xlarge", 2)
    assert not {"cpu", "memory", "ephemeralStorage"} & cluster.keys(), "the worker sizes are the defaults"
    start = time.monotonic()
    apply(namespace, manifest)

    verdicts: dict[str, tuple[str, str] | None] = {}
    waits: list[dict[str, Any]] = []  # the run's PodsScheduled while it waited for Karpenter's nodes

    def run_now() -> dict[str, Any]:
        run = run_of(namespace, name)
        if run.get("status", {}).get("phase") == "Failed":
            raise AssertionError(f"the run failed: {run_summary(run)}; Karpenter said: {verdicts}")
        scheduled = conditions_of(run).get("PodsScheduled") or {}
        if scheduled.get("reason") == "WaitingForScaleUp" and not waits:
            waits.append(scheduled)
        return run

    def nominated() -> bool:
        run_now()
        verdicts.clear()
        verdicts.update(karpenter_verdicts(namespace, name))
        return all_nominated(verdicts, 3)

    try:
        wait_until("Karpenter's Nominated event on both workers and the head", nominated, timeout=90)
    except AssertionError as waited:
        raise AssertionError(f"{waited}; Karpenter said: {verdicts}") from None
    to_nomination = time.monotonic() - start
    assert all("Pod should schedule on: nodeclaim/" in v[1] for v in verdicts.values() if v), verdicts

    def cluster_ready() -> bool:
        return conditions_of(run_now()).get("ClusterReady", {}).get("status") == "True"

    try:
        wait_until("ClusterReady=True on Karpenter's nodes", cluster_ready, timeout=SCALE_UP_BOUND)
    except AssertionError as waited:
        raise AssertionError(f"{waited}; the run: {run_summary(run_of(namespace, name))}") from None
    to_ready = time.monotonic() - start
    assert waits, "the run never showed PodsScheduled=False WaitingForScaleUp while Karpenter added nodes"
    assert waits[0]["status"] == "False", waits
    assert "Nominated: Pod should schedule on: nodeclaim/" in waits[0]["message"], waits

    run = run_of(namespace, name)
    assert conditions_of(run)["PodsScheduled"]["status"] == "True"
    claims = {c["status"].get("nodeName"): c for c in node_claims()}
    workers = ray_pods(namespace, name, "worker")
    [head] = ray_pods(namespace, name, "head")
    assert claims[head["spec"]["nodeName"]]["metadata"]["labels"][LABEL_NODEPOOL] == HEAD_POOL
    worker_nodes = {pod["spec"]["nodeName"] for pod in workers}
    assert len(workers) == 2 and len(worker_nodes) == 2, "one g6.12xlarge node per worker"
    memory = quantity.whole(workers[0]["spec"]["containers"][0]["resources"]["requests"]["memory"])
    for node_name in worker_nodes:
        claim = claims[node_name]  # the node was made from this NodeClaim
        assert claim["metadata"]["labels"][LABEL_NODEPOOL] == GPU_POOL, claim["metadata"]
        node = kubectl_json("get", "node", node_name)
        labels = node["metadata"]["labels"]
        assert node["spec"]["providerID"] == claim["status"]["providerID"]
        assert labels["node.kubernetes.io/instance-type"] == "g6.12xlarge"
        assert labels["topology.kubernetes.io/zone"] == run["status"]["zone"]
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake", "KWOK manages the node"
        # What the node offers is the AWS provider's estimate, under 176Gi: the worker's default fits it.
        allocatable = quantity.whole(node["status"]["allocatable"]["memory"])
        assert memory <= allocatable < quantity.whole("176Gi"), (memory, allocatable)
    print(f"Karpenter nominated at {to_nomination:.0f}s, the cluster was ready at {to_ready:.0f}s")


def test_a_worker_no_node_pool_can_fit_fails_at_once_naming_karpenters_reason(
    namespace: str, s3: Any, karpenter: Karpenter, lifecycle_operator: OperatorProcess
) -> None:
    """Three runs whose worker Karpenter can make no node for. Two preflight foresees from the NodePools
    before any pod exists: one asks for spot capacity, which the GPU NodePool does not offer, one for every
    vCPU of a g6.12xlarge, more than Karpenter assumes its node offers; they fail at once, holding nothing.
    The third is pinned to a zone the node class has no subnet in, which only Karpenter knows: it fails within
    REFUSAL_BOUND s of Karpenter's refusal, with Karpenter's reason. No node is made for any."""
    common: dict[str, Any] = {
        "preflight.scaleFromZero": True,
        "cluster.workers": 1,
        "cluster.memory": "160Gi",  # under the type's estimate: only the named cause is left
        "cluster.head.cpu": "1",  # the heads on the fixed system node
        "cluster.head.memory": "4Gi",
    }
    foreseen: dict[str, tuple[dict[str, Any], str]] = {
        "wants-spot": (
            {"cluster.nodeSelector": {LABEL_NODEPOOL: GPU_POOL, "karpenter.sh/capacity-type": "spot"}},
            "karpenter.sh/capacity-type",
        ),
        "whole-cpu": ({"cluster.nodeSelector": {LABEL_NODEPOOL: GPU_POOL}, "cluster.cpu": "48"}, "cpu"),
    }
    for name, (changes, _) in foreseen.items():
        apply(namespace, demo_manifest(name, **common, **changes))
    unseen = {"cluster.nodeSelector": {LABEL_NODEPOOL: GPU_POOL}, "cluster.zone": ZONE_WITHOUT_SUBNET}
    apply(namespace, demo_manifest("no-subnet", **common, **unseen))
    for name, (_, named) in foreseen.items():
        failed = wait_for_phase(namespace, name, "Failed", timeout=CREATION_TO_REFUSAL_BOUND)
        reason = conditions_of(failed)["Failed"]
        assert reason["reason"] == "NoNodePoolOrNodeGroupCanLaunch", reason
        assert GPU_POOL in reason["message"] and named in reason["message"], reason
        assert not failed["status"].get("rayClusterName"), "preflight refused it before any RayCluster"
    failed = wait_for_phase(namespace, "no-subnet", "Failed", timeout=CREATION_TO_REFUSAL_BOUND)
    reason = conditions_of(failed)["Failed"]
    assert reason["reason"] == "NoNodePoolFits", reason
    assert "Failed to schedule pod" in reason["message"], reason
    took = (
        _stamp(reason["lastTransitionTime"]) - karpenter_refused_at(namespace, "no-subnet")
    ).total_seconds()
    assert took <= REFUSAL_BOUND, took
    assert not node_claims(), "Karpenter made no node for them"
    print(f"seconds from Karpenter's FailedScheduling to the run's Failed: {took}")


def test_the_heads_scale_up_is_seen_after_an_operator_restart(
    namespace: str, s3: Any, karpenter: Karpenter, lifecycle_operator: OperatorProcess, reliability: Recorder
) -> None:
    """A run whose head and three workers wait on nodes Karpenter is adding (GPU instances that boot for
    minutes) across an operator restart: the operator is killed once it has created the RayCluster and
    started again once Karpenter has nominated every pod. The restarted operator lists the pods by name,
    workers before the head, and must still read the head's Nominated event: without it the head is
    HeadUnschedulable, a pod that cannot start, and the run fails after podErrorTimeoutSeconds though its node
    is on the way. The run's spec is edited while no operator runs (a shorter podErrorTimeoutSeconds), so
    that what the restarted operator wrote carries the new generation."""
    slow_boot = {"spec": {"nodeRegistrationDelay": "10m"}}  # no node registers while the test looks
    kubectl("patch", "kwoknodeclass", "default", "--type=merge", "-p", json.dumps(slow_boot))
    name = "restarted"
    # Three workers, listed before the head by name: the operator once read the events of only the first
    # three waiting pods, in its index's order.
    changes: dict[str, Any] = {
        "preflight.scaleFromZero": True,
        "cluster.workers": 3,
        "cluster.memory": "160Gi",  # under Karpenter's estimate of a g6.12xlarge
        "cluster.nodeSelector": {LABEL_NODEPOOL: GPU_POOL},
        "cluster.head.nodeSelector": {LABEL_NODEPOOL: HEAD_POOL},
    }
    apply(namespace, demo_manifest(name, **changes))
    wait_until("the operator to create the run's RayCluster", lambda: rayclusters(namespace), timeout=90)
    lifecycle_operator.kill()  # at once, as an OOM kill or a drained node ends it
    shorter = {"spec": {"recovery": {"podErrorTimeoutSeconds": RESTART_POD_ERROR_TIMEOUT}}}
    kubectl("patch", "fsdptrainingrun", name, "-n", namespace, "--type=merge", "-p", json.dumps(shorter))
    generation = run_of(namespace, name)["metadata"]["generation"]
    verdicts: dict[str, tuple[str, str] | None] = {}

    def nominated() -> bool:
        verdicts.clear()
        verdicts.update(karpenter_verdicts(namespace, name))
        return all_nominated(verdicts, 4)

    try:
        wait_until("Karpenter's Nominated event on the three workers and the head", nominated, timeout=90)
    except AssertionError as waited:
        raise AssertionError(f"{waited}; Karpenter said: {verdicts}") from None
    [head] = [pod["metadata"]["name"] for pod in ray_pods(namespace, name, "head")]
    assert max(verdicts) == head, "the head's name sorts after the workers': a relisted index has it last"

    restarted = time.monotonic()
    lifecycle_operator.start()

    def restarted_wrote(run: dict[str, Any], condition: str) -> dict[str, Any]:
        found = conditions_of(run).get(condition) or {}
        return found if found.get("observedGeneration") == generation else {}

    def not_failed() -> dict[str, Any]:
        run = run_of(namespace, name)
        unhealthy = restarted_wrote(run, "PodsHealthy").get("status") == "False"
        if run["status"].get("phase") != "Provisioning" or unhealthy:
            raise AssertionError(f"the head's scale-up was missed: {run_summary(run)}")
        return run

    def head_seen_waiting() -> dict[str, Any] | None:
        scheduled = restarted_wrote(not_failed(), "PodsScheduled")
        return scheduled if f"pod {head}:" in scheduled.get("message", "") else None

    seen = wait_until("the restarted operator's PodsScheduled naming the head", head_seen_waiting, 90)
    took = time.monotonic() - restarted
    assert (seen["status"], seen["reason"]) == ("False", "WaitingForScaleUp"), seen
    head_wait = seen["message"].split(f"pod {head}:", 1)[1]
    assert "Nominated: Pod should schedule on: nodeclaim/" in head_wait.split("; pod ", 1)[0], seen
    # Past the restarted operator's podErrorTimeoutSeconds, and three of its 2 s passes more.
    deadline = time.monotonic() + RESTART_POD_ERROR_TIMEOUT + 6
    while time.monotonic() < deadline:
        not_failed()
        time.sleep(1)
    held = time.monotonic() - restarted
    measured = (
        f"the head's scale-up shown {took:.0f} s after the restart (the operator's start "
        f"included); still waiting at {held:.0f} s"
    )
    reliability.record(
        "The operator SIGKILLed and started again while a run's head and three workers wait on nodes "
        "Karpenter is adding (Nominated); its pod index relisted by name, workers before the head",
        "the head's Nominated read: PodsScheduled WaitingForScaleUp naming it, the run still provisioning "
        f"past podErrorTimeoutSeconds ({RESTART_POD_ERROR_TIMEOUT} s here; HeadUnschedulable before)",
        measured,
    )
    print(measured)
