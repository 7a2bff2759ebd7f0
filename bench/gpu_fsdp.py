"""GPU benchmark: our per-worker loop against baseline A, one after the other on one GPU, offline.

Baseline A (bench/trainer_baseline.py) is a minimal FSDP2 loop with our parallelisation, optimizer and data
layout and nothing else (no Ray, no progress records, no checkpoints), so the ratio isolates our overhead.
Ours and A run a Qwen2.5-1.5B-shaped model initialised from its config, bf16 compute, synthetic tokens,
sequence 2048, micro-batch 4, `--warmup-steps` steps left out and `--steps` measured, with one host sync per
step on both sides (our loop logs every step here; baseline A reads its loss). Each is run without and with
per-block torch.compile; neither uses CUDA graphs. torchtitan is not run: the GPU machine has none, and its
PyPI release (0.3.0) needs a dozen more packages (datasets, wandb, tensorboard, spmd_types, torchdata, ...)
whose working with that machine's torch (2.11) nothing here can show, while the benchmark has one run there.

Reported per loop: tokens/s/GPU at p10/p50/p90 over the measured steps, MFU against the spec-sheet bf16 peak
(fsdp_trainer.metrics) and against a bf16 matmul peak measured here, peak memory over the measured steps
(counter reset after warm-up), and for our loop the seconds its checkpoint at the last step held training
up (the model, AdamW moments and loop state, 18.5-19.5 GB for this shape, written to local disk only).
"checkpoint_saves" then makes two saves of the same state in a row with CheckpointSaver
(bench/trainer_checkpoint.py's measurement): the first allocates the pinned staging buffers, the second is
the steady state, and both are reported with their save-to-durable seconds.

The JSON summary is written after every step of the benchmark, to $OUT/gpu_fsdp.json when OUT is set and to
--output when given: each entry holds its figures, or why it did not run or failed, or that the run ended
before reaching it. The order puts what matters most first: the compiled loops (the MFU figure), then the
eager ones, then "checkpoint_saves", so a slow disk cannot cut the loops' figures.

--time-budget counts from the process's start, imports included (torch and transformers alone take tens of
seconds on a busy host). Shortly before it, an alarm stops the part then running, which is recorded; at it,
a watchdog thread armed before the imports writes the summary as it stands and ends the process (exit status
3), whatever it is doing, so a cut run never takes longer than its budget. Before each part that saves, the
disk is checked against what the saves write (the model's and AdamW's state of this shape, counted from a
weightless copy): ours saves one checkpoint, "checkpoint_saves" needs room for two at once (the new one is
written before the old is pruned), both within --disk-bound-gb, with the saver's reserve free besides.

    python bench/gpu_fsdp.py                   # one GPU, torch + transformers + pydantic, no Ray, no network
    python bench/gpu_fsdp.py --tiny            # a seconds-long smoke run, CPU is fine

On the GPU machine, which lacks pydantic, bench/gpu-wheels.sh DIR downloads the wheels and prints the line
that installs them and runs this script.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn


def monotonic_at_process_start() -> float:
    """time.monotonic() at this process's start, from the kernel's record of it (Linux's /proc, in clock ticks
    of the boot clock), so the interpreter's own start-up counts too. The boot clock's lead on the monotonic
    one is read between two monotonic reads, the closest pair of a few: a process descheduled between two
    reads on a loaded machine would otherwise date its start too early (seen at 3 test workers on 2 cores)."""
    after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    samples = []
    for _ in range(5):
        before = time.monotonic()
        boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        after = time.monotonic()
        samples.append((after - before, boot - after))  # boot - after: the lead, never over-estimated
    return started - min(samples)[1]


# --time-budget counts from here.
PROCESS_STARTED = monotonic_at_process_start()
HARD_STOP_EXIT = 3  # the watchdog ended the run at its deadline


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
        help="seconds the whole process may take, counted from its start (default 450); what runs then is "
        "stopped and recorded",
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


class Watchdog:
    """Ends the process at `deadline` (time.monotonic()), whatever it is doing then: an import, a CUDA
    synchronisation, a checkpoint's wait. The summary, once there is one, is written as it stands first; the
    part then running keeps "not reached". `exit` is os._exit, `clock` time.monotonic and `sleep` time.sleep
    but in tests."""

    def __init__(
        self,
        deadline: float,
        exit: Callable[[int], object] = os._exit,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.deadline, self.exit, self.clock, self.sleep = deadline, exit, clock, sleep
        self.summary: Summary | None = None
        threading.Thread(target=self._run, name="deadline", daemon=True).start()

    def _run(self) -> None:
        self.sleep(max(self.deadline - self.clock(), 0.0))
        if self.summary is not None:
            self.summary.fields["ended"] = "the time budget: the watchdog ended the process"
            # RuntimeError: the main thread changed the summary while it was dumped. Its last write stands,
            # and the process must end all the same.
            with contextlib.suppress(RuntimeError):
                self.summary.write()
        print("gpu_fsdp: the time budget is spent; ended", file=sys.stderr, flush=True)
        self.exit(HARD_STOP_EXIT)


if __name__ == "__main__":
    # Armed before the imports below, which alone can take a minute on a busy host.
    WATCHDOG = Watchdog(PROCESS_STARTED + parse_args().time_budget)

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path[:0] = [str(BENCH), str(REPO / "trainer")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sysconfig  # noqa: E402
import traceback  # noqa: E402
from types import FrameType  # noqa: E402

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
from fsdp_trainer.transport import allocator_env  # noqa: E402
from trainer_baseline import run_baseline  # noqa: E402
from trainer_checkpoint import measure_saves  # noqa: E402

# The loop's allocator settings (expandable segments), here: CUDA reads them once, when it starts, which the
# matmul peak and the host preflight do before any loop runs (train_loop's own setting would come too late).
os.environ.update(allocator_env())

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
# Left between the alarm that stops a part and the watchdog's deadline, for the stopped part's clean-up (its
# checkpoint directory removed, its process group destroyed) and the last summary: a tenth of the budget, at
# most 15 s.
STOP_MARGIN_SECONDS = 15.0
# DCP writes each tensor as a torch.save record (about 1.6 KB beside its data, measured) with an entry in the
# checkpoint's .metadata (about 0.2 KB): 4 KiB a tensor is counted. Beside the tensors a checkpoint holds the
# RNG states, the scheduler and the loop's position: 64 KiB is counted.
DCP_BYTES_PER_TENSOR = 4 << 10
CHECKPOINT_OTHER_BYTES = 64 << 10


class NotRun(Exception):
    """A part of the benchmark that cannot run here, and why."""


class BudgetSpent(Exception):
    """The --time-budget alarm: whatever was running is stopped and recorded, with the figures it had
    measured when stopped (`figures`, set by the part on its way out)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.figures: dict[str, Any] = {}


