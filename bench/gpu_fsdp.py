"""GPU benchmark: our per-worker loop against baselines A and B, one after another on one GPU, offline.

Baseline A (bench/trainer_baseline.py) is a minimal FSDP2 loop with our parallelisation, optimizer and data
layout and nothing else (no Ray, no progress records, no checkpoints), so the ratio isolates our overhead.
Ours and A run a Qwen2.5-1.5B-shaped model initialised from its config, bf16 compute, synthetic tokens,
sequence 2048, micro-batch 4, `--warmup-steps` steps left out and `--steps` measured, with one host sync per
step on both sides (our loop logs every step here; baseline A reads its loss). Each is run without and with
per-block torch.compile; neither uses CUDA graphs.

Reported per loop: tokens/s/GPU at p10/p50/p90 over the measured steps, MFU against the spec-sheet bf16 peak
(fsdp_trainer.metrics) and against a bf16 matmul peak measured here, peak memory over the measured steps
(counter reset after warm-up), and for our loop the seconds its checkpoint at the last step held training
up (the model, AdamW moments and loop state, ~18.5 GB for this shape, written to local disk only).
"checkpoint_saves" then makes two saves of the same state in a row with CheckpointSaver
(bench/trainer_checkpoint.py's measurement): the first allocates the pinned staging buffers, the second is
the steady state, and both are reported with their save-to-durable seconds.

Baseline B is torchtitan's own trainer (PyPI torchtitan, 0.3.0) with the same sizes and settings, CUDA graphs
off (bench/trainer_torchtitan.py says what differs: it has no Qwen2, so its Qwen3 stands in). It runs after
the others, as a subprocess (torchrun -m torchtitan.train with our config module), and its figures come from
its log lines: tokens/s per GPU, its own MFU, and its peak *reserved* memory (ours and A's are peak
allocated). It runs only where torchtitan imports and a CUDA device is present, and only within
--time-budget; otherwise the summary records it as not run, with the reason. Its logs go to
$OUT/baseline_b_<eager|compiled>.log. The JSON says which settings each side ran with.

The JSON summary is written after every step of the benchmark, to $OUT/gpu_fsdp.json when OUT is set and to
--output when given: each entry holds its figures, or why it did not run or failed, or that the run ended
before reaching it. The whole run stops at --time-budget (an alarm ends what is running, which is recorded).
Before each checkpoint the disk is checked: ours saves one checkpoint, "checkpoint_saves" needs room for two
at once (the new one is written before the old is pruned), both within --disk-bound-gb.

    python bench/gpu_fsdp.py                   # one GPU, torch + transformers + pydantic, no Ray, no network
    python bench/gpu_fsdp.py --tiny            # a seconds-long smoke run, CPU is fine

On the GPU machine, which lacks pydantic, bench/gpu-wheels.sh DIR downloads the wheels and prints the line
that installs them and runs this script.
"""

from __future__ import annotations

