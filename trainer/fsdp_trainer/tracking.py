"""MLflow tracking through MLflow's REST API, by a client the trainer carries: the DLC image ships no
mlflow and its pods reach no package index, and the handful of endpoints needed here are a stable,
documented HTTP API that the standard library speaks.

Rank 0 alone tracks. The training loop only appends to an in-memory buffer (`log_metrics`); a background
thread finds or creates the MLflow run, logs the params and tags, sends the metrics in batches, and at the
end uploads the exported model through the server's proxied artifact API. Every request has a timeout, and
a server that is down or refuses a request costs a warning, never the training: the buffer is bounded (values
beyond it are dropped, with a warning) and the end waits for at most one failed request.

One MLflow run per training run: its id is stored in mlflow.json beside the checkpoints, and every later
attempt (a restart, a Ray Train retry) continues that run, so the steps of all attempts form one history.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_trainer.background import BackgroundStore
from fsdp_trainer.contract import (
    MLFLOW_RUN_FILE,
    MODEL_DIR,
    AttemptInfo,
    MlflowConfig,
    MlflowRunRef,
    TrainerConfig,
)
from fsdp_trainer.storage import Location

log = logging.getLogger(__name__)

TAG_PREFIX = "fsdp.training.dev/"
ARTIFACT_ROUTE = "/api/2.0/mlflow-artifacts/artifacts/"
REQUEST_TIMEOUT_SECONDS = 10.0
ARTIFACT_TIMEOUT_SECONDS = 60.0  # per socket operation of an upload, not for the whole file
FLUSH_INTERVAL_SECONDS = 2.0  # metrics wait at most this long for their batch
RETRY_SECONDS = 30.0  # after a failed request, the next try (the buffer keeps filling meanwhile)
MAX_BUFFERED_METRICS = 100_000  # about 10 MB; values beyond it are dropped (the history keeps its start)
# MLflow's LogBatch limits (1000 items in all per request).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100
MAX_PARAM_VALUE = 6000
MAX_KEY = 250


class MlflowError(Exception):
    """A request the tracking server refused or never answered."""

    def __init__(self, message: str, error_code: str | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


# ----------------------------------------------------------------------------------------------------------
# What is logged (pure)


def config_params(config: TrainerConfig) -> dict[str, str]:
    """Every resolved config field as an MLflow param, by its dotted camelCase path (training.maxSteps);
    lists as JSON, values cut to MLflow's limit."""
    params: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[prefix[:MAX_KEY]] = text[:MAX_PARAM_VALUE]

    walk("", config.model_dump(mode="json", by_alias=True, exclude_none=True))
    return params


def run_tags(
    config: TrainerConfig, attempt: AttemptInfo, submission_id: str, data_fingerprint: str
) -> dict[str, str]:
    """The tags that say what ran: the training run, the attempt, the code, the image and the data."""
    tags = {
        "run": f"{config.namespace}/{config.run_name}",
        "namespace": config.namespace,
        "name": config.run_name,
        "submission-id": submission_id,
        "attempt": None if attempt.attempt is None else str(attempt.attempt),
        "image-digest": attempt.image_digest,
        "trainer-package-sha256": attempt.trainer_package_sha256,
        "data-fingerprint": data_fingerprint,
        "resume-fingerprint": config.resume_fingerprint(),
        "storage": config.run_uri(),
    }
    return {TAG_PREFIX + key: value for key, value in tags.items() if value is not None}


def continues(recorded: MlflowRunRef | None, mlflow: MlflowConfig, resume: str, submission_id: str) -> bool:
    """Whether this attempt logs to the MLflow run recorded beside the checkpoints: always, on the same
    server, unless the run starts afresh (resume=never) in a submission that did not create it."""
    if recorded is None or recorded.tracking_uri != mlflow.tracking_uri:
        return False
    return resume != "never" or recorded.submission_id == submission_id


def experiment_name(config: TrainerConfig, mlflow: MlflowConfig) -> str:
    return mlflow.experiment_name or config.namespace


def proxied_artifact_path(artifact_uri: str) -> str | None:
    """The path below /api/2.0/mlflow-artifacts/artifacts/ of a run's artifact root, when the tracking
    server serves it (mlflow-artifacts:/<experiment>/<run>/artifacts, or that route's http(s) URL); None
    for any other store."""
    parsed = urllib.parse.urlparse(artifact_uri)
    if parsed.scheme == "mlflow-artifacts":
        return parsed.path.strip("/")
    if parsed.scheme in ("http", "https") and ARTIFACT_ROUTE in parsed.path:
        return parsed.path.split(ARTIFACT_ROUTE, 1)[1].strip("/")
    return None


