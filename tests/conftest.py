"""Test tiers by directory (unit / cluster / e2e) and the session-wide local cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.support import reliability as reliability_table
from tests.support.kube import apply_crd, fresh_namespace
from tests.support.local_cluster import LocalCluster
from tests.support.mlflow import MlflowServer, mlflow_server
from tests.support.net import answers, free_port
from tests.support.operator_process import OperatorProcess
from tests.support.paths import INSTANCE, REPO, dlc_python
from tests.support.waiting import wait_until

# FSDP_CPU_PROFILE=DIR: each test's CPU-seconds, by whom (tests/support/cpu_profile.py).
pytest_plugins = ["tests.support.cpu_profile"]

TIERS = ("unit", "local", "cluster", "e2e")
# The longest files go first, each to a worker of its own, so that the many short ones fill the end of the
# run: the real pods' (about 17 minutes of one worker under load) and the cluster tier's longest (5.5
# minutes, two of them waiting out provisioning timeouts), which, last of its tier, had kept one worker busy
# 4.5 minutes after the other finished (2026-12-05, 33 min 34 s for the tier).
LONGEST_FILES = ("tests/e2e/test_real_pods.py", "tests/cluster/test_operator.py")
# Tests of the trainer run in the DLC's environment (Python 3.13, torch), all others in the operator's.
TRAINER_TESTS = REPO / "tests" / "trainer"


def pytest_configure(config: pytest.Config) -> None:
    # The hack/ scripts this process runs (cluster-up, ray-head.sh, ...) act on this process's cluster.
    os.environ["FSDP_CLUSTER_INSTANCE"] = str(INSTANCE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its tier (the folder it is in), refuses a test run in the other environment than
    its own (the folder tests/trainer says which), and runs the longest files, then the slow tiers first:
    pytest-xdist hands whole files to its workers in this order, so the long files start early and the many
    short ones even out the end."""
    in_dlc_environment = Path(sys.prefix).resolve() == dlc_python().parents[1].resolve()
    tiers: dict[str, str] = {}
    for item in items:
        tier = item.path.parent.name
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in a folder named for its tier: {TIERS}")
        if item.path.is_relative_to(TRAINER_TESTS) != in_dlc_environment:
            raise pytest.UsageError(
                f"{item.nodeid}: tests under tests/trainer run in the DLC's venv ({dlc_python()}), the "
                f"rest in the operator's; this is {sys.executable}"
            )
        item.add_marker(getattr(pytest.mark, tier))
        tiers[item.nodeid] = tier

    def file_rank(item: pytest.Item) -> int:
        file = item.nodeid.split("::")[0]
        return LONGEST_FILES.index(file) if file in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(
        key=lambda item: (file_rank(item), ("e2e", "cluster", "local", "unit").index(tiers[item.nodeid]))
    )


def _cluster_running() -> bool:
    return subprocess.run([REPO / "hack" / "cluster-status.sh"], capture_output=True).returncode == 0


# What failed cluster-up attempts printed, repeated at the very end of the run where CI's tail shows it
# (pytest-xdist's workers hand theirs to the controller, which prints the summary).
_cluster_up_failures: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for attempt, output in enumerate(_cluster_up_failures, start=1):
        terminalreporter.section(f"hack/cluster-up.sh attempt {attempt} failed; its output", sep="!")
        terminalreporter.write_line(output)


