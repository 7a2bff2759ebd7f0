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


def eks_node(name: str, zone: str, disk: str = "18Gi", **allocatable: str) -> dict[str, Any]:
    """A g6.12xlarge as an EKS managed node group makes it: a 20 GiB root volume, ~18Gi of it allocatable."""
    found = node(name, zone)
    found["status"]["allocatable"] |= {
        "cpu": "47810m",
        "memory": "187Gi",
        "ephemeral-storage": disk,
        **allocatable,
    }
    return found


def admit_alone(run_spec: api.FSDPTrainingRunSpec, nodes: list[dict[str, Any]], pods: list[Any]) -> Any:
    from fsdp_operator.admission import Admission
    from fsdp_operator.builder import RunRef
    from fsdp_operator.kube import Indexes

    indexes = Indexes(
        runs={}, rayclusters={}, ray_pods={}, nodes={None: nodes}, accelerator_pods={None: pods}
    )
    admission = Admission(watch_namespaces=[], kube=None, ec2=lambda: None)
    return admission.admit(RunRef("r", "team-a", "uid-r"), run_spec, "2026-12-01T00:00:00Z", indexes)


def test_a_worker_larger_than_every_node_is_refused_naming_each_resource_and_what_to_change() -> None:
    """Qwen2.5-1.5B's worker disk on EKS's default 20 GiB root volume: the run would wait for ever. The
    message says what the default is made of and what to change on the node group."""
    nodes = [eks_node("a0", "us-west-2a"), eks_node("a1", "us-west-2a")]
    result = admit_alone(spec(), nodes, [])
    assert not result.ok and result.reason == preflight.WORKER_FITS_NO_NODE
    assert "33Gi ephemeral-storage per worker, at most 18Gi ephemeral-storage on a node" in result.message
    assert (
        "33Gi for a 1.5B-parameter model: 3Gi model download, 17Gi checkpoint copied whole" in result.message
    )
    assert "diskSize is 20 GiB" in result.message and "localStorage" in result.message
    assert "g6.12xlarge has 3760 GB of NVMe instance store" in result.message
    explicit = admit_alone(spec(ephemeralStorage="100Gi"), nodes, []).message
    assert "(lower spec.cluster.ephemeralStorage, or give the node group larger disks" in explicit
    too_big = admit_alone(spec(cpu="64", memory="300Gi", ephemeralStorage="10Gi"), nodes, [])
    assert "64 CPU per worker, at most 47.81 CPU on a node (lower spec.cluster.cpu)" in too_big.message
    assert (
        "300Gi memory per worker, at most 187Gi memory on a node (lower spec.cluster.memory)"
        in too_big.message
    )
    assert "ephemeral-storage" not in too_big.message
    assert admit_alone(spec(ephemeralStorage="10Gi"), nodes, []).ok


def test_cpu_memory_and_disk_other_workers_hold_are_counted_and_the_short_one_named() -> None:
    nodes = [eks_node(f"a{i}", "us-west-2a", disk="450Gi", **{"nvidia.com/gpu": "8"}) for i in range(2)]
    holding = [
        {
            "spec": {
                "nodeName": f"a{i}",
                "containers": [{"resources": {"requests": {"nvidia.com/gpu": "4", "cpu": "20"}}}],
            },
            "status": {"phase": "Running"},
        }
        for i in range(2)
    ]
    two_gpus = spec(
        gpusPerWorker=2, efaPerWorker=0, cpu="16", memory="40Gi", ephemeralStorage="100Gi", workers=4
    )
    result = check(two_gpus, nodes, holding)
    assert not result.ok and result.reason == "InsufficientCapacity"
    assert "short of cpu (2 worker slots by it)" in result.message, result.message
    assert check(two_gpus, nodes, []).ok  # without the other workers they fit


