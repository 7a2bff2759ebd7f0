"""The chart's alert rules and Grafana dashboard, checked with promtool (Debian's prometheus package,
installed by hack/packages.sh; it needs no server). The e2e test (tests/e2e/test_metrics.py) runs the same
rules and every dashboard query against a real Prometheus scraping the operator."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsdp_operator import metrics
from tests.support.paths import REPO

FILES = REPO / "charts" / "fsdp-operator" / "files"
RULES = FILES / "prometheus-rules.yaml"
RULE_TESTS = FILES / "prometheus-rules.test.yaml"
DASHBOARD = FILES / "grafana-dashboard.json"
ALERTS = {
    "FSDPTrainingRunFailed",
    "FSDPTrainingRunRestartingRepeatedly",
    "FSDPTrainingRunNoCheckpoint",
    "FSDPTrainingRunTransportDegraded",
    "FSDPOperatorDown",
    "FSDPOperatorReconcileErrors",
}
# Every series the operator exports (histograms with their _bucket/_count/_sum; counters with _total).
SERIES = {
    "fsdp_operator_leader",
    "fsdp_operator_asyncio_tasks",
    "fsdp_operator_runs",
    "fsdp_operator_run_phase",
    "fsdp_operator_run_info",
    "fsdp_operator_run_condition",
    "fsdp_operator_run_restarts_total",
    "fsdp_operator_run_attempt",
    "fsdp_operator_run_preemptions",
    "fsdp_operator_run_step",
    "fsdp_operator_run_max_steps",
    "fsdp_operator_run_loss",
    "fsdp_operator_run_eval_loss",
    "fsdp_operator_run_tokens_per_second",
    "fsdp_operator_run_mfu_ratio",
    "fsdp_operator_run_checkpoint_interval_steps",
    "fsdp_operator_run_last_checkpoint_step",
    "fsdp_operator_run_last_checkpoint_timestamp_seconds",
    "fsdp_operator_run_last_checkpoint_age_seconds",
    "fsdp_operator_run_goodput_ratio",
    "fsdp_operator_run_gpu_hours_held",
    "fsdp_operator_run_cost_usd",
    "fsdp_operator_run_progress_percent",
    "fsdp_operator_run_time_seconds",
    "fsdp_operator_restarts_total",
    "fsdp_operator_errors_total",
    "fsdp_operator_admission_cpu_seconds_total",
    "fsdp_operator_admission_queue_placements_total",
    "fsdp_operator_nodes_labelled_fabric_degraded_total",
    *(
        f"fsdp_operator_{histogram}_{suffix}"
        for histogram in (
            "reconcile_duration_seconds",
            "job_submission_duration_seconds",
            "run_time_to_running_seconds",
        )
        for suffix in ("bucket", "count", "sum")
    ),
}


def promtool(*args: str, cwd: Path = FILES) -> subprocess.CompletedProcess[str]:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: hack/packages.sh (make tools) installs Debian's prometheus package")
    return subprocess.run([found, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def metric_names(promql: str) -> set[str]:
    """The fsdp_operator_* names a query reads."""
    return set(re.findall(r"\bfsdp_operator_[a-z_]+", promql))


def test_rules_are_valid() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout


def test_every_alert_fires_and_resolves_as_its_unit_tests_say() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    alerted = {check["alertname"] for case in cases for check in case.get("alert_rule_test", [])}
    firing = {
        check["alertname"]
        for case in cases
        for check in case.get("alert_rule_test", [])
        if check.get("exp_alerts")
    }
    assert alerted == firing == ALERTS


def test_rules_read_only_series_the_operator_exports() -> None:
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert {rule["alert"] for rule in rules} == ALERTS
    for rule in rules:
        assert metric_names(rule["expr"]) <= SERIES, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_series_list_matches_what_the_operator_exports() -> None:
    exported = set(re.findall(r"^# TYPE (fsdp_operator_[a-z_]+) (\w+)", metrics.exposition().decode(), re.M))
    names = set()
    for name, kind in exported:
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        else:
            names.add(name)  # a counter's TYPE line names it with its _total
    assert names <= SERIES
    # The per-run families appear once there is a run; the others are always there.
    assert "fsdp_operator_errors_total" in names and "fsdp_operator_leader" in names


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_uses_a_datasource_variable_and_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    queries = dashboard_queries(dashboard)
    for title, expr in queries:
        assert metric_names(expr) and metric_names(expr) <= SERIES, (title, expr)
    read = set().union(*(metric_names(expr) for _, expr in queries))
    # The series each have a panel.
    for wanted in (
        "fsdp_operator_runs",
        "fsdp_operator_run_step",
        "fsdp_operator_run_loss",
        "fsdp_operator_run_tokens_per_second",
        "fsdp_operator_run_mfu_ratio",
        "fsdp_operator_run_last_checkpoint_age_seconds",
        "fsdp_operator_restarts_total",
        "fsdp_operator_errors_total",
        "fsdp_operator_reconcile_duration_seconds_bucket",
        "fsdp_operator_job_submission_duration_seconds_bucket",
        "fsdp_operator_run_time_to_running_seconds_bucket",
        "fsdp_operator_run_info",
    ):
        assert wanted in read, wanted
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