import argparse
import functools
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
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path[:0] = [str(BENCH), str(REPO / "trainer")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_trainer import checkpoint, distributed, model, optim, parallelize  # noqa: E402
from fsdp_trainer.contract import (  # noqa: E402
    FsdpSpec,
    ModelSpec,
    Precision,
    ProgressRecord,
    TrainerConfig,
    TrainingSpec,
)
from fsdp_trainer.launch import LoopInput  # noqa: E402
from fsdp_trainer.loop import train_loop  # noqa: E402
from fsdp_trainer.metrics import flops_per_token, peak_flops  # noqa: E402
from fsdp_trainer.model import AutoModelForCausalLM  # noqa: E402
from fsdp_trainer.storage import Location  # noqa: E402
from trainer_baseline import run_baseline  # noqa: E402
from trainer_checkpoint import measure_saves  # noqa: E402

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
NOT_REACHED = "not reached: the run ended before it (a crash or the time limit); what came before is complete"
# fp32 weights and AdamW's two fp32 moments: 12 bytes a parameter, the bulk of a checkpoint.
CHECKPOINT_BYTES_PER_PARAMETER = 12


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
        default=None,
        help="per-block torch.compile (default both; off with --tiny)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short sequences: a smoke run")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=450.0,
        help="seconds the whole benchmark may take; what runs then is stopped and recorded (default 450)",
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=Path(tempfile.gettempdir()), help="local disk for checkpoints"
    )
    parser.add_argument(
        "--disk-bound-gb",
        type=float,
        default=40.0,
        help="the most the benchmark's checkpoints may take on that disk at once (default 40)",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON summary here")
    args = parser.parse_args()
    if args.tiny:
        args.sequence_length, args.micro_batch_size = 64, 2
        args.steps, args.warmup_steps = min(args.steps, 6), min(args.warmup_steps, 2)
    args.compile = args.compile or ("off" if args.tiny else "both")
    return args


class NotRun(Exception):
    """A part of the benchmark that cannot run here, and why."""


class BudgetSpent(Exception):
    """The --time-budget alarm: whatever was running is stopped and recorded."""


def on_alarm(signum: int, frame: FrameType | None) -> None:
    raise BudgetSpent("stopped: the time budget was spent while it ran")


class Summary:
    """The JSON summary, written out again after every change, so a crash or a kill loses nothing done."""

    def __init__(self, fields: dict[str, Any], outputs: list[Path]) -> None:
        self.fields, self.outputs, self.started = fields, outputs, time.monotonic()

    def write(self) -> None:
        self.fields["wall_seconds"] = time.monotonic() - self.started
        text = json.dumps(self.fields, indent=2)
        for output in self.outputs:
            output.write_text(text + "\n")

    def run(self, entry: dict[str, Any], key: str, work: Callable[[], dict[str, Any]]) -> bool:
        """Runs one part of the benchmark into entry[key]: its figures, or {"failed": why}; True when it
        finished. The summary is written whatever happens."""
        try:
            entry[key] = {"finished": True, **work()}
            return True
        except NotRun as refused:
            entry[key] = {"finished": False, "not_run": str(refused)}
            return False
        except BudgetSpent as stopped:
            entry[key] = {"finished": False, "not_run": str(stopped)}
            raise
        except Exception as error:  # recorded, and the benchmark goes on with the next part
            lines = traceback.format_exception(error)
            entry[key] = {
                "finished": False,
                "failed": f"{type(error).__name__}: {error}",
                "where": lines[-3:],
            }
            return False
        finally:
            release_memory()
            self.write()


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


def side_settings(config: TrainerConfig, runner: str) -> dict[str, Any]:
    """What one side ran with, for the JSON."""
    fsdp, training = config.fsdp, config.training
    return {
        "runner": runner,
        "compile": "per decoder layer, fullgraph" if fsdp.compile else "off",
        "cuda_graphs": False,
        "attention": "SDPA (transformers' Qwen2)",
        "activation_checkpointing": fsdp.activation_checkpointing,
        "mixed_precision": "bf16 parameters, fp32 gradient reduction, fp32 master weights",
        "optimizer": "AdamW (fused on CUDA), betas 0.9/0.95, clipping at 1.0",
        "micro_batch_size": training.micro_batch_size,
        "grad_accumulation": training.grad_accumulation,
        "sequence_length": training.sequence_length,
    }


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


def measured_records(records: list[ProgressRecord], warmup: int) -> list[ProgressRecord]:
    """The training records of the measured steps, one per step (the first record of a step counts)."""
    steps: dict[int, ProgressRecord] = {}
    for record in records:
        if record.phase == "training" and record.step > warmup and record.tokens_per_second:
            steps.setdefault(record.step, record)
    return [steps[step] for step in sorted(steps)]


def checkpoint_bytes(shape: dict[str, Any]) -> int:
    return parameter_count(shape) * CHECKPOINT_BYTES_PER_PARAMETER


def require_disk_for(args: argparse.Namespace, checkpoints: int, shape: dict[str, Any]) -> None:
    """Refuses a part whose checkpoints would exceed --disk-bound-gb or the disk's free space."""
    needed = checkpoints * checkpoint_bytes(shape)
    free = shutil.disk_usage(args.checkpoint_dir).free
    bound = int(args.disk_bound_gb * 1e9)
    if needed > bound or needed + checkpoint.DISK_RESERVE_BYTES > free:
        raise NotRun(
            f"not run: {checkpoints} checkpoint(s) at once need {needed / 1e9:.1f} GB in "
            f"{args.checkpoint_dir} (bound {bound / 1e9:.1f} GB, {free / 1e9:.1f} GB free)"
        )


def our_loop(args: argparse.Namespace, compile_blocks: bool, shape: dict[str, Any]) -> dict[str, Any]:
    require_disk_for(args, 1, shape)
    storage = tempfile.mkdtemp(prefix="bench-fsdp-", dir=args.checkpoint_dir)
    try:
        config = trainer_config(args, storage, compile_blocks)
        started = time.perf_counter()
        train_loop(LoopInput(trainer=config, submission_id="bench").model_dump(mode="json"))
        wall = time.perf_counter() - started
        run = Location.parse(config.run_uri())
        records = [
            ProgressRecord.model_validate_json(line)
            for name in run.child("metrics").list_files()
            for line in run.child("metrics", name).read_text().splitlines()
        ]
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    measured = measured_records(records, args.warmup_steps)
    blocked = [r.checkpoint_blocked_seconds for r in records if r.checkpoint_blocked_seconds is not None]
    return {
        "settings": side_settings(config, "fsdp_trainer.loop.train_loop, one process, local checkpoint"),
        "tokens_per_second": [r.tokens_per_second_per_device or 0.0 for r in measured],
        "measured_steps": len(measured),
        "peak_memory_bytes": max(r.peak_memory_bytes or 0 for r in measured),
        "checkpoint_blocked_seconds_last_step": blocked[-1] if blocked else None,
        "wall_seconds_including_setup_and_checkpoint": wall,
    }


def baseline_a(args: argparse.Namespace, compile_blocks: bool) -> dict[str, Any]:
    config = trainer_config(args, str(args.checkpoint_dir), compile_blocks)
    runtime = distributed.start(use_gpu=config.gpus_per_worker > 0)
    try:
        result = run_baseline(config, runtime, time.time(), reset_memory_after=args.warmup_steps)
    finally:
        distributed.stop(runtime)
    step_seconds = result["window_step_seconds"][args.warmup_steps :]
    return {
        "settings": side_settings(config, "bench/trainer_baseline.py run_baseline, one process"),
        "tokens_per_second": [result["tokens_per_step"] / seconds for seconds in step_seconds],
        "peak_memory_bytes": result["peak_memory_bytes"],
    }


def checkpoint_saves(args: argparse.Namespace, shape: dict[str, Any]) -> dict[str, Any]:
    """Two saves of the model's full training state in a row, as the loop makes them: the first with its
    buffer allocation, the second in steady state."""
    require_disk_for(args, 2, shape)
    storage = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.checkpoint_dir)
    runtime = distributed.start(use_gpu=torch.cuda.is_available())
    try:
        app = training_state(shape, runtime)
        result = measure_saves(app, runtime, storage, checkpoint.DEFAULT_WRITER, True, saves=2)
    finally:
        distributed.stop(runtime)
        shutil.rmtree(storage, ignore_errors=True)
    blocked, durable = result["blocked_seconds"], result["durable_seconds"]
    return {
        "writer": result["writer"],
        "bytes": result["bytes"],
        "blocked_seconds_first": blocked[0],
        "blocked_seconds_second": blocked[1],
        "durable_seconds_first": durable[0],
        "durable_seconds_second": durable[1],
        "durable_bytes_per_second_second": result["bytes"] / durable[1],
        "step_seconds_after_save": result["step_seconds_after_save"],
        "quiet_step_seconds": result["quiet_step_seconds"],
    }


