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


@pytest.mark.parametrize("scoped", [True, False], ids=["watch-one-namespace", "cluster-wide"])
def test_install_grants_the_operator_what_it_needs(namespace: str, crd_installed: None, scoped: bool) -> None:
    release = f"r{namespace[-6:]}"
    extra = ["--set", f"watchNamespaces={{{namespace}}}"] if scoped else []
    helm("install", release, str(CHART), "-n", namespace, "--wait=false", *extra)
    try:
        deployment = kubectl_json("get", "deployment", f"{release}-fsdp-operator", "-n", namespace)
        env = {
            e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert (env["FSDP_OPERATOR_WATCH_NAMESPACES"] or "") == (namespace if scoped else "")
        sa = f"system:serviceaccount:{namespace}:{release}-fsdp-operator"
        needed = [
            ("watch", "fsdptrainingruns.fsdp.training.dev"),
            ("patch", "fsdptrainingruns.fsdp.training.dev/status"),
            ("create", "rayclusters.ray.io"),
            ("delete", "rayclusters.ray.io"),
            ("create", "events"),
        ]
        for verb, resource in needed:
            assert can_i(verb, resource, namespace, sa), f"{sa} cannot {verb} {resource}"
        assert can_i("list", "nodes", "default", sa)  # preflight reads capacity cluster-wide
        assert not can_i("delete", "pods", namespace, sa)
        assert can_i("create", "rayclusters.ray.io", "default", sa) is not scoped
    finally:
        helm("uninstall", release, "-n", namespace)
    assert (
        kubectl("get", "deployment", f"{release}-fsdp-operator", "-n", namespace, check=False).returncode != 0
    )
