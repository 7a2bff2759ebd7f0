"""MLflow tracking's cost per training step: the same CPU run (one process, `--launcher direct`, local
storage) with tracking off and on, against a real MLflow server on loopback (SQLite, artifacts served from a
local directory), in alternating order so drift in the machine's load falls on both sides alike.

logEvery 1 is the worst case: every step queues its metrics for the tracker's thread. The wall-clock figure
is the median step time (the trainer's own step_time_seconds, setup and the first steps left out) of each
run, then the median over the runs of each side; on a loaded machine its noise is larger than the tracker's
cost, so the tracker's own cost is measured too: the training thread's time in `log_metrics` (timed over
many calls against the live server) and the CPU time of the tracker's thread (which the trainer logs at the
end), per step, against the step time with tracking off.

    python bench/trainer_mlflow.py [--pairs 3] [--steps 40] [--output out.json] [--no-doc]

The server comes from the MLflow venv hack/venv.sh installs (hack/lib.sh MLFLOW_VENV).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.mlflow import mlflow_server

from doc_section import publish
from fsdp_trainer.contract import AttemptInfo, TrainerConfig
from fsdp_trainer.storage import Location
from fsdp_trainer.tracking import MlflowTracker

REPO = Path(__file__).resolve().parents[1]

MODEL = {
    "model_type": "qwen2",
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
WARMUP_STEPS = 5
# What the metrics processor logs per step on CPU (mfu needs a GPU's peak FLOPS).
METRICS = ("loss", "learning_rate", "grad_norm", "tokens_per_second", "tokens_per_second_per_device",
           "step_time_seconds", "tokens_seen", "mfu")  # fmt: skip
SECTION = "trainer-mlflow"


def run(storage: Path, name: str, steps: int, tracking_uri: str | None) -> tuple[list[float], float | None]:
    """One run's step times after the warm-up steps, and the CPU seconds its tracker's thread used."""
    config: dict[str, Any] = {
        "runName": name,
        "model": {"fromConfig": MODEL, "tokenizer": "byte-level"},
        "training": {"maxSteps": steps, "microBatchSize": 4, "sequenceLength": 64, "logEvery": 1},
        "data": {"source": "synthetic", "evalFraction": 0},
        "checkpoint": {"storagePath": str(storage), "everySteps": steps, "exportModel": False},
        "network": {"bandwidthProbeMb": 0},
    }
    if tracking_uri:
        config["tracking"] = {"mlflow": {"trackingUri": tracking_uri, "experimentName": "bench"}}
    output = subprocess.run(
        [sys.executable, "-m", "fsdp_trainer", "--launcher", "direct", "--config", json.dumps(config)],
        env={**os.environ, "PYTHONPATH": str(REPO / "trainer")},
        check=True,
        capture_output=True,
        text=True,
    ).stderr
    [history] = (storage / "default" / name / "metrics").glob("*.jsonl")
    records = [json.loads(line) for line in history.read_text().splitlines()]
    times = [
        r["stepTimeSeconds"]
        for r in records
        if r["phase"] == "training" and r.get("stepTimeSeconds") and r["step"] > WARMUP_STEPS
    ]
    cpu = re.search(r"the tracker's thread used ([0-9.]+) s of CPU", output)
    return times, float(cpu.group(1)) if cpu else None


def call_cost(url: str, storage: Path, calls: int) -> float:
    """Seconds one logged step's `log_metrics` (8 values) holds the training thread, with the tracker's
    thread sending to the server meanwhile."""
    config = TrainerConfig.model_validate(
        {
            "runName": "calls",
            "model": {"fromConfig": MODEL},
            "checkpoint": {"storagePath": str(storage)},
            "tracking": {"mlflow": {"trackingUri": url, "experimentName": "bench"}},
        }
    )
    tracker = MlflowTracker(config, AttemptInfo(), "bench", Location.parse(config.run_uri()), "bench")
    values = dict.fromkeys(METRICS, 1.0)
    started = time.perf_counter()
    for step in range(calls):
        tracker.log_metrics(step, values)
    elapsed = time.perf_counter() - started
    tracker.close()
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--calls", type=int, default=5_000)  # 40,000 values: within the tracker's buffer
    parser.add_argument("--output", type=Path)
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    medians: dict[str, list[float]] = {"off": [], "on": []}
    thread_cpu_per_step: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as scratch:
        home = Path(scratch)
        with mlflow_server(home, str(home / "artifacts")) as url:
            for pair in range(args.pairs):
                order = ("off", "on") if pair % 2 == 0 else ("on", "off")
                for side in order:
                    name = f"{side}-{pair}"
                    times, cpu = run(home / "runs", name, args.steps, url if side == "on" else None)
                    medians[side].append(statistics.median(times))
                    if cpu is not None:
                        thread_cpu_per_step.append(cpu / args.steps)
            per_call = call_cost(url, home / "calls", args.calls)
    off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
    cpu_per_step = statistics.median(thread_cpu_per_step)
    cost = per_call + cpu_per_step  # what the tracker takes per step, whichever thread pays it
    results = {
        "steps_per_run": args.steps,
        "pairs": args.pairs,
        "median_step_seconds_off": off,
        "median_step_seconds_on": on,
        "per_run_medians": medians,
        "ratio_on_over_off": on / off,
        "log_metrics_seconds_per_step": per_call,
        "tracker_thread_cpu_seconds_per_step": cpu_per_step,
        "tracker_cost_over_step_time": cost / off,
    }
    table = "\n".join(
        [
            f"{args.pairs} runs a side, {args.steps} steps each, logEvery 1 (8 values a step), one CPU "
            f"process; medians of each run's median step time, the first {WARMUP_STEPS} steps left out:",
            "",
            "| tracking | step time (ms) | runs' medians (ms) |",
            "| --- | --- | --- |",
            *(
                f"| {side} | {statistics.median(medians[side]) * 1000:.1f} | "
                + ", ".join(f"{m * 1000:.1f}" for m in medians[side])
                + " |"
                for side in ("off", "on")
            ),
            "",
            f"Wall clock, on / off: {on / off:.3f}. What the tracker itself takes per step: "
            f"{per_call * 1e6:.1f} µs in `log_metrics` on the training thread ({args.calls} calls) and "
            f"{cpu_per_step * 1e3:.2f} ms of its own thread's CPU (sending included), together "
            f"**{cost / off:.2%}** of the step time with tracking off.",
        ]
    )
    publish(SECTION, results, table, args.output, not args.no_doc)


if __name__ == "__main__":
    main()