def training_state(shape: dict[str, Any], runtime: distributed.Runtime) -> checkpoint.AppState:
    """The loop's state for this shape (bf16 compute, fp32 weights, AdamW), sharded on `runtime`."""
    spec = ModelSpec(from_config=shape)
    lm = model.empty_model(model.model_config(spec, runtime.local_rank, dist.barrier))
    device_type = runtime.device.type
    mesh = parallelize.build_mesh(parallelize.MeshShape(1, runtime.world_size), device_type)
    fsdp = FsdpSpec(mixed_precision=Precision.BF16)
    parallelize.parallelize(lm, fsdp, mesh, parallelize.compute_dtype(Precision.BF16, device_type))
    model.materialise(lm, runtime.device, "initialise", spec, 0, runtime.rank, 0, dist.barrier)
    training = TrainingSpec(learning_rate=1e-4)
    optimizer = optim.build_optimizer(lm, training)
    return checkpoint.AppState(
        lm, optimizer, optim.build_scheduler(optimizer, training), checkpoint.TrainState()
    )


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
        "cuda_graphs": False,  # like ours and baseline A: eager against eager, compiled against compiled
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
            except BaseException:  # the budget's alarm, or an interrupt: the tree goes too
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                raise
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
    return {
        **figures_b,
        "settings": {
            "runner": "torchtitan.train (torchrun, one process), bench/trainer_torchtitan.py's config",
            "compile": "per block (torchtitan's CompileConfig, components=model)"
            if compile_blocks
            else "off",
            "cuda_graphs": False,
            "attention": "FlexAttention, causal (torchtitan's Qwen3)",
            "activation_checkpointing": "none",
            "mixed_precision": "bf16 parameters, fp32 gradient reduction, fp32 master weights",
            "optimizer": "AdamW (torchtitan's default_adamw), no weight decay, clipping at 1.0",
            "micro_batch_size": args.micro_batch_size,
            "sequence_length": args.sequence_length,
        },
        "wall_seconds_including_setup": time.perf_counter() - started,
    }


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
        return {"baseline_b": {"finished": False, **result}}
    measured = dict(result)
    spread = figures(measured.pop("tokens_per_second"), flops, spec_peak, matmul_peak)
    entry: dict[str, Any] = {"baseline_b": {"finished": True, **spread, **measured}}
    if "tokens_per_second_per_gpu" in ours:
        entry["ours_over_baseline_b_p50"] = (
            ours["tokens_per_second_per_gpu"]["p50"] / spread["tokens_per_second_per_gpu"]["p50"]
        )
    return entry