def on_alarm(signum: int, frame: FrameType | None) -> NoReturn:
    raise BudgetSpent("stopped: the time budget was spent while it ran")


class Summary:
    """The JSON summary, written out again after every change, so a crash or a kill loses nothing done. Each
    write replaces the file whole, under a lock, so the watchdog's write never interleaves with another."""

    def __init__(self, fields: dict[str, Any], outputs: list[Path]) -> None:
        self.fields, self.outputs = fields, outputs
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            self.fields["wall_seconds"] = time.monotonic() - PROCESS_STARTED
            text = json.dumps(self.fields, indent=2)
            for output in self.outputs:
                partial = output.with_name(output.name + ".partial")
                partial.write_text(text + "\n")
                partial.replace(output)

    def memory_snapshot(self, key: str) -> str | None:
        """The CUDA allocator's history up to an out-of-memory error (torch's memory_viz reads it), next to
        the summary: what held the memory is what the next run needs to know."""
        if not self.outputs or not torch.cuda.is_available():
            return None
        path = self.outputs[-1].with_name(f"oom-{key}.pickle")
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        except Exception as error:  # the failure is what matters; a snapshot is a bonus
            return f"not written: {type(error).__name__}: {error}"
        return str(path)

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
            entry[key] = {"finished": False, "not_run": str(stopped), **stopped.figures}
            raise
        except Exception as error:  # recorded, and the benchmark goes on with the next part
            lines = traceback.format_exception(error)
            entry[key] = {
                "finished": False,
                "failed": f"{type(error).__name__}: {error}",
                "where": lines[-3:],
            }
            if isinstance(error, torch.OutOfMemoryError) and (snapshot := self.memory_snapshot(key)):
                entry[key]["memory_snapshot"] = snapshot
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
    """The bytes one checkpoint of this shape writes, counted on a weightless (meta-device) copy: the tensors
    of the state the trainer saves (checkpoint.AppState: fp32 weights, a tied embedding under both its names,
    AdamW's step and two moments per parameter), each with DCP's record, and the rest of the checkpoint."""
    lm = meta_model(shape)
    training = TrainingSpec(learning_rate=1e-4)
    optimizer = optim.build_optimizer(lm, training)
    scheduler = optim.build_scheduler(optimizer, training)
    # Its state_dict makes AdamW's state (a step of zero gradients), on meta like the weights.
    state = checkpoint.AppState(lm, optimizer, scheduler, checkpoint.TrainState()).state_dict()
    tensors = sum(1 for _ in tensors_in(state))
    return checkpoint.staged_bytes(state) + tensors * DCP_BYTES_PER_TENSOR + CHECKPOINT_OTHER_BYTES


