"""Prometheus metrics of the operator, served on /metrics of a port of its own (setting metrics-port).

Per-run series (phase, step, loss, tokens/s, MFU, checkpoints, conditions, image digest) come from a collector
that reads the runs kopf's index holds at scrape time, as KubeRay's info series do: a deleted run's series are
gone at the next scrape by construction, and nothing is kept per run in between. Counters and histograms
(restarts by reason, reconcile passes, errors by kind, job submissions, time from creation to Running) are
recorded where those things happen (runpass.py, admission.py, actions.py).

Label values are bounded: namespace and name are Kubernetes names, phase and condition type/status come
from the API's enums, a restart reason outside the operator's own set is counted as "Other", an error kind is
one of ERROR_KINDS; no label is taken from a message or other free text.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

from aiohttp import web
from kubernetes.client.exceptions import ApiException
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fsdp_operator import api, conditions
from fsdp_operator.health import start_site

PREFIX = "fsdp_operator_"
OTHER = "Other"
# Every reason a restart entry can carry (reconcile/, recovery.py); anything else is counted as OTHER.
RESTART_REASONS = frozenset(
    {
        "JobFailed",
        "TrainerFailed",
        "OutOfMemoryAfterProgress",
        "ClusterLost",
        "ClusterModified",
        "JobLost",
        "SubmissionFailed",
        "Hang",
        "SetupTimeout",
        "Unobservable",
        "Preempted",
    }
)
# apiserver: a pass failed on an apiserver call; action: creating or deleting a RayCluster or submitting a
# job failed; storage: progress or checkpoints could not be read from S3; ray_dashboard: the job's state
# could not be read from Ray; other: a pass failed otherwise.
ERROR_KINDS = ("apiserver", "action", "storage", "ray_dashboard", "other")
CONDITION_TYPES = frozenset(
    {
        conditions.PREFLIGHT,
        conditions.CLUSTER_READY,
        conditions.PODS_HEALTHY,
        conditions.PODS_SCHEDULED,
        conditions.JOB_RUNNING,
        conditions.FINISHED,
        conditions.SUCCEEDED,
        conditions.FAILED,
        conditions.SUSPENDED,
        conditions.TRANSPORT_DEGRADED,
        conditions.IMAGE_CONSISTENT,
        conditions.STORAGE_READABLE,
        conditions.QUEUE_ADMITTED,
    }
)
CONDITION_STATUSES = frozenset({"True", "False", "Unknown"})
PHASES = tuple(str(phase) for phase in api.Phase)
NO_PHASE = "Unknown"  # a run the operator has not written a status to yet

disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series beside counters, histograms
REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)  # process_* (CPU, memory, open files) of the operator

RESTARTS = Counter(
    f"{PREFIX}restarts",
    "Restarts of runs decided by this operator process, by reason (Preempted: Kueue took the capacity back).",
    ["namespace", "reason"],
    registry=REGISTRY,
)
NODES_LABELLED = Counter(
    f"{PREFIX}nodes_labelled_fabric_degraded",
    "Nodes this operator process labelled fsdp.training.dev/fabric-degraded after a run's failed fabric "
    "check, by the run's namespace.",
    ["namespace"],
    registry=REGISTRY,
)
ERRORS = Counter(
    f"{PREFIX}errors",
    "Errors by kind: apiserver, action (RayCluster or job calls), storage (S3), ray_dashboard, other.",
    ["kind"],
    registry=REGISTRY,
)
for _kind in ERROR_KINDS:
    ERRORS.labels(_kind)  # every kind exists from the start, so increase() sees the first error
RECONCILE_DURATION = Histogram(
    f"{PREFIX}reconcile_duration_seconds",
    "Duration of reconcile passes, by result (success or error).",
    ["result"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
for _result in ("success", "error"):
    RECONCILE_DURATION.labels(_result)
SUBMISSION_DURATION = Histogram(
    f"{PREFIX}job_submission_duration_seconds",
    "Submission latency: how long the Ray dashboard took to accept a job (trainer package upload included).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60),
    registry=REGISTRY,
)
TIME_TO_RUNNING = Histogram(
    f"{PREFIX}run_time_to_running_seconds",
    "From a run's creation to its first attempt running (preflight, queueing, provisioning, submission).",
    buckets=(5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 43200),
    registry=REGISTRY,
)

ADMISSION_CPU = Counter(
    f"{PREFIX}admission_cpu_seconds",
    "CPU time (the deciding thread's) spent on admission decisions: the other runs, the queue's placement.",
    registry=REGISTRY,
)
QUEUE_PLACEMENTS = Counter(
    f"{PREFIX}admission_queue_placements",
    "How often the whole admission queue was placed (once per view; the runs of one view share it).",
    registry=REGISTRY,
)

P = ParamSpec("P")
R = TypeVar("R")


def restart_reason(reason: str) -> str:
    return reason if reason in RESTART_REASONS else OTHER


def error_kind(error: BaseException) -> str:
    return "apiserver" if isinstance(error, ApiException) else "other"


def timed_reconcile(function: Callable[P, R]) -> Callable[P, R]:
    """Records each pass's duration with its result, and the kind of error that failed it."""

    @functools.wraps(function)
    def timed(*args: P.args, **kwargs: P.kwargs) -> R:
        started = time.perf_counter()
        try:
            result = function(*args, **kwargs)
        except Exception as error:
            RECONCILE_DURATION.labels("error").observe(time.perf_counter() - started)
            ERRORS.labels(error_kind(error)).inc()
            raise
        RECONCILE_DURATION.labels("success").observe(time.perf_counter() - started)
        return result

    return timed


