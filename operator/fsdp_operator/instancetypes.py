"""What a worker gets when its spec leaves a size unset: every GPU and EFA interface of its EC2 instance type,
and the CPU and memory a pod can have on such a node.

The facts are EC2's (DescribeInstanceTypes: DefaultVCpus, MemoryInfo, GpuInfo, EfaInfo.MaximumEfaInterfaces,
InstanceStorageInfo.TotalSizeInGB);
a unit test checks this table against that data as moto ships it. A type not listed keeps the defaults of the
AWS sample's g6.12xlarge shape and its one EFA interface.
"""

from __future__ import annotations

from dataclasses import dataclass

# Left to the kubelet, the system daemons and the node's DaemonSets (EKS reserves ~0.1-0.2 cores and
# 255 MiB + 11 MiB per pod; the VPC CNI, EFA and NVIDIA device plugins, kube-proxy and log agents run beside).
RESERVED_VCPUS = 4
MEMORY_FOR_PODS = 11 / 12


@dataclass(frozen=True)
class InstanceType:
    vcpus: int
    memory_gib: int
    gpus: int
    efa_interfaces: int
    instance_store_gb: int  # NVMe the node's disk request can use only where the AMI mounts it

    @property
    def worker_cpu(self) -> str:
        return str(max(self.vcpus - RESERVED_VCPUS, 1))

    @property
    def worker_memory(self) -> str:
        return f"{int(self.memory_gib * MEMORY_FOR_PODS)}Gi"


GPU_INSTANCE_TYPES: dict[str, InstanceType] = {
    "g5.12xlarge": InstanceType(48, 192, 4, 1, 3800),
    "g5.48xlarge": InstanceType(192, 768, 8, 1, 7600),
    "g6.12xlarge": InstanceType(48, 192, 4, 1, 3760),
    "g6.48xlarge": InstanceType(192, 768, 8, 1, 7520),
    "g6e.12xlarge": InstanceType(48, 384, 4, 1, 3800),
    "g6e.48xlarge": InstanceType(192, 1536, 8, 4, 7600),
    "p4d.24xlarge": InstanceType(96, 1152, 8, 4, 8000),
    "p4de.24xlarge": InstanceType(96, 1152, 8, 4, 8000),
    "p5.48xlarge": InstanceType(192, 2048, 8, 32, 30400),
    "p5e.48xlarge": InstanceType(192, 2048, 8, 32, 30400),
    "p5en.48xlarge": InstanceType(192, 2048, 8, 16, 30400),
    "p6-b200.48xlarge": InstanceType(192, 2048, 8, 8, 30400),
}
# A type the table does not know: the g6.12xlarge shape (the AWS sample's), one EFA interface.
UNKNOWN = GPU_INSTANCE_TYPES["g6.12xlarge"]


def of(instance_type: str) -> InstanceType:
    return GPU_INSTANCE_TYPES.get(instance_type, UNKNOWN)