def test_a_worker_that_fits_no_node_fails_the_run_at_once_under_the_wait_policy() -> None:
    import datetime as dt

    from fsdp_operator import conditions
    from fsdp_operator.reconcile import Observation, reconcile

    refused = preflight.PreflightResult(
        False, preflight.WORKER_FITS_NO_NODE, "no g6.12xlarge node can take one"
    )
    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    decision = reconcile(spec(), api.FSDPTrainingRunStatus(), Observation(now, 1, None, preflight=refused))
    assert decision.status.phase == api.Phase.FAILED and not decision.create_cluster
    failed = conditions.condition(decision.status.conditions, conditions.FAILED)
    assert failed is not None and failed.reason == preflight.WORKER_FITS_NO_NODE


def test_nodes_without_efa_say_what_dra_needs_and_admission_through_dra_does_not_count_it() -> None:
    no_efa = [eks_node("a0", "us-west-2a", disk="500Gi", **{"vpc.amazonaws.com/efa": "0"})]
    refused = admit_alone(spec(), no_efa, [])
    assert refused.reason == preflight.WORKER_FITS_NO_NODE and "efa-device-class" in refused.message
    assert "efa.networking.k8s.aws" in refused.message

    from fsdp_operator.admission import Admission
    from fsdp_operator.builder import RunRef
    from fsdp_operator.kube import Indexes

    indexes = Indexes(runs={}, rayclusters={}, ray_pods={}, nodes={None: no_efa}, accelerator_pods={None: []})
    through_dra = Admission(watch_namespaces=[], kube=None, ec2=lambda: None, efa_through_dra=True)
    one = spec(workers=1)
    assert through_dra.admit(RunRef("r", "team-a", "uid-r"), one, "2026-12-01T00:00:00Z", indexes).ok


def test_a_worker_too_large_for_the_nodes_of_the_zone_it_names_is_refused_whatever_other_zones_have() -> None:
    small = eks_node("c0", "us-west-2c")
    large = eks_node("a0", "us-west-2a", disk="500Gi")
    result = admit_alone(spec(zone="us-west-2c"), [small, large], [])
    assert result.reason == preflight.WORKER_FITS_NO_NODE, result
    assert "no g6.12xlarge node in us-west-2c can take one worker" in result.message
    assert admit_alone(spec(), [small, large], []).reason != preflight.WORKER_FITS_NO_NODE


def test_an_elastic_run_is_admitted_on_its_fewest_workers_when_that_is_all_a_zone_has() -> None:
    """Three workers fit no zone (two each); with minWorkers 2 the run starts on two in one zone."""
    rigid = check(spec(workers=3, zone="us-west-2a"), NODES, [])
    assert rigid.reason == "InsufficientCapacity"
    elastic = check(spec(workers=3, minWorkers=2, zone="us-west-2a"), NODES, [])
    assert elastic.ok and elastic.reason == "ElasticCapacityAvailable" and elastic.zone == "us-west-2a"
    assert "2 of 3 x (4 GPU, 1 EFA) fit in zone us-west-2a" in elastic.message
    assert check(spec(workers=3, minWorkers=3, zone="us-west-2a"), NODES, []).reason == "InsufficientCapacity"


G6_ABC = preflight.InstanceTypeFacts(
    "g6.12xlarge",
    True,
    gpus=4,
    efa_supported=True,
    max_efa_interfaces=1,
    zones=("us-west-2a", "us-west-2b", "us-west-2c"),
)


def nodepool(name: str, *requirements: tuple[str, str, list[str]], **template: Any) -> preflight.NodePool:
    """A NodePool as the apiserver returns it, read as preflight reads it."""
    return preflight.NodePool.of(
        {
            "metadata": {"name": name},
            "spec": {
                "template": {
                    "metadata": {"labels": template.get("labels", {})},
                    "spec": {
                        "requirements": [
                            {"key": key, "operator": op, "values": values} for key, op, values in requirements
                        ],
                        "taints": template.get("taints", []),
                    },
                }
            },
        }
    )


