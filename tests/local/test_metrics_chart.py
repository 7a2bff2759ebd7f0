"""The chart's metrics objects, rendered with `helm template` (no cluster): a metrics Service by default;
ServiceMonitor, PodMonitor, PrometheusRule and the Grafana dashboard ConfigMap only when asked for."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
import yaml

from tests.support.paths import REPO

CHART = REPO / "charts" / "fsdp-operator"
FILES = CHART / "files"
EVERYTHING = (
    "metrics.serviceMonitor.enabled=true,metrics.podMonitor.enabled=true,metrics.prometheusRule.enabled=true,"
    "metrics.dashboard.enabled=true,metrics.prometheusRule.labels.release=prometheus"
)


def render(*values: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    helm = REPO / "bin" / "helm"
    if not helm.exists():
        pytest.fail("bin/helm not found: make tools builds it")
    settings = [arg for value in values for arg in ("--set", value)]
    return subprocess.run(
        [str(helm), "template", "r", str(CHART), "--kube-version", "1.35.0", *settings],
        capture_output=True,
        text=True,
        check=check,
        timeout=120,
    )


def objects(*values: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(render(*values).stdout) if d}


def test_by_default_a_metrics_port_and_service_and_nothing_that_needs_the_prometheus_operator() -> None:
    rendered = objects()
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} & set(rendered)
    [container] = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (
        env["FSDP_OPERATOR_METRICS_PORT"] == "8081" and env["FSDP_OPERATOR_METRICS_BIND_ADDRESS"] == "0.0.0.0"
    )
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    service = rendered["Service"]
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert (
        service["spec"]["selector"].items()
        <= rendered["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )


def test_metrics_off_removes_port_env_and_service() -> None:
    rendered = objects("metrics.enabled=false")
    assert "Service" not in rendered
    [container] = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["health"]
    assert not [e for e in container["env"] if e["name"].startswith("FSDP_OPERATOR_METRICS")]


def test_monitors_rules_and_dashboard_when_enabled() -> None:
    rendered = objects(EVERYTHING)
    service = rendered["Service"]
    monitor = rendered["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # the runs' namespace label stays theirs
    pod_monitor = rendered["PodMonitor"]
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    rule = rendered["PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"] == yaml.safe_load((FILES / "prometheus-rules.yaml").read_text())
    dashboard = rendered["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["fsdp-operator.json"]) == json.loads(
        (FILES / "grafana-dashboard.json").read_text()
    )


def test_bad_metrics_values_are_refused() -> None:
    for bad in (
        "metrics.port=0",
        "metrics.serviceMonitor.interval=soon",
        "metrics.prometheusRule.enable=true",
    ):
        refused = render(bad, check=False)
        assert refused.returncode != 0, bad
        assert bad.split("=")[0].split(".")[-1] in refused.stderr, refused.stderr


def test_the_operators_pods_take_metrics_scrapes_from_the_named_namespaces_only() -> None:
    """Its metrics name every tenant's runs and images; Ray pods run tenants' code."""
    closed = objects()["NetworkPolicy"]["spec"]
    assert closed["policyTypes"] == ["Ingress"] and closed["ingress"] == [], closed
    deployment = objects()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert closed["podSelector"]["matchLabels"].items() <= deployment.items()

    [rule] = objects("metrics.scrapeNamespaces={monitoring}")["NetworkPolicy"]["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    [peer] = rule["from"]
    assert peer == {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}
            ]
        }
    }
    assert "NetworkPolicy" not in objects("networkPolicy.enabled=false")
