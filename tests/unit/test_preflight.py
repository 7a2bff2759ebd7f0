"""Preflight decisions on node and EC2 facts (pure)."""

from __future__ import annotations

from typing import Any

from fsdp_operator import api, preflight

BASE_SPEC: dict[str, Any] = {
    "model": {"source": "Qwen/Qwen2.5-1.5B"},
    "checkpoint": {"storagePath": "s3://bucket/runs"},
}


def spec(**cluster: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate({**BASE_SPEC, "cluster": cluster})


def node(name: str, zone: str, gpus: int = 4, efa: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {
                "node.kubernetes.io/instance-type": "g6.12xlarge",
                "topology.kubernetes.io/zone": zone,
            },
        },
        "spec": extra.get("spec", {}),
        "status": {
            "allocatable": {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa)},
            "conditions": [{"type": "Ready", "status": extra.get("ready", "True")}],
        },
    }


def pod_on(node_name: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
    return {
        "spec": {
            "nodeName": node_name,
            "containers": [{"resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}],
        },
        "status": {"phase": phase},
    }


NODES = [
    node("a0", "us-west-2a"),
    node("a1", "us-west-2a"),
    node("b0", "us-west-2b"),
    node("b1", "us-west-2b"),
]


def check(
    s: api.FSDPTrainingRunSpec, nodes: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> preflight.PreflightResult:
    return preflight.check_nodes(s, preflight.free_worker_nodes(s, nodes, pods))


def test_two_workers_fit_in_one_zone() -> None:
    result = check(spec(workers=2), NODES, [])
    assert result.ok and result.reason == "CapacityAvailable" and result.zone == "us-west-2a"


def test_zone_with_more_free_capacity_is_chosen() -> None:
    result = check(spec(workers=2), NODES, [pod_on("a0", 4)])
    assert result.ok and result.zone == "us-west-2b"


def test_three_workers_would_span_zones() -> None:
    result = check(spec(workers=3), NODES, [])
    assert not result.ok and result.reason == "WouldSpanZones"
    assert result.capacity_by_zone == {"us-west-2a": 2, "us-west-2b": 2}


def test_more_gpus_than_exist_is_insufficient_capacity() -> None:
    result = check(spec(workers=5), NODES, [])
    assert not result.ok and result.reason == "InsufficientCapacity"
    assert "5 x (4 GPU, 1 EFA)" in result.message


def test_pods_already_using_gpus_count_and_finished_pods_do_not() -> None:
    busy = [pod_on("a0", 4), pod_on("a1", 2), pod_on("b0", 4, phase="Succeeded")]
    result = check(spec(workers=2), NODES, busy)
    assert result.ok and result.zone == "us-west-2b"


def test_efa_is_a_limit_of_its_own() -> None:
    no_efa = [node("a0", "us-west-2a", efa=0), node("a1", "us-west-2a", efa=0)]
    assert check(spec(workers=2), no_efa, []).reason == "InsufficientCapacity"
    assert check(spec(workers=2, efaPerWorker=0), no_efa, []).ok


def test_unready_cordoned_and_tainted_nodes_are_not_capacity() -> None:
    nodes = [
        node("a0", "us-west-2a", ready="False"),
        node("a1", "us-west-2a", spec={"unschedulable": True}),
        node("b0", "us-west-2b", spec={"taints": [{"key": "dedicated", "effect": "NoSchedule"}]}),
    ]
    assert check(spec(workers=1), nodes, []).reason == "NoMatchingNodes"
    tolerating = spec(workers=1, tolerations=[{"key": "dedicated", "operator": "Exists"}])
    assert check(tolerating, nodes, []).zone == "us-west-2b"


def test_the_gpu_taint_of_gpu_node_groups_is_tolerated_as_the_workers_tolerate_it() -> None:
    gpu_tainted = [
        node("b0", "us-west-2b", spec={"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]})
    ]
    assert check(spec(workers=1), gpu_tainted, []).zone == "us-west-2b"


def test_no_nodes_of_the_instance_type() -> None:
    result = check(spec(workers=1, instanceType="p5.48xlarge"), NODES, [])
    assert not result.ok and result.reason == "NoMatchingNodes"


def test_pinned_zone_is_respected() -> None:
    assert check(spec(workers=2, zone="us-west-2b"), NODES, []).zone == "us-west-2b"
    assert check(spec(workers=2, zone="us-west-2c"), NODES, []).reason == "InsufficientCapacity"


G6 = preflight.InstanceTypeFacts(
    "g6.12xlarge", True, gpus=4, efa_supported=True, max_efa_interfaces=1, zones=("us-west-2a", "us-west-2b")
)


def test_scale_from_zero_offered_with_efa() -> None:
    result = preflight.check_instance_type(spec(), G6)
    assert result.ok and result.zone == "us-west-2a"


def test_scale_from_zero_refusals_name_the_reason() -> None:
    no_efa = preflight.InstanceTypeFacts(
        "g5.xlarge", True, gpus=1, efa_supported=False, zones=("us-west-2a",)
    )
    assert preflight.check_instance_type(spec(gpusPerWorker=1), no_efa).reason == "EfaUnsupported"
    assert preflight.check_instance_type(spec(gpusPerWorker=8), G6).reason == "NotEnoughGPUs"
    assert preflight.check_instance_type(spec(zone="eu-west-1a"), G6).reason == "InstanceTypeNotOffered"
    unknown = preflight.InstanceTypeFacts("x9.huge", False)
    assert preflight.check_instance_type(spec(), unknown).reason == "UnknownInstanceType"