ZONE, TYPE, FAMILY = (
    "topology.kubernetes.io/zone",
    "node.kubernetes.io/instance-type",
    ("karpenter.k8s.aws/instance-family"),
)


def test_scale_from_zero_goes_to_a_zone_a_nodepool_can_launch_the_type_in_not_the_first_ec2_offers() -> None:
    """EC2 offers g6.12xlarge in a, b and c; the only GPU NodePool launches in c: the workers go there (in a
    they would wait for a node Karpenter never adds)."""
    gpu = nodepool("gpu", (ZONE, "In", ["us-west-2c"]), (FAMILY, "In", ["g6", "p5"]))
    cpu = nodepool("cpu", (FAMILY, "In", ["m7i"]))
    result = preflight.check_instance_type(spec(), G6_ABC, preflight.Launchers(nodepools=(cpu, gpu)))
    assert (result.ok, result.reason, result.zone) == (True, "InstanceTypeLaunchable", "us-west-2c"), result
    assert "NodePool gpu can launch g6.12xlarge in us-west-2c" in result.message


def test_scale_from_zero_goes_to_a_zone_of_a_node_group_that_launches_the_type() -> None:
    groups = (
        preflight.NodeGroup("eks-p5", ("us-west-2a",), ("p5.48xlarge",)),
        preflight.NodeGroup("eks-g6", ("us-west-2b", "us-west-2d"), ("g6.12xlarge",)),
    )
    result = preflight.check_instance_type(spec(), G6_ABC, preflight.Launchers(node_groups=groups))
    assert (result.ok, result.zone) == (True, "us-west-2b"), result  # d: EC2 does not offer the type there


def test_with_nodepools_and_node_groups_visible_and_none_able_to_launch_the_type_the_run_is_refused() -> None:
    pools = (
        nodepool("p5-only", (TYPE, "In", ["p5.48xlarge"])),
        nodepool("no-g6", (FAMILY, "NotIn", ["g6"])),
        nodepool("big-gpus", ("karpenter.k8s.aws/instance-gpu-count", "Gt", ["4"])),
        nodepool("graviton", ("kubernetes.io/arch", "In", ["arm64"])),
        nodepool("dedicated", taints=[{"key": "team", "value": "ml", "effect": "NoSchedule"}]),
        nodepool("elsewhere", (ZONE, "In", ["us-east-1a"])),
    )
    groups = (preflight.NodeGroup("eks-g6", ("us-west-2d",), ("g6.12xlarge",)),)
    result = preflight.check_instance_type(spec(), G6_ABC, preflight.Launchers(pools, groups))
    assert (result.ok, result.reason) == (False, preflight.NOT_LAUNCHABLE), result
    for why in (
        "NodePool p5-only requires node.kubernetes.io/instance-type In ['p5.48xlarge'], which rules out",
        "NodePool no-g6 requires karpenter.k8s.aws/instance-family NotIn ['g6']",
        "NodePool big-gpus requires karpenter.k8s.aws/instance-gpu-count Gt ['4']",
        "NodePool graviton requires kubernetes.io/arch In ['arm64']: g6.12xlarge is amd64",
        "NodePool dedicated taints its nodes team=ml:NoSchedule, not tolerated (spec.cluster.tolerations)",
        "NodePool elsewhere allows none of the zones EC2 offers g6.12xlarge in",
    ):
        assert why in result.message, (why, result.message)
    # node groups past the shown NodePools are counted, not listed
    assert "1 more" in result.message
    nothing = preflight.check_instance_type(spec(), G6_ABC, preflight.Launchers((), ()))
    assert nothing.reason == preflight.NOT_LAUNCHABLE and "the cluster has none" in nothing.message


