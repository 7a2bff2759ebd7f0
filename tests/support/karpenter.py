"""Real Karpenter for the tests where GPU nodes scale from zero, as on most new EKS clusters (EKS Auto Mode
among them): its KWOK cloud provider (main package sigs.k8s.io/karpenter/kwok, built by hack/build-tools.sh
as bin/karpenter-kwok), started on demand as a process against the local apiserver, never by cluster-up.

Karpenter decides which instance type, if any, can take a pending pod from what it assumes a node of that type
will offer before one has ever launched. On EKS that is the AWS provider's estimate (karpenter-provider-aws,
pkg/providers/instancetype/types.go), which `aws_allocatable` recomputes here from EC2's facts
(DescribeInstanceTypes, served by the local cluster's moto with real EC2 data) as an independent reference.
The KWOK provider subtracts a fixed 100m CPU and 10Mi from each type's resources instead, so each type's
resources are that estimate plus those: Karpenter's view of a g6.12xlarge is then AWS's, about 174.7 GiB
of memory, not 192 GiB.

The nodes Karpenter makes carry the annotation kwok.x-k8s.io/node=fake, which the cluster's kwok controller
selects (hack/cluster/kwokctl.yaml), so KWOK makes them Ready and runs their pods as it does the fixed nodes'.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import yaml

from tests.support.kube import kubectl, kubectl_json, wait_established
from tests.support.local_cluster import LocalCluster
from tests.support.netns import in_network_namespace
from tests.support.paths import REPO
from tests.support.waiting import wait_until

KARPENTER_BIN = REPO / "bin" / "karpenter-kwok"
KARPENTER_CRDS = REPO / "bin" / "karpenter-crds"
LABEL_NODEPOOL = "karpenter.sh/nodepool"
GPU_POOL = "gpu"  # the EKS GPU types, tainted nvidia.com/gpu as EKS's GPU NodePools are
HEAD_POOL = "ray-heads"  # CPU nodes tainted for Ray heads (the operator's heads tolerate ray.io/head-node)
GPU_TYPES = ("g6.12xlarge", "g6.48xlarge", "p5.48xlarge")
HEAD_TYPES = ("m6i.2xlarge",)
# On-demand prices in us-west-2, $/hour: Karpenter launches the cheapest type that fits.
PRICES = {"g6.12xlarge": 4.6016, "g6.48xlarge": 13.3504, "p5.48xlarge": 55.04, "m6i.2xlarge": 0.384}
REGION = "us-west-2"
# A zone EC2 offers the types in where the node class has no subnet, as an EC2NodeClass's subnetSelectorTerms
# often cover some of a region's zones only: Karpenter offers no type there, which preflight cannot see (it
# reads NodePools and EC2's offerings, not node classes), so a run pinned to it meets Karpenter's own refusal.
ZONE_WITHOUT_SUBNET = "us-west-2d"
# Seconds from a NodeClaim's launch to its node's registration: a GPU instance boots in minutes; this is long
# enough for a run to be seen waiting on Karpenter's nomination, short enough for a test.
REGISTRATION_DELAY = "15s"
GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
MI = 1024**2
GI = 1024**3

# karpenter-provider-aws's estimate before a type has launched: 7.5 % of memory for the hypervisor
# (vmMemoryOverheadPercent), kube-reserved 11Mi per pod + 255Mi and a CPU share by steps of the vCPUs,
# 100Mi of memory and 10 % of the disk held for eviction, 1Gi of disk kube-reserved, and an AL2023 root
# volume of 20 GiB (unless an EC2NodeClass's blockDeviceMappings say more).
VM_MEMORY_OVERHEAD = 0.075
CPU_RESERVED_STEPS = ((0, 1000, 0.06), (1000, 2000, 0.01), (2000, 4000, 0.005), (4000, 1 << 31, 0.0025))
EVICTION_MEMORY_MI = 100
ROOT_VOLUME = 20 * GI
DISK_KUBE_RESERVED = GI
DISK_EVICTION_PERCENT = 10
# What the KWOK provider subtracts from every type's resources (kwok/cloudprovider/helpers.go).
KWOK_OVERHEAD_CPU_M = 100
KWOK_OVERHEAD_MEMORY_MI = 10


@dataclass(frozen=True)
class Ec2Facts:
    """What DescribeInstanceTypes says of a type, as much as the AWS provider's estimate reads."""

    name: str
    vcpus: int
    memory_mib: int
    enis: int  # network interfaces of the default network card (the VPC CNI uses only those)
    ipv4_per_eni: int
    gpus: int
    efa: int

    @classmethod
    def of(cls, info: dict[str, Any]) -> Ec2Facts:
        network = info["NetworkInfo"]
        default_card = network.get("DefaultNetworkCardIndex", 0)
        card = next(c for c in network["NetworkCards"] if c["NetworkCardIndex"] == default_card)
        return cls(
            name=info["InstanceType"],
            vcpus=info["VCpuInfo"]["DefaultVCpus"],
            memory_mib=info["MemoryInfo"]["SizeInMiB"],
            enis=card["MaximumNetworkInterfaces"],
            ipv4_per_eni=network["Ipv4AddressesPerInterface"],
            gpus=sum(g["Count"] for g in (info.get("GpuInfo") or {}).get("Gpus", [])),
            efa=(network.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0),
        )

    @property
    def max_pods(self) -> int:
        """The VPC CNI's limit, AL2023's max-pods: ENIs x (IPv4 addresses per ENI - 1) + 2."""
        return self.enis * (self.ipv4_per_eni - 1) + 2


