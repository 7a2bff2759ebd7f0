"""The operator's metrics: series read from the runs at scrape time, counters recorded by the handlers (served
over HTTP: tests/cluster/test_metrics_server.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from fsdp_operator import api, metrics
from fsdp_trainer.contract import RestartEntry
from tests.support.metrics_index import NOW, RUNNING, Store, index_fixture, run_body  # noqa: F401 (a fixture)


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def series(
    samples: dict[Any, float], metric: str, /, **labels: str
) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of `name` whose labels include `labels`."""
    return {
        key: value
        for (found, key), value in samples.items()
        if found == metric and set(labels.items()) <= set(key)
    }


def one(samples: dict[Any, float], metric: str, /, **labels: str) -> float:
    [value] = series(samples, metric, **labels).values()
    return value


def test_per_run_series_come_from_the_index_and_vanish_with_the_run(
    index: dict[tuple[str, str], Store],
) -> None:
    index[("ml", "tiny")] = Store([RUNNING])
    index[("ml", "new")] = Store([run_body("new")])
    index[("cv", "done")] = Store([run_body("done", "cv", phase="Succeeded")])
    samples = scrape()
    run = {"namespace": "ml", "name": "tiny"}
    assert one(samples, "fsdp_operator_leader") == 1
    assert one(samples, "fsdp_operator_runs", namespace="ml", phase="Running") == 1
    assert one(samples, "fsdp_operator_runs", namespace="ml", phase="Unknown") == 1  # no status yet
    assert one(samples, "fsdp_operator_runs", namespace="ml", phase="Failed") == 0  # every phase, even at 0
    assert one(samples, "fsdp_operator_runs", namespace="cv", phase="Succeeded") == 1
    assert len(series(samples, "fsdp_operator_runs", namespace="cv")) == len(api.Phase)
    assert one(samples, "fsdp_operator_run_phase", **run) == 1
    assert series(samples, "fsdp_operator_run_phase", **run, phase="Running")
    info = series(samples, "fsdp_operator_run_info", **run)
    assert [dict(k)["image_digest"] for k in info] == ["repo/ray@sha256:" + "a" * 64]
    assert one(samples, "fsdp_operator_run_step", **run) == 25
    assert one(samples, "fsdp_operator_run_max_steps", **run) == 40
    assert one(samples, "fsdp_operator_run_loss", **run) == 3.5
    assert one(samples, "fsdp_operator_run_tokens_per_second", **run) == 1200
    assert one(samples, "fsdp_operator_run_mfu_ratio", **run) == 0.41
    assert one(samples, "fsdp_operator_run_attempt", **run) == 2
    assert one(samples, "fsdp_operator_run_restarts_total", **run) == 1
    assert one(samples, "fsdp_operator_run_checkpoint_interval_steps", **run) == 10
    assert one(samples, "fsdp_operator_run_last_checkpoint_step", **run) == 20
    assert one(samples, "fsdp_operator_run_last_checkpoint_age_seconds", **run) == 60
    # A run without a checkpoint: step 0 (where it would resume from), no age.
    assert one(samples, "fsdp_operator_run_last_checkpoint_step", name="new") == 0
    assert not series(samples, "fsdp_operator_run_last_checkpoint_age_seconds", name="new")
    assert not series(samples, "fsdp_operator_run_mfu_ratio", name="new")  # unknown: no series, not 0
    # Conditions of known types only: no label value from elsewhere.
    conditions = series(samples, "fsdp_operator_run_condition", **run)
    assert [dict(k)["condition"] for k in conditions] == ["TransportDegraded"]

    del index[("ml", "tiny")]
    after = scrape()
    assert not [key for key in after if ("name", "tiny") in key[1]], "a deleted run's series must go"
    assert one(after, "fsdp_operator_runs", namespace="ml", phase="Running") == 0


