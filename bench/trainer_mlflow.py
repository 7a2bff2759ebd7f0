"""MLflow tracking's cost per training step: the same CPU run (one process, `--launcher direct`, local
storage) with tracking off and on, against a real MLflow server on loopback (SQLite, artifacts served from a
local directory), in alternating order so drift in the machine's load falls on both sides alike.

logEvery 1 is the worst case: every step queues its metrics for the tracker's thread. The figure is the
median step time (the trainer's own step_time_seconds, setup and the first steps left out) of each run,
then the median over the runs of each side.

    python bench/trainer_mlflow.py [--pairs 3] [--steps 60] [--output out.json] [--no-doc]

The server comes from the MLflow venv hack/venv.sh installs (hack/lib.sh MLFLOW_VENV).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

from tests.harness import mlflow_server  # noqa: E402

from doc_section import publish  # noqa: E402

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
SECTION = "trainer-mlflow"


def run(storage: Path, name: str, steps: int, tracking_uri: str | None) -> list[float]:
    """One run's step times after the warm-up steps."""
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
    subprocess.run(
        [sys.executable, "-m", "fsdp_trainer", "--launcher", "direct", "--config", json.dumps(config)],
        env={**os.environ, "PYTHONPATH": str(REPO / "trainer")},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    [history] = (storage / "default" / name / "metrics").glob("*.jsonl")
    records = [json.loads(line) for line in history.read_text().splitlines()]
    return [
        r["stepTimeSeconds"]
        for r in records
        if r["phase"] == "training" and r.get("stepTimeSeconds") and r["step"] > WARMUP_STEPS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    medians: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as scratch:
        home = Path(scratch)
        with mlflow_server(home, str(home / "artifacts")) as url:
            for pair in range(args.pairs):
                order = ("off", "on") if pair % 2 == 0 else ("on", "off")
                for side in order:
                    times = run(home / "runs", f"{side}-{pair}", args.steps, url if side == "on" else None)
                    medians[side].append(statistics.median(times))
    off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
    results = {
        "steps_per_run": args.steps,
        "pairs": args.pairs,
        "median_step_seconds_off": off,
        "median_step_seconds_on": on,
        "per_run_medians": medians,
        "ratio_on_over_off": on / off,
    }
    table = "\n".join(
        [
            f"{args.pairs} runs a side, {args.steps} steps each, logEvery 1, one CPU process (medians of "
            f"each run's median step time, the first {WARMUP_STEPS} steps left out):",
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
            f"MLflow on / off: **{on / off:.3f}** ({(on - off) * 1000:+.2f} ms a step).",
        ]
    )
    publish(SECTION, results, table, args.output, not args.no_doc)


if __name__ == "__main__":
    main()
