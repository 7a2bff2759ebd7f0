"""The operator's run metrics over a stand-in for kopf's index, at a fixed time: a run's body, and the index
the collector reads at scrape time."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest

from fsdp_operator import metrics

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def run_body(name: str, namespace: str = "ml", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": "2026-11-30T11:58:00Z"},
        "spec": {"image": "repo/ray:2.58", "checkpoint": {"everySteps": 10, "storagePath": "s3://b/runs"}},
        "status": status,
    }


RUNNING = run_body(
    "tiny",
    phase="Running",
    attempt=2,
    image={"requested": "repo/ray:2.58", "digest": "repo/ray@sha256:" + "a" * 64},
    progress={"step": 25, "maxSteps": 40, "loss": 3.5, "tokensPerSecond": 1200.0, "mfu": 0.41},
    checkpoints={
        "latest": {"uri": "s3://b/runs/ml/tiny/step-20", "step": 20, "time": "2026-11-30T11:59:00Z"}
    },
    restarts={"count": 1, "preemptions": 0, "history": []},
    conditions=[
        {
            "type": "TransportDegraded",
            "status": "True",
            "reason": "SocketFallback",
            "lastTransitionTime": "x",
        },
        {"type": "SomethingNew", "status": "True", "reason": "X", "lastTransitionTime": "x"},
    ],
)


class Store(list[dict[str, Any]]):
    """What kopf's index holds under one key."""


@pytest.fixture(name="index")
def index_fixture() -> Iterator[dict[tuple[str, str], Store]]:
    held: dict[tuple[str, str], Store] = {}
    saved = (metrics.RUNS.index, metrics.RUNS.leading, metrics.RUNS.clock)
    metrics.RUNS.index, metrics.RUNS.leading = held, lambda: True
    metrics.RUNS.clock = lambda: NOW.timestamp()
    try:
        yield held
    finally:
        metrics.RUNS.index, metrics.RUNS.leading, metrics.RUNS.clock = saved