def _start_cluster(attempts: int = 2) -> None:
    """cluster-up, once more after a failure: a start can time out on a machine that is briefly overloaded.
    Each failure is cleaned up by pid and its output kept for the end of the run."""
    for _ in range(attempts):
        up = subprocess.run(
            [REPO / "hack" / "cluster-up.sh"], stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
        sys.stderr.write(up.stderr)
        if up.returncode == 0:
            return
        subprocess.run([REPO / "hack" / "cluster-down.sh"], check=False)
        # Its steps first: the logs' tails it prints at the end would push the failed step out of the window.
        steps = [line for line in up.stderr.splitlines() if re.match(r"\[\d\d:\d\d:\d\d\] ", line)]
        _cluster_up_failures.append("\n".join(steps) + "\n" + up.stdout + up.stderr[-12000:])
    reason = " / ".join(steps[-2:]) or up.stderr.strip()[-300:]
    pytest.fail(f"the local cluster did not start in {attempts} attempts: {reason}", pytrace=False)


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """The local cluster: reused when already running, else started here and stopped (by pid) at the end."""
    running = _cluster_running()
    if not running:
        _start_cluster()
    cluster = LocalCluster.from_env_file()
    saved = dict(os.environ)
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if not running:
            subprocess.run([REPO / "hack" / "cluster-down.sh"], check=True)


@pytest.fixture
def namespace(local_cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards with everything in it."""
    with fresh_namespace() as name:
        yield name


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-compatible server on loopback: the local cluster's when it runs, else a moto server of our own.

    Sets AWS_ENDPOINT_URL and dummy credentials in the environment for the session, so boto3, pyarrow and
    Ray's storage layer all talk to it.
    """
    saved = dict(os.environ)
    server: subprocess.Popen[bytes] | None = None
    if _cluster_running():
        endpoint = LocalCluster.from_env_file().s3_endpoint
    else:
        port = free_port()
        moto = Path(sys.executable).with_name("moto_server")
        server = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-west-2",
    )
    try:
        wait_until(
            f"S3 server at {endpoint}", lambda: answers(f"{endpoint}/moto-api/"), timeout=30, interval=0.3
        )
        yield endpoint
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


@pytest.fixture
def s3_storage(s3_endpoint: str) -> str:
    """A storagePath of a new bucket of its own on the test S3 server."""
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
    )
    return f"s3://{bucket}/runs"


@pytest.fixture(scope="module")
def mlflow(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    bucket = f"mlflow-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
    )
    home = tmp_path_factory.mktemp("mlflow")
    with mlflow_server(home, f"s3://{bucket}/artifacts", {"MLFLOW_S3_ENDPOINT_URL": s3_endpoint}) as url:
        yield MlflowServer(url, bucket)


@pytest.fixture(scope="session")
def crd_installed(local_cluster: LocalCluster) -> None:
    apply_crd()


@pytest.fixture
def operator(namespace: str, crd_installed: None, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator watching the test's namespace; its log is printed when the test fails."""
    proc = OperatorProcess(namespace=namespace, env={}, log=tmp_path / "operator.log").start()
    try:
        yield proc
    finally:
        proc.stop()
        print(f"--- operator log ({proc.log}) ---\n{proc.log.read_text()[-6000:]}")


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> reliability_table.Recorder:
    """Records the test's row of docs/reliability.md (the fault, the behaviour asserted, the figure)."""
    rows = request.config.stash.setdefault(reliability_table.ROWS, {})
    return reliability_table.Recorder(rows, request.node.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A whole run of `make test` (its configured test paths, nothing deselected) that passed rewrites its
    section of the table. Under pytest-xdist each worker hands its rows to the controller, which writes it."""
    config = session.config
    rows = config.stash.setdefault(reliability_table.ROWS, {})
    order = config.stash.setdefault(reliability_table.ORDER, reliability_table.fault_tests(session.items))
    if hasattr(config, "workeroutput"):
        config.workeroutput["reliability"] = reliability_table.to_wire(rows, order)
        config.workeroutput["cluster_up_failures"] = _cluster_up_failures
        return
    # `make test` names the table when it runs its whole configured set (no PYTEST_ARGS).
    table = os.environ.get("FSDP_RELIABILITY_TABLE")
    whole = table and not config.option.keyword and not config.option.markexpr and not config.option.deselect
    if whole and exitstatus == 0 and order and set(order) <= set(rows):
        reliability_table.write_table(rows, order, Path(table))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's controller: a worker finished; keep the rows it recorded (every worker collected the
    same tests, so any one's order is the order) and what its failed cluster starts printed."""
    _cluster_up_failures.extend(getattr(node, "workeroutput", {}).get("cluster_up_failures", []))
    wire = getattr(node, "workeroutput", {}).get("reliability")
    if wire:
        rows, order = reliability_table.from_wire(wire)
        node.config.stash.setdefault(reliability_table.ROWS, {}).update(rows)
        node.config.stash[reliability_table.ORDER] = order
