"""A worker whose spec leaves sizes unset gets all of its instance type: p5.48xlarge's 32 EFA interfaces and
8 GPUs, not the g6.12xlarge sample's one and four."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import moto
import pytest

from fsdp_operator import api, builder, instancetypes, preflight

RUN = builder.RunRef(name="run", namespace="team-a", uid="0f1e2d3c-0000-4000-8000-000000000001")
IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
BASE: dict[str, Any] = {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}}


def worker_resources(cluster: dict[str, Any], **rest: Any) -> dict[str, str]:
    spec = api.FSDPTrainingRunSpec.model_validate({**BASE, "cluster": cluster, **rest})
    manifest = builder.build_raycluster(spec, RUN, IMAGE, zone="us-west-2a")
    container = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    return dict(container["resources"]["limits"])


def test_a_p5_worker_gets_every_efa_interface_and_gpu_of_the_node_by_default() -> None:
    limits = worker_resources({"instanceType": "p5.48xlarge"})
    assert limits == {
        "cpu": "188",
        "memory": "1888Gi",
        builder.GPU: "8",
        builder.EFA: "32",
    }
    assert worker_resources({"instanceType": "p5en.48xlarge"})[builder.EFA] == "16"


def test_the_sample_shape_is_unchanged_and_what_the_spec_sets_wins() -> None:
    assert worker_resources({}) == {"cpu": "44", "memory": "170Gi", builder.GPU: "4", builder.EFA: "1"}
    set_by_hand = {"instanceType": "p5.48xlarge", "gpusPerWorker": 4, "efaPerWorker": 16, "cpu": "90"}
    limits = worker_resources(set_by_hand)
    assert (limits["cpu"], limits[builder.GPU], limits[builder.EFA]) == ("90", "4", "16")
    assert builder.EFA not in worker_resources({"instanceType": "p5.48xlarge"}, network={"efa": "disabled"})


def test_karpenters_estimate_of_the_sample_node_is_aws_providers() -> None:
    """g6.12xlarge as karpenter-provider-aws sizes it before one launched: 192 GiB less 7.5 % (14,746 MiB),
    less kube-reserved for 234 pods (8 ENIs x 29 addresses + 2: 2,829 MiB), less the 100 MiB eviction
    threshold."""
    g6 = instancetypes.GPU_INSTANCE_TYPES["g6.12xlarge"]
    assert g6.max_pods == 234
    assert g6.estimated_allocatable_mib == 196_608 - 14_746 - 2_829 - 100 == 178_933
    assert g6.estimated_allocatable_millicores == 48_000 - 60 - 10 - 2 * 5 - 44 * 2.5 == 47_810


@pytest.mark.parametrize("name", sorted(instancetypes.GPU_INSTANCE_TYPES))
def test_a_default_worker_fits_the_node_karpenter_assumes_with_room_for_daemonsets(name: str) -> None:
    """Karpenter launches a node only for pods that fit its estimate of the type's allocatable: the default
    worker (cpu and memory unset) must, with the node's DaemonSet pods beside it (176Gi of g6.12xlarge's 192
    did not: Karpenter assumes 174.7 GiB)."""
    shape = instancetypes.GPU_INSTANCE_TYPES[name]
    limits = worker_resources({"instanceType": name})
    memory_mib = int(limits["memory"].removesuffix("Gi")) * 1024
    assert memory_mib + instancetypes.DAEMONSET_MIB <= shape.estimated_allocatable_mib, limits
    assert int(limits["cpu"]) * 1000 + 500 <= shape.estimated_allocatable_millicores, limits


def ec2_data(name: str) -> dict[str, Any]:
    """The type's DescribeInstanceTypes entry as moto ships it (real EC2 data)."""
    data = json.loads(
        gzip.decompress((Path(moto.__file__).parent / "ec2/resources/instance_types.json.gz").read_bytes())
    )
    return dict(data[name] if isinstance(data, dict) else next(t for t in data if t["InstanceType"] == name))


@pytest.mark.parametrize("name", sorted(instancetypes.GPU_INSTANCE_TYPES))
def test_the_table_says_what_ec2_says(name: str) -> None:
    assert instancetypes.from_ec2(ec2_data(name)) == instancetypes.GPU_INSTANCE_TYPES[name]


def test_a_type_the_table_does_not_list_is_sized_by_ec2s_facts_not_the_samples_shape() -> None:
    """g6e.24xlarge (96 vCPUs, 768 GiB, 4 L40S, 2 EFA interfaces) is not in the table: its default worker
    was g6.12xlarge's (44 CPU, 170Gi, 1 EFA), a quarter of its memory. Sized by EC2's answer it gets 92 CPU
    and 700Gi (Karpenter's estimate of 721,682 MiB for 492 ENI-limited pods, less 4Gi for DaemonSets)."""
    assert "g6e.24xlarge" not in instancetypes.GPU_INSTANCE_TYPES
    shape = instancetypes.from_ec2(ec2_data("g6e.24xlarge"))
    assert shape.estimated_allocatable_mib == 721_682
    cluster: dict[str, Any] = {"instanceType": "g6e.24xlarge"}
    assert worker_resources(cluster) == {"cpu": "44", "memory": "170Gi", builder.GPU: "4", builder.EFA: "1"}
    spec = api.FSDPTrainingRunSpec.model_validate({**BASE, "cluster": cluster})
    sized = builder.build_raycluster(preflight.sized_by(spec, shape), RUN, IMAGE, zone="us-west-2a")
    limits = sized["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "92", "memory": "700Gi", builder.GPU: "4", builder.EFA: "2"}
    by_hand = {**cluster, "cpu": "50", "gpusPerWorker": 2, "efaPerWorker": 0}
    spec = api.FSDPTrainingRunSpec.model_validate(
        {**BASE, "cluster": by_hand, "network": {"efa": "preferred"}}
    )
    kept = preflight.sized_by(spec, shape).cluster
    assert (kept.worker_cpu(), kept.worker_memory(), kept.gpus(), kept.efa(spec.network)) == (
        "50",
        "700Gi",
        2,
        0,
    )
    no_efa = api.FSDPTrainingRunSpec.model_validate(
        {**BASE, "cluster": cluster, "network": {"efa": "disabled"}}
    )
    assert preflight.sized_by(no_efa, shape).cluster.efa(no_efa.network) == 0


def test_where_nodes_expose_efa_through_dra_workers_claim_it_from_the_device_class() -> None:
    spec = api.FSDPTrainingRunSpec.model_validate({**BASE, "cluster": {"instanceType": "p5.48xlarge"}})
    platform = builder.Platform(efa_device_class="efa.networking.k8s.aws")
    manifest = builder.build_raycluster(spec, RUN, IMAGE, zone="us-west-2a", platform=platform)
    pod = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    name = builder.ray_cluster_name(RUN.name)
    assert pod["resourceClaims"] == [{"name": "efa", "resourceClaimTemplateName": name}]
    container = pod["containers"][0]
    assert container["resources"]["claims"] == [{"name": "efa"}]
    assert (
        builder.EFA not in container["resources"]["limits"]
        and builder.EFA not in container["resources"]["requests"]
    )
    template = builder.build_efa_claim_template(spec, RUN, "efa.networking.k8s.aws")
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request == {
        "name": "efa",
        "exactly": {"deviceClassName": "efa.networking.k8s.aws", "allocationMode": "ExactCount", "count": 32},
    }
    assert (
        template["metadata"]["name"] == name and template["metadata"]["ownerReferences"][0]["uid"] == RUN.uid
    )
