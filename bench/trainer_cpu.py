"""Trainer benchmarks on CPU (gloo, 2 ranks), each a ratio measured side by side in one run, written to
docs/benchmarks.md (between the trainer markers) and as JSON to --output.

1. Our Ray Train entrypoint (`python -m fsdp_trainer` on a Ray head of this script's own, exactly as the
   operator submits it) against baseline A (bench/trainer_baseline.py under torchrun: the same model,
   parallelisation, optimizer and batch, nothing else): median step time ratio; the same loop without Ray
   (torchrun, `--launcher direct`) separates the loop's overhead from Ray's; start-up (launch to first
   step) reported separately. Runs alternate, and each ratio is taken within a round (this machine's speed
   drifts by a few per cent between minutes), then the median over rounds is reported with its range.
2. Checkpoints (bench/trainer_checkpoint.py under torchrun, ~30M parameters): training blocked per
   checkpoint with the asynchronous saver as a fraction of the synchronous save; save-to-durable throughput
   against a plain boto3 upload of the same bytes to the same S3 (a moto server on loopback).
3. A resubmitted job (the same run name, more steps): time from launch to its first step after the
   restore, and the share of it spent loading the checkpoint, from the job's own setup-stage records.

    python bench/trainer_cpu.py [--rounds 5] [--output results.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
from tests.support.net import free_port
from tests.support.waiting import wait_until

from doc_section import DOC, publish
from fsdp_trainer.contract import METRICS_DIR, ProgressRecord, TrainerConfig
from fsdp_trainer.storage import Location

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
SINGLE_MACHINE_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
STEPS = 120
LOG_EVERY = 10
MODEL: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def trainer_config(run_name: str, storage: str, max_steps: int = STEPS) -> dict[str, Any]:
    return {
        "runName": run_name,
        "namespace": "bench",
        "workers": 2,
        "cpusPerWorker": 1,
        "model": {"fromConfig": MODEL},
        "training": {
            "maxSteps": max_steps,
            "microBatchSize": 4,
            "sequenceLength": 128,
            "logEvery": LOG_EVERY,
            "seed": 1,
        },
        "data": {"source": "synthetic", "evalFraction": 0},
        # Checkpoint cost has a benchmark of its own: here only the final save, after the last measured step.
        "checkpoint": {"storagePath": storage, "everySteps": 1_000_000, "exportModel": False},
        "network": {"bandwidthProbeMb": 1},
    }


class Services:
    """A moto S3 server and a Ray head on loopback, stopped by pid."""

    def __init__(self, workdir: Path) -> None:
        s3_port, ray_port, client_port = free_port(), free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{s3_port}"
        self.env = {
            **os.environ,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-west-2",
            "RAY_ADDRESS": f"127.0.0.1:{ray_port}",
            "PYTHONPATH": str(REPO / "trainer"),
            "HF_HUB_OFFLINE": "1",
            "RAY_DEDUP_LOGS": "0",
            **SINGLE_MACHINE_RAY,
        }
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("AWS_")})
        self.processes = [
            subprocess.Popen(
                [BIN / "moto_server", "-H", "127.0.0.1", "-p", str(s3_port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            ),
        ]  # fmt: skip
        ray_log = (workdir / "ray-head.log").open("wb")
        self.processes.append(
            subprocess.Popen(
                [BIN / "ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={ray_port}",
                 f"--ray-client-server-port={client_port}", "--num-cpus=2", "--include-dashboard=false",
                 "--disable-usage-stats", "--block"],
                env=self.env, stdout=ray_log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        )  # fmt: skip
        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        wait_until("the S3 server", self._s3_answers, timeout=30, interval=0.3)
        boto3.client("s3").create_bucket(
            Bucket=self.bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
        )
        wait_until(
            "the Ray head",
            lambda: "Ray runtime started" in (workdir / "ray-head.log").read_text(),
            timeout=120,
        )

    def _s3_answers(self) -> bool:
        try:
            boto3.client("s3").list_buckets()
        except Exception:
            return False
        return True

    @property
    def storage(self) -> str:
        return f"s3://{self.bucket}/runs"

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def command_line(pid: str) -> str:
    """The process's command line, arguments joined by spaces (OSError once it has exited)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def ray_daemon_cpu_seconds(services: Services) -> float:
    """CPU seconds used so far by the Ray head's own long-lived processes (GCS, raylet, agents, monitors):
    the processes of its session that are not a job's driver or workers."""
    session = services.processes[-1].pid  # `ray start` leads the session every Ray process of the head is in
    total = 0.0
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or os.getsid(int(entry.name)) != session:
                continue
            command = command_line(entry.name)
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ProcessLookupError):
            continue  # exited meanwhile
        if "ray::" in command or "fsdp_trainer" in command:
            continue  # the job's own processes: its driver, controller and training workers
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def history(services: Services, run_name: str) -> list[list[ProgressRecord]]:
    config = TrainerConfig.model_validate(trainer_config(run_name, services.storage))
    metrics = Location.parse(config.run_uri()).child(METRICS_DIR)
    return [
        [ProgressRecord.model_validate_json(line) for line in metrics.child(name).read_text().splitlines()]
        for name in sorted(metrics.list_files())
    ]


