"""The operator running as a process of its own against the local cluster."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.kube import kubectl
from tests.support.paths import REPO
from tests.support.processes import stop_process

# The platform's S3 grant of the tests' operators: the examples' buckets (the demo's, and the one of the AWS
# sample, named by runs that only wait for capacity) and the e2e tier's.
TEST_S3_PREFIXES = "s3://fsdp-demo/,s3://my-training-bucket/,s3://fsdp-e2e/"
OBSERVE_INTERVAL_SECONDS = 2  # the tests' operators observe a running run this often (the product's is 15)


@dataclass
class OperatorProcess:
    """The operator running as `python -m fsdp_operator` against the local cluster, stopped by pid."""

    namespace: str
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {
            **os.environ,
            # One operator per test: no election to wait for after a kill (tests of it turn it on), and no
            # probe server whose port other test sessions on this machine could hold.
            "FSDP_OPERATOR_LEADER_ELECTION": "false",
            "FSDP_OPERATOR_HEALTH_PORT": "0",
            "FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS": str(OBSERVE_INTERVAL_SECONDS),
            "FSDP_OPERATOR_S3_PREFIXES": TEST_S3_PREFIXES,
            **self.env,
            "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}",
            "FSDP_OPERATOR_WATCH_NAMESPACES": self.namespace,
        }
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fsdp_operator"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        return self

    def kill(self) -> None:
        """SIGKILL: the operator gets no chance to finish what it was doing."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        stop_process(self.process)


@contextlib.contextmanager
def operator_watching(namespace: str, env: dict[str, str], log: Path) -> Iterator[OperatorProcess]:
    """An operator for one test's namespace: afterwards the namespace's runs are deleted while it runs (it
    removes what they hold), then it is stopped by pid and its log's tail printed (pytest shows it when the
    test fails)."""
    proc = OperatorProcess(namespace=namespace, env=env, log=log).start()
    try:
        yield proc
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ({log}) ---\n{log.read_text()[-8000:]}")