@dataclass(frozen=True)
class Metric:
    key: str
    value: float
    step: int
    timestamp_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "step": self.step, "timestamp": self.timestamp_ms}


def chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# ----------------------------------------------------------------------------------------------------------
# The REST client


def origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


class CredentialsStayWithTheirOrigin(urllib.request.HTTPRedirectHandler):
    """Follows a redirect as urllib does, except that the tracking server's credentials never go to another
    origin: urllib copies every header but the body's into the redirected request, Authorization included,
    so a server (or whoever answers in its name) could send the token anywhere."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        redirected = super().redirect_request(req, fp, code, msg, headers, newurl)
        if redirected is not None and origin(newurl) != origin(req.full_url):
            redirected.remove_header("Authorization")
        return redirected


OPENER = urllib.request.build_opener(CredentialsStayWithTheirOrigin)


class MlflowClient:
    """The MLflow REST endpoints the tracker uses, each request bounded by a timeout."""

    def __init__(self, tracking_uri: str) -> None:
        self.base = tracking_uri.rstrip("/")
        self.headers = auth_headers(os.environ)

    def call(self, method: str, endpoint: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.base}/api/2.0/mlflow/{endpoint}"
        data = None
        if body is not None and method == "GET":
            url += "?" + urllib.parse.urlencode(body)
        elif body is not None:
            data = json.dumps(body).encode()
        request = urllib.request.Request(
            url, data=data, method=method, headers={**self.headers, "Content-Type": "application/json"}
        )
        return self._send(request, REQUEST_TIMEOUT_SECONDS)

    def upload_artifact(self, path: str, stream: Any, size: int) -> None:
        """PUT through the server's proxied artifact API, streaming the file."""
        url = f"{self.base}{ARTIFACT_ROUTE}{urllib.parse.quote(path)}"
        headers = {**self.headers, "Content-Type": "application/octet-stream", "Content-Length": str(size)}
        request = urllib.request.Request(url, data=stream, method="PUT", headers=headers)
        self._send(request, ARTIFACT_TIMEOUT_SECONDS)

    def _send(self, request: urllib.request.Request, timeout: float) -> dict[str, Any]:
        try:
            with OPENER.open(request, timeout=timeout) as response:
                text = response.read().decode() or "{}"
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            try:
                code = json.loads(detail).get("error_code")
            except (ValueError, AttributeError):
                code = None
            raise MlflowError(
                f"{request.get_method()} {request.full_url}: {error.code} {detail}", code
            ) from None
        except (OSError, ValueError) as error:  # refused, unreachable, timed out, TLS
            raise MlflowError(f"{request.get_method()} {request.full_url}: {error}") from None
        result: dict[str, Any] = json.loads(text)
        return result

    # Endpoints ------------------------------------------------------------------------------------------
    def experiment_id(self, name: str) -> str:
        """The experiment's id, created when missing (another run may create it at the same moment)."""
        for _ in range(2):
            try:
                found = self.call("GET", "experiments/get-by-name", {"experiment_name": name})
                return str(found["experiment"]["experiment_id"])
            except MlflowError as error:
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            try:
                return str(self.call("POST", "experiments/create", {"name": name})["experiment_id"])
            except MlflowError as error:
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
        raise MlflowError(f"experiment {name!r} neither found nor created")

    def create_run(self, experiment_id: str, run_name: str) -> dict[str, Any]:
        body = {"experiment_id": experiment_id, "run_name": run_name, "start_time": now_ms()}
        run: dict[str, Any] = self.call("POST", "runs/create", body)["run"]
        return run

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run, or None when it is gone (deleted, or never on this server)."""
        try:
            run: dict[str, Any] = self.call("GET", "runs/get", {"run_id": run_id})["run"]
        except MlflowError as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return None if run["info"].get("lifecycle_stage") == "deleted" else run

    def log_batch(
        self,
        run_id: str,
        metrics: list[Metric] | None = None,
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        body: dict[str, Any] = {"run_id": run_id}
        if metrics:
            body["metrics"] = [metric.to_json() for metric in metrics]
        if params:
            body["params"] = [{"key": k, "value": v} for k, v in params.items()]
        if tags:
            body["tags"] = [{"key": k, "value": v} for k, v in tags.items()]
        self.call("POST", "runs/log-batch", body)

    def create_model_version(self, name: str, source: str, run_id: str) -> str:
        """A new version of the registered model `name` (created when missing), from the run's artifacts."""
        try:
            self.call("POST", "registered-models/create", {"name": name})
        except MlflowError as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        body = {"name": name, "source": source, "run_id": run_id}
        return str(self.call("POST", "model-versions/create", body)["model_version"]["version"])

    def update_run(self, run_id: str, status: str, end: bool) -> None:
        body: dict[str, Any] = {"run_id": run_id, "status": status}
        if end:
            body["end_time"] = now_ms()
        self.call("POST", "runs/update", body)