@dataclass(frozen=True)
class Allocatable:
    cpu_m: int
    memory_mi: int
    disk: int  # bytes
    pods: int


def aws_allocatable(facts: Ec2Facts) -> Allocatable:
    """The AWS provider's allocatable of a type that has not launched yet (float arithmetic as it does it)."""
    vm_overhead_mi = math.ceil(facts.memory_mib * MI * VM_MEMORY_OVERHEAD / 1024 / 1024)
    kube_reserved_mi = 11 * facts.max_pods + 255
    cpu_m = facts.vcpus * 1000
    reserved_cpu_m = sum(
        int((min(cpu_m, end) - start) * share) for start, end, share in CPU_RESERVED_STEPS if cpu_m >= start
    )
    disk_eviction = math.ceil(ROOT_VOLUME / 100 * DISK_EVICTION_PERCENT)
    return Allocatable(
        cpu_m=cpu_m - reserved_cpu_m,
        memory_mi=facts.memory_mib - vm_overhead_mi - kube_reserved_mi - EVICTION_MEMORY_MI,
        disk=ROOT_VOLUME - DISK_KUBE_RESERVED - disk_eviction,
        pods=facts.max_pods,
    )


def kwok_instance_type(facts: Ec2Facts, zones: list[str]) -> dict[str, Any]:
    """The KWOK provider's entry of a type (INSTANCE_TYPES_FILE_PATH): the AWS estimate plus what the KWOK
    provider subtracts, so that Karpenter's allocatable of the type is the AWS provider's."""
    estimate = aws_allocatable(facts)
    resources = {
        "cpu": f"{estimate.cpu_m + KWOK_OVERHEAD_CPU_M}m",
        "memory": f"{estimate.memory_mi + KWOK_OVERHEAD_MEMORY_MI}Mi",
        "ephemeral-storage": str(estimate.disk),
        "pods": str(estimate.pods),
    }
    if facts.gpus:
        resources[GPU] = str(facts.gpus)
    if facts.efa:
        resources[EFA] = str(facts.efa)
    return {
        "name": facts.name,
        "architecture": "amd64",
        "operatingSystems": ["linux"],
        "resources": resources,
        "offerings": [
            {
                "Price": PRICES[facts.name],
                "Available": True,
                "Requirements": [
                    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [zone]},
                ],
            }
            for zone in zones
        ],
    }


def ec2_instance_types(local_cluster: LocalCluster, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The KWOK provider's entries of these types from the local EC2 API: its facts and the zones it offers
    each type in (where preflight places scale-from-zero workers too)."""
    ec2 = boto3.client("ec2", endpoint_url=local_cluster.s3_endpoint, region_name=REGION)
    found = ec2.describe_instance_types(InstanceTypes=list(names))["InstanceTypes"]
    entries = []
    for info in sorted(found, key=lambda i: str(i["InstanceType"])):
        offerings = ec2.describe_instance_type_offerings(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": [info["InstanceType"]]}],
        )["InstanceTypeOfferings"]
        zones = sorted(o["Location"] for o in offerings if o["Location"] != ZONE_WITHOUT_SUBNET)
        entries.append(kwok_instance_type(Ec2Facts.of(info), zones))
    return entries


def node_class() -> dict[str, Any]:
    return {
        "apiVersion": "karpenter.kwok.sh/v1alpha1",
        "kind": "KWOKNodeClass",
        "metadata": {"name": "default"},
        "spec": {"nodeRegistrationDelay": REGISTRATION_DELAY},
    }


def node_pool(name: str, instance_types: tuple[str, ...], taint: dict[str, str]) -> dict[str, Any]:
    """A NodePool as a platform team writes one for a class of nodes: its types, on demand, one taint; empty
    nodes go after a minute."""
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": name},
        "spec": {
            "template": {
                "spec": {
                    "nodeClassRef": {
                        "group": "karpenter.kwok.sh",
                        "kind": "KWOKNodeClass",
                        "name": "default",
                    },
                    "requirements": [
                        {
                            "key": "node.kubernetes.io/instance-type",
                            "operator": "In",
                            "values": list(instance_types),
                        },
                        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]},
                    ],
                    "taints": [{**taint, "effect": "NoSchedule"}],
                    "expireAfter": "Never",
                }
            },
            "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "60s"},
        },
    }


NODE_POOLS = (
    node_pool(GPU_POOL, GPU_TYPES, {"key": GPU, "value": "true"}),
    node_pool(HEAD_POOL, HEAD_TYPES, {"key": "ray.io/head-node", "value": "true"}),
)


def install_crds() -> None:
    """Karpenter's CRDs (server-side: they exceed the client-side annotation limit); waits until served."""
    # bin/karpenter-crds is a link: with the slash kubectl reads the directory behind it.
    kubectl("apply", "--server-side", "--force-conflicts", "-f", f"{KARPENTER_CRDS}/")
    wait_established(
        "crd/nodepools.karpenter.sh", "crd/nodeclaims.karpenter.sh", "crd/kwoknodeclasses.karpenter.kwok.sh"
    )


@dataclass
class Karpenter:
    """The Karpenter process, in a network namespace of its own (tests/support/netns.py): its metrics and
    health servers bind every interface and it has no address setting."""

    workdir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "karpenter.log"

    def log_tail(self, chars: int = 8000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else ""

    def wait_until_ready(self) -> None:
        def pools_ready() -> bool:
            """Karpenter validated each NodePool and found its node class Ready: it provisions for them."""
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"karpenter exited {self.process.returncode}:\n{self.log_tail()}")
            pools = kubectl_json("get", "nodepools")["items"]
            return len(pools) == len(NODE_POOLS) and all(
                any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in p.get("status", {}).get("conditions", [])
                )
                for p in pools
            )

        wait_until("Karpenter to find its NodePools Ready", pools_ready, timeout=90)
        # A file it cannot parse is only logged, and leaves it with no instance types at all.
        if "failed constructing instance types" in self.log.read_text():
            raise AssertionError(f"karpenter did not take its instance types:\n{self.log_tail()}")