def record_pass(
    run: Mapping[str, Any], new: api.FSDPTrainingRunStatus, now: dt.datetime, errors: Iterable[str | None]
) -> None:
    """After a pass wrote its status: the restarts it decided, the first time the run runs, and the errors
    its observations met (`errors`: storage, ray_dashboard, action, in ERROR_KINDS order; None: none)."""
    for kind, error in zip(("storage", "ray_dashboard", "action"), errors, strict=True):
        if error:
            ERRORS.labels(kind).inc()
    meta = run["metadata"]
    old = run.get("status") or {}
    old_restarts = old.get("restarts") or {}
    added = (new.restarts.count - old_restarts.get("count", 0)) + (
        new.restarts.preemptions - old_restarts.get("preemptions", 0)
    )
    if added > 0:
        for entry in new.restarts.history[-added:]:
            RESTARTS.labels(meta["namespace"], restart_reason(entry.reason)).inc()
    first_run = new.attempt == 1 and new.restarts.count == 0 and new.restarts.preemptions == 0
    if new.phase == api.Phase.RUNNING and old.get("phase") != api.Phase.RUNNING and first_run:
        created = _timestamp(meta.get("creationTimestamp"))
        if created is not None:
            TIME_TO_RUNNING.observe(max(now.timestamp() - created, 0.0))


def _timestamp(value: Any) -> float | None:
    if isinstance(value, dt.datetime):
        return value.timestamp()
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class RunsCollector(Collector):
    """The runs the operator holds (kopf's `runs` index, read at scrape time) as gauges, and leadership."""

    def __init__(self) -> None:
        self.index: Any = None  # kopf's (namespace, name) -> store of run bodies; None before kopf runs
        self.leading: Callable[[], bool] = lambda: False
        self.clock: Callable[[], float] = time.time

    def runs(self) -> list[Mapping[str, Any]]:
        if self.index is None:
            return []
        return [body for store in list(self.index.values()) for body in list(store)]

    def describe(self) -> Iterable[Metric]:
        return []  # the families depend on the runs of the moment; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}leader", "1 while this replica holds the Lease and reconciles, else 0.", self.leading()
        )
        try:
            tasks = len(asyncio.all_tasks())  # scraped on the operator's loop (serve); none elsewhere
        except RuntimeError:
            tasks = None
        if tasks is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}asyncio_tasks",
                "Tasks on the operator's event loop (kopf's watchers, workers and timers): flat while the "
                "runs are; a rise with a steady set of runs is a leak.",
                tasks,
            )
        per_run = PerRun(self.clock())
        for body in self.runs():
            per_run.add(body)
        yield from per_run.families()