def test_a_nodepool_launches_for_the_workers_only_what_their_selector_and_tolerations_allow() -> None:
    dedicated = nodepool(
        "ml",
        ("team", "In", ["ml", "research"]),
        labels={"tier": "gpu"},
        taints=[{"key": "team", "value": "ml", "effect": "NoSchedule"}],
    )
    tolerating = {"tolerations": [{"key": "team", "operator": "Equal", "value": "ml"}]}
    launchers = preflight.Launchers(nodepools=(dedicated,), node_groups=())
    assert preflight.check_instance_type(spec(**tolerating), G6_ABC, launchers).zone == "us-west-2a"
    for selector, fits in (
        ({"team": "research"}, True),
        ({"tier": "gpu", "karpenter.sh/capacity-type": "on-demand"}, True),
        ({"karpenter.sh/nodepool": "ml"}, True),
        ({"team": "infra"}, False),
        ({"tier": "cpu"}, False),
        ({"rack": "r1"}, False),  # a label the NodePool never sets
        ({"karpenter.sh/nodepool": "other"}, False),
    ):
        result = preflight.check_instance_type(spec(nodeSelector=selector, **tolerating), G6_ABC, launchers)
        assert result.ok is fits, (selector, result)
        if not fits:
            assert "(spec.cluster.nodeSelector)" in result.message
    zone_b = spec(nodeSelector={ZONE: "us-west-2b"}, **tolerating)
    assert preflight.check_instance_type(zone_b, G6_ABC, launchers).zone == "us-west-2b"


def test_a_named_zone_no_launcher_serves_is_refused_naming_the_zones_they_serve() -> None:
    gpu = nodepool("gpu", (ZONE, "In", ["us-west-2c"]))
    result = preflight.check_instance_type(
        spec(zone="us-west-2a"), G6_ABC, preflight.Launchers(nodepools=(gpu,))
    )
    assert (result.ok, result.reason) == (False, preflight.NOT_LAUNCHABLE)
    assert "in zone us-west-2a: they can in us-west-2c (NodePool gpu) (spec.cluster.zone)" in result.message


def test_one_visible_autoscaler_that_cannot_launch_the_type_leaves_the_choice_to_ec2s_offerings() -> None:
    """NodePools for CPU only, node groups not visible (no autoscaling permission): a node group may launch
    it, so the run goes where EC2 offers the type, and the message says what was seen."""
    cpu = nodepool("cpu", (FAMILY, "In", ["m7i"]))
    result = preflight.check_instance_type(spec(), G6_ABC, preflight.Launchers(nodepools=(cpu,)))
    assert (result.ok, result.reason, result.zone) == (True, "InstanceTypeOffered", "us-west-2a")
    assert "no visible NodePool or node group launches it: NodePool cpu requires" in result.message
    assert preflight.check_instance_type(spec(), G6_ABC).message == (
        "g6.12xlarge is offered in us-west-2a, us-west-2b, us-west-2c; workers go to us-west-2a"
    )


def test_a_type_without_efa_is_refused_when_the_run_requires_efa_whatever_its_efa_default() -> None:
    """Sized by EC2, a type without EFA defaults to no interface; network.efa required still needs one."""
    g5 = preflight.InstanceTypeFacts("g5.xlarge", True, gpus=1, zones=("us-west-2a",))
    required = api.FSDPTrainingRunSpec.model_validate(
        {**BASE_SPEC, "cluster": {"gpusPerWorker": 1, "efaPerWorker": 0}, "network": {"efa": "required"}}
    )
    result = preflight.check_instance_type(required, g5)
    assert (result.ok, result.reason) == (False, "EfaUnsupported") and "spec.network.efa" in result.message
    preferred = required.model_copy(
        update={"network": required.network.model_copy(update={"efa": "preferred"})}
    )
    assert preflight.check_instance_type(preferred, g5).ok


