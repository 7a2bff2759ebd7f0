"""The CPU demo run as the e2e tests use it: the test bucket, the operator's settings, S3 helpers."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fsdp_trainer.contract import RunRecord
from tests.support.kube import apply
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import example
from tests.support.runs import run_of
from tests.support.waiting import wait_until

BUCKET = "fsdp-e2e"
CORPUS = "data/stdlib-docstrings.jsonl"
CHAT_CORPUS = "data/stdlib-chat.jsonl"  # conversations made from the same text (examples/data/README.md)
# A bound on a 40-80-step run, not a target: at the start of a CI run, beside the other worker's real pods and
# both clusters' first start, one was not done after 300 s (the operator had seen its Ray job PENDING).
RUN_TIMEOUT = 600
# One GPU worker, no EFA and a one-CPU head: several such runs fit the fake nodes at once (the system node
# takes only two default heads), and each trains on one Ray Train worker, not two. The tests about what the
# operator does use it: a worker process is about a quarter of an attempt's CPU (41-50 vs 59 CPU-s here).
SMALL: dict[str, Any] = {
    "cluster.workers": 1,
    "cluster.gpusPerWorker": 1,
    "cluster.efaPerWorker": 0,
    "cluster.head.cpu": "1",
    "cluster.head.memory": "4Gi",
    "network.efa": "disabled",
}


# The price of the demo's instance type (us-west-2 on demand, 2026), so that runs show a cost.
DEMO_PRICES = {"g6.12xlarge": 4.6016}


def lifecycle_env(local_cluster: LocalCluster) -> dict[str, str]:
    """The operator as the demo runs it: jobs to the local Ray head, on CPU, S3 on loopback."""
    return {
        "FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE": "override",
        "FSDP_OPERATOR_DASHBOARD_URL": local_cluster.ray_dashboard_url,
        "FSDP_OPERATOR_DASHBOARD_TOKEN": local_cluster.env["FSDP_LOCAL_RAY_TOKEN"],
        "FSDP_OPERATOR_TRAINER_DEVICE": "cpu",
        "FSDP_OPERATOR_AWS_ENDPOINT_URL": local_cluster.s3_endpoint,
        "FSDP_OPERATOR_INSTANCE_HOUR_PRICES": json.dumps(DEMO_PRICES),
    }


def demo_manifest(name: str, example_name: str = "cpu-demo", **changes: Any) -> dict[str, Any]:
    """A CPU demo of examples/ reading the corpus from, and checkpointing to, the test bucket."""
    manifest = example(
        example_name,
        **{
            "data.source": f"s3://{BUCKET}/{CORPUS}",
            "checkpoint.storagePath": f"s3://{BUCKET}/runs",
            "recovery.backoffSeconds": 1,
            **changes,
        },
    )
    manifest["metadata"]["name"] = name
    return manifest


def demo_run(namespace: str, **changes: Any) -> str:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    apply(namespace, demo_manifest(name, **changes))
    return name


def keys_under(s3: Any, prefix: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def checkpoint_steps_in_s3(s3: Any, namespace: str, name: str, written_by: str | None = None) -> set[int]:
    """The steps of the run's complete checkpoints (those with a manifest); with written_by, only those the
    Ray job of that submission id wrote."""
    found = complete_checkpoint_manifests(s3, BUCKET, f"runs/{namespace}/{name}/")
    return {m["step"] for m in found if written_by is None or m.get("submissionId") == written_by}


def complete_checkpoint_manifests(s3: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    """The manifests of the complete checkpoints under the prefix. One that the trainer's retention deletes
    between the listing and its read is left out: it is no longer there to resume from."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    found = []
    for key in keys:
        if not key.endswith("/fsdp_manifest.json"):
            continue
        try:
            found.append(json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))
        except s3.exceptions.NoSuchKey:
            continue
    return found


def progress_record(s3: Any, namespace: str, name: str) -> dict[str, Any]:
    """progress.json: the latest attempt's trainer's own record (where it resumed from, its step)."""
    found: dict[str, Any] = json.loads(
        s3.get_object(Bucket=BUCKET, Key=f"runs/{namespace}/{name}/progress.json")["Body"].read()
    )
    return found


def checkpoints_at_first_restart(s3: Any, namespace: str, name: str, submission: str) -> set[int]:
    """Waits for the run's first restart; then the steps of the complete checkpoints the job of `submission`
    (the attempt it ended) had written. The next attempt, which starts after this, must resume from the
    newest of them or from one completed later."""
    wait_until(
        f"run {name} to restart",
        lambda: run_of(namespace, name).get("status", {}).get("restarts", {}).get("history"),
        timeout=RUN_TIMEOUT,
        interval=0.5,
    )
    return checkpoint_steps_in_s3(s3, namespace, name, written_by=submission)


def run_record(s3: Any, namespace: str, name: str) -> RunRecord:
    body = s3.get_object(Bucket=BUCKET, Key=f"runs/{namespace}/{name}/run.json")["Body"].read()
    return RunRecord.model_validate_json(body)


def final_run_record(s3: Any, namespace: str, name: str, phase: str) -> RunRecord:
    """run.json once it records the run's final phase: the operator writes it right after the status that
    says so (the status first, as every intent), so a reader who saw the phase may find the one before."""

    def recorded() -> RunRecord | None:
        record = run_record(s3, namespace, name)
        return record if record.phase == phase else None

    return wait_until(f"run.json of {name} to record phase {phase}", recorded, timeout=60)


def wait_for_step(namespace: str, name: str, at_least: int) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        run = run_of(namespace, name)
        latest = run.get("status", {}).get("checkpoints", {}).get("latest") or {}
        return run if latest.get("step", 0) >= at_least else None

    return wait_until(f"run {name} to have a checkpoint at step >= {at_least}", reached, timeout=RUN_TIMEOUT)
