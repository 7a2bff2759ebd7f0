"""A worker's node drained mid-run costs no step: Ray's own drain (SIGTERM to the node's `ray start --block`,
as a deleted pod gets it: Ray marks the node draining with reason PREEMPTION for
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, then stops it) reaches the training loop through Ray Train's
PreemptionWatcher; the trainer checkpoints at the next step boundary and trains no further step on that
attempt, and Ray Train's restart on the nodes left resumes from exactly that step.

Three Ray nodes on this machine: a head without CPUs (the driver and Ray Train's controller), two nodes of one
CPU each, one per worker. A third worker node joins once the drain has begun, as the autoscaler's replacement
would. Periodic checkpoints are out of the way (checkpoint.everySteps above maxSteps). The run may spend one
restart (maxFailures 1): Ray Train counts a preemption apart from failures when it sees the drained worker's
death flagged as a preemption, but at 3 test workers on 2 cores (a stress run) Ray Core once recorded it as
the node's plain SIGTERM ("terminated expectedly"), and Ray Train's controller, seeing a worker error with no
preempted worker before the drain's deadline passed, took it for a failure. Which one Ray chose is Ray's and
is printed; what the trainer owes (a checkpoint at the notice, the next attempt from exactly it, no step
trained twice) is asserted either way. The operator's own count of restarts does not rest on Ray's: it reads
the pods' DisruptionTarget and the nodes' marks (tests/e2e/test_real_pods_drain.py).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError

from fsdp_trainer.contract import METRICS_DIR, PROGRESS_FILE, ProgressRecord
from tests.support.manifests import tiny_qwen2
from tests.support.paths import REPO
from tests.support.processes import stop_process
from tests.support.ray_nodes import local_ray_cluster
from tests.support.waiting import wait_until

CORPUS = REPO / "examples" / "data" / "stdlib-docstrings.jsonl"
MAX_STEPS = 80
# RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: the node's notice, Kubernetes' default grace period. At 8 s a loaded
# machine (CI, two test workers on two cores) let the node die before the notice reached the loop, and Ray
# Train took it as a worker's failure.
DRAIN_SECONDS = 30
RUN_TIMEOUT_S = 240
RUNS = "runs/default"


def read(bucket: str, key: str) -> str | None:
    try:
        body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if error.response["Error"]["Code"] == "NoSuchKey":
            return None
        raise
    return str(body.decode())


def history(bucket: str, run: str) -> list[list[ProgressRecord]]:
    """Each attempt's progress records, attempts in time order."""
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=f"{RUNS}/{run}/{METRICS_DIR}/")
    files = sorted(obj["Key"] for obj in listed.get("Contents", []) if obj["Key"].endswith(".jsonl"))
    return [
        [ProgressRecord.model_validate_json(line) for line in (read(bucket, key) or "").splitlines() if line]
        for key in files
    ]


def drain_lines(output: str) -> str:
    """What the trainer and Ray said of the drain, for a failure's message: the notice taken or not."""
    said = [line for line in output.splitlines() if re.search(r"drain|preempt", line, re.IGNORECASE)]
    return "the drain, as logged:\n" + "\n".join(said[:20]) if said else "nothing logged of the drain"


def training_steps(records: list[ProgressRecord]) -> set[int]:
    return {r.step for r in records if r.phase == "training" and r.loss is not None and r.step > 0}


def gap_by_phase(notice_sent: float, drain: ProgressRecord, resumed: list[ProgressRecord]) -> str:
    """Where the seconds from the notice to training again go, from the progress records' own times: the
    drain checkpoint (the trainer's), Ray Train's restart up to the resumed attempt's first record (Ray's: the
    drained worker group's end, the new one's placement and processes), then the resumed attempt's setup
    stages up to its first step (the trainer's). Each line: the seconds until that mark."""
    marks = [
        ("the drain checkpoint durable", drain.updated_at),
        ("the resumed attempt's first record (Ray Train's restart)", resumed[0].updated_at),
    ]
    stages: set[str] = set()
    for record in resumed:
        if record.phase == "training":
            marks.append(("the first step", record.updated_at))
            break
        if record.stage is not None and str(record.stage) not in stages:
            stages.add(str(record.stage))
            marks.append((f"stage {record.stage} began", record.updated_at))
    times = [notice_sent, *(at.timestamp() for _, at in marks)]
    lines = [
        f"  {end - start:6.2f} s until {name}"
        for (name, _), (start, end) in zip(marks, itertools.pairwise(times), strict=True)
    ]
    return f"the notice to training again, {times[-1] - notice_sent:.1f} s:\n" + "\n".join(lines)