def with_figures(
    measure: Callable[[], dict[str, Any]], peaks: tuple[float, float | None, float | None]
) -> dict[str, Any]:
    """A loop's result with its tokens/s turned into percentiles and MFU (FLOPs per token, spec and
    measured peaks)."""
    measured = dict(measure())
    return {**figures(measured.pop("tokens_per_second"), *peaks), **measured}


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = TINY if args.tiny else QWEN25_15B
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    labels = ["compiled" if compile_blocks else "eager" for compile_blocks in modes]
    outputs = [
        path
        for path in (args.output, os.environ.get("OUT") and Path(os.environ["OUT"], "gpu_fsdp.json"))
        if path
    ]
    summary = Summary(
        {
            "device": device_name,
            "torch": torch.__version__,
            "model": "tiny qwen2" if args.tiny else "Qwen2.5-1.5B shape (random init)",
            "sequence_length": args.sequence_length,
            "micro_batch_size": args.micro_batch_size,
            "warmup_steps": args.warmup_steps,
            "measured_steps": args.steps,
            "time_budget_seconds": args.time_budget,
            "checkpoint_dir": str(args.checkpoint_dir),
            "disk_free_bytes_at_start": shutil.disk_usage(args.checkpoint_dir).free,
            "disk_bound_bytes": int(args.disk_bound_gb * 1e9),
            "flops_per_token": model_flops_per_token(shape, args.sequence_length),
            "spec_peak_flops": peak_flops(device_name),
            "measured_matmul_peak_flops": None,
            "loops": {
                label: {
                    "ours": {"finished": False, "not_run": NOT_REACHED},
                    "baseline_a": {"finished": False, "not_run": NOT_REACHED},
                    "baseline_b": {"finished": False, "not_run": NOT_REACHED},
                }
                for label in labels
            },
            "checkpoint_saves": {"finished": False, "not_run": NOT_REACHED},
            "baseline_b_torchtitan": {
                "model": "torchtitan's Qwen3 of the same sizes (it has no Qwen2; see trainer_torchtitan.py)",
                "launch": " ".join(["python", *BASELINE_B_COMMAND]),
                "memory": "peak reserved (torchtitan's figure), not peak allocated as for ours and A",
            },
        },
        [Path(path) for path in outputs],
    )
    fields = summary.fields
    summary.write()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, args.time_budget)
    try:
        run_all(args, summary, device, shape, modes)
    except BudgetSpent:
        pass  # recorded in the part it stopped; the parts after it stay "not reached"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        summary.write()
    print(json.dumps(fields, indent=2))


