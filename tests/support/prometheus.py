"""A real Prometheus (Debian's 2.42, installed by hack/packages.sh) on loopback, scraping given targets.

Started by pid in a session of its own, with its storage in a temporary directory, and stopped by pid; every
wait is bounded and names what it waited for. Queries go through its HTTP API, as Grafana's do.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.net import free_port
from tests.support.paths import REPO
from tests.support.processes import stop_process
from tests.support.waiting import wait_until

RULES = REPO / "charts" / "fsdp-operator" / "files" / "prometheus-rules.yaml"


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: hack/packages.sh installs Debian's prometheus package")
    return found


@dataclass
class Prometheus:
    """One Prometheus scraping `targets` (host:port) every `interval`, with `rule_files` loaded."""

    directory: Path
    targets: list[str]
    interval: str = "1s"
    rule_files: list[Path] = field(default_factory=list)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.directory / "prometheus.log"

    def start(self) -> Prometheus:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [
                {"job_name": "fsdp-operator", "static_configs": [{"targets": self.targets}]},
            ],
        }
        config_file = self.directory / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        self.port = free_port()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    binary("prometheus"),
                    f"--config.file={config_file}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    "--storage.tsdb.retention.time=1h",
                    "--web.enable-lifecycle",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_until(f"Prometheus to be ready on {self.url} (log: {self.log})", self._ready, timeout=60)
        return self

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"Prometheus exited with {self.process.returncode}: {self.log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.process)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: the `data` of a successful answer; else an AssertionError with the error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"query {params} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of `promql` now: [{"metric": {...}, "value": [time, "value"]}, ...]."""
        data = self.api("query", query=promql)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else []
        if data["resultType"] == "scalar":
            result = [{"metric": {}, "value": data["result"]}]
        return result

    def value(self, promql: str) -> float | None:
        """The single value of `promql`, or None when it returns no series; more than one is an error."""
        result = self.query(promql)
        if not result:
            return None
        assert len(result) == 1, f"{promql} returned {len(result)} series: {result}"
        return float(result[0]["value"][1])

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)