def auth_headers(env: Mapping[str, str]) -> dict[str, str]:
    """MLflow's own client's variables: a bearer token, or a user name and password."""
    if env.get("MLFLOW_TRACKING_TOKEN"):
        return {"Authorization": f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"}
    if env.get("MLFLOW_TRACKING_USERNAME"):
        pair = f"{env['MLFLOW_TRACKING_USERNAME']}:{env.get('MLFLOW_TRACKING_PASSWORD', '')}"
        return {"Authorization": "Basic " + base64.b64encode(pair.encode()).decode()}
    return {}


def now_ms() -> int:
    return int(time.time() * 1000)


# ----------------------------------------------------------------------------------------------------------
# The tracker


@dataclass(frozen=True)
class TrackedRun:
    run_id: str
    artifact_uri: str


class MlflowTracker:
    """Rank 0's MLflow run, fed by the training loop and written by a background thread.

    `log_metrics` and `log_model` return at once; `close` ends the run (FINISHED or FAILED) after sending
    what is buffered, and gives up on the first failed request, so it never waits long for a server that
    is down.
    """

    def __init__(
        self,
        config: TrainerConfig,
        attempt: AttemptInfo,
        submission_id: str,
        run: Location,
        data_fingerprint: str,
    ) -> None:
        assert config.tracking is not None and config.tracking.mlflow is not None
        self.config, self.mlflow = config, config.tracking.mlflow
        self.submission_id = submission_id
        self.record = run.child(MLFLOW_RUN_FILE)
        self.params = config_params(config)
        self.tags = run_tags(config, attempt, submission_id, data_fingerprint)
        self.client = MlflowClient(self.mlflow.tracking_uri)
        self.run: TrackedRun | None = None
        self._metrics: collections.deque[Metric] = collections.deque()
        self._dropped = 0
        self._model: Location | None = None
        self._end_status: str | None = None
        self.sent = 0  # metric values the server took
        self.thread_cpu_seconds = 0.0  # the thread's CPU time, once it has ended
        self._store = BackgroundStore(
            "mlflow-tracker",
            lambda: self._end_status,
            self._send,
            self._report_failure,
            interval_seconds=FLUSH_INTERVAL_SECONDS,
            retry_seconds=RETRY_SECONDS,
        )
        self._store.start()
        self._store.changed()  # the MLflow run is found or created at once, while the model is built

    # Called by the training loop -----------------------------------------------------------------------
    def log_metrics(self, step: int, values: dict[str, float | None]) -> None:
        timestamp = now_ms()
        with self._store.lock:
            for key, value in values.items():
                if value is None or not math.isfinite(value):
                    continue
                if len(self._metrics) >= MAX_BUFFERED_METRICS:
                    self._dropped += 1
                    continue
                self._metrics.append(Metric(key, float(value), step, timestamp))
            self._store.changed()

    def flush(self) -> None:
        """Sends what is buffered now, without waiting: at a checkpoint, so that a crash loses only the
        metrics of steps that a restart trains again."""
        self._store.request()

    def log_model(self, exported: Location) -> None:
        """Uploads the exported model's files as the run's model/ artifacts when the run ends."""
        with self._store.lock:
            self._model = exported

    def close(self, status: str = "FINISHED") -> None:
        with self._store.lock:
            self._end_status = status
            self._store.changed()
        self._store.close()
        self.thread_cpu_seconds = self._store.cpu_seconds
        log.info(
            "mlflow: %d metric values sent; the tracker's thread used %.3f s of CPU",
            self.sent,
            self.thread_cpu_seconds,
        )

    # The background thread ------------------------------------------------------------------------------
    def _send(self, end_status: str | None) -> None:
        """Opens the run (once), sends the buffered metrics and, with `end_status`, ends the run."""
        if self.run is None:
            self.run = self._open_run()
        self._send_metrics(self.run)
        if end_status is not None:
            self._finish(self.run, end_status)
        if self._store.failures_in_a_row:
            log.warning("mlflow: the tracking server answers again")

    def _open_run(self) -> TrackedRun:
        """The recorded run when this attempt continues it, else a new one (recorded for the next)."""
        recorded = None
        try:
            if self.record.exists():
                recorded = MlflowRunRef.model_validate_json(self.record.read_text())
        except (OSError, ValueError) as error:
            log.warning("mlflow: %s unreadable, starting a new MLflow run: %s", self.record.uri, error)
        resume = self.config.checkpoint.resume
        found = None
        if recorded is not None and continues(recorded, self.mlflow, resume, self.submission_id):
            found = self.client.get_run(recorded.run_id)
            if found is None:
                log.warning("mlflow: run %s is gone from the server: starting a new one", recorded.run_id)
        if found is not None:
            self._log_new_params(found)
            self.client.update_run(found["info"]["run_id"], "RUNNING", end=False)
            log.info("mlflow: continuing run %s", found["info"]["run_id"])
        else:
            experiment = self.client.experiment_id(experiment_name(self.config, self.mlflow))
            name = f"{self.config.namespace}/{self.config.run_name}"
            found = self.client.create_run(experiment, name)
            ref = MlflowRunRef(
                tracking_uri=self.mlflow.tracking_uri,
                experiment_id=experiment,
                run_id=found["info"]["run_id"],
                submission_id=self.submission_id,
            )
            self.record.write_text(ref.to_json())  # first: a retry after a failure below continues it
            log.info("mlflow: new run %s in experiment %s", ref.run_id, experiment)
            for batch in chunks(sorted(self.params.items()), MAX_PARAMS_PER_BATCH):
                self.client.log_batch(ref.run_id, params=dict(batch))
        run = TrackedRun(found["info"]["run_id"], found["info"]["artifact_uri"])
        for batch in chunks(sorted(self.tags.items()), MAX_TAGS_PER_BATCH):
            self.client.log_batch(run.run_id, tags=dict(batch))
        return run

    def _log_new_params(self, found: dict[str, Any]) -> None:
        """Params are immutable in MLflow: a continued run gets the ones it lacks; a changed value (a
        resume with a larger maxSteps) keeps the first and says so."""
        logged = {p["key"]: p["value"] for p in found.get("data", {}).get("params", [])}
        changed = sorted(k for k, v in self.params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("mlflow: params changed since the run began, kept as first logged: %s", changed)
        missing = {k: v for k, v in self.params.items() if k not in logged}
        for batch in chunks(sorted(missing.items()), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(found["info"]["run_id"], params=dict(batch))

    def _send_metrics(self, run: TrackedRun) -> None:
        while True:
            with self._store.lock:
                batch = [self._metrics[i] for i in range(min(MAX_METRICS_PER_BATCH, len(self._metrics)))]
                dropped, self._dropped = self._dropped, 0
            if dropped:
                log.warning("mlflow: %d metric values dropped: the server fell behind the training", dropped)
            if not batch:
                return
            self.client.log_batch(run.run_id, metrics=batch)
            self.sent += len(batch)
            with self._store.lock:  # only now: a failed batch stays buffered for the next try
                for _ in batch:
                    self._metrics.popleft()

    def _finish(self, run: TrackedRun, status: str) -> None:
        with self._store.lock:
            model = self._model
        if model is not None:
            self._upload_model(run, model)
        self.client.update_run(run.run_id, status, end=True)

    def _upload_model(self, run: TrackedRun, model: Location) -> None:
        self.client.log_batch(run.run_id, tags={TAG_PREFIX + "model-uri": model.uri})
        root = proxied_artifact_path(run.artifact_uri)
        if root is None:
            log.warning(
                "mlflow: the run's artifacts (%s) are not served by the tracking server; the model stays "
                "at %s (tag %smodel-uri)",
                run.artifact_uri,
                model.uri,
                TAG_PREFIX,
            )
            return
        files = model.list_files()
        for name, size in sorted(files.items()):
            with model.fs.open_input_stream(model.child(name).path) as stream:
                self.client.upload_artifact(f"{root}/{MODEL_DIR}/{name}", stream, size)
        log.info("mlflow: uploaded the model (%d files) to run %s", len(files), run.run_id)
        registered = self.mlflow.registered_model_name
        if registered is not None:
            version = self.client.create_model_version(
                registered, f"{run.artifact_uri}/{MODEL_DIR}", run.run_id
            )
            self.client.log_batch(
                run.run_id, tags={TAG_PREFIX + "registered-model": f"{registered}/{version}"}
            )
            log.info("mlflow: registered the model as %s version %s", registered, version)

    def _report_failure(self, error: Exception) -> None:  # tracking must never fail the training
        if self._store.failures_in_a_row == 1:  # the first of a run of failures is worth a warning
            log.warning(
                "mlflow: tracking degraded, training goes on (retrying every %.0f s): %s",
                RETRY_SECONDS,
                error,
            )


def start_tracking(
    config: TrainerConfig, attempt: AttemptInfo, submission_id: str, run: Location, data_fingerprint: str
) -> MlflowTracker | None:
    """The tracker when the config asks for MLflow, else None."""
    if config.tracking is None or config.tracking.mlflow is None:
        return None
    return MlflowTracker(config, attempt, submission_id, run, data_fingerprint)