def daemon_pod(node_name: str, cpu: str, memory: str) -> dict[str, Any]:
    """A DaemonSet's pod as the pod index keeps it (preflight.placement_of)."""
    return preflight.placement_of(
        {
            "metadata": {
                "name": f"agent-{node_name}",
                "namespace": "kube-system",
                "ownerReferences": [{"kind": "DaemonSet", "name": "agent", "uid": "u-agent"}],
            },
            "spec": {
                "nodeName": node_name,
                "containers": [{"resources": {"requests": {"cpu": cpu, "memory": memory}}}],
            },
            "status": {"phase": "Running"},
        }
    )


def test_daemonset_pods_on_a_node_leave_less_for_a_worker_even_on_an_otherwise_empty_node() -> None:
    """A g6.12xlarge allocates 47.81 CPU; a log agent's DaemonSet takes 4 of them on every node. The default
    worker (44 CPU) fits no node, however empty: refused at once, not waited for."""
    nodes = [eks_node(f"a{i}", "us-west-2a", disk="500Gi") for i in range(2)]
    agents = [daemon_pod(f"a{i}", "4", "1Gi") for i in range(2)]
    assert admit_alone(spec(workers=1), nodes, []).ok
    result = admit_alone(spec(workers=1), nodes, agents)
    assert (result.ok, result.reason) == (False, preflight.WORKER_FITS_NO_NODE), result
    assert "44 CPU per worker, at most 43.81 CPU on a node" in result.message


def cpu_node(name: str, cpu: str, memory: str, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {"node.kubernetes.io/instance-type": "m7i.xlarge", ZONE: "us-west-2a", **labels},
        },
        "spec": {},
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory, "ephemeral-storage": "18Gi"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_a_head_larger_than_every_node_it_may_go_on_is_refused_naming_the_head_fields() -> None:
    """The head's default 4 CPU and 16Gi on m7i.xlarge nodes (3.92 CPU, 15Gi allocatable): the head would wait
    for ever. GPU nodes do not count: the head keeps off the workers' instance type."""
    from fsdp_operator.builder import Platform

    nodes = [cpu_node("c0", "3920m", "15Gi"), eks_node("g0", "us-west-2a", disk="500Gi")]
    result = preflight.head_fits_no_node(spec(), Platform(), nodes, [])
    assert result is not None and result.reason == preflight.HEAD_FITS_NO_NODE
    assert "(1 not of the workers' type g6.12xlarge)" in result.message
    assert "4 CPU, at most 3.92 CPU free of DaemonSets on a node (spec.cluster.head.cpu)" in result.message
    assert "16Gi memory, at most 15Gi memory free of DaemonSets on a node (spec.cluster.head.memory)" in (
        result.message
    )
    small = spec(head={"cpu": "2", "memory": "8Gi"})
    assert preflight.head_fits_no_node(small, Platform(), nodes, []) is None
    agents = [daemon_pod("c0", "2", "1Gi")]  # leaves 1.92 CPU
    crowded = preflight.head_fits_no_node(small, Platform(), nodes, agents)
    assert crowded is not None and "2 CPU, at most 1.92 CPU free of DaemonSets" in crowded.message
    # Where the operator sends heads to nodes the cluster has none of yet, there is nothing to judge by.
    to_pool = Platform(head_node_selector={"pool": "heads"})
    assert preflight.head_fits_no_node(spec(), to_pool, nodes, []) is None
    big = cpu_node("h0", "15890m", "60Gi", pool="heads")
    assert preflight.head_fits_no_node(spec(), to_pool, [*nodes, big], []) is None


def test_a_refused_head_stops_admission_before_any_worker_is_placed() -> None:
    nodes = [cpu_node("c0", "3920m", "15Gi"), eks_node("g0", "us-west-2a", disk="500Gi")]
    result = admit_alone(spec(workers=1), nodes, [])
    assert (result.ok, result.reason) == (False, preflight.HEAD_FITS_NO_NODE), result


