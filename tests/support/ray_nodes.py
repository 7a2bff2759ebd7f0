"""Several Ray nodes on this machine, each a `ray start --block` process in a process group of its own, as
each Ray pod runs it: SIGTERM to one is its pod deleted (Ray drains the node); its group stopped, gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.net import free_port
from tests.support.processes import stop_process_group
from tests.support.waiting import wait_until

RAY = Path(sys.executable).with_name("ray")
# Ray's switch for several nodes on one machine (named for the platforms where it is off by default; "0"
# refuses a second node). Every node is given 127.0.0.1.
SEVERAL_NODES_ON_ONE_MACHINE = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
# A raylet hands its workers and drivers ports from --min-worker-port to --max-worker-port (10002-19999 by
# default), each checked free before it is handed out: two raylets on one machine with one range can hand out
# a port at once, and the later process dies binding it (a driver's "Failed to start the grpc server ...
# Address already in use": the DLC tier's two test workers, each with Ray nodes, 2026-12-06). So each test
# node has a range of its own, by pytest-xdist worker (up to 8) and node (up to NODES_PER_TEST_WORKER).
WORKER_PORTS_PER_NODE = 200
NODES_PER_TEST_WORKER = 6
START_ATTEMPTS = 3


def worker_port_flags(node: int) -> list[str]:
    """`ray start` flags for the worker ports of this test worker's `node`-th Ray node."""
    test_worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    slot = test_worker * NODES_PER_TEST_WORKER + node % NODES_PER_TEST_WORKER
    first = 10002 + slot * WORKER_PORTS_PER_NODE
    return [f"--min-worker-port={first}", f"--max-worker-port={first + WORKER_PORTS_PER_NODE - 1}"]


@dataclass
class LocalRayCluster:
    address: str
    session: Path  # Ray's session files (its socket paths live below it: a short path)
    logs: Path
    env: dict[str, str]
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_nodes(self, count: int, *args: str) -> list[subprocess.Popen[bytes]]:
        """`count` more nodes (`args` add to `ray start`), each started once the one before has registered:
        started at once, one `ray start` failed to find its own node in the GCS (Deadline Exceeded)."""
        return [self._start(*args) for _ in range(count)]

    def _start(self, *args: str) -> subprocess.Popen[bytes]:
        """A node that exits before it has started is started again (fresh ports, the same worker-port range),
        as hack/ray-head.sh does for the head: `ray start` gives its raylet a fixed 30 s to register with the
        GCS, and under the whole suite's load one did not (Deadline Exceeded; test_drain, 2026-12-07)."""
        for attempt in range(1, START_ATTEMPTS + 1):
            node, log = self._launch(*args)
            index = len(self.nodes) - 1

            def settled(node: subprocess.Popen[bytes] = node, log: Path = log) -> bool:
                return node.poll() is not None or "Ray runtime started" in log.read_text()

            wait_until(f"Ray node {index} to start or exit (log {log})", settled, timeout=120)
            if node.poll() is None:
                return node
            stop_process_group(node)  # the servers it started, where they outlived it
            self.nodes.pop()
            log.rename(log.with_suffix(f".exited-{attempt}.log"))  # kept for the test's report
        exited = log.with_suffix(f".exited-{START_ATTEMPTS}.log")
        raise AssertionError(f"Ray node {index} exited {START_ATTEMPTS} times:\n{exited.read_text()[-3000:]}")

    def _launch(self, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        index = len(self.nodes)
        log = self.logs / f"node-{index}.log"
        port = self.address.rsplit(":", 1)[1]
        where = [f"--port={port}", "--head"] if index == 0 else [f"--address={self.address}"]
        ports = [
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            *worker_port_flags(index),
        ]
        with log.open("wb") as out:
            node = subprocess.Popen(
                [str(RAY), "start", *where, "--node-ip-address=127.0.0.1", *ports,
                 f"--temp-dir={self.session}", "--disable-usage-stats", "--block", *args],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.nodes.append(node)
        return node, log


@contextmanager
def local_ray_cluster(logs: Path, env: dict[str, str], *head_args: str) -> Iterator[LocalRayCluster]:
    """A head node (`head_args` add to its `ray start`); every node's process group is stopped at the end.

    `env` is every node's environment (the workers inherit their raylet's), with RAY_ADDRESS pointing Ray's
    own lookups at this head even when other Ray instances run here."""
    address = f"127.0.0.1:{free_port()}"
    session = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    cluster = LocalRayCluster(
        address, session, logs, {**os.environ, **env, **SEVERAL_NODES_ON_ONE_MACHINE, "RAY_ADDRESS": address}
    )
    try:
        cluster.start_nodes(
            1, "--include-dashboard=false", f"--ray-client-server-port={free_port()}", *head_args
        )
        yield cluster
    finally:
        for node in reversed(cluster.nodes):
            stop_process_group(node)
        shutil.rmtree(session, ignore_errors=True)
