"""The Helm chart installs on the local cluster, and its RBAC grants exactly what the operator uses."""

from __future__ import annotations

import subprocess

import pytest

from tests.harness import REPO, kubectl, kubectl_json

CHART = REPO / "charts" / "fsdp-operator"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPO / "bin" / "helm"), *args], text=True, capture_output=True, check=check)


def can_i(verb: str, resource: str, namespace: str, service_account: str) -> bool:
    answer = kubectl("auth", "can-i", verb, resource, "-n", namespace, f"--as={service_account}", check=False)
    return answer.stdout.strip() == "yes"


def test_chart_lints_and_rejects_bad_values() -> None:
    assert helm("lint", str(CHART)).returncode == 0
    bad = helm("template", "x", str(CHART), "--set", "dashboardAddressMode=override", check=False)
    assert bad.returncode != 0 and "dashboardUrl" in bad.stderr
    typo = helm("template", "x", str(CHART), "--set", "observeIntervalSecond=5", check=False)
    assert typo.returncode != 0 and "observeIntervalSecond" in typo.stderr
    # Two replicas without leader election would both reconcile.
    both_active = helm("template", "x", str(CHART), "--set", "leaderElection.enabled=false", check=False)
    assert both_active.returncode != 0 and "replicaCount" in both_active.stderr
    single = ["--set", "leaderElection.enabled=false,replicaCount=1", "--kube-version", "1.35.0"]
    assert helm("template", "x", str(CHART), *single).returncode == 0
    no_replicas = helm("template", "x", str(CHART), "--set", "replicaCount=0", check=False)
    assert no_replicas.returncode != 0 and "replicaCount" in no_replicas.stderr


@pytest.mark.parametrize("scoped", [True, False], ids=["watch-one-namespace", "cluster-wide"])
def test_install_grants_the_operator_what_it_needs(namespace: str, crd_installed: None, scoped: bool) -> None:
    release = f"r{namespace[-6:]}"
    extra = ["--set", f"watchNamespaces={{{namespace}}}"] if scoped else []
    helm("install", release, str(CHART), "-n", namespace, "--wait=false", *extra)
    try:
        deployment = kubectl_json("get", "deployment", f"{release}-fsdp-operator", "-n", namespace)
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") or e.get("valueFrom") for e in container["env"]}
        assert (env["FSDP_OPERATOR_WATCH_NAMESPACES"] or "") == (namespace if scoped else "")
        # Two replicas, one of which leads through a Lease in the release namespace.
        spec = deployment["spec"]
        assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
        assert env["FSDP_OPERATOR_LEADER_ELECTION"] == "true"
        assert env["FSDP_OPERATOR_LEASE_NAMESPACE"] == namespace
        assert env["POD_NAME"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert env["FSDP_OPERATOR_HEALTH_PORT"] == str(ports.pop("health"))
        assert env["FSDP_OPERATOR_METRICS_PORT"] == str(ports.pop("metrics")) and not ports
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            assert container[probe]["httpGet"] == {"path": path, "port": "health", "scheme": "HTTP"}
        budget = kubectl_json("get", "poddisruptionbudget", f"{release}-fsdp-operator", "-n", namespace)
        assert budget["spec"]["maxUnavailable"] == 1
        sa = f"system:serviceaccount:{namespace}:{release}-fsdp-operator"
        needed = [
            ("watch", "fsdptrainingruns.fsdp.training.dev"),
            ("patch", "fsdptrainingruns.fsdp.training.dev/status"),
            ("create", "rayclusters.ray.io"),
            ("delete", "rayclusters.ray.io"),
            ("list", "workloads.kueue.x-k8s.io"),
            ("create", "events"),
        ]
        for verb, resource in needed:
            assert can_i(verb, resource, namespace, sa), f"{sa} cannot {verb} {resource}"
        assert can_i("list", "nodes", "default", sa)  # preflight reads capacity cluster-wide
        for verb in ("get", "create", "update"):
            assert can_i(verb, "leases.coordination.k8s.io", namespace, sa), f"{sa} cannot {verb} leases"
        assert not can_i("update", "leases.coordination.k8s.io", "default", sa)  # only its own namespace's
        assert not can_i("delete", "pods", namespace, sa)
        assert can_i("create", "rayclusters.ray.io", "default", sa) is not scoped
    finally:
        helm("uninstall", release, "-n", namespace)
    assert (
        kubectl("get", "deployment", f"{release}-fsdp-operator", "-n", namespace, check=False).returncode != 0
    )
