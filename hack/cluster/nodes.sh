#!/usr/bin/env bash
# Prints the fake KWOK nodes of the local cluster: two g6.12xlarge node groups and one CPU system node for Ray
# heads. Capacity and labels follow what EKS and the NVIDIA/EFA device plugins set.
# - gpu-g6: four nodes, two per zone in us-west-2a and us-west-2b, whose launch template gives a 500 GiB root
#   volume (the shape the examples' runs need);
# - gpu-g6-default-disk: one node in us-west-2d as an EKS managed node group makes it when diskSize is left at
#   its default, 20 GiB, of which the kubelet offers 17Gi (as the real node does): a run's default disk does not
#   fit there, which is what a new EKS user meets first (not us-west-2c: that zone is the real node's alone, where
#   the real-pod runs pin their workers).
# p5.48xlarge (8 GPUs, 32 EFA) is a group that scales from zero: tests add its node as an autoscaler would.
set -euo pipefail

node() { # name zone instance-type nodegroup cpu memory disk gpus efa
  local name=$1 zone=$2 type=$3 group=$4 cpu=$5 memory=$6 disk=$7 gpus=$8 efa=$9 extra_capacity=""
  if ((gpus > 0)); then
    extra_capacity="
    nvidia.com/gpu: \"$gpus\"
    vpc.amazonaws.com/efa: \"$efa\""
  fi
  cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: $name
    node.kubernetes.io/instance-type: $type
    topology.kubernetes.io/region: us-west-2
    topology.kubernetes.io/zone: $zone
    eks.amazonaws.com/nodegroup: $group
spec: {}
status:
  allocatable: &resources
    cpu: "$cpu"
    memory: $memory
    pods: "110"
    ephemeral-storage: $disk$extra_capacity
  capacity: *resources
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    kubeletVersion: fake
    kubeProxyVersion: fake
EOF
}

for zone in us-west-2a us-west-2b; do
  for i in 0 1; do
    node "gpu-${zone##*-}-$i" "$zone" g6.12xlarge gpu-g6 48 192Gi 500Gi 4 1
  done
done
node gpu-d-0 us-west-2d g6.12xlarge gpu-g6-default-disk 48 192Gi 17Gi 4 1
node system-0 us-west-2a m6i.2xlarge system 8 32Gi 500Gi 0 0