def tensors_in(state: Any) -> Iterator[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors_in(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from tensors_in(value)


def require_disk_for(args: argparse.Namespace, checkpoints: int, per_checkpoint: int) -> None:
    """Refuses a part whose checkpoints would exceed --disk-bound-gb, or leave less free than the saver's
    reserve (the saver refuses such a save itself, but only once the part has spent its time training)."""
    needed = checkpoints * per_checkpoint
    free = shutil.disk_usage(args.checkpoint_dir).free
    bound = int(args.disk_bound_gb * 1e9)
    if needed > bound or needed + checkpoint.DISK_RESERVE_BYTES > free:
        raise NotRun(
            f"not run: {checkpoints} checkpoint(s) at once need {needed / 1e9:.1f} GB in "
            f"{args.checkpoint_dir} (bound {bound / 1e9:.1f} GB, {free / 1e9:.1f} GB free, "
            f"{checkpoint.DISK_RESERVE_BYTES / 1e9:.1f} GB to keep free)"
        )


def our_loop(
    args: argparse.Namespace, compile_blocks: bool, shape: dict[str, Any], per_checkpoint: int
) -> dict[str, Any]:
    require_disk_for(args, 1, per_checkpoint)
    if compile_blocks:
        require_compile_toolchain()
    storage = tempfile.mkdtemp(prefix="bench-fsdp-", dir=args.checkpoint_dir)
    try:
        config = trainer_config(args, storage, compile_blocks)
        started = time.perf_counter()
        try:
            train_loop(LoopInput(trainer=config, submission_id="bench").model_dump(mode="json"))
        except BudgetSpent as stopped:
            # Stopped in the last step's save, say: the steps measured before it are figures all the same
            # (the loop stored its history on the way out).
            measured = measured_records(stored_records(config), args.warmup_steps)
            stopped.figures = {
                "measured_steps": len(measured),
                "tokens_per_second": [r.tokens_per_second_per_device or 0.0 for r in measured],
            }
            raise
        wall = time.perf_counter() - started
        records = stored_records(config)
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


def stored_records(config: TrainerConfig) -> list[ProgressRecord]:
    """The progress records of our loop's run, as its history stored them."""
    run = Location.parse(config.run_uri())
    return [
        ProgressRecord.model_validate_json(line)
        for name in run.child("metrics").list_files()
        for line in run.child("metrics", name).read_text().splitlines()
    ]


def baseline_a(args: argparse.Namespace, compile_blocks: bool) -> dict[str, Any]:
    if compile_blocks:
        require_compile_toolchain()
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


def checkpoint_saves(args: argparse.Namespace, shape: dict[str, Any], per_checkpoint: int) -> dict[str, Any]:
    """Two saves of the model's full training state in a row, as the loop makes them: the first with its
    buffer allocation, the second in steady state."""
    require_disk_for(args, 2, per_checkpoint)
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


def host_preflight(checkpoint_dir: Path) -> dict[str, Any]:
    """What the GPU host offers, found before anything runs: the driver and CUDA torch sees, the C compiler
    and Python headers Triton builds its launchers with on the first compiled step (without them that step
    crashes), and the free disk."""
    compiler = next(
        (
            found
            for name in (os.environ.get("CC"), "cc", "gcc", "clang")
            if name and (found := shutil.which(name))
        ),
        None,
    )
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    driver = None
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or None
    return {
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "nvidia_driver": driver,
        "c_compiler": compiler,
        "python_headers": str(headers) if headers.exists() else None,
        "disk_free_bytes": shutil.disk_usage(checkpoint_dir).free,
    }


def compile_toolchain_missing(found: dict[str, Any]) -> str | None:
    """Why torch.compile cannot run on this host, or None."""
    missing = [
        what
        for what, key in (
            ("a C compiler (cc, gcc or clang; CC)", "c_compiler"),
            ("Python.h", "python_headers"),
        )
        if not found.get(key)
    ]
    if not missing:
        return None
    return f"not run: torch.compile's Triton kernels need {' and '.join(missing)}, which this host lacks"


def require_compile_toolchain() -> None:
    refusal = compile_toolchain_missing(host_preflight(Path(tempfile.gettempdir())))
    if refusal is not None:
        raise NotRun(refusal)


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


def with_figures(
    measure: Callable[[], dict[str, Any]], peaks: tuple[float, float | None, float | None]
) -> dict[str, Any]:
    """A loop's result with its tokens/s turned into percentiles and MFU (FLOPs per token, spec and
    measured peaks)."""
    try:
        measured = dict(measure())
    except BudgetSpent as stopped:
        steps = stopped.figures.pop("tokens_per_second", [])
        if len(steps) >= 2:  # enough for percentiles
            stopped.figures.update(figures(steps, *peaks))
        raise
    return {**figures(measured.pop("tokens_per_second"), *peaks), **measured}


def main(args: argparse.Namespace, watchdog: Watchdog) -> None:
    preflight = host_preflight(args.checkpoint_dir)
    print(f"gpu_fsdp: host preflight {json.dumps(preflight)}", file=sys.stderr, flush=True)
    if torch.cuda.is_available():  # an out-of-memory error then leaves a snapshot (Summary.memory_snapshot)
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = TINY if args.tiny else QWEN25_15B
    # Compiled first: its MFU is the figure that matters most, and an eager loop cut short costs less.
    modes = {"off": [False], "on": [True], "both": [True, False]}[args.compile]
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
            "seconds_from_process_start_to_imports_done": time.monotonic() - PROCESS_STARTED,
            "host_preflight": preflight,
            "compile_refused": compile_toolchain_missing(preflight),
            "checkpoint_dir": str(args.checkpoint_dir),
            "disk_free_bytes_at_start": shutil.disk_usage(args.checkpoint_dir).free,
            "disk_bound_bytes": int(args.disk_bound_gb * 1e9),
            "checkpoint_bytes": checkpoint_bytes(shape),
            "flops_per_token": model_flops_per_token(shape, args.sequence_length),
            "spec_peak_flops": peak_flops(device_name),
            "measured_matmul_peak_flops": None,
            "loops": {
                label: {
                    "ours": {"finished": False, "not_run": NOT_REACHED},
                    "baseline_a": {"finished": False, "not_run": NOT_REACHED},
                }
                for label in labels
            },
            "checkpoint_saves": {"finished": False, "not_run": NOT_REACHED},
        },
        [Path(path) for path in outputs],
    )
    fields = summary.fields
    summary.write()
    watchdog.summary = summary
    signal.signal(signal.SIGALRM, on_alarm)
    margin = min(STOP_MARGIN_SECONDS, args.time_budget / 10)
    # At least a moment: imports that took the whole budget leave the alarm to fire at once (0 would disarm).
    signal.setitimer(signal.ITIMER_REAL, max(watchdog.deadline - margin - watchdog.clock(), 1e-3))
    try:
        run_all(args, summary, device, shape, modes)
    except BudgetSpent:
        fields["ended"] = "the time budget: the part then running was stopped"
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
    """The loops in `modes`' order, ours and baseline A each, then checkpoint_saves: the saves last, so a
    slow disk cannot cut a loop's figures."""
    fields = summary.fields
    fields["measured_matmul_peak_flops"] = matmul_peak = matmul_peak_flops(device)
    peaks = (fields["flops_per_token"], fields["spec_peak_flops"], matmul_peak)
    per_checkpoint = fields["checkpoint_bytes"]
    for compile_blocks in modes:
        loop = fields["loops"]["compiled" if compile_blocks else "eager"]
        ours = functools.partial(our_loop, args, compile_blocks, shape, per_checkpoint)
        baseline = functools.partial(baseline_a, args, compile_blocks)
        # Both run whatever becomes of the other (&, not and).
        if summary.run(loop, "ours", functools.partial(with_figures, ours, peaks)) & summary.run(
            loop, "baseline_a", functools.partial(with_figures, baseline, peaks)
        ):
            loop["ours_over_baseline_a_p50"] = (
                loop["ours"]["tokens_per_second_per_gpu"]["p50"]
                / loop["baseline_a"]["tokens_per_second_per_gpu"]["p50"]
            )
    summary.run(fields, "checkpoint_saves", lambda: checkpoint_saves(args, shape, per_checkpoint))


def model_flops_per_token(from_config: dict[str, Any], sequence_length: int) -> float:
    """As the trainer counts them, from a weightless (meta-device) copy of the model."""
    return flops_per_token(model.model_shape(meta_model(from_config)), sequence_length)


def meta_model(from_config: dict[str, Any]) -> Any:
    spec = ModelSpec(from_config=from_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.model_config(spec, 0, lambda: None))


if __name__ == "__main__":
    main(parse_args(), WATCHDOG)
    sys.stdout.flush()
    # Everything is written by now. The interpreter's own teardown (atexit handlers, the collection of a torch
    # process: 5 s measured on a busy host) would run past the watchdog, which stops with the interpreter.
    os._exit(0)
