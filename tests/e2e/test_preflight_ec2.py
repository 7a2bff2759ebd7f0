"""Scale-from-zero preflight against a local EC2 API (moto's server, with real instance-type data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3

from fsdp_operator import api, preflight
from tests.harness import (
    LocalCluster,
    OperatorProcess,
    apply,
    conditions_of,
    example,
    rayclusters,
    run_of,
    wait_until,
)


def spec(**cluster: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        example(
            "aws-sample",
            **{"preflight.scaleFromZero": True, **{f"cluster.{k}": v for k, v in cluster.items()}},
        )["spec"]
    )


def test_instance_type_facts_come_from_the_ec2_api(local_cluster: LocalCluster) -> None:
    ec2 = boto3.client("ec2", endpoint_url=local_cluster.s3_endpoint, region_name="us-west-2")
    g6 = preflight.ec2_instance_type_facts(ec2, "g6.12xlarge")
    assert g6.exists and g6.gpus == 4 and g6.efa_supported and g6.max_efa_interfaces >= 1
    assert "us-west-2a" in g6.zones
    assert preflight.check_instance_type(spec(), g6).ok

    g5 = preflight.ec2_instance_type_facts(ec2, "g5.xlarge")  # one A10G, no EFA
    result = preflight.check_instance_type(spec(instanceType="g5.xlarge", gpusPerWorker=1), g5)
    assert (result.ok, result.reason) == (False, "EfaUnsupported")

    unknown = preflight.ec2_instance_type_facts(ec2, "g99.mega")
    assert (
        preflight.check_instance_type(spec(instanceType="g99.mega"), unknown).reason == "UnknownInstanceType"
    )


def test_operator_uses_ec2_when_gpu_nodes_scale_from_zero(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path
) -> None:
    proc = OperatorProcess(
        namespace=namespace,
        env={"FSDP_OPERATOR_AWS_ENDPOINT_URL": local_cluster.s3_endpoint},
        log=tmp_path / "operator.log",
    ).start()
    try:
        # g5.xlarge has one A10G and no EFA: refused by the EC2 facts, whatever the nodes look like.
        manifest = example(
            "aws-sample",
            **{
                "preflight.scaleFromZero": True,
                "cluster.instanceType": "g5.xlarge",
                "cluster.gpusPerWorker": 1,
            },
        )
        apply(namespace, manifest)

        def preflight_condition() -> dict[str, Any] | None:
            return conditions_of(run_of(namespace, "qwen25-sample")).get("Preflight")

        condition = wait_until("a Preflight condition", preflight_condition, timeout=60)
        assert (condition["status"], condition["reason"]) == ("False", "EfaUnsupported"), condition
        assert rayclusters(namespace) == []
    finally:
        proc.stop()
