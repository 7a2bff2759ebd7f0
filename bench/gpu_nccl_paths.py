"""The trainer's NCCL and CUDA paths that only a GPU can exercise (issue 47), in one process on one GPU:

- "loop": our training loop (one process, NCCL), 8 steps logging every 4, under CUDA's sync debug mode:
  the synchronising CUDA calls each step makes (expected: none on steps 1-3 and 5-7 beyond the first step's
  setup; the logging steps 4 and 8 read their values), the process group's collective timeout after the
  first step (distributed.STEP_TIMEOUT), and NCCL's flight recorder read as forensics reads it (entries
  there, all completed).
- "skip": a step whose loss is NaN skipped on the device (fused CUDA AdamW's found_inf): the run finishes,
  one skipped step counted, AdamW's step count and the schedule at the applied steps only.
- "cpu_offload": the loop with fsdp.cpuOffload on a "cpu:gloo,cuda:nccl" group: clipping, the non-finite
  check and the norm run on host-memory gradients (NCCL alone fails them at step 1).

What one GPU cannot show (two or more are needed): HYBRID_SHARD/NO_SHARD replicas equal after init on CUDA
(DTensor's RNG tracker), the fabric check's batched P2P leaving no two-rank communicators, a hang's NCCL
timeout dump (TORCH_NCCL_DUMP_ON_TIMEOUT) and forensics on a rank whose GPU waits in a collective.

    python bench/gpu_nccl_paths.py      # writes $OUT/gpu_nccl_paths.json (or ./gpu_nccl_paths.json)
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "trainer")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from fsdp_trainer import data, distributed, forensics, optim  # noqa: E402
from fsdp_trainer.contract import ProgressRecord, TrainerConfig  # noqa: E402
from fsdp_trainer.launch import LoopInput  # noqa: E402
from fsdp_trainer.loop import train_loop  # noqa: E402
from fsdp_trainer.storage import Location  # noqa: E402

TINY_QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
STEPS, LOG_EVERY = 8, 4


def config(storage: str, **fsdp: Any) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "run_name": "gpu-paths",
            "gpus_per_worker": 1 if torch.cuda.is_available() else 0,  # 0: a smoke run of the script on CPU
            "model": {"from_config": TINY_QWEN2},
            "fsdp": {"mixed_precision": "bf16", **fsdp},
            "training": {
                "max_steps": STEPS,
                "micro_batch_size": 2,
                "grad_accumulation": 2,
                "sequence_length": 128,
                "log_every": LOG_EVERY,
            },
            "data": {"source": "synthetic", "eval_fraction": 0},
            "checkpoint": {"storage_path": storage, "every_steps": 1000, "export_model": False},
            "network": {"bandwidth_probe_mb": 0},
        }
    )


def records(trainer: TrainerConfig) -> list[ProgressRecord]:
    run = Location.parse(trainer.run_uri())
    return [
        ProgressRecord.model_validate_json(line)
        for name in run.child("metrics").list_files()
        for line in run.child("metrics", name).read_text().splitlines()
    ]


def train(trainer: TrainerConfig) -> None:
    train_loop(LoopInput(trainer=trainer, submission_id="gpu-paths").model_dump(mode="json"))


def loop_check(storage: str) -> dict[str, Any]:
    """Synchronising CUDA calls per step (torch.cuda.set_sync_debug_mode's warnings), counted from the first
    step's batch on; the timeout in force after the run; the flight recorder's NCCL entries."""
    per_step: list[list[str]] = []
    next_step = data.BatchLoader.next_step
    timeouts: list[str] = []
    set_timeout = distributed.set_collective_timeout

    def marked(loader: data.BatchLoader) -> Any:
        per_step.append([])
        return next_step(loader)

    def recorded_timeout(timeout: Any, groups: Any) -> None:
        timeouts.append(str(timeout))
        set_timeout(timeout, groups)

    def on_warning(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if per_step and "synchroniz" in str(message).lower():
            per_step[-1].append(f"{filename}:{lineno}: {str(message)[:200]}")

    collectives: list[dict[str, Any]] = []

    def read_recorder_before_stop(runtime: Any) -> None:
        collectives.extend(record.model_dump() for record in forensics.recent_collectives())
        stop(runtime)

    data.BatchLoader.next_step = marked  # type: ignore[method-assign]
    distributed.set_collective_timeout = recorded_timeout
    stop = distributed.stop
    distributed.stop = read_recorder_before_stop
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # every synchronising call, not the first of each site
            warnings.showwarning = on_warning
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
            train(config(storage))
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        data.BatchLoader.next_step = next_step  # type: ignore[method-assign]
        distributed.set_collective_timeout = set_timeout
        distributed.stop = stop
    final = records(config(storage))[-1]
    return {
        "phase": final.phase,
        "loss": final.loss,
        "syncs_per_step": {step: len(calls) for step, calls in enumerate(per_step, start=1)},
        "sync_sites": {step: calls[:8] for step, calls in enumerate(per_step, start=1) if calls},
        "timeouts_set": timeouts,
        "nccl_collectives": [c for c in collectives if str(c["op"]).startswith("nccl:")][-8:],
        "all_completed": all(c["completed"] for c in collectives),
    }


def skip_check(storage: str) -> dict[str, Any]:
    """Step 2's loss made NaN (the embeddings' output): skipped on the device, counted once read."""
    accumulate = optim.accumulate_gradients
    calls = 0

    def poisoned(lm: torch.nn.Module, *args: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls != 2:
            return accumulate(lm, *args)
        hook = lm.get_input_embeddings().register_forward_hook(lambda m, a, out: out * math.nan)
        try:
            return accumulate(lm, *args)
        finally:
            hook.remove()

    optim.accumulate_gradients = poisoned
    try:
        train(config(storage))
    finally:
        optim.accumulate_gradients = accumulate
    final = records(config(storage))[-1]
    return {"phase": final.phase, "non_finite_steps": final.non_finite_steps, "loss": final.loss}


def offload_check(storage: str) -> dict[str, Any]:
    train(config(storage, cpu_offload=True))
    final = records(config(storage, cpu_offload=True))[-1]
    return {"phase": final.phase, "loss": final.loss, "grad_norm": final.grad_norm}


def main() -> None:
    output = Path(os.environ.get("OUT", "."), "gpu_nccl_paths.json")
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    checks: dict[str, Callable[[str], dict[str, Any]]] = {
        "loop": loop_check,
        "skip": skip_check,
        "cpu_offload": offload_check,
    }
    for name, check in checks.items():
        with tempfile.TemporaryDirectory(prefix=f"gpu-paths-{name}-") as storage:
            try:
                results[name] = {"ok": True, **check(storage)}
            except Exception as error:  # recorded; the next check runs
                results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
                results[name]["where"] = traceback.format_exception(error)[-4:]
        output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
