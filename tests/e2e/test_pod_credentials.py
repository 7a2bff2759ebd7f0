"""Pod credentials as EKS gives them, on real pods, with the real amazon-eks-pod-identity-webhook serving the
test's namespace and no keys in the operator's ray-pod-env. A run whose service account carries an IAM
role trains with the web-identity credentials its pods trade at STS (AWS's regional name, answered in the
cluster by the local STS over TLS); a run whose service account has none fails before training: the operator
warns when admitting it, and the trainer's first act, an S3 access check, fails the run once (no retry) naming
the prefix and the identity."""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_operator import credentials, tenancy
from tests.support.demo import BUCKET
from tests.support.kube import grant, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.moto_recorder import recorded_requests
from tests.support.operator_process import OperatorProcess
from tests.support.pod_identity import ROLE_ANNOTATION, irsa_pod_env, pod_identity_webhook
from tests.support.real_node import RUN_TIMEOUT, RealNode, real_pods_run
from tests.support.runs import conditions_of, run_of, run_summary, wait_for_phase
from tests.support.waiting import wait_until

# A run refused for its credentials: its RayCluster's start on the real node (about 2 min on its 2 CPUs,
# measured 100-150 s) and one job whose access check fails in seconds.
REFUSED_WITHIN = 420
ENDED = ("Succeeded", "Failed")
# aws-c-auth (pyarrow's AWS SDK) names its web-identity sessions with a bare UUID; botocore's are
# "botocore-session-<time>".
PYARROW_SESSION = re.compile(r"[0-9A-Fa-f]{8}(-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}")


@pytest.fixture
def ray_pod_env(real_node: RealNode) -> dict[str, str]:
    """As on an EKS platform: where S3 is, no keys; credentials come from the service account."""
    return irsa_pod_env(real_node.pod_env_without_credentials)


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


def pods_of(namespace: str, run: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"fsdp.training.dev/run={run}"
    )["items"]
    return found


@pytest.mark.timeout(RUN_TIMEOUT + 300)
def test_a_run_with_an_iam_role_trains_on_web_identity_credentials_from_sts(
    namespace: str, webhook: None, proxied_operator: OperatorProcess, local_cluster: LocalCluster
) -> None:
    role = f"arn:aws:iam::123456789012:role/{namespace}-trainer"
    kubectl("create", "serviceaccount", "trainer", "-n", namespace)
    kubectl("annotate", "serviceaccount", "trainer", "-n", namespace, f"{ROLE_ANNOTATION}={role}")
    grant(namespace, tenancy.SERVICE_ACCOUNTS, "trainer")
    few_steps = {"training.maxSteps": 10, "data.evalEvery": 10}  # one checkpoint, at the end
    with recorded_requests(local_cluster.s3_endpoint) as requests_so_far:
        started = time.monotonic()
        run = real_pods_run(
            namespace, **{"cluster.serviceAccountName": "trainer", "cluster.workers": 1, **few_steps}
        )["metadata"]["name"]
        pods = wait_until(
            "the run's head and worker pods",
            lambda: found if len(found := pods_of(namespace, run)) == 2 else None,
            timeout=180,
        )
        ended = wait_until(
            f"run {run} to succeed or fail",
            lambda: r if (r := run_of(namespace, run)).get("status", {}).get("phase") in ENDED else None,
            timeout=RUN_TIMEOUT,
        )
        print(f"{ended['status']['phase']} {time.monotonic() - started:.1f}s after apply")
        recorded = requests_so_far()
    assert ended["status"]["phase"] == "Succeeded", run_summary(ended)
    assert (ended["status"].get("restarts") or {}).get("count", 0) == 0, run_summary(ended)
    for pod in pods:  # the webhook's role and token, no keys
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            where = f"{pod['metadata']['name']}/{container['name']}"
            assert env.get("AWS_ROLE_ARN") == role and env.get("AWS_WEB_IDENTITY_TOKEN_FILE"), (where, env)
            assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env), (where, env)

    # Ray Train's storage (pyarrow's AWS SDK) and the trainer's boto3 each traded the pods' token for the
    # role's credentials at STS's own name.
    exchanges = [
        r.form["RoleSessionName"]
        for r in recorded
        if r.form.get("Action") == "AssumeRoleWithWebIdentity"
        and r.form.get("RoleArn") == role
        and r.headers.get("Host") == "sts.us-west-2.amazonaws.com"
    ]
    assert any(PYARROW_SESSION.fullmatch(s) for s in exchanges), exchanges
    assert any(s.startswith("botocore-session-") for s in exchanges), exchanges
    # The checkpoint went to S3, from both SDKs, signed with temporary keys, which only STS issues (ASIA...):
    # the pods have no others.
    checkpoint = f"/runs/{namespace}/{run}/checkpoint"
    writes = [
        r for r in recorded if r.method in ("PUT", "POST") and checkpoint in urllib.parse.unquote(r.url)
    ]
    agents = {r.headers.get("User-Agent", "").split("/", 1)[0] for r in writes}
    assert {"aws-sdk-cpp", "Boto3"} <= agents, sorted({f"{r.method} {r.url}" for r in recorded})
    signed_by = {r.access_key for r in writes}
    assert all(key and key.startswith("ASIA") for key in signed_by), signed_by
