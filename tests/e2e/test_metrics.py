"""A real Prometheus scrapes the operator during one demo run that fails once and resumes; its query API shows
the phase counts, the step rising, the restart counted by reason, and every dashboard query returns data."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.demo import RUN_TIMEOUT, SMALL, demo_run, lifecycle_env
from tests.support.kube import kubectl
from tests.support.local_cluster import LocalCluster
from tests.support.net import free_port
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.prometheus import RULES, Prometheus
from tests.support.runs import wait_for_phase
from tests.support.waiting import wait_until

DASHBOARD = REPO / "charts" / "fsdp-operator" / "files" / "grafana-dashboard.json"
# Grafana's variables as a query sees them with every namespace selected.
VARIABLES = {"$namespace": ".*", "$__rate_interval": "1m"}
# Panels that cannot have data on the CPU demo, and why.
NO_DATA_ON_CPU = {"MFU": "a CPU has no peak-FLOPs figure, so the trainer reports no MFU"}


@pytest.fixture
def scraped_operator(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path
) -> Iterator[tuple[OperatorProcess, Prometheus]]:
    """The operator as the demo runs it with /metrics on a loopback port, and Prometheus scraping it every
    second with the chart's alert rules loaded."""
    port = free_port()
    env = {
        **lifecycle_env(local_cluster),
        "FSDP_OPERATOR_METRICS_PORT": str(port),
        "FSDP_OPERATOR_METRICS_BIND_ADDRESS": "127.0.0.1",
    }
    proc = OperatorProcess(namespace=namespace, env=env, log=tmp_path / "operator.log").start()
    prometheus = Prometheus(tmp_path / "prometheus", targets=[f"127.0.0.1:{port}"], rule_files=[RULES])
    try:
        prometheus.start()
        yield proc, prometheus
    finally:
        prometheus.stop()
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{proc.log.read_text()[-8000:]}")
        print(f"--- prometheus log ---\n{prometheus.log.read_text()[-3000:]}")


def test_prometheus_sees_phases_progress_restarts_and_every_dashboard_query(
    namespace: str, scraped_operator: tuple[OperatorProcess, Prometheus], s3: Any, tmp_path: Path
) -> None:
    operator, prometheus = scraped_operator
    wait_until("Prometheus to scrape the operator", prometheus.targets_up, timeout=30)
    assert wait_until(
        "the operator to report itself leader", lambda: prometheus.value("fsdp_operator_leader"), 30
    )

    # The rank dies at step 25, once: the job fails, the operator restarts it from the latest checkpoint.
    fault = f"rank=0,step=25,marker={tmp_path / 'killed'}"
    name = demo_run(
        namespace,
        **SMALL,
        **{"recovery.inJobMaxFailures": 0, "runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": fault}}},
    )
    run = f'namespace="{namespace}", name="{name}"'
    in_namespace = f'namespace="{namespace}"'

    def phase_count(phase: str) -> float | None:
        return prometheus.value(f'fsdp_operator_runs{{{in_namespace}, phase="{phase}"}}')

    wait_until("Prometheus to count the run as Running", lambda: phase_count("Running") == 1, RUN_TIMEOUT)
    assert phase_count("Pending") == 0 and phase_count("Failed") == 0

    def step() -> float:
        return prometheus.value(f"fsdp_operator_run_step{{{run}}}") or 0.0

    first = wait_until("a training step in Prometheus", step, RUN_TIMEOUT, interval=0.5)
    wait_until(
        f"the step in Prometheus to rise past {first}", lambda: step() > first, RUN_TIMEOUT, interval=0.5
    )

    restarts = f'fsdp_operator_restarts_total{{{in_namespace}, reason=~"JobFailed|TrainerFailed"}}'
    wait_until("the restart counter to count the injected failure", lambda: prometheus.value(restarts), 300)
    assert prometheus.value(restarts) == 1
    assert prometheus.value('sum(fsdp_operator_restarts_total{reason="Other"})') in (None, 0)

    final = wait_for_phase(namespace, name, "Succeeded", timeout=2 * RUN_TIMEOUT)["status"]
    assert (tmp_path / "killed").exists(), "the fault was never injected"
    assert final["restarts"]["count"] == 1
    wait_until("Prometheus to count the run as Succeeded", lambda: phase_count("Succeeded") == 1, 30)
    assert phase_count("Running") == 0
    assert prometheus.value(f"fsdp_operator_run_restarts_total{{{run}}}") == 1
    assert prometheus.value(f"fsdp_operator_run_step{{{run}}}") == 40
    assert prometheus.value(f"fsdp_operator_run_last_checkpoint_step{{{run}}}") == 40
    assert prometheus.value(f"max_over_time(fsdp_operator_run_attempt{{{run}}}[10m])") == 2
    [info] = prometheus.query(f"fsdp_operator_run_info{{{run}}}")
    assert info["metric"]["image_digest"] == final["image"]["digest"]
    # Histograms recorded by the handlers: two submissions, one first Running, many passes.
    assert prometheus.value("fsdp_operator_job_submission_duration_seconds_count") == 2
    assert prometheus.value("fsdp_operator_run_time_to_running_seconds_count") == 1
    assert (prometheus.value('fsdp_operator_reconcile_duration_seconds_count{result="success"}') or 0) > 10

    # Every dashboard query returns data from this Prometheus.
    dashboard = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: unsubstituted variable in {expr}"
            if not prometheus.query(expr) and panel["title"] not in NO_DATA_ON_CPU:
                empty.append(f"{panel['title']}: {expr}")
    assert not empty, f"dashboard queries without data: {empty}"

    # The chart's rules loaded into this Prometheus and evaluate on the live series; none fires here.
    groups = prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(yaml.safe_load(RULES.read_text())["groups"][0]["rules"])
    assert all(rule["health"] == "ok" for rule in rules), rules
    firing = [a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"]
    assert firing == []

    # A deleted run's series go with it.
    kubectl("delete", "fsdptrainingrun", name, "-n", namespace, "--timeout=60s")  # waits until it is gone
    target = prometheus.api("targets")["activeTargets"][0]["scrapeUrl"]

    def scrape_without_the_run() -> bool:
        with urllib.request.urlopen(target, timeout=5) as answer:
            text = answer.read().decode()
        return "fsdp_operator_leader" in text and f'name="{name}"' not in text

    wait_until(f"the series of deleted run {name} to leave /metrics", scrape_without_the_run, timeout=30)
    assert operator.process is not None and operator.process.poll() is None
