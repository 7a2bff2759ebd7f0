"""Pod credentials as EKS gives them, on real pods: the operator puts no keys in the Ray pods (its ray-pod-env
names only where S3 is), the real amazon-eks-pod-identity-webhook gives the pods of a service account
annotated eks.amazonaws.com/role-arn a projected token the real kubelet mounts, and botocore and pyarrow trade
it for the role's credentials with moto's STS (AssumeRoleWithWebIdentity).

A run whose service account has no role fails before training: the operator warns when admitting it, and the
trainer's first act, an S3 access check, fails the run once (no retry) naming the prefix and the identity."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_operator import credentials, tenancy
from fsdp_trainer.contract import driver_log_name
from tests.support.demo import BUCKET
from tests.support.kube import grant, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.operator_process import OperatorProcess
from tests.support.pod_identity import TOKEN_AUDIENCE, irsa_service_account, pod_identity_webhook
from tests.support.real_node import RUN_TIMEOUT, RealNode, real_pods_run
from tests.support.runs import conditions_of, run_of, wait_for_phase
from tests.support.waiting import wait_until

ROLE_NAME = "fsdp-irsa-training"
ROLE_ARN = f"arn:aws:iam::123456789012:role/{ROLE_NAME}"
STATIC_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
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


def ray_pods(namespace: str, run: str) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"fsdp.training.dev/run={run}"
    )["items"]
    return pods


def ray_container_env(pod: dict[str, Any]) -> dict[str, Any]:
    [container] = [c for c in pod["spec"]["containers"] if c["name"] in ("ray-head", "ray-worker")]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def jwt_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return claims


@pytest.mark.timeout(RUN_TIMEOUT + 300)
def test_a_run_whose_service_account_has_an_irsa_role_trains_on_real_pods_with_web_identity_credentials(
    namespace: str, webhook: None, proxied_operator: OperatorProcess, s3: Any
) -> None:
    irsa_service_account(namespace, "trainer", ROLE_ARN)
    grant(namespace, tenancy.SERVICE_ACCOUNTS, "trainer")
    steps = {"training.maxSteps": 20, "checkpoint.everySteps": 10, "data.evalEvery": 10}
    # Synthetic data: pyarrow's bundled AWS SDK asks STS at AWS's own endpoint for web-identity credentials
    # (it takes no STS endpoint override), gets none here and reads unsigned, which moto refuses for the
    # corpus the s3 fixture uploaded (private). boto3 (the access check, checkpoint uploads) uses moto's STS.
    steps["data.source"] = "synthetic"
    run = real_pods_run(namespace, **{"cluster.serviceAccountName": "trainer", **steps})["metadata"]["name"]

    pods = wait_until(
        "the run's head and two workers created", lambda: len(p := ray_pods(namespace, run)) == 3 and p, 300
    )
    for pod in pods:
        env = ray_container_env(pod)
        name = pod["metadata"]["name"]
        assert env.get("AWS_ROLE_ARN") == ROLE_ARN, (name, env)
        assert env.get("AWS_WEB_IDENTITY_TOKEN_FILE", "").startswith("/var/run/secrets/eks.amazonaws.com/"), (
            name,
            env,
        )
        assert not set(STATIC_KEYS) & set(env), (name, sorted(env))
        sources = [
            s
            for v in pod["spec"]["volumes"]
            if v["name"] == "aws-iam-token"
            for s in v["projected"]["sources"]
        ]
        assert sources and sources[0]["serviceAccountToken"]["audience"] == TOKEN_AUDIENCE, (
            name,
            pod["spec"]["volumes"],
        )

    head = next(p for p in pods if p["metadata"]["labels"]["ray.io/node-type"] == "head")["metadata"]["name"]
    wait_until(
        "the head pod running",
        lambda: kubectl_json("get", "pod", "-n", namespace, head)["status"].get("phase") == "Running",
        timeout=300,
    )
    # The token the kubelet projected: the apiserver's, for the service account, for STS.
    token = kubectl(
        "exec", "-n", namespace, head, "-c", "ray-head", "--", "cat",
        ray_container_env(pods[0])["AWS_WEB_IDENTITY_TOKEN_FILE"],
    ).stdout  # fmt: skip
    claims = jwt_claims(token)
    assert claims["sub"] == f"system:serviceaccount:{namespace}:trainer", claims
    assert TOKEN_AUDIENCE in claims["aud"] and claims["iss"], claims

    succeeded = wait_for_phase(namespace, run, "Succeeded", timeout=RUN_TIMEOUT)
    assert (succeeded["status"].get("restarts") or {}).get("count", 0) == 0, succeeded["status"]
    prefix = f"runs/{namespace}/{run}/"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]]
    assert any("checkpoint" in k for k in keys), keys
    # The trainer's access check says who it was: the role the webhook named, by STS's web identity.
    log = s3.get_object(Bucket=BUCKET, Key=prefix + driver_log_name(1))["Body"].read().decode()
    assert f"S3 access checked as arn:aws:sts::123456789012:assumed-role/{ROLE_NAME}/" in log, log[-3000:]


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
