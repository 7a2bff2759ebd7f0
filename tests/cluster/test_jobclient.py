"""The operator's Ray job client against a recording HTTP server: what it sends, and how it reads answers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
import urllib3

from fsdp_operator import jobclient
from fsdp_operator.jobs import Jobs
from tests.support.paths import REPO


class Dashboard(ThreadingHTTPServer):
    """Answers as Ray's dashboard does, for the calls the operator makes; records every request."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.packages: dict[str, bytes] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.hang = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Dashboard

    def log_message(self, *_: Any) -> None:
        pass

    def answer(self, status: int, body: str | dict[str, Any] = "") -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def handle_any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append((self.command, self.path, dict(self.headers), body))
        if self.server.hang.is_set():
            time.sleep(2)  # longer than the client's read timeout
            return
        path, method = self.path, self.command
        if path.startswith("/api/packages/"):
            uri = path.removeprefix("/api/packages/").replace("/", "://", 1)
            if method == "PUT":
                self.server.packages[uri] = body
                return self.answer(200)
            return (
                self.answer(200)
                if uri in self.server.packages
                else self.answer(404, f"Package {uri} does not exist")
            )
        if path == "/api/jobs/" and method == "POST":
            request = json.loads(body)
            if request["submission_id"] in self.server.jobs:
                return self.answer(400, f"Job with submission_id {request['submission_id']} already exists.")
            self.server.jobs[request["submission_id"]] = {**request, "status": "PENDING", "start_time": 1e12}
            return self.answer(200, {"submission_id": request["submission_id"]})
        if path.startswith("/api/jobs/"):
            job_id = path.removeprefix("/api/jobs/").removesuffix("/stop")
            job = self.server.jobs.get(job_id)
            if job is None:
                return self.answer(404, f"Job {job_id} does not exist")
            if path.endswith("/stop"):
                job["status"] = "STOPPED"
                return self.answer(200, {"stopped": True})
            return self.answer(200, job)
        if path.startswith("/api/v0/logs/file"):
            if "node_id=" not in path:  # Ray 2.58: no driver log found without the node
                return self.answer(500, "node_id or node_ip must be provided")
            return self.answer(200, "".join(f"line {i}\n" for i in range(100)))
        return self.answer(404, "no such route")

    do_GET = do_POST = do_PUT = handle_any


@pytest.fixture
def dashboard() -> Iterator[Dashboard]:
    server = Dashboard()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.hang.clear()
    server.shutdown()


