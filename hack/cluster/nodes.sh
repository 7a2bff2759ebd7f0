#!/usr/bin/env bash
# Prints the fake KWOK nodes of the local cluster: four g6.12xlarge-shaped GPU nodes, two per zone, and one
# CPU system node for Ray heads. Capacity and labels follow what EKS and the NVIDIA/EFA device plugins set.
set -euo pipefail

node() { # name zone instance-type nodegroup cpu memory gpus efa
  local name=$1 zone=$2 type=$3 group=$4 cpu=$5 memory=$6 gpus=$7 efa=$8 extra_capacity=""
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
    ephemeral-storage: 500Gi$extra_capacity
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
    node "gpu-${zone##*-}-$i" "$zone" g6.12xlarge gpu-g6 48 192Gi 4 1
  done
done
node system-0 us-west-2a m6i.2xlarge system 8 32Gi 0 0