def test_names_share_one_prefix_and_labels_are_bounded(index: dict[tuple[str, str], Store]) -> None:
    index[("ml", "tiny")] = Store([RUNNING])
    allowed = {"namespace", "name", "phase", "reason", "kind", "result", "le", "condition", "status"}
    allowed |= {"image", "image_digest"}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        if family.name.startswith("process_"):
            continue  # the standard process collector
        assert family.name.startswith("fsdp_operator_"), family.name
        assert re.fullmatch(r"[a-z_]+", family.name), family.name
        for sample in family.samples:
            assert set(sample.labels) <= allowed, (sample.name, sample.labels)


def test_restarts_are_counted_by_reason_with_unknown_reasons_as_other() -> None:
    def restarts(reason: str) -> float:
        return metrics.RESTARTS.labels("team-r", reason)._value.get()

    before = {reason: restarts(reason) for reason in ("JobFailed", "Preempted", "Other")}
    old = run_body("r", "team-r", phase="Running", attempt=1, restarts={"count": 1, "preemptions": 0})
    history = [
        RestartEntry(time=NOW, reason="Hang"),  # counted by an earlier pass
        RestartEntry(time=NOW, reason="JobFailed"),
        RestartEntry(time=NOW, reason="Preempted"),
        RestartEntry(time=NOW, reason="Cosmic rays: a free-text reason"),
    ]
    new = api.FSDPTrainingRunStatus(
        phase=api.Phase.RESTARTING,
        attempt=1,
        restarts=api.RestartsStatus(count=3, preemptions=1, history=history),
    )
    metrics.record_pass(old, new, NOW, (None, None, None))
    assert {reason: restarts(reason) - before[reason] for reason in before} == {
        "JobFailed": 1,
        "Preempted": 1,
        "Other": 1,
    }
    metrics.record_pass({**old, "status": new.model_dump(mode="json", by_alias=True)}, new, NOW, [None] * 3)
    assert restarts("JobFailed") - before["JobFailed"] == 1  # the same status again counts nothing


def test_time_to_running_is_observed_once_at_the_first_running() -> None:
    count = metrics.TIME_TO_RUNNING._sum.get(), sum(b.get() for b in metrics.TIME_TO_RUNNING._buckets)
    pending = run_body("t", phase="ClusterReady", attempt=1)
    running = api.FSDPTrainingRunStatus(phase=api.Phase.RUNNING, attempt=1)
    metrics.record_pass(pending, running, NOW, (None, None, None))
    total = metrics.TIME_TO_RUNNING._sum.get() - count[0]
    assert total == 120  # created at 11:58, running at 12:00
    metrics.record_pass(run_body("t", phase="Running", attempt=1), running, NOW, (None, None, None))
    resumed = api.FSDPTrainingRunStatus(phase=api.Phase.RUNNING, attempt=2)
    metrics.record_pass(run_body("t", phase="Restarting", attempt=2), resumed, NOW, (None, None, None))
    assert sum(b.get() for b in metrics.TIME_TO_RUNNING._buckets) - count[1] == 1


def test_errors_by_kind_and_reconcile_results() -> None:
    def errors(kind: str) -> float:
        return metrics.ERRORS.labels(kind)._value.get()

    before = {kind: errors(kind) for kind in metrics.ERROR_KINDS}
    metrics.record_pass(run_body("e"), api.FSDPTrainingRunStatus(), NOW, ("s3 down", None, "forbidden"))

    @metrics.timed_reconcile
    def failing(error: Exception) -> None:
        raise error

    for error in (ApiException(status=500), RuntimeError("bug")):
        with pytest.raises(type(error)):
            failing(error)
    assert {kind: errors(kind) - before[kind] for kind in metrics.ERROR_KINDS} == {
        "apiserver": 1,
        "action": 1,
        "storage": 1,
        "ray_dashboard": 0,
        "other": 1,
    }
    samples = scrape()
    assert one(samples, "fsdp_operator_reconcile_duration_seconds_count", result="error") >= 2