def run_all(
    args: argparse.Namespace,
    summary: Summary,
    device: torch.device,
    shape: dict[str, Any],
    modes: list[bool],
) -> None:
    fields = summary.fields
    fields["measured_matmul_peak_flops"] = matmul_peak = matmul_peak_flops(device)
    flops, spec_peak = fields["flops_per_token"], fields["spec_peak_flops"]
    for compile_blocks in modes:
        loop = fields["loops"]["compiled" if compile_blocks else "eager"]
        peaks = (flops, spec_peak, matmul_peak)
        ours = functools.partial(
            with_figures, functools.partial(our_loop, args, compile_blocks, shape), peaks
        )
        baseline = functools.partial(with_figures, functools.partial(baseline_a, args, compile_blocks), peaks)
        # Both run whatever becomes of the other (&, not and).
        if summary.run(loop, "ours", ours) & summary.run(loop, "baseline_a", baseline):
            loop["ours_over_baseline_a_p50"] = (
                loop["ours"]["tokens_per_second_per_gpu"]["p50"]
                / loop["baseline_a"]["tokens_per_second_per_gpu"]["p50"]
            )
        if compile_blocks == modes[0]:  # once, after the first loop
            summary.run(fields, "checkpoint_saves", lambda: checkpoint_saves(args, shape))
    # Baseline B after the others: ours and A have their figures whatever happens to it.
    unavailable, torchtitan_version = baseline_b_unavailable(device)
    fields["baseline_b_torchtitan"]["torchtitan"] = torchtitan_version
    logs = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="bench-torchtitan-logs-"))
    for compile_blocks in modes:
        label = "compiled" if compile_blocks else "eager"
        loop = fields["loops"][label]
        if unavailable is not None:
            result: dict[str, Any] = {"not_run": unavailable}
        else:
            left = args.time_budget - (time.monotonic() - summary.started) - BASELINE_B_MARGIN_SECONDS
            result = baseline_b(args, shape, compile_blocks, left, logs / f"baseline_b_{label}.log")
        loop.update(baseline_b_entry(result, loop["ours"], flops, spec_peak, matmul_peak))
        summary.write()


def model_flops_per_token(from_config: dict[str, Any], sequence_length: int) -> float:
    """As the trainer counts them, from a weightless (meta-device) copy of the model."""
    return flops_per_token(model.model_shape(meta_model(from_config)), sequence_length)


def parameter_count(from_config: dict[str, Any]) -> int:
    return sum(p.numel() for p in meta_model(from_config).parameters())


def meta_model(from_config: dict[str, Any]) -> Any:
    spec = ModelSpec(from_config=from_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.model_config(spec, 0, lambda: None))


if __name__ == "__main__":
    main()
