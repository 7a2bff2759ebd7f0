"""What a worker gets when its spec leaves a size unset: every GPU and EFA interface of its EC2 instance type,
and the CPU and memory a pod can have on such a node, below what Karpenter assumes of it before one launched.

The facts are EC2's (DescribeInstanceTypes: DefaultVCpus, MemoryInfo, GpuInfo, EfaInfo.MaximumEfaInterfaces,
InstanceStorageInfo.TotalSizeInGB, the default network card's MaximumNetworkInterfaces and
Ipv4AddressesPerInterface); a unit test checks this table against that data as moto ships it. A type not
listed takes its shape from EC2's answer where the operator asks EC2 (scale-from-zero runs: `from_ec2`), and
otherwise keeps the defaults of the AWS sample's g6.12xlarge shape and its one EFA interface.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Karpenter's AWS provider sizes a node before any of its type has launched (karpenter-provider-aws,
# pkg/providers/instancetype/types.go): memory less 7.5 % for the hypervisor, less kube-reserved (11 MiB per
# pod the ENIs allow, plus 255 MiB) and the 100 MiB eviction threshold; CPU less 6 % of the first core, 1 % of
# the second, 0.5 % of the third and fourth, 0.25 % of the rest. A pod asking more never gets a node from it.
VM_MEMORY_OVERHEAD = 0.075
KUBE_RESERVED_MIB_PER_POD = 11
KUBE_RESERVED_MIB = 255
EVICTION_THRESHOLD_MIB = 100
# Left under that estimate to the node's DaemonSet pods: the VPC CNI, kube-proxy, the NVIDIA and EFA device
# plugins, the EBS CSI node and a log agent ask for about 1 GiB and half a core on EKS; the rest is margin for
# a platform's own agents.
DAEMONSET_MIB = 4096
DAEMONSET_VCPUS = 4
# Karpenter's default AL2023 root volume (its EC2NodeClass blockDeviceMappings otherwise), and what a pod can
# have of it: less the kubelet's 10 % nodefs eviction threshold and the 1 GiB EKS reserves for the kubelet.
DEFAULT_ROOT_VOLUME_GIB = 20
ROOT_VOLUME_NOT_FOR_PODS_GIB = 3


@dataclass(frozen=True)
class InstanceType:
    vcpus: int
    memory_gib: int
    gpus: int
    efa_interfaces: int
    instance_store_gb: int  # NVMe the node's disk request can use only where the AMI mounts it
    enis: int  # network interfaces of the default network card, which bound the pods the VPC CNI can address
    ipv4_per_eni: int

    @property
    def max_pods(self) -> int:
        """ENI-limited pods: the first address of each interface is the node's; +2 host-network pods."""
        return self.enis * (self.ipv4_per_eni - 1) + 2

    @property
    def estimated_allocatable_mib(self) -> int:
        """The memory Karpenter's AWS provider assumes pods have on a node of this type before one ran."""
        memory = self.memory_gib * 1024
        capacity = memory - math.ceil(memory * VM_MEMORY_OVERHEAD)
        reserved = KUBE_RESERVED_MIB_PER_POD * self.max_pods + KUBE_RESERVED_MIB
        return capacity - reserved - EVICTION_THRESHOLD_MIB

    @property
    def estimated_allocatable_millicores(self) -> int:
        """The CPU Karpenter's AWS provider assumes pods can have, by its kube-reserved steps per core."""
        steps = ((1, 60), (1, 10), (2, 5))  # (cores, millicores reserved of each)
        reserved, left = 0.0, self.vcpus
        for cores, each in steps:
            taken = min(cores, left)
            reserved, left = reserved + taken * each, left - taken
        reserved += left * 2.5
        return self.vcpus * 1000 - math.ceil(reserved)

    @property
    def worker_cpu(self) -> str:
        return str(max(self.vcpus - DAEMONSET_VCPUS, 1))

    @property
    def worker_memory(self) -> str:
        return f"{(self.estimated_allocatable_mib - DAEMONSET_MIB) // 1024}Gi"


GPU_INSTANCE_TYPES: dict[str, InstanceType] = {
    "g5.12xlarge": InstanceType(48, 192, 4, 1, 3800, 15, 50),
    "g5.48xlarge": InstanceType(192, 768, 8, 1, 7600, 7, 50),
    "g6.12xlarge": InstanceType(48, 192, 4, 1, 3760, 8, 30),
    "g6.48xlarge": InstanceType(192, 768, 8, 1, 7520, 15, 50),
    "g6e.12xlarge": InstanceType(48, 384, 4, 1, 3800, 10, 30),
    "g6e.48xlarge": InstanceType(192, 1536, 8, 4, 7600, 10, 50),
    "p4d.24xlarge": InstanceType(96, 1152, 8, 4, 8000, 15, 50),
    "p4de.24xlarge": InstanceType(96, 1152, 8, 4, 8000, 15, 50),
    "p5.48xlarge": InstanceType(192, 2048, 8, 32, 30400, 2, 50),
    "p5e.48xlarge": InstanceType(192, 2048, 8, 32, 30400, 2, 50),
    "p5en.48xlarge": InstanceType(192, 2048, 8, 16, 30400, 4, 50),
    "p6-b200.48xlarge": InstanceType(192, 2048, 8, 8, 30400, 4, 50),
}
# A type the table does not know: the g6.12xlarge shape (the AWS sample's), one EFA interface.
UNKNOWN = GPU_INSTANCE_TYPES["g6.12xlarge"]


def of(instance_type: str) -> InstanceType:
    return GPU_INSTANCE_TYPES.get(instance_type, UNKNOWN)


def from_ec2(info: Mapping[str, Any]) -> InstanceType:
    """A type's shape from its DescribeInstanceTypes entry: the facts the table holds of its types."""
    network = info.get("NetworkInfo", {})
    default_card = network.get("DefaultNetworkCardIndex", 0)
    enis = next(
        (
            card["MaximumNetworkInterfaces"]
            for card in network.get("NetworkCards") or ()
            if card.get("NetworkCardIndex", 0) == default_card
        ),
        network.get("MaximumNetworkInterfaces", 1),
    )
    return InstanceType(
        vcpus=info["VCpuInfo"]["DefaultVCpus"],
        memory_gib=info["MemoryInfo"]["SizeInMiB"] // 1024,
        gpus=sum(gpu.get("Count", 0) for gpu in info.get("GpuInfo", {}).get("Gpus", ())),
        efa_interfaces=network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)
        if network.get("EfaSupported")
        else 0,
        instance_store_gb=info.get("InstanceStorageInfo", {}).get("TotalSizeInGB", 0),
        enis=enis,
        ipv4_per_eni=network.get("Ipv4AddressesPerInterface", 1),
    )