def daemonset(
    name: str, memory: str, cpu: str = "100m", tolerations: list[Any] | None = None, **pod: Any
) -> preflight.DaemonSetDemand:
    """A DaemonSet as the apiserver returns it, read as preflight reads it."""
    return preflight.DaemonSetDemand.of(
        {
            "metadata": {"name": name, "namespace": "kube-system"},
            "spec": {
                "template": {
                    "spec": {
                        "containers": [{"resources": {"requests": {"cpu": cpu, "memory": memory}}}],
                        "tolerations": tolerations or [],
                        **pod,
                    }
                }
            },
        }
    )


def test_a_nodepool_adds_no_node_for_a_worker_that_does_not_fit_beside_the_daemonsets_it_would_get() -> None:
    """Karpenter assumes 174.7Gi (178,933 MiB) for pods on a g6.12xlarge before one launched, and counts the
    DaemonSets that would run there: a 174Gi worker fits alone, not beside a 2Gi agent. DaemonSets that
    select other nodes, or do not tolerate the NodePool's taint, are not counted."""
    gpu_taint = [{"key": "nvidia.com/gpu", "value": "", "effect": "NoSchedule"}]
    gpu = nodepool("gpu", (FAMILY, "In", ["g6"]), taints=gpu_taint)
    everywhere = [{"operator": "Exists"}]
    elsewhere = [
        daemonset("arm-agent", "100Gi", tolerations=everywhere, nodeSelector={"kubernetes.io/arch": "arm64"}),
        daemonset("cpu-only-agent", "100Gi"),  # no toleration for the GPU taint
        daemonset(
            "not-g6",
            "100Gi",
            tolerations=everywhere,
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": TYPE, "operator": "NotIn", "values": ["g6.12xlarge"]}
                                ]
                            }
                        ]
                    }
                }
            },
        ),
    ]
    agent = daemonset("log-agent", "2Gi", tolerations=everywhere)
    big = spec(memory="174Gi")
    alone = preflight.Launchers(nodepools=(gpu,), node_groups=(), daemonsets=tuple(elsewhere))
    assert preflight.check_instance_type(big, G6_ABC, alone).ok
    beside = preflight.Launchers(nodepools=(gpu,), node_groups=(), daemonsets=(*elsewhere, agent))
    result = preflight.check_instance_type(big, G6_ABC, beside)
    assert (result.ok, result.reason) == (False, preflight.NOT_LAUNCHABLE), result
    assert (
        "NodePool gpu: a g6.12xlarge it adds leaves pods too little by Karpenter's estimate before one "
        "launched: 174Gi memory for the worker and 2Gi memory for 1 DaemonSets' pods, of 174.7Gi memory"
    ) in result.message, result.message
    assert "largest DaemonSets: kube-system/log-agent" in result.message
    assert preflight.check_instance_type(spec(), G6_ABC, beside).ok  # the default worker leaves them 4Gi


def test_a_node_group_whose_template_taints_the_workers_do_not_tolerate_is_not_a_launcher() -> None:
    dedicated = preflight.NodeGroup(
        "eks-infra", ("us-west-2a",), ("g6.12xlarge",), taints=(("dedicated", "infra", "NoSchedule"),)
    )
    labelled = preflight.NodeGroup("eks-team-b", ("us-west-2b",), ("g6.12xlarge",), labels=(("team", "b"),))
    launchers = preflight.Launchers(node_groups=(dedicated, labelled))
    assert preflight.check_instance_type(spec(), G6_ABC, launchers).zone == "us-west-2b"
    result = preflight.check_instance_type(spec(nodeSelector={"team": "a"}), G6_ABC, launchers)
    assert (result.ok, result.reason) == (True, "InstanceTypeOffered")  # NodePools unseen: EC2 decides
    assert "node group eks-infra taints its nodes dedicated=infra:NoSchedule" in result.message
    assert "node group eks-team-b labels its nodes team=b (spec.cluster.nodeSelector)" in result.message
