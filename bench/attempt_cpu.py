"""The CPU one Ray Train attempt of the CPU demo costs, by process, in the suite's variants side by side.

`make test` is CPU-bound on this machine's 2 cores, and most of its CPU is Ray Train attempts: each starts a
job supervisor, a driver, Ray Train's controller and helper actors and its workers, most of them importing
torch. This measures one attempt as the e2e tests submit it (`ray job submit` of `python -m fsdp_trainer`
with the trainer package in py_modules, 40 steps, a checkpoint every 10 to a moto S3), on a fresh Ray head
of the DLC environment per attempt, variants alternating within each round:

- demo: two Ray Train workers, Ray's defaults (as the suite ran every attempt before);
- no-watcher: the same without Ray Train's preemption watcher (the local heads' setting, hack/ray-head.sh);
- one-worker: one worker, no watcher (the SMALL shape of the tests about what the operator does).

CPU is every process in the head's session (its servers, the job's driver, actors and workers), sampled from
/proc four times a second from submission to the job's end; the ratio is against `demo` in the same round.

    ~/.cache/fsdp-operator/dlc-venv/bin/python bench/attempt_cpu.py [--rounds 3] [--output results.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import yaml
from tests.support.net import answers, free_port
from tests.support.processes import stop_process_group
from tests.support.waiting import wait_until

from doc_section import measured, publish

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
HZ = os.sysconf("SC_CLK_TCK")
BUCKET = "attempt-cpu"
NO_WATCHER = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
VARIANTS: dict[str, tuple[int, dict[str, str]]] = {  # name: (Ray Train workers, head environment)
    "demo": (2, {}),
    "no-watcher": (2, NO_WATCHER),
    "one-worker": (1, NO_WATCHER),
}


class SessionCpu:
    """CPU seconds of every process in one session, by process name (Ray names its workers `ray::<Actor>`),
    from /proc; a process's last sample counts, so one that exits between samples loses at most 0.25 s."""

    def __init__(self, session: int) -> None:
        self.session = session
        self.ticks: dict[tuple[str, str], tuple[str, int]] = {}  # (pid, start time) -> (name, ticks)
        self.baseline: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[tuple[str, str], tuple[str, int]]:
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[3]) == self.session:  # field 6 of stat: the session id
                found[(pid, fields[19])] = (name, int(fields[11]) + int(fields[12]))
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            self.ticks.update(self._sample())
            time.sleep(0.25)

    def start(self) -> SessionCpu:
        self.baseline = {key: ticks for key, (_, ticks) in self._sample().items()}
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.ticks.update(self._sample())
        by_name: collections.Counter[str] = collections.Counter()
        for key, (name, ticks) in self.ticks.items():
            by_name[name] += (ticks - self.baseline.get(key, 0)) / HZ
        return dict(by_name)


def demo_config(run: str, workers: int) -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "examples" / "cpu-demo.yaml").read_text())["spec"]
    return {
        "runName": run,
        "workers": workers,
        "model": spec["model"],
        "fsdp": spec["fsdp"],
        "training": spec["training"],
        "data": {**spec["data"], "source": f"s3://{BUCKET}/corpus.jsonl"},
        "checkpoint": {**spec["checkpoint"], "storagePath": f"s3://{BUCKET}/runs"},
        "network": {"bandwidthProbeMb": 1},
    }


def attempt(variant: str, env: dict[str, str], workdir: Path) -> dict[str, Any]:
    """One head, one job: its wall time and its session's CPU."""
    workers, head_env = VARIANTS[variant]
    gcs, dashboard = free_port(), free_port()
    env = {**env, **head_env, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths live below it
    log = (workdir / f"head-{variant}.log").open("wb")
    head = subprocess.Popen(
        [BIN / "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=4", "--num-gpus=0",
         f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{dashboard}"
        wait_until(f"the dashboard at {url} (log {log.name})", lambda: answers(f"{url}/api/version"), 120)
        time.sleep(10)  # the head's own start-up settles
        cpu = SessionCpu(head.pid).start()
        started = time.monotonic()
        config = json.dumps(demo_config(f"r-{uuid.uuid4().hex[:6]}", workers))
        job = subprocess.run(
            [BIN / "ray", "job", "submit", f"--address={url}",
             "--runtime-env-json", json.dumps({"py_modules": [str(REPO / "trainer" / "fsdp_trainer")]}),
             "--", "python", "-m", "fsdp_trainer", "--config", config],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        wall = time.monotonic() - started
        by_name = cpu.stop()
        if "succeeded" not in job.stdout:
            raise RuntimeError(
                f"the {variant} job did not succeed:\n{job.stdout[-3000:]}\n{job.stderr[-2000:]}"
            )
        return {"wall_s": round(wall, 1), "cpu_s": round(sum(by_name.values()), 1), "by_process": by_name}
    finally:
        stop_process_group(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def table(rounds: list[dict[str, dict[str, Any]]], command: str) -> str:
    lines = [
        measured(command),
        "",
        "| variant | CPU-s per attempt, median (range) | wall s, median | CPU ratio to demo (range) |",
        "|---|---|---|---|",
    ]
    for variant in VARIANTS:
        cpu = [r[variant]["cpu_s"] for r in rounds]
        wall = [r[variant]["wall_s"] for r in rounds]
        ratios = [r[variant]["cpu_s"] / r["demo"]["cpu_s"] for r in rounds]
        lines.append(
            f"| {variant} | {statistics.median(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f}) | "
            f"{statistics.median(wall):.1f} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    heaviest = collections.Counter[str]()
    for r in rounds:
        heaviest.update(r["demo"]["by_process"])
    top = ", ".join(f"{name} {seconds / len(rounds):.1f}" for name, seconds in heaviest.most_common(8))
    lines += ["", f"Where a demo attempt's CPU goes, CPU-s by process name (mean): {top}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="attempt-cpu-"))
    port = free_port()
    moto = subprocess.Popen(
        [BIN / "moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-west-2",
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # head and jobs stay on loopback
        # The local cluster's head settings (hack/ray-head.sh) other than the one measured here.
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
        "LOG_NAME_UPDATE_INTERVAL_S": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
    }
    try:
        wait_until("moto", lambda: answers(f"http://127.0.0.1:{port}/moto-api/"), 30)
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-west-2",
                          aws_access_key_id="testing", aws_secret_access_key="testing")  # fmt: skip
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        s3.upload_file(str(REPO / "examples" / "data" / "stdlib-docstrings.jsonl"), BUCKET, "corpus.jsonl")
        rounds = []
        for number in range(args.rounds):
            measured = {variant: attempt(variant, env, workdir) for variant in VARIANTS}
            print(f"round {number + 1}: " + ", ".join(f"{v} {m['cpu_s']} CPU-s" for v, m in measured.items()))
            rounds.append(measured)
    finally:
        moto.terminate()
        moto.wait(timeout=30)
    shutil.rmtree(workdir, ignore_errors=True)  # kept, with the heads' logs, when a round failed
    command = f"~/.cache/fsdp-operator/dlc-venv/bin/python bench/attempt_cpu.py --rounds {args.rounds}"
    publish("attempt-cpu", {"rounds": rounds}, table(rounds, command), args.output, not args.no_doc)


if __name__ == "__main__":
    main()
