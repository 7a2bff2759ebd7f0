"""GPU benchmark: our per-worker loop against baselines A and B, one after another on one GPU, offline.

Baseline A (bench/trainer_baseline.py) is a minimal FSDP2 loop with our parallelisation, optimizer and data
layout and nothing else (no Ray, no progress records, no checkpoints), so the ratio isolates our overhead.
Ours and A run a Qwen2.5-1.5B-shaped model initialised from its config, bf16 compute, synthetic tokens,
sequence 2048, micro-batch 4, `--warmup-steps` steps left out and `--steps` measured, with one host sync per
step on both sides (our loop logs every step here; baseline A reads its loss). Each is run without and with
per-block torch.compile.

Reported per loop: tokens/s/GPU at p10/p50/p90 over the measured steps, MFU against the spec-sheet bf16 peak
(fsdp_trainer.metrics) and against a bf16 matmul peak measured here, peak memory over the measured steps
(counter reset after warm-up), and for our loop the seconds one checkpoint blocked training (saved at the
last step: the model, AdamW moments and loop state, ~18.5 GB for this shape).

Baseline B is torchtitan's own trainer (PyPI torchtitan, 0.3.0) with the same sizes and settings
(bench/trainer_torchtitan.py says what differs: it has no Qwen2, so its Qwen3 stands in). It runs after the
others, as a subprocess (torchrun -m torchtitan.train with our config module), and its figures come from its
log lines: tokens/s per GPU, its own MFU, and its peak *reserved* memory (ours and A's are peak allocated).
It runs only where torchtitan imports and a CUDA device is present, and only within --time-budget; otherwise
the summary records it as not run, with the reason (the import error's text, no CUDA, the budget, or the
tail of its log when it failed). Its logs go to $OUT/baseline_b_<eager|compiled>.log.

    python bench/gpu_fsdp.py                   # one GPU, torch + transformers, no Ray, no network
    python bench/gpu_fsdp.py --tiny            # a seconds-long smoke run, CPU is fine

Writes the JSON summary to $OUT/gpu_fsdp.json when OUT is set, and to --output when given.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path[:0] = [str(BENCH), str(REPO / "trainer")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from fsdp_trainer import distributed, model  # noqa: E402
from fsdp_trainer.contract import ModelSpec, ProgressRecord, TrainerConfig  # noqa: E402
from fsdp_trainer.loop import LoopInput, train_loop  # noqa: E402
from fsdp_trainer.metrics import flops_per_token, peak_flops  # noqa: E402
from fsdp_trainer.model import AutoModelForCausalLM  # noqa: E402
from fsdp_trainer.storage import Location  # noqa: E402
from trainer_baseline import run_baseline  # noqa: E402

# Qwen2.5-1.5B's shape (config.json of the published model): 1,543,714,304 parameters.
QWEN25_15B: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY: dict[str, Any] = {
    **QWEN25_15B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=50, help="measured steps per loop (default 50)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps before measuring (default 10)")
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="both",
        help="per-block torch.compile (default both)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short sequences: a smoke run")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=450.0,
        help="seconds the whole benchmark may take; baseline B runs only in what is left (default 450)",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON summary here")
    args = parser.parse_args()
    if args.tiny:
        args.sequence_length, args.micro_batch_size = 64, 2
        args.steps, args.warmup_steps = min(args.steps, 6), min(args.warmup_steps, 2)
    return args


def trainer_config(args: argparse.Namespace, storage: str, compile_blocks: bool) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "run_name": "bench",
            "gpus_per_worker": 1 if torch.cuda.is_available() else 0,
            "model": {"from_config": TINY if args.tiny else QWEN25_15B},
            "fsdp": {"mixed_precision": "bf16", "compile": compile_blocks},
            "training": {
                "max_steps": args.warmup_steps + args.steps,
                "micro_batch_size": args.micro_batch_size,
                "sequence_length": args.sequence_length,
                "learning_rate": 1e-4,
                "log_every": 1,
            },
            "data": {"source": "synthetic", "eval_fraction": 0},
            # One checkpoint, at the last step: its blocking time is measured, its writing finishes after.
            "checkpoint": {
                "storage_path": storage,
                "every_steps": 1_000_000,
                "keep": 1,
                "export_model": False,
            },
            "network": {"bandwidth_probe_mb": 0},
        }
    )


def percentiles(values: list[float]) -> dict[str, float]:
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return {"p10": deciles[0], "p50": statistics.median(values), "p90": deciles[-1]}


def figures(
    tokens_per_second: list[float], flops: float, spec_peak: float | None, matmul_peak: float | None
) -> dict[str, Any]:
    spread = percentiles(tokens_per_second)
    median = spread["p50"]
    return {
        "tokens_per_second_per_gpu": spread,
        "mfu_spec_peak": median * flops / spec_peak if spec_peak else None,
        "mfu_measured_matmul_peak": median * flops / matmul_peak if matmul_peak else None,
    }


def our_loop(config: TrainerConfig, warmup: int) -> dict[str, Any]:
    started = time.perf_counter()
    train_loop(LoopInput(trainer=config, submission_id="bench").model_dump(mode="json"))
    wall = time.perf_counter() - started
    run = Location.parse(config.run_uri())
    records = [
        ProgressRecord.model_validate_json(line)
        for name in run.child("metrics").list_files()
        for line in run.child("metrics", name).read_text().splitlines()
    ]
    measured = [r for r in records if r.phase == "training" and r.step > warmup and r.tokens_per_second]
    blocked = [r.checkpoint_blocked_seconds for r in records if r.checkpoint_blocked_seconds is not None]
    return {
        "tokens_per_second": [r.tokens_per_second_per_device or 0.0 for r in measured],
        "peak_memory_bytes": max(r.peak_memory_bytes or 0 for r in measured),
        "checkpoint_blocked_seconds": blocked[-1] if blocked else None,
        "wall_seconds_including_setup_and_checkpoint": wall,
    }


def baseline_a(config: TrainerConfig, warmup: int) -> dict[str, Any]:
    runtime = distributed.start(use_gpu=config.gpus_per_worker > 0)
    try:
        result = run_baseline(config, runtime, time.time(), reset_memory_after=warmup)
    finally:
        distributed.stop(runtime)
    step_seconds = result["window_step_seconds"][warmup:]
    return {
        "tokens_per_second": [result["tokens_per_step"] / seconds for seconds in step_seconds],
        "peak_memory_bytes": result["peak_memory_bytes"],
    }


BASELINE_B_COMMAND = [
    *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"),
    *("-m", "torchtitan.train", "--module", "trainer_torchtitan", "--config", "baseline_b"),
]
# torchtitan's per-step log line (MetricsProcessor.log, colours off), after the logger's prefix:
# "step:  7  loss:  11.93  grad_norm:  3.4  memory: 31.52GiB(22.05%)  tps: 20,109  tflops: 207.5  mfu: 20.98%"
TORCHTITAN_STEP = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:.*?memory:\s*(?P<memory_gib>[\d.]+)GiB.*?tps:\s*(?P<tps>[\d,]+)"
    r".*?mfu:\s*(?:(?P<mfu>[\d.]+)%|N/A)"
)
BASELINE_B_MARGIN_SECONDS = 20.0  # left of the budget for the summary after a baseline B run is stopped


def baseline_b_environment(settings: dict[str, Any] | None = None) -> dict[str, str]:
    paths = [str(BENCH), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
    if settings is not None:
        env["BASELINE_B_SETTINGS"] = json.dumps(settings)
    return env


def baseline_b_unavailable(device: torch.device) -> tuple[str | None, str | None]:
    """Why baseline B cannot run here (None when it can), and torchtitan's version when it imports. The
    import is tried in a child process, so its error text is exact and nothing it sets up leaks into ours."""
    if device.type != "cuda":
        return "not run: no CUDA device (torchtitan trains on GPUs only)", None
    probe = subprocess.run(
        [sys.executable, "-c", "import trainer_torchtitan, torchtitan; print(torchtitan.__version__)"],
        env=baseline_b_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        lines = [line for line in probe.stderr.splitlines() if line.strip()]
        return f"not run: {lines[-1] if lines else f'import failed with exit code {probe.returncode}'}", None
    return None, probe.stdout.strip()


def parse_torchtitan_log(text: str, warmup: int) -> dict[str, Any]:
    """The measured steps' tokens/s per GPU, torchtitan's own MFU and its peak reserved memory."""
    steps = [m for m in TORCHTITAN_STEP.finditer(text) if int(m["step"]) > warmup]
    if not steps:
        raise ValueError("no step after the warm-up in its log")
    return {
        "tokens_per_second": [float(m["tps"].replace(",", "")) for m in steps],
        "torchtitan_mfu_p50": statistics.median(float(m["mfu"]) / 100 for m in steps)
        if steps[0]["mfu"]
        else None,
        "peak_memory_reserved_bytes": int(max(float(m["memory_gib"]) for m in steps) * 2**30),
    }


def baseline_b(
    args: argparse.Namespace, shape: dict[str, Any], compile_blocks: bool, timeout: float, log_file: Path
) -> dict[str, Any]:
    """Runs torchtitan's trainer; returns its figures, or {"not_run": why}."""
    if timeout <= 0:
        return {"not_run": f"not run: the time budget of {args.time_budget:.0f} s was spent"}
    dump_folder = tempfile.mkdtemp(prefix="bench-torchtitan-")
    settings = {
        "shape": shape,
        "sequence_length": args.sequence_length,
        "micro_batch_size": args.micro_batch_size,
        "steps": args.warmup_steps + args.steps,
        "compile": compile_blocks,
        "dump_folder": dump_folder,
    }
    started = time.perf_counter()
    try:
        with log_file.open("w") as log:
            # A session of its own: on a timeout the whole tree (torchrun and its worker) is killed.
            child = subprocess.Popen(
                [sys.executable, *BASELINE_B_COMMAND],
                env=baseline_b_environment(settings),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return {"not_run": f"not run: stopped after {timeout:.0f} s, the time budget left"}
    finally:
        shutil.rmtree(dump_folder, ignore_errors=True)
    text = log_file.read_text(errors="replace")
    if child.returncode != 0:
        tail = " | ".join(line.strip() for line in text.splitlines()[-8:] if line.strip())
        return {"not_run": f"failed with exit code {child.returncode}: {tail}"}
    try:
        figures_b = parse_torchtitan_log(text, args.warmup_steps)
    except ValueError as error:
        return {"not_run": f"failed: {error}"}
    return {**figures_b, "wall_seconds_including_setup": time.perf_counter() - started}


def matmul_peak_flops(device: torch.device, seconds: float = 3.0) -> float | None:
    """bf16 dense matmul throughput measured here: the ceiling a training step can approach."""
    if device.type != "cuda":
        return None
    size = 8192
    left = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    right = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        left @ right
    torch.cuda.synchronize(device)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            left @ right
        torch.cuda.synchronize(device)
        count += 10
    return 2 * size**3 * count / (time.perf_counter() - started)


def release_memory() -> None:
    gc.collect()  # the previous loop's model and optimizer are garbage now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def baseline_b_entry(
    result: dict[str, Any],
    ours: dict[str, Any],
    flops: float,
    spec_peak: float | None,
    matmul_peak: float | None,
) -> dict[str, Any]:
    """Baseline B's part of one loop's summary: its figures (MFU by our FLOPs count, as for the others) and
    our ratio to it, or why it did not run."""
    if "not_run" in result:
        return {"baseline_b": result}
    measured = dict(result)
    spread = figures(measured.pop("tokens_per_second"), flops, spec_peak, matmul_peak)
    return {
        "baseline_b": {**spread, **measured},
        "ours_over_baseline_b_p50": ours["tokens_per_second_per_gpu"]["p50"]
        / spread["tokens_per_second_per_gpu"]["p50"],
    }


