"""Pod credentials as EKS gives them, on real pods, with the real amazon-eks-pod-identity-webhook serving the
test's namespace and no keys in the operator's ray-pod-env: a run whose service account has no IAM role fails
before training. The operator warns when admitting it, and the trainer's first act, an S3 access check, fails
the run once (no retry) naming the prefix and the identity.

A run with an IRSA role is not here yet: its pods get the role and the token from the webhook, and boto3
trades it with moto's STS (tests/trainer/local/test_access.py checks that exchange), but pyarrow's bundled AWS
SDK (Ray Train's storage layer) asks STS at AWS's own endpoint, gets nothing locally and writes unsigned,
which moto refuses for some keys: such a run trained once and failed once in Ray Train's controller."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_operator import credentials, tenancy
from tests.support.demo import BUCKET
from tests.support.kube import grant, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.operator_process import OperatorProcess
from tests.support.pod_identity import pod_identity_webhook
from tests.support.real_node import RealNode, real_pods_run
from tests.support.runs import conditions_of, run_of, wait_for_phase
from tests.support.waiting import wait_until

# A run refused for its credentials: its RayCluster's start on the real node (about 2 min on its 2 CPUs,
# measured 100-150 s) and one job whose access check fails in seconds.
REFUSED_WITHIN = 420


@pytest.fixture
def ray_pod_env(real_node: RealNode) -> dict[str, str]:
    """As on an EKS platform: where S3 and STS are, no keys; credentials come from the service account."""
    return real_node.pod_env_without_credentials


@pytest.fixture
def webhook(namespace: str, local_cluster: LocalCluster, tmp_path: Path) -> Iterator[None]:
    with pod_identity_webhook(local_cluster.kubeconfig, [namespace], tmp_path / "pod-identity"):
        yield


@pytest.mark.timeout(REFUSED_WITHIN + 300)
def test_a_run_whose_pods_have_no_credentials_fails_before_training_naming_the_prefix_without_a_retry(
    namespace: str, webhook: None, proxied_operator: OperatorProcess
) -> None:
    kubectl("create", "serviceaccount", "no-role", "-n", namespace)
    grant(namespace, tenancy.SERVICE_ACCOUNTS, "no-role")
    started = time.monotonic()
    run = real_pods_run(namespace, **{"cluster.serviceAccountName": "no-role", "cluster.workers": 1})[
        "metadata"
    ]["name"]

    def warned() -> dict[str, Any] | None:
        events = kubectl_json(
            "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={run}"
        )
        return next((e for e in events["items"] if e["reason"] == credentials.NO_POD_CREDENTIALS), None)

    warning = wait_until("the operator's NoPodCredentials warning", warned, timeout=60)
    assert warning["type"] == "Warning" and f"{namespace}/no-role" in warning["message"], warning
    print(f"warned {time.monotonic() - started:.1f}s after apply")

    failed = wait_for_phase(namespace, run, "Failed", timeout=REFUSED_WITHIN)
    took = time.monotonic() - started
    print(f"Failed {took:.1f}s after apply")
    reason = conditions_of(failed)["Failed"]
    assert reason["reason"] == "StorageAccessDenied", reason
    assert f"s3://{BUCKET}/runs/{namespace}/{run}" in reason["message"], reason
    assert "no identity" in reason["message"] and "no AWS credentials" in reason["message"], reason
    status = run_of(namespace, run)["status"]
    assert (status.get("restarts") or {}).get("count", 0) == 0, status
    assert not (status.get("progress") or {}).get("step"), status  # not one step trained