def karpenter_nodes() -> list[str]:
    found = kubectl("get", "nodes", "-l", LABEL_NODEPOOL, "-o", "name", check=False).stdout.split()
    return [name.removeprefix("node/") for name in found]


def node_claims() -> list[dict[str, Any]]:
    claims: list[dict[str, Any]] = kubectl_json("get", "nodeclaims")["items"]
    return claims


def _remove_leftovers() -> None:
    """Whatever a Karpenter that was stopped early left: its objects' finalizers are its own."""
    no_finalizers = '{"metadata":{"finalizers":null}}'
    for kind, names in (
        ("nodeclaim", [c["metadata"]["name"] for c in node_claims()]),
        ("node", karpenter_nodes()),
        ("nodepool", [p["metadata"]["name"] for p in NODE_POOLS]),
        ("kwoknodeclass", ["default"]),
    ):
        for name in names:
            kubectl("patch", kind, name, "--type=merge", "-p", no_finalizers, check=False)
            kubectl("delete", kind, name, "--ignore-not-found", "--wait=false", check=False)


@contextmanager
def running_karpenter(local_cluster: LocalCluster, workdir: Path) -> Iterator[Karpenter]:
    """Karpenter with its CRDs, the KWOK node class and the NodePools, for the duration; afterwards its
    NodePools are deleted while it runs (it drains and deletes their nodes), then it is stopped by pid and
    anything it left is removed. Its log's tail is printed (pytest shows it when the test fails)."""
    workdir.mkdir(parents=True, exist_ok=True)
    install_crds()
    karpenter = Karpenter(workdir)
    types = workdir / "instance-types.json"
    types.write_text(json.dumps(ec2_instance_types(local_cluster, GPU_TYPES + HEAD_TYPES), indent=1))
    kubeconfig = yaml.safe_load(Path(local_cluster.kubeconfig).read_text())
    port = urllib.parse.urlsplit(kubeconfig["clusters"][0]["cluster"]["server"]).port or 443
    env = {
        "PATH": os.environ["PATH"],
        "KUBECONFIG": local_cluster.kubeconfig,
        "DISABLE_LEADER_ELECTION": "true",
        "INSTANCE_TYPES_FILE_PATH": str(types),
    }
    try:
        kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"kind": "List", "apiVersion": "v1", "items": [node_class(), *NODE_POOLS]}),
        )
        with in_network_namespace([str(KARPENTER_BIN)], karpenter.log, port, None, env, workdir) as process:
            karpenter.process = process
            karpenter.wait_until_ready()
            try:
                yield karpenter
            finally:
                if process.poll() is None:
                    kubectl("delete", "nodepools", "--all", "--wait=false", check=False)
                    try:
                        wait_until(
                            "karpenter to remove its nodes",
                            lambda: not node_claims() and not karpenter_nodes(),
                            timeout=60,
                        )
                    except AssertionError as left:
                        print(f"{left}: removed by hand")
    finally:
        _remove_leftovers()
        # The cluster as it was: other tests' operators read NodePools, and an installed API with none in it
        # is a Karpenter that can launch nothing (preflight refuses scale-from-zero runs then).
        kubectl("delete", "-f", f"{KARPENTER_CRDS}/", "--ignore-not-found", "--timeout=60s", check=False)
        print(f"--- karpenter log ({karpenter.log}) ---\n{karpenter.log_tail()}")
