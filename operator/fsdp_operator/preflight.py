"""Preflight: is there room for every worker of a run, with its GPUs and EFA, inside one availability zone?

Two sources of truth, both reduced to data before a pure decision: the nodes that exist (allocatable minus
what pods already request), or, where GPU nodes scale from zero, what can launch them: the EC2 API (is the
instance type offered in the region's zones, does it support EFA, does it have enough GPUs) and the cluster's
autoscalers (Karpenter's NodePools, cluster-autoscaler's node groups), which say in which of those zones a
node of the type can be added for the workers.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from fsdp_operator import api, fabric, instancetypes, quantity
from fsdp_operator.builder import EFA, GPU, LABEL_INSTANCE_TYPE, LABEL_ZONE, uses_efa, worker_tolerations
from fsdp_trainer.contract import EfaPolicy

CPU, MEMORY, DISK = "cpu", "memory", "ephemeral-storage"
# A waiting run whose single worker fits no node of its instance type, not even an empty one: nodes the
# group adds have the same shape, so it would wait for ever. It fails at once, with what to change.
WORKER_FITS_NO_NODE = "WorkerFitsNoNode"
EFA_NOT_COUNTED = (
    1 << 20
)  # a node's EFA where the scheduler allocates it through DRA: never the short resource


@dataclass(frozen=True)
class NodeFree:
    """A schedulable node of the requested instance type and what is still free on it (CPU in millicores,
    memory and disk in bytes; None where the node does not report the resource: not counted)."""

    name: str
    zone: str
    gpus: int
    efa: int
    cpu_m: int | None = None
    memory: int | None = None
    disk: int | None = None


@dataclass(frozen=True)
class WorkerDemand:
    """What one worker pod requests."""

    gpus: int
    efa: int
    cpu_m: int
    memory: int
    disk: int

    @classmethod
    def of(cls, spec: api.FSDPTrainingRunSpec) -> WorkerDemand:
        cluster = spec.cluster
        return cls(
            gpus=cluster.gpus(),
            efa=cluster.efa(spec.network) if uses_efa(spec) else 0,
            cpu_m=quantity.milli(cluster.worker_cpu()),
            memory=quantity.whole(cluster.worker_memory()),
            disk=quantity.whole(spec.worker_ephemeral_storage()),
        )

    def dimensions(self, node: NodeFree) -> list[tuple[str, int, int | None]]:
        """(resource, asked, free on the node) for every resource this demand asks for."""
        return [
            (GPU, self.gpus, node.gpus),
            (EFA, self.efa, node.efa),
            (CPU, self.cpu_m, node.cpu_m),
            (MEMORY, self.memory, node.memory),
            (DISK, self.disk, node.disk),
        ]


@dataclass(frozen=True)
class InstanceTypeFacts:
    """What the EC2 API says about an instance type in the region."""

    instance_type: str
    exists: bool
    gpus: int = 0
    efa_supported: bool = False
    max_efa_interfaces: int = 0
    zones: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ("amd64",)  # as Kubernetes names them (kubernetes.io/arch)
    shape: instancetypes.InstanceType | None = None  # its sizes, for a type instancetypes does not list


@dataclass(frozen=True)
class Requirement:
    """One of a NodePool's node requirements (a node selector requirement, as Karpenter evaluates it)."""

    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist, Gt, Lt
    values: tuple[str, ...] = ()

    def allows(self, value: str | None) -> bool:
        """Whether a node whose label `key` is `value` (None: no such label) meets the requirement."""
        if self.operator == "In":
            return value in self.values
        if self.operator == "NotIn":
            return value not in self.values
        if self.operator == "Exists":
            return value is not None
        if self.operator == "DoesNotExist":
            return value is None
        if self.operator in ("Gt", "Lt") and value is not None and value.isdigit() and self.values:
            bound = int(self.values[0])
            return int(value) > bound if self.operator == "Gt" else int(value) < bound
        return False

    def __str__(self) -> str:
        return f"{self.key} {self.operator}" + (f" {list(self.values)}" if self.values else "")


@dataclass(frozen=True)
class NodePool:
    """A Karpenter NodePool (karpenter.sh/v1): the nodes it may launch and the labels and taints they get."""

    name: str
    requirements: tuple[Requirement, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect)

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> NodePool:
        template = (body.get("spec") or {}).get("template") or {}
        node = template.get("spec") or {}
        return cls(
            name=body["metadata"]["name"],
            requirements=tuple(
                Requirement(r["key"], r["operator"], tuple(str(v) for v in r.get("values") or ()))
                for r in node.get("requirements") or ()
            ),
            labels=tuple(sorted(((template.get("metadata") or {}).get("labels") or {}).items())),
            taints=tuple((t["key"], t.get("value") or "", t["effect"]) for t in node.get("taints") or ()),
        )


@dataclass(frozen=True)
class NodeGroup:
    """An EC2 Auto Scaling group cluster-autoscaler manages (tagged k8s.io/cluster-autoscaler/enabled)."""

    name: str
    zones: tuple[str, ...]
    instance_types: tuple[str, ...]
    # What its nodes will carry, from the node-template tags cluster-autoscaler itself reads at zero nodes
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect)


