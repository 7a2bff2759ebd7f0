"""Checkpoint cost, run under torchrun by bench/trainer_cpu.py: how long training is blocked per checkpoint
with the asynchronous saver against the synchronous one (the same CheckpointSaver, waited for at once),
and how fast a checkpoint becomes durable (manifest written) against a plain boto3 upload of the same
number of bytes from the same ranks to the same S3.

    torchrun --nproc-per-node 2 bench/trainer_checkpoint.py --storage s3://bucket/prefix --output out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer"))

import boto3  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_trainer import checkpoint, distributed, model, optim, parallelize  # noqa: E402
from fsdp_trainer.contract import FsdpSpec, ModelSpec, TrainingSpec, Versions  # noqa: E402
from fsdp_trainer.storage import Location  # noqa: E402

# About 30M parameters: a 360 MB checkpoint with the AdamW moments, big enough that writing it dominates.
MODEL: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def build(runtime: distributed.Runtime) -> checkpoint.AppState:
    spec = ModelSpec(from_config=MODEL)
    config = model.model_config(spec, runtime.local_rank, dist.barrier)
    lm = model.empty_model(config)
    mesh = parallelize.build_mesh(parallelize.MeshShape(1, runtime.world_size), runtime.device.type)
    parallelize.parallelize(lm, FsdpSpec(), mesh, torch.float32)
    model.materialise(
        lm, runtime.device, "initialise", spec, 0, runtime.rank, runtime.local_rank, dist.barrier
    )
    training = TrainingSpec(learning_rate=1e-4)
    optimizer = optim.build_optimizer(lm, training)
    return checkpoint.AppState(
        lm, optimizer, optim.build_scheduler(optimizer, training), checkpoint.TrainState()
    )


def train_step(app: checkpoint.AppState) -> None:
    batch = torch.randint(0, MODEL["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    app.model(input_ids=batch, labels=batch).loss.backward()
    app.optimizer.step()
    app.optimizer.zero_grad(set_to_none=True)
    app.train.step += 1


def measure_saves(
    app: checkpoint.AppState,
    runtime: distributed.Runtime,
    storage: str,
    asynchronous: bool,
    saves: int,
    compare_with_boto3: bool = False,
) -> dict[str, Any]:
    """Each save's blocked and save-to-durable seconds; with compare_with_boto3, each followed by a plain
    boto3 upload of the same bytes, so both see the same load on a shared machine."""
    mode = "async" if asynchronous else "sync"
    identity = checkpoint.SaveIdentity("bench", "bench", "bench", "bench", runtime.world_size, Versions())
    saver = checkpoint.CheckpointSaver(
        Location.parse(storage).child(mode), identity, runtime.rank, saves, runtime.device, asynchronous
    )
    blocked, durable, plain, size = [], [], [], 0
    for _ in range(saves):
        train_step(app)
        dist.barrier()
        started = time.perf_counter()
        blocked.append(saver.start(app, checkpoint.checkpoint_name(app.train.step, mode), loss=None))
        result = saver.wait()
        durable.append(time.perf_counter() - started)
        if result is not None and result.manifest is not None:
            size = sum(result.manifest.files.values())
        size = distributed.broadcast(size)
        if compare_with_boto3:
            plain.append(boto3_upload_seconds(size, runtime, storage))
        dist.barrier()
    saver.close()
    return {
        "blocked_seconds": blocked,
        "durable_seconds": durable,
        "boto3_upload_seconds": plain,
        "bytes": size,
    }


def boto3_upload_seconds(total_bytes: int, runtime: distributed.Runtime, storage: str) -> float:
    """Every rank uploads its share of `total_bytes` with boto3's managed upload (default settings), as the
    ranks do with their own shards; the slowest rank's time counts."""
    bucket, _, prefix = storage.removeprefix("s3://").partition("/")
    share = total_bytes // runtime.world_size
    with tempfile.NamedTemporaryFile(prefix="bench-upload-") as local:
        local.write(os.urandom(share))
        local.flush()
        client = boto3.client("s3")
        dist.barrier()
        started = time.perf_counter()
        client.upload_file(local.name, bucket, f"{prefix}/boto3/rank{runtime.rank}")
        seconds = time.perf_counter() - started
    return distributed.maximum(seconds, runtime.device)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--storage", required=True, help="s3://bucket/prefix")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime = distributed.start(use_gpu=False)
    try:
        app = build(runtime)
        train_step(app)
        synchronous = measure_saves(app, runtime, args.storage, False, args.saves)
        asynchronous = measure_saves(app, runtime, args.storage, True, args.saves, compare_with_boto3=True)
    finally:
        distributed.stop(runtime)
    if runtime.is_main:
        result = {
            "parameters": sum(p.numel() for p in app.model.parameters()),
            "sync": synchronous,
            "async": asynchronous,
            "boto3_upload_seconds": statistics.median(asynchronous["boto3_upload_seconds"]),
        }
        args.output.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