def run_ours(
    services: Services, run_name: str, max_steps: int = STEPS, without_ray: bool = False
) -> tuple[float, list[ProgressRecord]]:
    """Launches the entrypoint as the operator's Ray job does (or, without_ray, our per-worker loop under
    torchrun); returns the launch time and the records of the attempt it made."""
    config = json.dumps(trainer_config(run_name, services.storage, max_steps))
    entrypoint = [sys.executable, "-m", "fsdp_trainer"]
    if without_ray:
        entrypoint = [str(BIN / "torchrun"), "--nproc-per-node=2", f"--master-port={free_port()}", "-m",
                      "fsdp_trainer", "--launcher", "direct"]  # fmt: skip
    launched = time.time()
    done = subprocess.run(
        [*entrypoint, "--config", config, "--submission-id", run_name],
        env=services.env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"trainer run {run_name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return launched, history(services, run_name)[-1]


def ours_figures(launched: float, records: list[ProgressRecord]) -> dict[str, Any]:
    # One record per logging step (a later update of the same step, e.g. the checkpoint's, repeats it).
    by_step = {r.step: r for r in records if r.phase == "training" and r.step_time_seconds}
    windows = [by_step[step] for step in sorted(by_step) if step % LOG_EVERY == 0]
    first_step = next(r for r in records if r.phase == "training" and r.step > 0)
    return {
        "window_step_seconds": [r.step_time_seconds for r in windows],
        # The first record after step 1 is at the first logging step; its interval's mean step time
        # tells when step 1 ended.
        "startup_seconds": first_step.updated_at.timestamp()
        - launched
        - (first_step.step - 1) * (first_step.step_time_seconds or 0.0),
    }


def torchrun(script: str, arguments: list[str], env: dict[str, str]) -> None:
    command = [
        str(BIN / "torchrun"),
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(REPO / script),
    ]
    done = subprocess.run([*command, *arguments], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")


def run_baseline(services: Services, workdir: Path, run_name: str) -> dict[str, Any]:
    output = workdir / f"{run_name}.json"
    config = TrainerConfig.model_validate(trainer_config(run_name, services.storage)).model_dump_json()
    env = {**services.env, "BENCH_LAUNCHED_AT": str(time.time())}
    torchrun("bench/trainer_baseline.py", ["--config", config, "--output", str(output)], env)
    return dict(json.loads(output.read_text()))


def run_checkpoint_bench(services: Services, workdir: Path) -> dict[str, Any]:
    output = workdir / "checkpoint.json"
    storage = f"s3://{services.bucket}/checkpoint-bench"
    torchrun("bench/trainer_checkpoint.py", ["--storage", storage, "--output", str(output)], services.env)
    return dict(json.loads(output.read_text()))


def resubmission_figures(launched: float, records: list[ProgressRecord]) -> dict[str, Any]:
    """Launch to the first resumed step, and the loading-checkpoint stage's share of it."""
    stages = [(r.stage, r.updated_at.timestamp()) for r in records if r.phase == "starting"]
    loading_started = next(t for stage, t in stages if stage == "loading-checkpoint")
    training = next(r for r in records if r.phase == "training")  # written once the checkpoint is loaded
    first_step = next(r for r in records if r.phase == "training" and r.step > (training.step or 0))
    first_step_done = first_step.updated_at.timestamp() - (first_step.step - training.step - 1) * (
        first_step.step_time_seconds or 0
    )
    to_first_step = first_step_done - launched
    loading = training.updated_at.timestamp() - loading_started
    # Where the time went: Ray (job, controller, worker actors) until the first record, then each stage
    # until the next one began, then the first step itself.
    by_stage: dict[str, float] = {"ray start-up": stages[0][1] - launched}
    ends = [t for _, t in stages[1:]] + [training.updated_at.timestamp()]
    for (stage, began), ended in zip(stages, ends, strict=True):
        by_stage[str(stage)] = by_stage.get(str(stage), 0.0) + ended - began
    by_stage["first step"] = first_step_done - training.updated_at.timestamp()
    return {
        "resumed_from_step": training.resumed_from_step,
        "launch_to_first_step_seconds": to_first_step,
        "loading_checkpoint_seconds": loading,
        "loading_share": loading / to_first_step,
        "seconds_by_stage": by_stage,
    }


def measured_windows(round_figures: dict[str, Any]) -> list[float]:
    # The first window holds the first step's lazy initialisation: warm-up, left out on both sides.
    return list(round_figures["window_step_seconds"][1:])


def paired_ratios(rounds: list[dict[str, Any]], baseline_rounds: list[dict[str, Any]]) -> list[float]:
    """Median step time over baseline A's in the same round, round by round."""
    return [
        statistics.median(measured_windows(ours)) / statistics.median(measured_windows(baseline))
        for ours, baseline in zip(rounds, baseline_rounds, strict=True)
    ]


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.3f}-{max(ratios):.3f}"


def summarise(results: dict[str, Any]) -> str:
    ours, without_ray, baseline = results["ours"], results["ours_without_ray"], results["baseline"]
    ratio = results["step_time_ratio"]
    checkpoints = results["checkpoint"]
    resubmitted = results["resubmission"]
    mb = checkpoints["bytes"] / 1e6
    rows = [
        ("Median step time, ours (Ray Train entrypoint) / baseline A (torchrun FSDP2 loop): median of the "
         "rounds' ratios (range)",
         f"{ours['median_step_seconds'] * 1e3:.1f} ms / {baseline['median_step_seconds'] * 1e3:.1f} ms; "
         f"**{ratio:.3f}** ({spread(results['step_time_ratios'])})", "<= 1.03"),
        ("The same loop without Ray (torchrun, `--launcher direct`) / baseline A: the loop's own overhead",
         f"{without_ray['median_step_seconds'] * 1e3:.1f} ms / "
         f"{baseline['median_step_seconds'] * 1e3:.1f} ms; "
         f"**{results['step_time_ratio_without_ray']:.3f}** "
         f"({spread(results['step_time_ratios_without_ray'])})",
         "reported"),
        ("Where the Ray entrypoint's extra time goes: CPU used by the Ray head's own processes (GCS, raylet, "
         "agents) during our runs, per second of the run, of the 2 cores the ranks share",
         f"{ours['ray_daemons_cpu_per_second']:.2f} CPU-s/s", "reported"),
        ("Start-up, launch to first step: ours / without Ray / baseline A",
         f"{ours['startup_seconds']:.1f} s / {without_ray['startup_seconds']:.1f} s / "
         f"{baseline['startup_seconds']:.1f} s", "reported"),
        (f"Training blocked per checkpoint ({mb:.0f} MB): async / sync",
         f"{checkpoints['async_blocked_seconds']:.3f} s / {checkpoints['sync_blocked_seconds']:.3f} s = "
         f"**{checkpoints['stall_ratio']:.3f}**", "<= 0.1"),
        ("Save-to-durable throughput: ours / plain boto3 upload of the same bytes",
         f"{checkpoints['durable_mb_per_second']:.0f} MB/s / {checkpoints['boto3_mb_per_second']:.0f} MB/s = "
         f"**{checkpoints['throughput_ratio']:.2f}**", ">= 0.8"),
        ("Resubmitted job: launch to first step after the restore (loading share)",
         f"{resubmitted['launch_to_first_step_seconds']:.1f} s "
         f"({resubmitted['loading_checkpoint_seconds']:.2f} s loading, {resubmitted['loading_share']:.0%}); "
         + ", ".join(f"{stage} {took:.1f} s" for stage, took in resubmitted["seconds_by_stage"].items()),
         "reported"),
    ]  # fmt: skip
    lines = [
        f"Measured {results['measured_at']} on {results['machine']} (`python bench/trainer_cpu.py`, "
        f"{results['rounds']} round(s), medians).",
        "",
        "| figure | measured | target |",
        "|---|---|---|",
        *(f"| {name} | {value} | {target} |" for name, value, target in rows),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating ours/baseline rounds (default 5)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--no-doc", action="store_true", help=f"do not rewrite {DOC.relative_to(REPO)}")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    services = Services(workdir)
    try:
        checkpoint_raw = run_checkpoint_bench(services, workdir)
        ours_rounds, without_ray_rounds, baseline_rounds = [], [], []
        for round_number in range(args.rounds):
            daemons_before = ray_daemon_cpu_seconds(services)
            launched, records = run_ours(services, f"ours-{round_number}")
            ours_rounds.append(
                {
                    **ours_figures(launched, records),
                    "ray_daemons_cpu_per_second": (ray_daemon_cpu_seconds(services) - daemons_before)
                    / (time.time() - launched),
                }
            )
            baseline_rounds.append(run_baseline(services, workdir, f"baseline-{round_number}"))
            launched, records = run_ours(services, f"direct-{round_number}", without_ray=True)
            without_ray_rounds.append(ours_figures(launched, records))
        # The first run again with more steps: a new submission resuming from its final checkpoint.
        launched, records = run_ours(services, "ours-0", max_steps=STEPS + LOG_EVERY)
        resubmission = resubmission_figures(launched, records)
    finally:
        services.stop()

    def median_step(rounds: list[dict[str, Any]]) -> float:
        return statistics.median(s for r in rounds for s in measured_windows(r))

    ours = {
        "median_step_seconds": median_step(ours_rounds),
        "startup_seconds": statistics.median(r["startup_seconds"] for r in ours_rounds),
        "ray_daemons_cpu_per_second": statistics.median(r["ray_daemons_cpu_per_second"] for r in ours_rounds),
        "rounds": ours_rounds,
    }
    without_ray = {
        "median_step_seconds": median_step(without_ray_rounds),
        "startup_seconds": statistics.median(r["startup_seconds"] for r in without_ray_rounds),
        "rounds": without_ray_rounds,
    }
    baseline = {
        "median_step_seconds": median_step(baseline_rounds),
        "startup_seconds": statistics.median(r["startup_seconds"] for r in baseline_rounds),
        "rounds": baseline_rounds,
    }
    ratios = paired_ratios(ours_rounds, baseline_rounds)
    ratios_without_ray = paired_ratios(without_ray_rounds, baseline_rounds)
    sync_blocked = statistics.median(checkpoint_raw["sync"]["blocked_seconds"])
    async_blocked = statistics.median(checkpoint_raw["async"]["blocked_seconds"])
    size = checkpoint_raw["async"]["bytes"]  # the synchronous saver's start() already consumed its result
    durable = size / 1e6 / statistics.median(checkpoint_raw["async"]["durable_seconds"])
    plain = size / 1e6 / checkpoint_raw["boto3_upload_seconds"]
    results = {
        "measured_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores, gloo, 2 ranks",
        "rounds": args.rounds,
        "ours": ours,
        "ours_without_ray": without_ray,
        "baseline": baseline,
        "step_time_ratio": statistics.median(ratios),
        "step_time_ratios": ratios,
        "step_time_ratio_without_ray": statistics.median(ratios_without_ray),
        "step_time_ratios_without_ray": ratios_without_ray,
        "checkpoint": {
            "parameters": checkpoint_raw["parameters"],
            "bytes": size,
            "sync_blocked_seconds": sync_blocked,
            "async_blocked_seconds": async_blocked,
            "stall_ratio": async_blocked / sync_blocked,
            "durable_mb_per_second": durable,
            "boto3_mb_per_second": plain,
            "throughput_ratio": durable / plain,
            "raw": checkpoint_raw,
        },
        "resubmission": resubmission,
    }
    publish("trainer-cpu", results, summarise(results), args.output, not args.no_doc)


if __name__ == "__main__":
    main()
