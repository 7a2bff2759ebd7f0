"""Scale-from-zero preflight picks the zone from what the cluster can launch: cluster-autoscaler's node groups
as the local EC2 Auto Scaling API (moto's server) describes them, on a cluster without Karpenter (its NodePool
API answers 404: not visible)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from tests.support.kube import apply
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import DELETE, example
from tests.support.operator_process import OperatorProcess
from tests.support.runs import conditions_of, rayclusters, run_of
from tests.support.waiting import wait_until

REGION = "us-west-2"
ZONE_LABEL = "topology.kubernetes.io/zone"


@pytest.fixture
def g6_node_group(local_cluster: LocalCluster) -> Iterator[str]:
    """An EKS-style node group of g6.12xlarge at zero nodes, in us-west-2c only (EC2 offers the type in
    us-west-2a too, which sorts first), tagged for cluster-autoscaler's auto-discovery."""
    endpoint = local_cluster.s3_endpoint
    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=REGION)
    autoscaling = boto3.client("autoscaling", endpoint_url=endpoint, region_name=REGION)
    name = f"eks-g6-{uuid.uuid4().hex[:8]}"
    template = ec2.create_launch_template(
        LaunchTemplateName=name, LaunchTemplateData={"InstanceType": "g6.12xlarge"}
    )["LaunchTemplate"]["LaunchTemplateId"]
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=name,
        LaunchTemplate={"LaunchTemplateId": template, "Version": "$Default"},
        MinSize=0,
        MaxSize=2,
        DesiredCapacity=0,
        AvailabilityZones=[f"{REGION}c"],
        Tags=[
            {"Key": "k8s.io/cluster-autoscaler/enabled", "Value": "true", "PropagateAtLaunch": False},
            {"Key": "k8s.io/cluster-autoscaler/local", "Value": "owned", "PropagateAtLaunch": False},
        ],
    )
    try:
        yield name
    finally:
        autoscaling.delete_auto_scaling_group(AutoScalingGroupName=name, ForceDelete=True)
        ec2.delete_launch_template(LaunchTemplateId=template)


def test_scale_from_zero_workers_go_to_the_zone_their_node_group_launches_in(
    namespace: str, local_cluster: LocalCluster, g6_node_group: str, ec2_operator: OperatorProcess
) -> None:
    """Before, the workers were pinned to us-west-2a, the first zone EC2 offers g6.12xlarge in, where no node
    group could ever add their node: they would wait out the provisioning timeout."""
    ec2 = boto3.client("ec2", endpoint_url=local_cluster.s3_endpoint, region_name=REGION)
    offered = ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": ["g6.12xlarge"]}]
    )["InstanceTypeOfferings"]
    assert min(o["Location"] for o in offered) == f"{REGION}a"  # what the old choice was
    apply(namespace, example("aws-sample", **{"preflight.scaleFromZero": True}))

    def admitted() -> dict[str, Any] | None:
        condition = conditions_of(run_of(namespace, "qwen25-sample")).get("Preflight")
        return condition if condition and condition["status"] == "True" else None

    condition = wait_until("the run admitted by preflight", admitted, timeout=60)
    assert condition["reason"] == "InstanceTypeLaunchable", condition
    assert f"node group {g6_node_group} can launch g6.12xlarge in {REGION}c" in condition["message"]
    assert run_of(namespace, "qwen25-sample")["status"]["zone"] == f"{REGION}c"
    [cluster] = wait_until("the run's RayCluster", lambda: rayclusters(namespace) or None, timeout=30)
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["nodeSelector"][ZONE_LABEL] == f"{REGION}c", worker["nodeSelector"]


def test_a_type_the_operator_does_not_list_gets_a_worker_of_its_size_from_ec2(
    namespace: str, ec2_operator: OperatorProcess
) -> None:
    """g6e.24xlarge (96 vCPUs, 768 GiB, 4 L40S, 2 EFA interfaces) is not in instancetypes' table: its workers
    were sized as g6.12xlarge's (44 CPU, 170Gi, 1 EFA). Now as EC2 describes it."""
    unset = {"cluster.gpusPerWorker": DELETE, "cluster.efaPerWorker": DELETE}
    manifest = example(
        "aws-sample",
        **{"preflight.scaleFromZero": True, "cluster.instanceType": "g6e.24xlarge", **unset},
    )
    apply(namespace, manifest)
    [cluster] = wait_until("the run's RayCluster", lambda: rayclusters(namespace) or None, timeout=60)
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    limits = worker["resources"]["limits"]
    assert limits == {"cpu": "92", "memory": "700Gi", "nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "2"}


def test_a_head_larger_than_every_node_it_may_go_on_is_named_before_any_cluster_exists(
    namespace: str, ec2_operator: OperatorProcess
) -> None:
    """The local cluster's head node is an m6i.2xlarge (8 CPU): a 64-CPU head was admitted, its RayCluster
    created and the GPUs held while the head waited for a node that never comes."""
    apply(namespace, example("aws-sample", **{"cluster.head.cpu": "64"}))

    def refused() -> dict[str, Any] | None:
        condition = conditions_of(run_of(namespace, "qwen25-sample")).get("Preflight")
        return condition if condition and condition["status"] == "False" else None

    condition = wait_until("the run refused by preflight", refused, timeout=60)
    assert condition["reason"] == "HeadFitsNoNode", condition
    assert (
        "64 CPU, at most 8 CPU free of DaemonSets on a node (spec.cluster.head.cpu)" in (condition["message"])
    ), condition
    assert rayclusters(namespace) == []