@dataclass(frozen=True)
class DaemonSetDemand:
    """What a DaemonSet's pod requests on every node it selects, a node still to be added too."""

    name: str  # namespace/name
    node_selector: tuple[tuple[str, str], ...]
    affinity: tuple[tuple[Requirement, ...], ...]  # required node affinity: any term, all of its expressions
    tolerations: tuple[api.Toleration, ...]
    cpu_m: int
    memory: int

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> DaemonSetDemand:
        meta, pod = body["metadata"], ((body.get("spec") or {}).get("template") or {}).get("spec") or {}
        required = (
            ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution"
            )
            or {}
        ).get("nodeSelectorTerms") or ()
        requests = [_requests(c) for c in pod.get("containers") or ()]
        return cls(
            name=f"{meta['namespace']}/{meta['name']}",
            node_selector=tuple(sorted((pod.get("nodeSelector") or {}).items())),
            affinity=tuple(
                tuple(
                    Requirement(e["key"], e["operator"], tuple(str(v) for v in e.get("values") or ()))
                    for e in term.get("matchExpressions") or ()
                )
                for term in required
            ),
            # Not validated: the apiserver did, and a platform's DaemonSet may tolerate what no run may ask.
            tolerations=tuple(
                api.Toleration.model_construct(
                    **{k: t[k] for k in ("key", "operator", "value", "effect") if k in t}
                )
                for t in pod.get("tolerations") or ()
            ),
            cpu_m=sum(quantity.milli(r.get(CPU, 0)) for r in requests),
            memory=sum(quantity.whole(r.get(MEMORY, 0)) for r in requests),
        )

    def selects(self, labels: Mapping[str, str], taints: Iterable[tuple[str, str, str]]) -> bool:
        """Whether the DaemonSet puts a pod on a node with these labels and taints."""
        if any(labels.get(k) != v for k, v in self.node_selector):
            return False
        if self.affinity and not any(
            all(r.allows(labels.get(r.key)) for r in term) for term in self.affinity
        ):
            return False
        tolerations = list(self.tolerations)
        return all(
            effect == "PreferNoSchedule" or _tolerated({"key": k, "value": v, "effect": effect}, tolerations)
            for k, v, effect in taints
        )


@dataclass(frozen=True)
class Launchers:
    """What can add nodes to the cluster; None where the operator cannot see that kind (no Karpenter CRD, no
    permission to describe Auto Scaling groups). The DaemonSets put a pod on each node they add."""

    nodepools: tuple[NodePool, ...] | None = None
    node_groups: tuple[NodeGroup, ...] | None = None
    daemonsets: tuple[DaemonSetDemand, ...] = ()


# Labels Karpenter's AWS provider gives every node of a type, from the type's name and facts.
LABEL_ARCH = "kubernetes.io/arch"
LABEL_OS = "kubernetes.io/os"
LABEL_NODEPOOL = "karpenter.sh/nodepool"
# Labels Karpenter sets on every node it launches (capacity type, AWS's finer instance facts): a nodeSelector
# on one needs no NodePool to define the label.
_KARPENTER_LABEL_PREFIXES = ("karpenter.sh/", "karpenter.k8s.aws/")


def _instance_type_labels(facts: InstanceTypeFacts) -> dict[str, str]:
    """The labels a node of the type gets whatever its zone and architecture (Karpenter's AWS provider)."""
    family, _, size = facts.instance_type.partition(".")
    named = re.match(r"([a-z]+)(\d+)", family)  # p5en: category p, generation 5
    return {
        LABEL_INSTANCE_TYPE: facts.instance_type,
        "karpenter.k8s.aws/instance-family": family,
        "karpenter.k8s.aws/instance-size": size,
        "karpenter.k8s.aws/instance-category": named.group(1) if named else family,
        "karpenter.k8s.aws/instance-generation": named.group(2) if named else "",
        "karpenter.k8s.aws/instance-gpu-count": str(facts.gpus),
        LABEL_OS: "linux",
    }


@dataclass(frozen=True)
class PreflightResult:
    ok: bool
    reason: str
    message: str
    zone: str | None = None
    capacity_by_zone: dict[str, int] = field(default_factory=dict)


def _quantity_int(value: str | int | None) -> int:
    if value is None:
        return 0
    text = str(value)
    return int(text[:-1]) // 1000 if text.endswith("m") else int(text)


def _tolerated(taint: Mapping[str, Any], tolerations: list[api.Toleration]) -> bool:
    if taint.get("effect") == "PreferNoSchedule":
        return True
    for t in tolerations:
        if t.effect and t.effect != taint.get("effect"):
            continue
        if t.operator == "Exists" and (not t.key or t.key == taint.get("key")):
            return True
        if t.key == taint.get("key") and (t.value or "") == (taint.get("value") or ""):
            return True
    return False


def _requests(container: Mapping[str, Any]) -> Mapping[str, Any]:
    resources = container.get("resources") or {}
    return cast(Mapping[str, Any], resources.get("requests") or resources.get("limits") or {})


def is_daemon(pod: Mapping[str, Any]) -> bool:
    """A DaemonSet's pod: every node it selects has one, a node still to be added too."""
    owners = (pod.get("metadata") or {}).get("ownerReferences") or ()
    return any(owner.get("kind") == "DaemonSet" for owner in owners)


def counted_by_preflight(pod: Mapping[str, Any]) -> bool:
    """A pod bound to a node, not finished, that requests GPUs or EFA, or a DaemonSet's (its CPU, memory and
    disk are not the workers' or the head's on any node it runs on): what preflight subtracts."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return False
    return is_daemon(pod) or any(_requests(c).get(r) for c in spec.get("containers", []) for r in (GPU, EFA))


def node_facts(node: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a node that preflight reads (a node's status also lists every image it holds)."""
    meta, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
    return {
        "metadata": {"name": meta["name"], "labels": dict(meta.get("labels") or {})},
        "spec": {"unschedulable": spec.get("unschedulable", False), "taints": list(spec.get("taints") or [])},
        "status": {
            "allocatable": dict(status.get("allocatable") or {}),
            "conditions": [
                {"type": c.get("type"), "status": c.get("status")} for c in status.get("conditions", [])
            ],
        },
    }