class PerRun:
    """The metric families of one scrape, filled run by run."""

    def __init__(self, now: float) -> None:
        self.now = now
        keys = ["namespace", "name"]
        self.counts: dict[tuple[str, str], int] = {}
        self.runs = GaugeMetricFamily(
            f"{PREFIX}runs", "Runs the operator holds, by namespace and phase.", labels=["namespace", "phase"]
        )
        self.phase = GaugeMetricFamily(
            f"{PREFIX}run_phase", "1 for each run's current phase.", labels=[*keys, "phase"]
        )
        self.info = GaugeMetricFamily(
            f"{PREFIX}run_info",
            "Always 1: the image a run asked for and the digest its pods ran (empty until known).",
            labels=[*keys, "image", "image_digest"],
        )
        self.condition = GaugeMetricFamily(
            f"{PREFIX}run_condition",
            "1 for each condition of a run with its current status.",
            labels=[*keys, "condition", "status"],
        )
        self.restarts = CounterMetricFamily(
            f"{PREFIX}run_restarts",
            "Restarts of a run after failures (status.restarts.count; preemptions not included).",
            labels=keys,
        )
        self.gauges = {
            field: GaugeMetricFamily(f"{PREFIX}{metric}", text, labels=keys)
            for field, metric, text in (
                ("attempt", "run_attempt", "Job submissions of the run so far."),
                ("preemptions", "run_preemptions", "Times Kueue took the run's capacity back."),
                ("step", "run_step", "The run's latest training step."),
                ("maxSteps", "run_max_steps", "The step the run ends at."),
                ("loss", "run_loss", "Training loss at the latest step."),
                ("evalLoss", "run_eval_loss", "The latest evaluation loss."),
                ("tokensPerSecond", "run_tokens_per_second", "Training throughput, tokens per second."),
                ("mfu", "run_mfu_ratio", "Model FLOPs utilisation (0-1; GPU runs only)."),
                ("everySteps", "run_checkpoint_interval_steps", "Steps between checkpoints (the spec's)."),
                ("checkpointStep", "run_last_checkpoint_step", "Step of the latest complete checkpoint."),
                (
                    "checkpointTime",
                    "run_last_checkpoint_timestamp_seconds",
                    "When the latest complete checkpoint was written (Unix time).",
                ),
                (
                    "checkpointAge",
                    "run_last_checkpoint_age_seconds",
                    "Seconds since the run's latest complete checkpoint was written.",
                ),
                ("goodput", "run_goodput_ratio", "Training seconds over the seconds its cluster was held."),
                ("gpuHoursHeld", "run_gpu_hours_held", "GPU-hours the run's clusters held."),
                ("costUsd", "run_cost_usd", "What the run cost so far, at the platform's instance prices."),
                ("progressPercent", "run_progress_percent", "The latest step over maxSteps, in percent."),
            )
        }
        self.time = GaugeMetricFamily(
            f"{PREFIX}run_time_seconds",
            "Seconds since the run was created, by what they went to (status.goodput.seconds).",
            labels=[*keys, "category"],
        )

    def add(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
        status = body.get("status") or {}
        phase = str(status["phase"]) if status.get("phase") in PHASES else NO_PHASE
        key = [namespace, name]
        self.counts[(namespace, phase)] = self.counts.get((namespace, phase), 0) + 1
        self.phase.add_metric([*key, phase], 1)
        image = status.get("image") or {}
        requested = image.get("requested") or (body.get("spec") or {}).get("image") or ""
        self.info.add_metric([*key, str(requested), str(image.get("digest") or "")], 1)
        for condition in status.get("conditions") or []:
            kind, state = condition.get("type"), condition.get("status")
            if kind in CONDITION_TYPES and state in CONDITION_STATUSES:
                self.condition.add_metric([*key, kind, state], 1)
        restarts = status.get("restarts") or {}
        self.restarts.add_metric(key, _number(restarts.get("count")) or 0.0)
        progress = status.get("progress") or {}
        latest = (status.get("checkpoints") or {}).get("latest") or {}
        written = _timestamp(latest.get("time"))
        goodput = status.get("goodput") or {}
        values = {
            "attempt": status.get("attempt", 0),
            "preemptions": restarts.get("preemptions", 0),
            **{f: progress.get(f) for f in ("step", "maxSteps", "loss", "evalLoss", "tokensPerSecond")},
            "mfu": progress.get("mfu"),
            "everySteps": ((body.get("spec") or {}).get("checkpoint") or {}).get("everySteps"),
            # No checkpoint yet: step 0, where a run without one resumes from.
            "checkpointStep": latest.get("step", 0),
            "checkpointTime": written,
            "checkpointAge": None if written is None else max(self.now - written, 0.0),
            **{f: goodput.get(f) for f in ("gpuHoursHeld", "costUsd", "progressPercent")},
            "goodput": goodput.get("fraction"),
        }
        for category, seconds in (goodput.get("seconds") or {}).items():
            number = _number(seconds)
            if number is not None:
                self.time.add_metric([*key, str(category)[:32]], number)
        for field, value in values.items():
            number = _number(value)
            if number is not None:
                self.gauges[field].add_metric(key, number)

    def families(self) -> Iterator[Metric]:
        for namespace in sorted({namespace for namespace, _ in self.counts}):  # each phase of each namespace
            for phase in (*PHASES, NO_PHASE):
                count = self.counts.get((namespace, phase), 0)
                if count or phase != NO_PHASE:
                    self.runs.add_metric([namespace, phase], count)
        yield self.runs
        yield self.phase
        yield self.info
        yield self.condition
        yield self.restarts
        yield from self.gauges.values()
        yield self.time


RUNS = RunsCollector()
REGISTRY.register(RUNS)


def exposition() -> bytes:
    return generate_latest(REGISTRY)


async def serve(host: str, port: int, leading: Callable[[], bool]) -> web.AppRunner:
    """Serves /metrics on the operator's event loop (where kopf updates its index, so a scrape reads a
    consistent index); stopped by the runner's cleanup()."""
    RUNS.leading = leading

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=exposition())
        # The text format every Prometheus 2 parses (names here need none of format 1.0.0's escaping).
        response.headers["Content-Type"] = CONTENT_TYPE_PLAIN_0_0_4
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return await start_site(app, host, port)