def test_a_drained_node_costs_no_step(s3_endpoint: str, tmp_path: Path) -> None:
    bucket = f"drain-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
    )
    run = "drained"
    config: dict[str, Any] = {
        "runName": run,
        "workers": 2,
        "cpusPerWorker": 1,
        "maxFailures": 1,
        "model": {"fromConfig": tiny_qwen2(), "tokenizer": "byte-level"},
        "training": {
            "maxSteps": MAX_STEPS,
            "microBatchSize": 2,
            "sequenceLength": 32,
            "seed": 7,
            "logEvery": 1,
        },
        "data": {"source": str(CORPUS)},
        "checkpoint": {"storagePath": f"s3://{bucket}/runs", "everySteps": 10 * MAX_STEPS},
        "network": {"bandwidthProbeMb": 1},
    }
    env = {
        "TMPDIR": str(tmp_path),
        "FSDP_TRAINER_CACHE": str(tmp_path / "trainer-cache"),
        "PYTHONPATH": str(REPO / "trainer"),
        "HF_HUB_OFFLINE": "1",
        "RAY_DEDUP_LOGS": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_SECONDS),
        "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",  # Ray's default 5 s: the notice comes sooner
    }
    with local_ray_cluster(tmp_path, env, "--num-cpus=0") as cluster:
        _, drained = cluster.start_nodes(2, "--num-cpus=1")
        trainer_log = tmp_path / "trainer.log"
        with trainer_log.open("wb") as out:
            trainer = subprocess.Popen(
                [sys.executable, "-m", "fsdp_trainer", "--config", json.dumps(config)],
                env=cluster.env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:

            def training_at() -> int:
                text = read(bucket, f"{RUNS}/{run}/{PROGRESS_FILE}")
                record = ProgressRecord.model_validate_json(text) if text else None
                assert trainer.poll() is None, f"the trainer exited early:\n{trainer_log.read_text()[-4000:]}"
                return record.step if record is not None and record.phase == "training" else 0

            wait_until("the run to train 3 steps", lambda: training_at() >= 3, timeout=120, interval=0.3)
            notice_sent = time.time()
            os.kill(drained.pid, signal.SIGTERM)  # the pod's deletion: `ray start` drains its node
            cluster.start_nodes(1, "--num-cpus=1")  # the replacement node
            returncode = trainer.wait(timeout=RUN_TIMEOUT_S)
        finally:
            stop_process(trainer)
        output = trainer_log.read_text()
        assert returncode == 0, f"{drain_lines(output)}\n{output[-6000:]}"

    attempts = history(bucket, run)
    drain = next((r for records in attempts for r in records if r.drain_checkpoint_step is not None), None)
    last = attempts[-1]
    resumed = next((r.resumed_from_step for r in last if r.resumed_from_step is not None), None)
    assert drain is not None, (
        f"no drain checkpoint recorded; the last of {len(attempts)} attempts' histories resumed from step "
        f"{resumed} and trained steps {sorted(training_steps(last))}:\n{output[-4000:]}"
    )
    assert len(attempts) == 2, f"two attempts expected (drained, resumed), found {len(attempts)}"
    trained_first, trained_second = training_steps(attempts[0]), training_steps(last)
    trained_again = min(r.updated_at for r in last if r.phase == "training" and r.step in trained_second)
    print(
        f"notice (SIGTERM) -> drain checkpoint at step {drain.drain_checkpoint_step} durable: "
        f"{drain.updated_at.timestamp() - notice_sent:.2f} s "
        f"({drain.drain_checkpoint_seconds:.2f} s from the step boundary that took the notice); "
        f"training again {trained_again.timestamp() - notice_sent:.1f} s after the notice "
        f"(drain window {DRAIN_SECONDS} s); Ray Train took it for "
        + ("a preemption" if "interrupted by node preemption" in output else "a worker's failure")
    )
    print(gap_by_phase(notice_sent, drain, last))
    assert max(trained_first) == drain.drain_checkpoint_step, (
        f"steps trained after the drain checkpoint at {drain.drain_checkpoint_step}: "
        f"{sorted(s for s in trained_first if s > (drain.drain_checkpoint_step or 0))}"
    )
    assert resumed == drain.drain_checkpoint_step, (
        f"the resumed attempt started from {resumed}, not from the drain checkpoint's step "
        f"{drain.drain_checkpoint_step}"
    )
    assert not trained_first & trained_second, (
        f"steps trained twice: {sorted(trained_first & trained_second)}"
    )
    assert trained_first | trained_second == set(range(1, MAX_STEPS + 1))
