"""Baseline A of the trainer benchmarks: a minimal FSDP2 loop with the trainer's own model building,
parallelisation, optimizer and data layout, and nothing else: no Ray, no progress records, no checkpoints,
no evaluation. Whatever our loop costs beyond this is our overhead.

    torchrun --nproc-per-node 2 bench/trainer_baseline.py --config '<TrainerConfig JSON>' --output out.json
    python bench/trainer_baseline.py --config ...      # one process (a GPU, or the CPU)

Steps are timed in windows of `training.logEvery` steps, ending each window with the same host sync our loop
makes when it logs (reading the loss), so both report the same statistic: mean step time per window.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

STARTED = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_trainer import data, distributed, model, optim  # noqa: E402
from fsdp_trainer.contract import TrainerConfig  # noqa: E402
from fsdp_trainer.sharded_model import build_sharded_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run_baseline(
    config: TrainerConfig, runtime: distributed.Runtime, launched_at: float, reset_memory_after: int = 0
) -> dict[str, Any]:
    """Trains `config.training.maxSteps` steps; returns window step times, start-up seconds (rank 0's) and
    the peak device memory of the steps after `reset_memory_after`."""
    training = config.training
    model_config = model.model_config(config.model, runtime.local_rank, dist.barrier)
    sharded = build_sharded_model(config, model_config, runtime, "initialise")
    lm, root = sharded.lm, sharded.root
    optimizer = optim.build_optimizer(lm, training)
    scheduler = optim.build_scheduler(optimizer, training)
    samples = data.SyntheticSamples(int(model_config.vocab_size), training.sequence_length, training.seed)
    layout = data.BatchLayout(runtime.world_size, training.micro_batch_size, training.grad_accumulation)
    position = 0
    windows: list[float] = []
    first_step_done: float | None = None
    window_start = time.perf_counter()
    lm.train()
    for step in range(1, training.max_steps + 1):
        micro_batches = [
            data.MicroBatch.from_samples(
                samples.samples(layout.micro_batch_indices(position, micro_step, runtime.rank)),
                runtime.device,
            )
            for micro_step in range(training.grad_accumulation)
        ]
        # The loop's loss (a token mean over the global batch: parallelize sums the gradients over ranks).
        loss_sum = optim.accumulate_gradients(lm, root, micro_batches, config.fsdp.reduce_every_micro_step)
        optim.clip_gradients(lm.parameters(), training.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        position += layout.samples_per_step
        if step == reset_memory_after and runtime.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(runtime.device)
        if first_step_done is None:
            float(loss_sum)
            first_step_done = time.time()
        if step % training.log_every == 0:
            float(loss_sum)  # the host sync our loop makes when it logs
            now = time.perf_counter()
            windows.append((now - window_start) / training.log_every)
            window_start = now
    tokens_per_step = layout.samples_per_step * training.sequence_length
    return {
        "window_step_seconds": windows,
        "tokens_per_step": tokens_per_step,
        "startup_seconds": (first_step_done or time.time()) - launched_at,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if runtime.device.type == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="TrainerConfig as JSON")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    config = TrainerConfig.model_validate_json(args.config)
    runtime = distributed.start(use_gpu=config.gpus_per_worker > 0)
    launched_at = float(os.environ.get("BENCH_LAUNCHED_AT", STARTED))
    try:
        result = run_baseline(config, runtime, launched_at)
    finally:
        distributed.stop(runtime)
    if runtime.is_main:
        args.output.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
