"""The rank logs' costs, against an S3 server (AWS_ENDPOINT_URL and credentials from the environment, or a
moto server of its own): what a log call costs the training step with the rank log attached, what storing a
full (capped) rank log costs the background thread, and how long after the trainer logged a line
`kubectl trainingrun logs -f` prints it, with the real intervals (15 s upload, 2 s poll).

    python bench/rank_logs.py [--seconds 60]

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import boto3

from fsdp_trainer import runlog
from fsdp_trainer.contract import rank_log_name
from fsdp_trainer.storage import Location
from kubectl_trainingrun import cli

REPO = Path(__file__).resolve().parents[1]

LINE = "step %d/%d | loss %.4f | lr %.3g | %s tok/s | MFU %s"


def moto_server() -> subprocess.Popen[bytes]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    moto = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    server = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-west-2",
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    return server


def log_call_cost(run: Location, calls: int = 20_000) -> dict[str, float]:
    logger = logging.getLogger("fsdp_trainer.telemetry")
    logging.getLogger().setLevel(logging.INFO)

    def per_call() -> float:
        start = time.perf_counter()
        for i in range(calls):
            logger.info(LINE, i, calls, 2.5, 1e-4, "12,345", "41.0%")
        return (time.perf_counter() - start) / calls

    without = per_call()
    handler = runlog.start_rank_log(run, 9, 0, [])
    with_log = per_call()
    runlog.stop_rank_log(handler)
    return {"log_call_us_without": without * 1e6, "log_call_us_with_rank_log": with_log * 1e6}


def full_log_store_seconds(run: Location) -> float:
    capped = runlog.CappedText()
    prefix = "2026-12-01T12:00:00.000+00:00 INFO fsdp_trainer.telemetry: "
    for i in range(200_000):
        capped.add(prefix + LINE % (i, 1, 2.5, 1, 1, 1) + "\n")
    text = capped.text()
    target = run.child("logs/attempt-8/rank-0.log")
    start = time.perf_counter()
    target.write_text(text)
    return time.perf_counter() - start


def follow_delays(bucket: str, seconds: float) -> list[float]:
    storage = f"s3://{bucket}/runs"
    target = Location.parse(f"{storage}/team-a/tiny").child(rank_log_name(1, 0))
    writer = runlog.RankLog(target, runlog.Redactor([]))
    run: dict[str, Any] = {
        "metadata": {"name": "tiny", "namespace": "team-a"},
        "spec": {"checkpoint": {"storagePath": storage}},
        "status": {"phase": "Running", "attempt": 1},
    }
    emitted: dict[str, float] = {}
    seen: dict[str, float] = {}

    def write(text: str) -> None:
        for line in text.splitlines():
            seen.setdefault(line.rsplit(": ", 1)[-1], time.monotonic())

    def train() -> None:
        step = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            step += 1
            emitted[f"step {step}"] = time.monotonic()
            writer.emit(logging.LogRecord("t", logging.INFO, __file__, 1, f"step {step}", None, None))
            time.sleep(1.0)
        writer.close()
        run["status"]["phase"] = "Succeeded"

    thread = threading.Thread(target=train)
    thread.start()
    options = cli.build_parser().parse_args(["logs", "tiny", "-f"])
    objects = cli.RunObjects(boto3.client("s3"), cli.storage_prefix(run))
    cli.logs(options, run, objects, write, lambda: run)
    thread.join()
    return [seen[line] - emitted[line] for line in emitted]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    server = None if os.environ.get("AWS_ENDPOINT_URL") else moto_server()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
        )
        run = Location.parse(f"s3://{bucket}/runs/team-a/cost")
        result: dict[str, Any] = log_call_cost(run)
        result["full_8mib_log_store_seconds"] = full_log_store_seconds(run)
        delays = follow_delays(bucket, args.seconds)
        result["follow_delay_seconds"] = {
            "lines": len(delays),
            "median": statistics.median(delays),
            "max": max(delays),
        }
        print(json.dumps(result, indent=2))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