def package(tmp_path: Path) -> Path:
    module = tmp_path / "mymodule"
    (module / "sub").mkdir(parents=True)
    (module / "__init__.py").write_text("X = 1\n")
    (module / "sub" / "data.txt").write_text("data\n")
    (module / "__pycache__").mkdir()
    (module / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0")
    return module


def test_submit_uploads_the_package_once_and_sends_the_job_as_rays_client_does(
    dashboard: Dashboard, tmp_path: Path
) -> None:
    module = package(tmp_path)
    jobs = Jobs(dashboard.url)
    env = {"py_modules": [str(module)], "pip": ["six"], "env_vars": {"A": "1"}}
    jobs.submit("run-1", "python -m mymodule", env, {"run": "r"})
    jobs.submit("run-2", "python -m mymodule", env, {"run": "r"})
    calls = [(method, path.split("?")[0]) for method, path, _, _ in dashboard.seen]
    uri, _ = jobclient.zip_package(module.resolve())
    name = uri.removeprefix("gcs://")
    assert calls == [
        ("GET", "/api/jobs/run-1"),  # not there yet
        ("GET", f"/api/packages/gcs/{name}"),
        ("PUT", f"/api/packages/gcs/{name}"),
        ("POST", "/api/jobs/"),
        ("GET", "/api/jobs/run-2"),
        ("GET", f"/api/packages/gcs/{name}"),  # there now (and pinned again): no second upload
        ("POST", "/api/jobs/"),
    ]
    assert name.startswith("_ray_pkg_") and name.endswith(".zip")
    submitted = dashboard.jobs["run-1"]
    assert submitted["runtime_env"] == {
        "py_modules": [uri],
        "pip": {"packages": ["six"], "pip_check": False},
        "env_vars": {"A": "1"},
    }
    assert submitted["entrypoint"] == "python -m mymodule" and submitted["metadata"] == {"run": "r"}
    # The module itself at the top of the zip (Ray's include_parent_dir), no bytecode.
    with zipfile.ZipFile(BytesIO(dashboard.packages[uri])) as archive:
        assert sorted(archive.namelist()) == ["mymodule/__init__.py", "mymodule/sub/data.txt"]
    # Resubmitting an id Ray has is a no-op; one it reports as existing is taken as ours.
    jobs.submit("run-1", "python -m mymodule", env, {"run": "r"})
    assert dashboard.seen[-1][:2] == ("GET", "/api/jobs/run-1")


def test_the_same_files_make_the_same_package(tmp_path: Path) -> None:
    first = jobclient.zip_package.__wrapped__(package(tmp_path / "a"))
    second = jobclient.zip_package.__wrapped__(package(tmp_path / "b"))
    assert first == second
    (tmp_path / "b" / "mymodule" / "__init__.py").write_text("X = 2\n")
    assert jobclient.zip_package.__wrapped__(tmp_path / "b" / "mymodule")[0] != first[0]


def test_status_stop_logs_and_unknown_jobs(dashboard: Dashboard) -> None:
    jobs = Jobs(dashboard.url)
    assert jobs.observe("nope").status is None
    jobs.stop("nope")  # Ray's "does not exist": nothing to stop
    dashboard.jobs["j"] = {"status": "FAILED", "message": "boom", "start_time": 1_700_000_000_000,
                           "driver_node_id": "n1"}  # fmt: skip
    seen = jobs.observe("j")
    assert seen.status == "FAILED" and seen.message == "boom" and seen.start_time is not None
    assert seen.logs_tail.endswith("line 99\n") and len(seen.logs_tail) <= 4000
    log_request = dashboard.seen[-1][1]
    assert log_request == "/api/v0/logs/file?node_id=n1&submission_id=j&lines=60"
    assert jobs.logs_tail("j").endswith("line 99\n")  # the driver's node read from the job
    jobs.stop("j")
    assert dashboard.jobs["j"]["status"] == "STOPPED"


def test_every_request_carries_the_headers_and_a_missing_route_is_not_an_unknown_job(
    dashboard: Dashboard,
) -> None:
    from fsdp_operator.jobs import DashboardAuth

    auth = DashboardAuth(headers=(("Authorization", "Bearer k8s"), ("X-Ray-Authorization", "Bearer ray")))
    jobs = Jobs(dashboard.url + "/not-a-dashboard", auth)
    with pytest.raises(jobclient.DashboardError, match="status code 404"):
        jobs.observe("j")  # a 404 that is not Ray's "Job j does not exist" (a missing Service)
    headers = dashboard.seen[-1][2]
    assert headers["Authorization"] == "Bearer k8s" and headers["X-Ray-Authorization"] == "Bearer ray"
    assert headers["User-Agent"] == "fsdp-operator"


def test_a_head_that_never_answers_costs_one_read_timeout(dashboard: Dashboard) -> None:
    """One request, cut by its read timeout and not retried: the operator's next pass is the retry."""
    client = jobclient.JobClient(dashboard.url, timeout=(1.0, 0.5))
    dashboard.hang.set()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        client.job_info("j")
    assert [(method, path) for method, path, _, _ in dashboard.seen] == [("GET", "/api/jobs/j")]


def test_a_refused_connection_raises_at_once() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(urllib3.exceptions.NewConnectionError):
        jobclient.JobClient(f"http://127.0.0.1:{port}").job_info("j")


def test_the_operator_never_imports_ray() -> None:
    code = "import sys, fsdp_operator.__main__, fsdp_operator.handlers; print('ray' in sys.modules)"
    path = os.pathsep.join(str(REPO / d) for d in ("operator", "trainer"))
    found = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert found.stdout.strip() == "False"


@dataclass
class RunningRun:
    """A Running run (attempt 2) as observe() sees it: its Ray job on the test's dashboard, its prefix in a
    bucket of its own on the S3 server."""

    ctx: Any
    run: Any
    spec: Any
    status: Any
    s3: Any
    bucket: str
    submission_id: str = "tiny-01234567-2"

    def observe(self) -> Any:
        from fsdp_operator import submission
        from fsdp_operator.kube import Indexes
        from fsdp_operator.observe import observe

        body = {"metadata": {"name": "tiny", "namespace": "team-a", "uid": self.run.uid, "generation": 1}}
        config = submission.trainer_config(self.spec, self.run, cpu_only=True)
        indexes = Indexes(runs={}, rayclusters={}, ray_pods={})
        return observe(self.ctx, self.run, body, self.spec, self.status, config, indexes)


def running_run(dashboard: Dashboard, hang_timeout_seconds: int = 1800) -> RunningRun:
    import boto3

    from fsdp_operator import api
    from fsdp_operator.builder import RunRef
    from fsdp_operator.context import Context
    from fsdp_operator.settings import Settings

    bucket = f"driver-{os.urandom(4).hex()}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    settings = Settings(dashboard_address_mode="override", dashboard_url=dashboard.url)
    kube: Any = type("Kube", (), {"configuration": type("Configuration", (), {"host": "unused"})})
    ctx = Context(settings=settings, kube=kube, s3=s3, ec2=lambda: None, package_sha256="x")
    spec = api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"source": "m"},
            "checkpoint": {"storagePath": f"s3://{bucket}/runs"},
            "recovery": {"hangTimeoutSeconds": hang_timeout_seconds},
        }
    )
    status = api.FSDPTrainingRunStatus(
        phase=api.Phase.RUNNING, attempt=2, job_submission_id="tiny-01234567-2"
    )
    run = RunRef(name="tiny", namespace="team-a", uid="0123456789")
    return RunningRun(ctx, run, spec, status, s3, bucket)