def placement_of(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The few fields of a pod that preflight reads (kept in the operator's index instead of whole pods)."""
    meta, spec = pod["metadata"], pod["spec"]
    return {
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": [{"kind": "DaemonSet"}] if is_daemon(pod) else [],
        },
        "spec": {
            "nodeName": spec["nodeName"],
            "containers": [
                {"resources": {"requests": dict(_requests(c))}} for c in spec.get("containers", [])
            ],
        },
        "status": {"phase": (pod.get("status") or {}).get("phase")},
    }


def placement_key(spec: api.FSDPTrainingRunSpec) -> str:
    """What decides which nodes a run's workers may use: runs that agree on it see the same free nodes."""
    return spec.cluster.model_dump_json(include={"instance_type", "node_selector", "tolerations"})


def _used(pods: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """node name -> resource -> what the pods bound to it request."""
    used: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for pod in pods:
        node_name = pod.get("spec", {}).get("nodeName")
        if not node_name or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for container in pod["spec"].get("containers", []):
            requests = _requests(container)
            for resource in (GPU, EFA):
                used[node_name][resource] += _quantity_int(requests.get(resource))
            used[node_name][CPU] += quantity.milli(requests.get(CPU, 0))
            for resource in (MEMORY, DISK):
                used[node_name][resource] += quantity.whole(requests.get(resource, 0))
    return used


def _takes_pods(node: Mapping[str, Any], tolerations: list[api.Toleration]) -> bool:
    """Ready, schedulable, and every NoSchedule/NoExecute taint tolerated."""
    node_spec, status = node.get("spec", {}), node.get("status", {})
    if node_spec.get("unschedulable"):
        return False
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
    taints = [t for t in node_spec.get("taints", []) if t.get("effect") in ("NoSchedule", "NoExecute")]
    return ready and all(_tolerated(t, tolerations) for t in taints)


def _node_free(node: Mapping[str, Any], used: Mapping[str, Mapping[str, int]]) -> NodeFree:
    labels, name = node["metadata"].get("labels", {}), node["metadata"]["name"]
    allocatable, by_pods = node.get("status", {}).get("allocatable", {}), used.get(name, {})
    taken: dict[str, int] = defaultdict(int, by_pods)
    return NodeFree(
        name=name,
        zone=labels.get(LABEL_ZONE, ""),
        gpus=_quantity_int(allocatable.get(GPU)) - taken[GPU],
        efa=_quantity_int(allocatable.get(EFA)) - taken[EFA],
        cpu_m=_free(allocatable, taken, CPU, quantity.milli),
        memory=_free(allocatable, taken, MEMORY, quantity.whole),
        disk=_free(allocatable, taken, DISK, quantity.whole),
    )


def free_worker_nodes(
    spec: api.FSDPTrainingRunSpec, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> list[NodeFree]:
    """Nodes a worker could land on (type, selector, Ready, schedulable, taints) with what is free on them."""
    used = _used(pods)
    wanted = {**spec.cluster.node_selector, LABEL_INSTANCE_TYPE: spec.cluster.instance_type}
    tolerations = worker_tolerations(spec)
    result = []
    for node in nodes:
        labels = node["metadata"].get("labels", {})
        if any(labels.get(k) != v for k, v in wanted.items()):
            continue
        if fabric.is_degraded(labels):  # workers avoid it (builder.py): its capacity is not the run's
            continue
        if _takes_pods(node, tolerations):
            result.append(_node_free(node, used))
    return result


HEAD_FITS_NO_NODE = "HeadFitsNoNode"


def head_fits_no_node(
    spec: api.FSDPTrainingRunSpec,
    platform: Any,
    nodes: Iterable[Mapping[str, Any]],
    daemon_pods: Iterable[Mapping[str, Any]],
) -> PreflightResult | None:
    """A failed result naming what the head asks more of than any node it may go on has beside that node's
    DaemonSet pods (builder.Platform `platform`: the operator's head selector and tolerations), or None when
    it fits one, or no such node exists to judge by (its nodes scale from zero)."""
    head = spec.cluster.head
    selector = head.node_selector or platform.head_node_selector
    tolerations = [api.Toleration.model_validate(t) for t in platform.head_tolerations]
    tolerations += head.tolerations
    used = _used(daemon_pods)
    candidates = [
        _node_free(node, used)
        for node in nodes
        if _takes_pods(node, tolerations)
        and _head_may_use(node["metadata"].get("labels", {}), selector, spec.cluster.instance_type)
    ]
    asked = [
        (CPU, quantity.milli(head.cpu), "cpu"),
        (MEMORY, quantity.whole(head.memory), "memory"),
        (DISK, quantity.whole(head.ephemeral_storage), "ephemeralStorage"),
    ]
    short = []
    for resource, amount, field_name in asked:
        known = [free for node in candidates if (free := _free_of(node, resource)) is not None]
        if known and max(known) < amount:
            short.append(
                f"{_shown(resource, amount)}, at most {_shown(resource, max(known))} free of DaemonSets on a "
                f"node (spec.cluster.head.{field_name})"
            )
    if not short:
        return None
    where = f"labelled {selector}" if selector else f"not of the workers' type {spec.cluster.instance_type}"
    return PreflightResult(
        False,
        HEAD_FITS_NO_NODE,
        f"the Ray head fits no node it may go on ({len(candidates)} {where}), not even an empty one: "
        + "; ".join(short),
    )


def _head_may_use(labels: Mapping[str, str], selector: Mapping[str, str], worker_type: str) -> bool:
    """The head's node selector, or by default any node not of the workers' instance type (builder.py)."""
    if selector:
        return all(labels.get(k) == v for k, v in selector.items())
    return labels.get(LABEL_INSTANCE_TYPE) != worker_type


def _free_of(node: NodeFree, resource: str) -> int | None:
    return {CPU: node.cpu_m, MEMORY: node.memory, DISK: node.disk}[resource]


def _free(
    allocatable: Mapping[str, Any], used: Mapping[str, int], resource: str, parse: Callable[[str], int]
) -> int | None:
    found = allocatable.get(resource)
    return None if found is None else parse(found) - used[resource]


def _workers_fitting(node: NodeFree, demand: WorkerDemand) -> int:
    return min(
        (max(free, 0) // asked for _, asked, free in demand.dimensions(node) if asked and free is not None),
        default=0,
    )


def _shown(resource: str, amount: int) -> str:
    if resource == CPU:
        return f"{amount / 1000:g} CPU"
    if resource in (MEMORY, DISK):
        return f"{quantity.human_bytes(amount)} {resource}"
    return f"{amount} {resource}"


# What to change for each resource a worker asks more of than any node has.
_REMEDY = {
    GPU: "lower spec.cluster.gpusPerWorker or pick an instanceType with more GPUs",
    EFA: "lower spec.cluster.efaPerWorker; nodes that expose EFA through DRA (AWS's EFA DRA driver, "
    "DeviceClass efa.networking.k8s.aws) advertise no vpc.amazonaws.com/efa: then set the operator's "
    "efa-device-class (chart efa.draDeviceClass)",
    CPU: "lower spec.cluster.cpu",
    MEMORY: "lower spec.cluster.memory",
}


def _remedy(resource: str, spec: api.FSDPTrainingRunSpec) -> str:
    if resource != DISK:
        return _REMEDY[resource]
    cluster = spec.cluster
    asked = (
        "lower spec.cluster.ephemeralStorage"
        if cluster.ephemeral_storage
        else f"the default is what a worker writes, {spec.worker_disk().explain()}; set "
        "spec.cluster.ephemeralStorage to override it"
    )
    store = instancetypes.of(cluster.instance_type).instance_store_gb
    nvme = (
        f"; {cluster.instance_type} has {store} GB of NVMe instance store, which counts once the AMI "
        "mounts it (AL2023 nodeadm: localStorage strategy RAID0)"
        if store and cluster.instance_type in instancetypes.GPU_INSTANCE_TYPES
        else "; or an instance store the AMI mounts (AL2023 nodeadm: localStorage strategy RAID0)"
    )
    return (
        f"{asked}, or give the node group larger disks (an EKS managed node group's diskSize is 20 GiB "
        f"unless set){nvme}"
    )


def worker_fits_no_node(spec: api.FSDPTrainingRunSpec, empty: list[NodeFree]) -> PreflightResult | None:
    """A failed result naming each resource a worker asks more of than any empty node of its type has, or
    None when one worker fits some node (or there is no such node to judge by: a group scaled to zero)."""
    demand = WorkerDemand.of(spec)
    zone = spec.cluster.zone
    if zone:  # the zone the run names: a node elsewhere will never take its workers
        empty = [node for node in empty if node.zone == zone]
    if not empty or any(_workers_fitting(node, demand) for node in empty):
        return None
    short = []
    for index, (resource, asked, _) in enumerate(demand.dimensions(empty[0])):
        known = [free for node in empty if (free := demand.dimensions(node)[index][2]) is not None]
        if asked and known and max(known) < asked:
            short.append(
                f"{_shown(resource, asked)} per worker, at most {_shown(resource, max(known))} on a node "
                f"({_remedy(resource, spec)})"
            )
    return PreflightResult(
        False,
        WORKER_FITS_NO_NODE,
        f"no {spec.cluster.instance_type} node{f' in {zone}' if zone else ''} can take one worker, not even "
        "an empty one: " + "; ".join(short),
    )


@dataclass(frozen=True)
class Competitor:
    """Another run that wants workers of the same instance type."""

    name: str  # namespace/name
    created: str  # creationTimestamp (RFC 3339 sorts in time order)
    instance_type: str
    admitted: bool  # its RayCluster exists or is being created
    zone: str | None  # where an admitted run's workers go
    workers_not_placed: int  # an admitted run's workers not yet bound to a node, or a waiting run's demand
    fits_when_empty: bool = True  # a waiting run that could fit once the nodes are free
    spec: api.FSDPTrainingRunSpec | None = None  # a waiting run's spec, to place it ahead of later runs
    free: tuple[NodeFree, ...] = ()  # the nodes a waiting run's workers could use now


def reservations(competitors: Iterable[Competitor], instance_type: str) -> dict[str, int]:
    """Worker slots per zone promised to admitted runs whose pods are not all placed yet: the nodes still look
    free, but those slots are taken."""
    reserved: dict[str, int] = defaultdict(int)
    for other in competitors:
        if other.admitted and other.instance_type == instance_type and other.zone:
            reserved[other.zone] += other.workers_not_placed
    return dict(reserved)


WAITING_FOR_EARLIER_RUN = "WaitingForEarlierRun"
NAMESPACE_RUN_LIMIT = "NamespaceRunLimit"


def namespace_of(name: str) -> str:
    """The namespace of a competitor's `namespace/name`."""
    return name.split("/", 1)[0]


def admit(
    spec: api.FSDPTrainingRunSpec,
    created: str,
    name: str,
    free: list[NodeFree],
    competitors: Iterable[Competitor],
) -> PreflightResult:
    """One run's admission as its own pass decides it: runs that compete for one instance type are admitted
    in creation order, many in one pass; every earlier run still waiting (that could fit once nodes free up)
    is placed first, in order, on what the admitted runs' unplaced workers leave; this run is admitted if it
    fits in what remains. An earlier run of its namespace that does not fit now holds it back (no backfill
    within a team, so a large run is not starved by its own team's smaller later ones); another namespace's
    does not (one team's run that needs every node does not stop the others)."""
    own = Competitor(name, created, spec.cluster.instance_type, False, None, spec.cluster.workers,
                     spec=spec, free=tuple(free))  # fmt: skip
    others = [c for c in competitors if c.name != name]
    return Queue.place([*others, own], spec.cluster.instance_type).results[name]


def _blocked_by(other: Competitor, instance_type: str) -> PreflightResult:
    return PreflightResult(
        False,
        WAITING_FOR_EARLIER_RUN,
        f"{other.name}, created earlier, waits for {instance_type} capacity too and is admitted first",
    )


def _in_order(competitors: Iterable[Competitor], instance_type: str) -> list[Competitor]:
    """The waiting runs of one instance type in admission order (creation time, then name)."""
    waiting = (c for c in competitors if not c.admitted and c.instance_type == instance_type)
    return sorted(waiting, key=lambda c: (c.created, c.name))


def _reserving(competitors: list[Competitor], instance_type: str) -> dict[str, tuple[str | None, int]]:
    """The admitted runs that `reservations` counts: name -> (zone, workers not placed)."""
    return {
        c.name: (c.zone, c.workers_not_placed)
        for c in competitors
        if c.admitted and c.instance_type == instance_type and c.zone
    }


@dataclass
class Queue:
    """One placement of every waiting run of an instance type, in order, as `admit` places them, with each
    run's own result; `extend` places runs created after all of them without placing the others again."""

    instance_type: str
    admitted: dict[
        str, tuple[str | None, int]
    ]  # name -> (zone, workers not placed): the runs it reserved for
    waiting: list[Competitor]
    results: dict[str, PreflightResult]
    reserved: dict[str, int]
    # namespace -> its earliest waiting run that fits only once nodes are freed: it holds back its own
    # namespace's later runs (no backfill within a team), never another team's.
    blockers: dict[str, Competitor] = field(default_factory=dict)

    @classmethod
    def place(cls, competitors: Iterable[Competitor], instance_type: str) -> Queue:
        competitors = list(competitors)
        admitted = _reserving(competitors, instance_type)
        queue = cls(instance_type, admitted, [], {}, reservations(competitors, instance_type))
        queue.extend(_in_order(competitors, instance_type))
        return queue

    def extend(self, later: Iterable[Competitor]) -> None:
        for run in later:
            assert run.spec is not None, "a waiting run's record carries its spec"
            self.waiting.append(run)
            blocker = self.blockers.get(namespace_of(run.name))
            if blocker is not None:
                self.results[run.name] = _blocked_by(blocker, self.instance_type)
                continue
            placed = check_nodes(run.spec, list(run.free), self.reserved)
            self.results[run.name] = placed
            if placed.ok and placed.zone is not None:
                self.reserved[placed.zone] = self.reserved.get(placed.zone, 0) + run.workers_not_placed
            elif run.fits_when_empty:  # one that never fits holds no one back
                self.blockers[namespace_of(run.name)] = run

    def still_holds(self, competitors: Iterable[Competitor]) -> Queue | None:
        """This placement for a newer view of the same runs, or None when the view changed in a way that
        could change a result. It holds when the only changes are runs it placed that are now admitted where
        it placed them, with all their workers still to place, and runs created after all of its own (placed
        now, after them)."""
        competitors = list(competitors)
        admitted = _reserving(competitors, self.instance_type)
        waiting = _in_order(competitors, self.instance_type)
        now_admitted = set(admitted) - set(self.admitted)
        if any(self.admitted[name] != admitted.get(name) for name in self.admitted):
            return None  # one finished, moved, or placed some of its workers: its reservation changed
        ours = {run.name: run for run in self.waiting}
        for name in now_admitted:
            result, run = self.results.get(name), ours.get(name)
            if (
                result is None
                or run is None
                or not result.ok
                or admitted[name] != (result.zone, run.workers_not_placed)
            ):
                return None
        still = [run for run in self.waiting if run.name not in now_admitted]
        if not _same_runs(waiting[: len(still)], still):
            return None
        later = waiting[len(still) :]
        if (
            later
            and self.waiting
            and (later[0].created, later[0].name)
            < (
                self.waiting[-1].created,
                self.waiting[-1].name,
            )
        ):
            return None  # a run placed among ours, not after them: every later result may change
        self.admitted.update((name, admitted[name]) for name in now_admitted)
        self.waiting = still
        self.extend(later)
        return self


def _same_runs(now: list[Competitor], placed: list[Competitor]) -> bool:
    """The same waiting runs with the same demand and the same free nodes (specs compared by identity: the
    operator parses each run's spec once per generation)."""
    same_free: dict[tuple[int, int], bool] = {}  # runs of one placement share one tuple of free nodes

    def free_equal(a: tuple[NodeFree, ...], b: tuple[NodeFree, ...]) -> bool:
        key = (id(a), id(b))
        if key not in same_free:
            same_free[key] = a == b
        return same_free[key]

    return len(now) == len(placed) and all(
        a.name == b.name
        and a.created == b.created
        and a.spec is b.spec
        and a.workers_not_placed == b.workers_not_placed
        and a.fits_when_empty == b.fits_when_empty
        and free_equal(a.free, b.free)
        for a, b in zip(now, placed, strict=True)
    )


def check_nodes(
    spec: api.FSDPTrainingRunSpec, free: list[NodeFree], reserved: Mapping[str, int] | None = None
) -> PreflightResult:
    """Decides whether the run's workers fit on existing nodes within a single zone, after the slots
    `reserved` for admitted runs whose pods are still being placed."""
    cluster = spec.cluster
    demand = WorkerDemand.of(spec)
    efa = demand.efa
    wanted = f"{cluster.workers} x ({cluster.gpus()} GPU" + (f", {efa} EFA)" if efa else ")")
    if not free:
        return PreflightResult(
            False,
            "NoMatchingNodes",
            f"no Ready, schedulable node of instance type {cluster.instance_type} matches the run's node "
            "selector and tolerations",
        )
    capacity: dict[str, int] = defaultdict(int)
    for node in free:
        capacity[node.zone] += _workers_fitting(node, demand)
    for zone, slots in (reserved or {}).items():
        if zone in capacity:
            capacity[zone] = max(capacity[zone] - slots, 0)
    zones = [cluster.zone] if cluster.zone else sorted(capacity, key=lambda z: (-capacity[z], z))
    best = zones[0]
    if capacity.get(best, 0) >= cluster.workers:
        return PreflightResult(
            True,
            "CapacityAvailable",
            f"{wanted} fits in zone {best} ({capacity[best]} worker slots free)",
            zone=best,
            capacity_by_zone=dict(capacity),
        )
    # Elastic: enough for the fewest workers it trains on; the other workers' pods wait for nodes, and
    # Ray Train grows onto them when they come.
    fewest = cluster.min_workers or cluster.workers
    if capacity.get(best, 0) >= fewest:
        return PreflightResult(
            True,
            "ElasticCapacityAvailable",
            f"{capacity[best]} of {wanted} fit in zone {best}, at least cluster.minWorkers {fewest}: "
            "training starts on those and grows when more nodes are free",
            zone=best,
            capacity_by_zone=dict(capacity),
        )
    total = sum(capacity.values())
    if total >= cluster.workers and not cluster.zone:
        return PreflightResult(
            False,
            "WouldSpanZones",
            f"{wanted} fits only across zones ({dict(sorted(capacity.items()))} worker slots free); "
            "EFA traffic does not cross availability zones",
            capacity_by_zone=dict(capacity),
        )
    where = f"zone {cluster.zone}" if cluster.zone else "any zone"
    return PreflightResult(
        False,
        "InsufficientCapacity",
        f"{wanted} of {cluster.instance_type} does not fit in {where}: "
        f"{dict(sorted(capacity.items()))} worker slots free"
        + _short_of([n for n in free if n.zone == best], demand, cluster.workers),
        capacity_by_zone=dict(capacity),
    )


def _short_of(nodes: list[NodeFree], demand: WorkerDemand, workers: int) -> str:
    """Which resources leave fewer worker slots than the run needs on `nodes`, and how many each leaves."""
    if not nodes:
        return ""
    short = []
    for index, (resource, asked, _) in enumerate(demand.dimensions(nodes[0])):
        free = [demand.dimensions(node)[index][2] for node in nodes]
        if asked and all(f is not None for f in free):
            slots = sum(max(f or 0, 0) // asked for f in free)
            if slots < workers:
                short.append(f"{resource} ({slots} worker slots by it)")
    return f"; short of {', '.join(short)}" if short else ""


def nodepool_zones(
    pool: NodePool, spec: api.FSDPTrainingRunSpec, facts: InstanceTypeFacts
) -> tuple[tuple[str, ...], str]:
    """The zones EC2 offers the type in where `pool` can launch a node the workers can use, and, when there
    are none, why: the first requirement, nodeSelector label or taint that rules the workers out."""
    fixed = _instance_type_labels(facts)
    labels = dict(pool.labels)
    kind = facts.instance_type
    for requirement in pool.requirements:
        if requirement.key == LABEL_ARCH and not any(map(requirement.allows, facts.architectures)):
            return (
                (),
                f"NodePool {pool.name} requires {requirement}: {kind} is {'/'.join(facts.architectures)}",
            )
        if requirement.key in fixed and not requirement.allows(fixed[requirement.key]):
            return (), f"NodePool {pool.name} requires {requirement}, which rules out {kind}"
    zone_rules = [r for r in pool.requirements if r.key == LABEL_ZONE]
    zones = [zone for zone in facts.zones if all(r.allows(zone) for r in zone_rules)]
    for key, value in spec.cluster.node_selector.items():
        on_key = [r for r in pool.requirements if r.key == key]
        if key == LABEL_ZONE:
            zones = [zone for zone in zones if zone == value]
            continue
        if key == LABEL_NODEPOOL:
            fits = value == pool.name
        elif key in fixed:
            fits = fixed[key] == value
        elif key == LABEL_ARCH:
            fits = value in facts.architectures and all(r.allows(value) for r in on_key)
        elif key in labels:
            fits = labels[key] == value
        elif on_key:
            fits = all(r.allows(value) for r in on_key)
        else:  # Karpenter sets its own labels per node; any other label must be one the NodePool defines
            fits = key.startswith(_KARPENTER_LABEL_PREFIXES)
        if not fits:
            return (), (
                f"NodePool {pool.name} makes no node labelled {key}={value} (spec.cluster.nodeSelector)"
            )
    untolerated = _untolerated(pool.taints, worker_tolerations(spec))
    if untolerated:
        return (
            (),
            f"NodePool {pool.name} taints its nodes {untolerated}, not tolerated (spec.cluster.tolerations)",
        )
    if not zones:
        return (
            (),
            f"NodePool {pool.name} allows none of the zones EC2 offers {kind} in ({', '.join(facts.zones)})",
        )
    return tuple(zones), ""


def _untolerated(taints: Iterable[tuple[str, str, str]], tolerations: list[api.Toleration]) -> str:
    """The first of `taints` that keeps pods with `tolerations` off a node, as key=value:effect, or ""."""
    for key, value, effect in taints:
        if effect != "PreferNoSchedule" and not _tolerated(
            {"key": key, "value": value, "effect": effect}, tolerations
        ):
            return f"{key}={value}:{effect}" if value else f"{key}:{effect}"
    return ""


def node_group_zones(
    group: NodeGroup, spec: api.FSDPTrainingRunSpec, facts: InstanceTypeFacts
) -> tuple[tuple[str, ...], str]:
    """The zones of an Auto Scaling group where EC2 offers the type, if it launches the type for the workers
    (its node-template labels and taints against their nodeSelector and tolerations); else why not."""
    kind = facts.instance_type
    if kind not in group.instance_types:
        return (), f"node group {group.name} launches {', '.join(group.instance_types) or 'no type it names'}"
    labels = dict(group.labels)
    for key, value in spec.cluster.node_selector.items():
        if key in labels and labels[key] != value:  # a label it does not tag may still be set by EKS
            return (
                (),
                f"node group {group.name} labels its nodes {key}={labels[key]} (spec.cluster.nodeSelector)",
            )
    untolerated = _untolerated(group.taints, worker_tolerations(spec))
    if untolerated:
        return (
            (),
            f"node group {group.name} taints its nodes {untolerated}, not tolerated "
            "(spec.cluster.tolerations)",
        )
    zones = tuple(zone for zone in facts.zones if zone in group.zones)
    if not zones:
        return (), f"node group {group.name} spans {', '.join(group.zones)}, where EC2 does not offer {kind}"
    return zones, ""


def launchable_zones(
    spec: api.FSDPTrainingRunSpec, facts: InstanceTypeFacts, launchers: Launchers
) -> tuple[dict[str, list[str]], list[str]]:
    """zone -> the NodePools and node groups that can add a node of the type there for the workers, sorted by
    zone; and why each of the others cannot."""
    zones: dict[str, list[str]] = defaultdict(list)
    why_not: list[str] = []
    found: list[tuple[str, tuple[tuple[str, ...], str]]] = []
    for pool in launchers.nodepools or ():
        name = f"NodePool {pool.name}"
        where, why = nodepool_zones(pool, spec, facts)
        if where:  # Karpenter launches only for pods that fit its estimate, DaemonSets' pods counted
            labels = {**dict(pool.labels), LABEL_NODEPOOL: pool.name}
            why = _no_room_beside_daemonsets(spec, facts, name, labels, pool.taints, launchers.daemonsets)
        found.append((name, ((), why) if why else (where, "")))
    found += [
        (f"node group {group.name}", node_group_zones(group, spec, facts))
        for group in launchers.node_groups or ()
    ]
    for name, (where, why) in found:
        for zone in where:
            zones[zone].append(name)
        if why:
            why_not.append(why)
    return dict(sorted(zones.items())), why_not


def _no_room_beside_daemonsets(
    spec: api.FSDPTrainingRunSpec,
    facts: InstanceTypeFacts,
    launcher: str,
    labels: dict[str, str],
    taints: tuple[tuple[str, str, str], ...],
    daemonsets: tuple[DaemonSetDemand, ...],
) -> str:
    """Why a worker does not fit a node the NodePool would add, beside the DaemonSets' pods that node gets, by
    what Karpenter's AWS provider assumes the type leaves pods before one launched; "" when it fits.
    (cluster-autoscaler sizes its groups' nodes otherwise, from the type's capacity: not judged here.)"""
    shape = facts.shape or instancetypes.GPU_INSTANCE_TYPES.get(facts.instance_type)
    if shape is None:
        return ""
    node_labels = {**labels, **_instance_type_labels(facts), LABEL_ARCH: facts.architectures[0]}
    on_node = [d for d in daemonsets if d.selects(node_labels, taints)]
    demand = WorkerDemand.of(spec)
    short = [
        f"{_shown(resource, asked)} for the worker and {_shown(resource, daemons)} for "
        f"{len(on_node)} DaemonSets' pods, of {_shown(resource, room)}"
        for resource, asked, daemons, room in (
            (CPU, demand.cpu_m, sum(d.cpu_m for d in on_node), shape.estimated_allocatable_millicores),
            (MEMORY, demand.memory, sum(d.memory for d in on_node), shape.estimated_allocatable_mib << 20),
        )
        if asked + daemons > room
    ]
    if not short:
        return ""
    largest = sorted(on_node, key=lambda d: -d.memory)[:3]
    return (
        f"{launcher}: a {facts.instance_type} it adds leaves pods too little by Karpenter's estimate before "
        f"one launched: {'; '.join(short)} (lower spec.cluster.cpu or spec.cluster.memory; largest "
        f"DaemonSets: {', '.join(d.name for d in largest)})"
    )


NOT_LAUNCHABLE = "NoNodePoolOrNodeGroupCanLaunch"
_REASONS_SHOWN = 6  # of the NodePools and node groups that cannot launch the type, in a refusal's message


def check_instance_type(
    spec: api.FSDPTrainingRunSpec, facts: InstanceTypeFacts, launchers: Launchers = Launchers()
) -> PreflightResult:
    """Scale-from-zero: can the autoscaler create the workers' nodes at all, in one zone, with EFA? The zone
    is one where a visible NodePool or node group can launch the type, else (none visible) one EC2 offers."""
    cluster = spec.cluster
    if not facts.exists:
        return PreflightResult(
            False, "UnknownInstanceType", f"EC2 does not know instance type {facts.instance_type}"
        )
    if facts.gpus < cluster.gpus():
        return PreflightResult(
            False,
            "NotEnoughGPUs",
            f"{facts.instance_type} has {facts.gpus} GPUs; "
            f"spec.cluster.gpusPerWorker asks for {cluster.gpus()}",
        )
    if spec.network.efa == EfaPolicy.REQUIRED and not facts.efa_supported:
        return PreflightResult(
            False,
            "EfaUnsupported",
            f"{facts.instance_type} has no EFA; spec.network.efa is required (set it to preferred or "
            "disabled to run without EFA, or pick an instanceType with EFA)",
        )
    if uses_efa(spec) and (not facts.efa_supported or facts.max_efa_interfaces < cluster.efa(spec.network)):
        return PreflightResult(
            False,
            "EfaUnsupported",
            f"{facts.instance_type} supports {facts.max_efa_interfaces if facts.efa_supported else 0} EFA "
            f"interfaces; spec.cluster.efaPerWorker asks for {cluster.efa(spec.network)}",
        )
    launchable, why_not = launchable_zones(spec, facts, launchers)
    # Both kinds of autoscaler visible, or one that can launch the type: the cluster decides. One visible kind
    # that cannot, beside one the operator cannot see: the other may, so EC2's offerings decide as before.
    if launchable or (launchers.nodepools is not None and launchers.node_groups is not None):
        return _launch_zone(spec, facts.instance_type, launchable, why_not)
    zones = [z for z in facts.zones if not cluster.zone or z == cluster.zone]
    if not zones:
        where = f"zone {cluster.zone}" if cluster.zone else "any zone of the region"
        return PreflightResult(
            False, "InstanceTypeNotOffered", f"{facts.instance_type} is not offered in {where}"
        )
    unseen = (
        f" (no visible NodePool or node group launches it: {'; '.join(why_not[:_REASONS_SHOWN])}; the "
        "autoscaler the operator cannot see may)"
        if why_not
        else ""
    )
    return PreflightResult(
        True,
        "InstanceTypeOffered",
        f"{facts.instance_type} is offered in {', '.join(sorted(zones))}; workers go to {sorted(zones)[0]}"
        + unseen,
        zone=sorted(zones)[0],
    )


def _launch_zone(
    spec: api.FSDPTrainingRunSpec, instance_type: str, launchable: dict[str, list[str]], why_not: list[str]
) -> PreflightResult:
    pinned = spec.cluster.zone
    zones = [zone for zone in launchable if not pinned or zone == pinned]
    if zones:
        zone = zones[0]
        return PreflightResult(
            True,
            "InstanceTypeLaunchable",
            f"{', '.join(launchable[zone])} can launch {instance_type} in {zone}; workers go to {zone}",
            zone=zone,
        )
    if launchable:  # only elsewhere than the zone the run names
        elsewhere = "; ".join(f"{zone} ({', '.join(names)})" for zone, names in launchable.items())
        why = f"they can in {elsewhere} (spec.cluster.zone)"
    else:
        shown = why_not[:_REASONS_SHOWN] + (
            [f"{len(why_not) - _REASONS_SHOWN} more"] if len(why_not) > _REASONS_SHOWN else []
        )
        why = "; ".join(shown) or "the cluster has none (Karpenter NodePool, or Auto Scaling group tagged "
        "k8s.io/cluster-autoscaler/enabled)"
    return PreflightResult(
        False,
        NOT_LAUNCHABLE,
        f"no Karpenter NodePool or cluster-autoscaler node group can add a {instance_type} node for the "
        f"workers{f' in zone {pinned}' if pinned else ''}: {why}",
    )


def ec2_instance_type_facts(ec2: Any, instance_type: str) -> InstanceTypeFacts:
    """Reads an instance type's GPUs, EFA support and zone offerings with a boto3 EC2 client."""
    try:
        info = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"]
    except ec2.exceptions.ClientError as error:
        if "InvalidInstanceType" in str(error):
            return InstanceTypeFacts(instance_type, exists=False)
        raise
    if not info:
        return InstanceTypeFacts(instance_type, exists=False)
    network = info[0].get("NetworkInfo", {})
    gpus = sum(g.get("Count", 0) for g in info[0].get("GpuInfo", {}).get("Gpus", []))
    architectures = info[0].get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
    offerings = ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}]
    )["InstanceTypeOfferings"]
    return InstanceTypeFacts(
        instance_type,
        exists=True,
        gpus=gpus,
        efa_supported=bool(network.get("EfaSupported")),
        max_efa_interfaces=int(network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)),
        zones=tuple(sorted(o["Location"] for o in offerings)),
        architectures=tuple(_KUBERNETES_ARCH.get(a, a) for a in architectures),
        shape=instancetypes.from_ec2(info[0]),
    )


def sized_by(spec: api.FSDPTrainingRunSpec, shape: instancetypes.InstanceType) -> api.FSDPTrainingRunSpec:
    """The spec with each worker size it leaves unset taken from `shape` (a type the table does not list, as
    EC2 describes it) and written out, so that the builder and every decision read the same sizes."""
    cluster = spec.cluster
    sizes: dict[str, Any] = {
        "gpus_per_worker": cluster.gpus_per_worker or shape.gpus,
        "cpu": cluster.worker_cpu() if cluster.cpu else shape.worker_cpu,
        "memory": cluster.worker_memory() if cluster.memory else shape.worker_memory,
    }
    if cluster.efa_per_worker is None and spec.network.efa != EfaPolicy.DISABLED:
        sizes["efa_per_worker"] = shape.efa_interfaces
    return spec.model_copy(update={"cluster": cluster.model_copy(update=sizes)})


_KUBERNETES_ARCH = {"x86_64": "amd64", "arm64": "arm64"}  # EC2's names -> kubernetes.io/arch
