"""Fixtures of the end-to-end tier: the test bucket with its corpus, and the operator as the demo runs it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.e2e.demo import BUCKET, CORPUS, lifecycle_env
from tests.harness import REPO, LocalCluster, OperatorProcess, delete_namespace, kubectl


@pytest.fixture(scope="session")
def s3(local_cluster: LocalCluster) -> Any:
    client = boto3.client("s3", endpoint_url=local_cluster.s3_endpoint)
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    client.upload_file(str(REPO / "examples" / "data" / "stdlib-docstrings.jsonl"), BUCKET, CORPUS)
    return client


@pytest.fixture
def lifecycle_operator(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator as the demo runs it, observing every 2 s."""
    proc = OperatorProcess(
        namespace=namespace, env=lifecycle_env(local_cluster), log=tmp_path / "operator.log"
    ).start()
    try:
        yield proc
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{proc.log.read_text()[-8000:]}")


@pytest.fixture
def second_namespace(namespace: str) -> Iterator[str]:
    """Another team's namespace beside the test's, with no grants."""
    name = f"{namespace}-b"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        delete_namespace(name)