def main() -> None:
    started = time.monotonic()
    args = parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec_peak = peak_flops(device_name)
    matmul_peak = matmul_peak_flops(device)
    shape = TINY if args.tiny else QWEN25_15B
    flops = model_flops_per_token(shape, args.sequence_length)
    loops: dict[str, Any] = {}
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    for compile_blocks in modes:
        label = "compiled" if compile_blocks else "eager"
        storage = tempfile.mkdtemp(prefix="bench-fsdp-")
        try:
            config = trainer_config(args, storage, compile_blocks)
            ours = our_loop(config, args.warmup_steps)
            release_memory()
            baseline = baseline_a(config, args.warmup_steps)
            release_memory()
        finally:
            shutil.rmtree(storage, ignore_errors=True)
        ours_figures = figures(ours.pop("tokens_per_second"), flops, spec_peak, matmul_peak)
        baseline_figures = figures(baseline.pop("tokens_per_second"), flops, spec_peak, matmul_peak)
        loops[label] = {
            "ours": {**ours_figures, **ours},
            "baseline_a": {**baseline_figures, **baseline},
            "ours_over_baseline_a_p50": ours_figures["tokens_per_second_per_gpu"]["p50"]
            / baseline_figures["tokens_per_second_per_gpu"]["p50"],
        }
    # Baseline B after the others: ours and A have their figures whatever happens to it.
    unavailable, torchtitan_version = baseline_b_unavailable(device)
    logs = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench-torchtitan-logs-"))
    for compile_blocks in modes:
        label = "compiled" if compile_blocks else "eager"
        if unavailable is not None:
            result: dict[str, Any] = {"not_run": unavailable}
        else:
            left = args.time_budget - (time.monotonic() - started) - BASELINE_B_MARGIN_SECONDS
            result = baseline_b(args, shape, compile_blocks, left, logs / f"baseline_b_{label}.log")
        loops[label].update(baseline_b_entry(result, loops[label]["ours"], flops, spec_peak, matmul_peak))
    summary = {
        "device": device_name,
        "torch": torch.__version__,
        "model": "tiny qwen2" if args.tiny else "Qwen2.5-1.5B shape (random init)",
        "sequence_length": args.sequence_length,
        "micro_batch_size": args.micro_batch_size,
        "warmup_steps": args.warmup_steps,
        "measured_steps": args.steps,
        "flops_per_token": flops,
        "spec_peak_flops": spec_peak,
        "measured_matmul_peak_flops": matmul_peak,
        "loops": loops,
        "baseline_b_torchtitan": {
            "torchtitan": torchtitan_version,
            "not_run": unavailable,
            "model": "torchtitan's Qwen3 of the same sizes (it has no Qwen2; see trainer_torchtitan.py)",
            "launch": " ".join(["python", *BASELINE_B_COMMAND]),
            "memory": "peak reserved (torchtitan's figure), not peak allocated as for ours and baseline A",
        },
        "wall_seconds": time.monotonic() - started,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_fsdp.json").write_text(text + "\n")
    if args.output:
        args.output.write_text(text + "\n")


def model_flops_per_token(from_config: dict[str, Any], sequence_length: int) -> float:
    """As the trainer counts them, from a weightless (meta-device) copy of the model."""
    spec = ModelSpec(from_config=from_config)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(model.model_config(spec, 0, lambda: None))
    return flops_per_token(model.model_shape(shell), sequence_length)


if __name__ == "__main__":
    main()