def test_an_ended_jobs_driver_log_is_kept_in_s3_once_and_bounded_by_an_action_not_the_observation(
    dashboard: Dashboard, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fsdp_operator import actions, jobs
    from fsdp_operator.reconcile import DriverLog, reconcile

    running = running_run(dashboard)
    ctx, run, spec, status, s3, bucket = (
        running.ctx,
        running.run,
        running.spec,
        running.status,
        running.s3,
        running.bucket,
    )
    dashboard.jobs["tiny-01234567-2"] = {"status": "SUCCEEDED", "driver_node_id": "n1"}
    monkeypatch.setattr(jobs, "MAX_DRIVER_LOG_BYTES", 200)

    def log_reads() -> list[str]:
        return [path for _, path, _, _ in dashboard.seen if path.startswith("/api/v0/logs/file")]

    key = "runs/team-a/tiny/logs/attempt-2/driver.log"
    obs = running.observe()
    assert log_reads() == [] and s3.list_objects_v2(Bucket=bucket).get("KeyCount") == 0  # it only read
    decision = reconcile(spec, status, obs)
    assert decision.keep_driver_log == DriverLog("tiny-01234567-2", "n1", 2)
    actions.keep_driver_log(ctx, run, spec, decision.keep_driver_log)
    actions.keep_driver_log(ctx, run, spec, decision.keep_driver_log)  # a pass before the memory was read
    again = reconcile(spec, status, running.observe())
    assert again.keep_driver_log is None  # kept: the next pass does not ask again

    stored = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert stored.startswith("line 0\n") and len(stored) == 200
    assert log_reads() == ["/api/v0/logs/file?node_id=n1&submission_id=tiny-01234567-2&lines=50000"]


def test_a_quiet_running_run_is_observed_every_fourth_tick_and_every_tick_once_it_changes(
    dashboard: Dashboard, s3_endpoint: str
) -> None:
    """A Running run of ten-minute steps whose progress.json stays the same: after QUIET_PASSES passes its
    timer observes it every MAX_STRETCH ticks (60 s at the default 15 s) and asks its Ray job only then; a
    new step, or a record that says the training ended, brings it back to every tick."""
    import datetime as dt

    from fsdp_operator.cadence import MAX_STRETCH, QUIET_PASSES
    from fsdp_trainer.contract import PROGRESS_FILE

    running = running_run(dashboard)
    dashboard.jobs[running.submission_id] = {"status": "RUNNING"}
    cadence = running.ctx.runs.of(running.run.uid).cadence

    def write(step: int, phase: str = "training") -> None:
        record = {
            "runName": "tiny",
            "phase": phase,
            "step": step,
            "maxSteps": 10,
            "stepTimeSeconds": 600,
            "updatedAt": dt.datetime.now(dt.UTC).isoformat(),
        }
        key = f"runs/team-a/tiny/{PROGRESS_FILE}"
        running.s3.put_object(Bucket=running.bucket, Key=key, Body=json.dumps(record).encode())

    def observed_ticks(passes: int) -> int:
        """Observes `passes` times; the timer ticks until the next observation."""
        for _ in range(passes):
            assert running.observe().progress is not None
        return 1 + sum(1 for _ in iter(lambda: cadence.due(), True))

    write(3)
    assert observed_ticks(QUIET_PASSES) == 1  # the first passes of a quiet record keep the base interval
    job_reads = len(dashboard.seen)
    assert observed_ticks(1) == MAX_STRETCH
    assert len(dashboard.seen) == job_reads + 1  # its Ray job asked once in those ticks
    write(4)
    assert observed_ticks(1) == 1
    write(4, phase="finished")
    assert observed_ticks(QUIET_PASSES + 2) == 1
