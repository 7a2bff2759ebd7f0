"""A real MLflow tracking server for tests, and its REST API as tests read it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.net import answers, free_port
from tests.support.paths import mlflow_venv
from tests.support.waiting import wait_until


@dataclass(frozen=True)
class MlflowServer:
    url: str
    bucket: str

    def get(self, endpoint: str, **query: str) -> dict[str, Any]:
        url = f"{self.url}/api/2.0/{endpoint}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
        return result

    def post(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/api/2.0/{endpoint}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
        return result

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        found = self.get("mlflow/experiments/get-by-name", experiment_name=experiment)["experiment"]
        runs: list[dict[str, Any]] = self.post(
            "mlflow/runs/search", {"experiment_ids": [found["experiment_id"]]}
        ).get("runs", [])
        return runs

    def logged_steps(self, experiment: str, metric: str) -> list[int]:
        """The steps of the metric in the experiment's runs, so far (none while it has no run)."""
        try:
            runs = self.runs(experiment)
        except urllib.error.HTTPError:  # no experiment yet
            return []
        return [m["step"] for r in runs for m in self.history(r["info"]["run_id"], metric)]

    def history(self, run_id: str, metric: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get(
            "mlflow/metrics/get-history", run_id=run_id, metric_key=metric, max_results="25000"
        ).get("metrics", [])
        return found


@contextlib.contextmanager
def mlflow_server(home: Path, artifacts: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A real MLflow tracking server on a free loopback port (SQLite in `home`, artifacts served by the
    server from `artifacts`: a directory or s3:// prefix), in a process group of its own, stopped by its pid
    at the end; yields its URL."""
    mlflow = mlflow_venv() / "bin" / "mlflow"
    assert mlflow.exists(), f"{mlflow} missing: hack/venv.sh installs the MLflow server's venv"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "mlflow-server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
             "--artifacts-destination", artifacts, "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            # No job runner (GenAI jobs: seven worker processes a tracking server needs none of).
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}, cwd=home,
            stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(f"the MLflow server at {url}", lambda: answers(f"{url}/health"), timeout=180)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        print(f"--- MLflow server log ({log}) ---\n{log.read_text()[-3000:]}")
