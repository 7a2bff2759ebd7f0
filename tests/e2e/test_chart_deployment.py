"""The chart's Deployment, run for real: the operator container exactly as `helm template` renders it, run
with podman as a kubelet would (the chart's ServiceAccount token, read-only root, the rendered uid, probes),
with nothing but the chart's RBAC, drives the demo run to Succeeded (and, cluster-wide, through a suspend and
a resume). The apiserver's audit log then shows every request the operator's ServiceAccount made: none may be
forbidden, and every verb the chart grants must have been used, or be listed below with the reason a demo run
cannot use it."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.apiserver_audit import AuditLog
from tests.support.chart import CHART, Rendered, render
from tests.support.demo import BUCKET, RUN_TIMEOUT, SMALL, checkpoint_steps_in_s3, demo_run, wait_for_step
from tests.support.image import (
    apiserver_address,
    operator_image,
    pod_container_command,
    podman,
    service_account_files,
)
from tests.support.kube import kubectl
from tests.support.local_cluster import LocalCluster
from tests.support.net import free_port
from tests.support.operator_process import TEST_S3_PREFIXES
from tests.support.runs import rayclusters, run_of, set_suspend, wait_for_phase
from tests.support.waiting import wait_until

Grant = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

# Granted, and used by the operator in situations a demo run on the local cluster does not reach.
UNUSED_BY_A_DEMO_RUN: dict[Grant, str] = {
    ("kueue.x-k8s.io", "workloads", "list"): "only while Kueue holds a run's RayCluster",
    # Used under the chart's RBAC by test_real_pods' slowed-link test, whose fabric check finds a slow node.
    ("", "nodes", "patch"): "the fabric check's label on a node it found slow (none is slow here)",
    # Read by scale-from-zero runs' preflight (test_karpenter, test_preflight_launchers); test_helm asks
    # the apiserver whether the chart's account may.
    ("karpenter.sh", "nodepools", "list"): "scale-from-zero preflight (the demo's nodes exist)",
    ("apps", "daemonsets", "list"): "scale-from-zero preflight: what a node to be added runs beside a worker",
    # test_helm asks whether the chart's account may; test_tenant_after_admission puts one back.
    ("networking.k8s.io", "networkpolicies", "update"): "a run's policy made first or edited, put back",
}
# Granted, and used by a demo run only when a race happens, so a run may or may not use them.
USED_BY_A_DEMO_RUN_ONLY_IN_A_RACE: dict[Grant, str] = {
    ("fsdp.training.dev", "fsdptrainingruns", "get"): "a pass reads its run again after a write conflict",
    ("", "events", "patch"): "a repeated event (count bump); a clean run posts each event once",
    # Also an autoscaler's events about a Ray pod that waits for a node, which none does here.
    ("", "events", "list"): "a pass that finds a pod placed and its containers not yet created (image pulls)",
    ("networking.k8s.io", "networkpolicies", "get"): "a pass whose create found the policy made by another",
}


def grants_of(rendered: Rendered, service_account: str, namespace: str) -> set[Grant]:
    """What the rendered Roles and ClusterRoles bound to the ServiceAccount allow, verb by verb."""
    roles = {
        (o["kind"], o["metadata"]["name"]): o
        for o in rendered.of_kind("Role") + rendered.of_kind("ClusterRole")
    }
    grants: set[Grant] = set()
    for binding in rendered.of_kind("RoleBinding") + rendered.of_kind("ClusterRoleBinding"):
        subject = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
        if subject not in binding["subjects"]:
            continue
        role = roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants |= {(group, resource, verb) for verb in rule["verbs"]}
    return grants


def requests_of(user: str, since: datetime) -> list[dict[str, Any]]:
    """The audit events (first stage of each request) of one user since a time."""
    seen: set[str] = set()
    events = []
    for line in AuditLog.of_local_cluster().lines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("user", {}).get("username") != user or event["auditID"] in seen:
            continue
        if datetime.fromisoformat(event["requestReceivedTimestamp"]) < since:
            continue
        seen.add(event["auditID"])
        events.append(event)
    return events


def grant_of(event: dict[str, Any]) -> Grant:
    ref = event.get("objectRef", {})
    resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
    return (ref.get("apiGroup", ""), resource, event["verb"])


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def image() -> str:
    return operator_image()


@dataclass
class ChartOperator:
    scoped: bool
    rendered: Rendered
    service_account: str
    container: str
    health: str
    started: datetime


@pytest.fixture
def chart_operator(
    request: pytest.FixtureRequest,
    image: str,
    namespace: str,
    crd_installed: None,
    local_cluster: LocalCluster,
    tmp_path: Path,
) -> Iterator[ChartOperator]:
    scoped: bool = request.param
    release = f"c{namespace[-6:]}"
    repository, tag = image.rsplit(":", 1)
    health_port = free_port()
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "watchNamespaces": [namespace] if scoped else [],
        "clusterWide": not scoped,
        "dashboardAddressMode": "override",
        "dashboardUrl": local_cluster.ray_dashboard_url,
        "aws": {"region": "us-west-2", "endpointUrl": local_cluster.s3_endpoint},
        "s3Prefixes": TEST_S3_PREFIXES.split(","),
        "observeIntervalSeconds": 2,
        "healthPort": health_port,
        # Jobs train on the local Ray head's CPUs; the local S3 takes any key (in EKS: IRSA).
        "extraEnv": [
            {"name": "FSDP_OPERATOR_TRAINER_DEVICE", "value": "cpu"},
            {"name": "AWS_ACCESS_KEY_ID", "value": "testing"},
            {"name": "AWS_SECRET_ACCESS_KEY", "value": "testing"},
            # The local Ray head is shared by every run, so it has one token, not each run's own.
            {"name": "FSDP_OPERATOR_DASHBOARD_TOKEN", "value": local_cluster.env["FSDP_LOCAL_RAY_TOKEN"]},
        ],
    }
    if "metrics" in yaml.safe_load((CHART / "values.yaml").read_text()):
        values["metrics"] = {"port": free_port()}  # host network: no fixed port
    rendered = render(release, namespace, values)
    deployment = rendered.deployment
    service_account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    # Everything but the Deployment goes to the cluster as rendered (RBAC, ServiceAccount, PDB, Service...).
    others = [o for o in rendered.objects if o["kind"] not in ("Deployment", "CustomResourceDefinition")]
    kubectl("apply", "--server-side", "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in others))
    token_dir = service_account_files(
        local_cluster.kubeconfig, namespace, service_account, tmp_path / "serviceaccount"
    )
    pod_name = f"{deployment['metadata']['name']}-{uuid.uuid4().hex[:10]}"
    started = datetime.now(UTC)
    argv = pod_container_command(
        deployment, name=pod_name, token_dir=token_dir, apiserver=apiserver_address(local_cluster.kubeconfig)
    )
    podman(*argv)
    operator = ChartOperator(
        scoped, rendered, service_account, pod_name, f"http://127.0.0.1:{health_port}", started
    )
    try:
        wait_until(
            "the operator container to be ready (/readyz)", lambda: answers(f"{operator.health}/readyz"), 90
        )
        yield operator
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        podman("stop", "--time", "30", pod_name, check=False)
        print(f"--- operator container log ---\n{podman('logs', pod_name, check=False).stderr[-8000:]}")
        podman("rm", "--force", pod_name, check=False)
        cluster_scoped = [o for o in others if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
        for obj in cluster_scoped:
            kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found")


@pytest.mark.parametrize(
    "chart_operator", [True, False], ids=["watch-one-namespace", "cluster-wide"], indirect=True
)
def test_chart_deployment_runs_the_demo_with_only_the_charts_rbac(
    chart_operator: ChartOperator, namespace: str, s3: Any
) -> None:
    container = podman("inspect", chart_operator.container).stdout
    [state] = json.loads(container)
    assert state["Config"]["User"] == "65532" and state["HostConfig"]["ReadonlyRootfs"]

    # Cluster-wide, the run is suspended and resumed once: the cluster goes, the checkpoints stay, and the
    # second attempt continues from the latest one.
    suspend = not chart_operator.scoped
    if suspend:
        name = demo_run(namespace, **SMALL, **{"training.maxSteps": 60})
        wait_for_step(namespace, name, 10)
        set_suspend(namespace, name, True)
        suspended = wait_for_phase(namespace, name, "Suspended", timeout=60)
        wait_until("the RayCluster to be deleted", lambda: rayclusters(namespace) == [], timeout=60)
        assert checkpoint_steps_in_s3(s3, namespace, name), "suspending must keep the checkpoints"
        set_suspend(namespace, name, False)
    else:
        name = demo_run(namespace, **SMALL)
    run = wait_for_phase(namespace, name, "Succeeded", timeout=RUN_TIMEOUT)
    assert run["status"]["attempt"] == (2 if suspend else 1)
    if suspend:
        assert run["status"]["progress"]["step"] == 60
        key = f"runs/{namespace}/{name}/progress.json"
        progress = json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        assert progress["resumedFromStep"] >= suspended["status"]["checkpoints"]["latest"]["step"], progress
    assert answers(f"{chart_operator.health}/healthz") and answers(f"{chart_operator.health}/readyz")
    assert (
        podman("inspect", "--format", "{{.State.Running}}", chart_operator.container).stdout.strip() == "true"
    )

    # The ServiceAccount's requests, from the apiserver's audit log (written when each request completes).
    user = f"system:serviceaccount:{namespace}:{chart_operator.service_account}"
    requests = wait_until(
        "the operator's requests in the audit log",
        lambda: requests_of(user, chart_operator.started),
        timeout=30,
    )
    forbidden = sorted(
        {
            (grant_of(e), e.get("requestURI", ""))
            for e in requests
            if e.get("responseStatus", {}).get("code") == 403
        }
    )
    assert not forbidden, f"the chart's RBAC lacks what the operator asked for: {forbidden}"
    used = {grant_of(e) for e in requests}
    granted = grants_of(chart_operator.rendered, chart_operator.service_account, namespace)
    unused = granted - used - set(UNUSED_BY_A_DEMO_RUN) - set(USED_BY_A_DEMO_RUN_ONLY_IN_A_RACE)
    assert not unused, f"the chart grants what the operator never used: {sorted(unused)}"
    stale = {g for g in UNUSED_BY_A_DEMO_RUN if g in used}
    assert not stale, f"listed as unused but used: {sorted(stale)}"
    ungranted = {g for g in used if g not in granted and g[1] != ""} - {
        ("authorization.k8s.io", "selfsubjectaccessreviews", "create")
    }
    assert not ungranted, f"used without a grant of the chart's: {sorted(ungranted)}"
    assert run_of(namespace, name)["status"]["phase"] == "Succeeded"
