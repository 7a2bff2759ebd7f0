"""Scale-from-zero preflight against a local EC2 API (moto's server, with real instance-type data)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import boto3

from fsdp_operator import api, preflight
from tests.support.kube import apply, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import DELETE, example
from tests.support.operator_process import OperatorProcess
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until


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
    namespace: str, ec2_operator: OperatorProcess
) -> None:
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


def autoscaler_says(namespace: str, pod: str, reason: str, message: str) -> None:
    """An Event on the pod as cluster-autoscaler posts one (this test plays the autoscaler)."""
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod}."},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": namespace},
        "reason": reason,
        "message": message,
        "type": "Normal",
        "source": {"component": "cluster-autoscaler"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(event))


def p5_node(name: str, zone: str) -> dict[str, Any]:
    """A p5.48xlarge as its node group adds it (KWOK runs its pods)."""
    resources = {
        "cpu": "192",
        "memory": "2048Gi",
        "pods": "110",
        "ephemeral-storage": "3500Gi",
        "nvidia.com/gpu": "8",
        "vpc.amazonaws.com/efa": "32",
    }
    labels = {
        "type": "kwok",
        "kubernetes.io/hostname": name,
        "node.kubernetes.io/instance-type": "p5.48xlarge",
        "topology.kubernetes.io/zone": zone,
        "topology.kubernetes.io/region": "us-west-2",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {"kwok.x-k8s.io/node": "fake"}},
        "status": {"allocatable": resources, "capacity": resources},
    }


def test_a_node_group_scaling_from_zero_is_waited_for_and_one_that_cannot_grow_is_refused(
    namespace: str, ec2_operator: OperatorProcess
) -> None:
    """Two runs on p5.48xlarge, of which no node exists. For one the autoscaler is first held back (its node
    group in backoff after a failed scale-up: EC2 out of p5s for now), which the run waits out past
    podErrorTimeoutSeconds with the reason shown, then adds a node (TriggeredScaleUp), which the run waits for
    and then uses; for the other no node group matches (NotTriggerScaleUp), which fails within
    podErrorTimeoutSeconds naming the autoscaler's reason."""
    node = f"p5-{namespace[-12:]}"
    try:
        common = {
            "preflight.scaleFromZero": True,
            "cluster.instanceType": "p5.48xlarge",
            "cluster.workers": 1,
            # Sized by the instance type: every GPU and EFA interface of a p5.48xlarge.
            "cluster.gpusPerWorker": DELETE,
            "cluster.efaPerWorker": DELETE,
            "recovery.podErrorTimeoutSeconds": 20,
        }
        for name in ("grows", "never"):
            manifest = example("aws-sample", **common)
            manifest["metadata"]["name"] = name
            apply(namespace, manifest)

        def waiting_worker(run: str) -> str | None:
            pods = kubectl_json("get", "pods", "-n", namespace, "-l", "ray.io/node-type=worker")["items"]
            cluster = (run_of(namespace, run).get("status") or {}).get("rayClusterName")
            for pod in pods:
                unschedulable = any(
                    c.get("reason") == "Unschedulable" for c in pod.get("status", {}).get("conditions") or []
                )
                if pod["metadata"]["labels"].get("ray.io/cluster") == cluster and unschedulable:
                    return str(pod["metadata"]["name"])
            return None

        grows = wait_until("the worker of 'grows' unschedulable", lambda: waiting_worker("grows"), timeout=90)
        never = wait_until("the worker of 'never' unschedulable", lambda: waiting_worker("never"), timeout=90)
        backoff = "pod didn't trigger scale-up: 1 in backoff after failed scale-up"
        autoscaler_says(namespace, grows, "NotTriggerScaleUp", backoff)
        no_match = "pod didn't trigger scale-up: 1 node(s) didn't match Pod's node affinity/selector"
        autoscaler_says(namespace, never, "NotTriggerScaleUp", no_match)

        failed = wait_for_phase(namespace, "never", "Failed", timeout=90)
        reason = conditions_of(failed)["Failed"]
        assert reason["reason"] == "NotTriggerScaleUp" and "didn't match" in reason["message"]

        # By then 'grows' has waited past podErrorTimeoutSeconds (20 s) behind its backoff, and still waits.
        def scheduled_reason(reason: str) -> dict[str, Any] | None:
            scheduled = conditions_of(run_of(namespace, "grows")).get("PodsScheduled") or {}
            return scheduled if scheduled.get("reason") == reason else None

        held_back = wait_until(
            "'grows' waiting out the backoff", lambda: scheduled_reason("ScaleUpDelayed"), 60
        )
        assert "in backoff after failed scale-up" in held_back["message"], held_back
        assert run_of(namespace, "grows")["status"]["phase"] == "Provisioning"
        autoscaler_says(
            namespace, grows, "TriggeredScaleUp", "pod triggered scale-up: [{eks-p5 0->1 (max: 2)}]"
        )

        wait_until("'grows' waiting for its scale-up", lambda: scheduled_reason("WaitingForScaleUp"), 60)
        run = run_of(namespace, "grows")
        scheduled = conditions_of(run)["PodsScheduled"]
        assert (scheduled["status"], scheduled["reason"]) == ("False", "WaitingForScaleUp"), scheduled
        assert "triggered scale-up" in scheduled["message"] and run["status"]["phase"] == "Provisioning"
        kubectl("apply", "-f", "-", input=json.dumps(p5_node(node, run["status"]["zone"])))
        wait_until(
            "'grows' to use the node its group added",
            lambda: conditions_of(run_of(namespace, "grows")).get("ClusterReady", {}).get("status") == "True",
            timeout=120,
        )
        assert conditions_of(run_of(namespace, "grows"))["PodsScheduled"]["status"] == "True"
        [cluster] = [
            c
            for c in rayclusters(namespace)
            if c["metadata"]["name"] == run_of(namespace, "grows")["status"]["rayClusterName"]
        ]
        worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        limits = worker["resources"]["limits"]
        assert (limits["nvidia.com/gpu"], limits["vpc.amazonaws.com/efa"]) == ("8", "32"), limits
    finally:
        kubectl("delete", "node", node, "--ignore-not-found", check=False)
