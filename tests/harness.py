"""Helpers for tests that use the local cluster started by hack/cluster-up.sh."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("FSDP_STATE_DIR", REPO / ".local-cluster"))
T = TypeVar("T")


@dataclass(frozen=True)
class LocalCluster:
    """Endpoints of the running local cluster, read from the env file cluster-up writes."""

    env: dict[str, str]

    @classmethod
    def from_env_file(cls, path: Path = STATE / "env") -> LocalCluster:
        env = {}
        for line in path.read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
        return cls(env)

    @property
    def kubeconfig(self) -> str:
        return self.env["KUBECONFIG"]

    @property
    def s3_endpoint(self) -> str:
        return self.env["AWS_ENDPOINT_URL"]

    @property
    def ray_dashboard_url(self) -> str:
        return self.env["RAY_DASHBOARD_URL"]


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs the repo's kubectl against the local cluster (KUBECONFIG comes from the session fixture)."""
    return subprocess.run(
        [str(REPO / "bin" / "kubectl"), *args], input=input, text=True, capture_output=True, check=check
    )


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json").stdout)


def wait_until(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 1.0) -> T:
    """Polls probe until it returns something truthy; fails naming what was awaited and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)
