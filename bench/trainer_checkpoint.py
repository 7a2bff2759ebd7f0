"""Checkpoint cost: how long training is held up per checkpoint and how fast a checkpoint becomes durable, for
the CheckpointSaver's two writers (a thread of the training process, or DCP's checkpoint process) against
the same saver waited for at once, on 2 gloo ranks.

Each save starts after a step, as in the loop; the next step's forward and backward run while the state is
staged, and the saver is waited for before its optimizer step: the seconds `start` took plus that wait are
the seconds training was held up. Three more steps follow while the save is written, and their median time
against steps with no save in flight is what the writing costs the training thread (a writer thread takes
turns with it for the GIL; a writer process does not). Save-to-durable throughput is the
checkpoint's bytes over the seconds from `start` to the manifest. The first save of each writer is reported
apart from the others: it allocates the staging buffers and, for the process writer, starts the process.

    python bench/trainer_checkpoint.py    # in `make bench`: local disk, rewrites docs/benchmarks.md's table
    torchrun --nproc-per-node 2 bench/trainer_checkpoint.py --storage s3://bucket/prefix --output out.json

Under torchrun (bench/trainer_cpu.py runs it so, against S3) it writes only the JSON, and with S3 storage
also times a plain boto3 upload of the same bytes after each save of the kept writer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_trainer import checkpoint, distributed, model, optim, parallelize
from fsdp_trainer.contract import FsdpSpec, ModelSpec, TrainingSpec, Versions
from fsdp_trainer.storage import Location

REPO = Path(__file__).resolve().parents[1]

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
QUIET_STEPS = 6  # steps with no save in flight, the reference step time
STEPS_AFTER_SAVE = 3  # steps right after a save's own step, while it is being written
SECTION = "trainer-checkpoint"


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


def train_step(app: checkpoint.AppState, saver: checkpoint.CheckpointSaver | None = None) -> float:
    """One step, as the loop makes it (a save's staging waited for before the optimizer step); returns the
    seconds that wait took."""
    lm: Any = app.model
    vocab = int(lm.config.vocab_size)
    batch = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    app.model(input_ids=batch.to(device_of(app)), labels=batch.to(device_of(app))).loss.backward()
    staging_wait = saver.wait_for_staging() if saver is not None else 0.0
    app.optimizer.step()
    app.optimizer.zero_grad(set_to_none=True)
    app.train.step += 1
    return staging_wait


def device_of(app: checkpoint.AppState) -> torch.device:
    return next(app.model.parameters()).device


def timed_step(app: checkpoint.AppState) -> float:
    started = time.perf_counter()
    train_step(app)
    if device_of(app).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure_saves(
    app: checkpoint.AppState,
    runtime: distributed.Runtime,
    storage: str,
    writer: checkpoint.Writer,
    asynchronous: bool,
    saves: int,
    compare_with_boto3: bool = False,
) -> dict[str, Any]:
    """Each save's blocked and save-to-durable seconds and the time of the steps made right after it, while
    it is written; with compare_with_boto3, each followed by a plain boto3 upload of the same bytes, so both
    see the same load on a shared machine."""
    mode = f"{writer}-{'async' if asynchronous else 'sync'}"
    identity = checkpoint.SaveIdentity("bench", "bench", "bench", "bench", runtime.world_size, Versions())
    saver = checkpoint.CheckpointSaver(
        Location.parse(storage).child(mode),
        identity,
        runtime.rank,
        1,
        runtime.device,
        writer=writer,
        ranks_per_node=runtime.local_world_size,
    )
    blocked: list[float] = []
    durable: list[float] = []
    plain: list[float] = []
    after_save: list[float] = []
    size = 0
    quiet = [timed_step(app) for _ in range(QUIET_STEPS)]
    for _ in range(saves):
        dist.barrier()
        started = time.perf_counter()
        launched = saver.start(app, checkpoint.checkpoint_name(app.train.step, mode), loss=None)
        if asynchronous:
            blocked.append(launched + train_step(app, saver))
            after_save.extend(timed_step(app) for _ in range(STEPS_AFTER_SAVE))
            result = saver.wait()
        else:  # the same saver waited for at once: training is held up for all of it
            result = saver.wait()
            blocked.append(time.perf_counter() - started)
            train_step(app)
        assert result is not None
        durable.append(distributed.maximum(result.completed_at - started, runtime.device))
        if result.manifest is not None:
            size = sum(result.manifest.files.values())
        size = distributed.broadcast(size)
        if compare_with_boto3:
            plain.append(boto3_upload_seconds(size, runtime, storage))
        dist.barrier()
    saver.close()
    return {
        "writer": writer,
        "blocked_seconds": blocked,
        "durable_seconds": durable,
        "boto3_upload_seconds": plain,
        "bytes": size,
        "quiet_step_seconds": statistics.median(quiet),
        "step_seconds_after_save": statistics.median(after_save) if after_save else None,
    }


def boto3_upload_seconds(total_bytes: int, runtime: distributed.Runtime, storage: str) -> float:
    """Every rank uploads its share of `total_bytes` with boto3's managed upload (default settings), as the
    ranks do with their own shards; the slowest rank's time counts."""
    import boto3

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


def steady(values: list[float]) -> float:
    """The median of the saves after the first (the first allocates buffers and starts the writer)."""
    return statistics.median(values[1:] if len(values) > 1 else values)


def kept_writer(results: dict[str, dict[str, Any]]) -> checkpoint.Writer:
    """The writer that costs training less time per save in steady state (held up, plus the slowdown of the
    steps made while it writes), throughput breaking a near tie."""
    cost = {name: training_cost(result) for name, result in results.items()}
    if abs(cost["thread"] - cost["process"]) <= 0.1 * min(cost.values()):
        durable = {name: steady(result["durable_seconds"]) for name, result in results.items()}
        return "process" if durable["process"] < durable["thread"] else "thread"
    return "process" if cost["process"] < cost["thread"] else "thread"


def training_cost(result: dict[str, Any]) -> float:
    """Seconds of training a save costs in steady state: held up, and the steps after it slowed down."""
    slower = max(0.0, float(result["step_seconds_after_save"]) - float(result["quiet_step_seconds"]))
    return steady(result["blocked_seconds"]) + slower * STEPS_AFTER_SAVE


def run_ranks(args: argparse.Namespace) -> dict[str, Any] | None:
    runtime = distributed.start(use_gpu=False)
    try:
        app = build(runtime)
        train_step(app)
        writers: dict[str, dict[str, Any]] = {}
        for writer in ("thread", "process"):
            writers[writer] = measure_saves(app, runtime, args.storage, writer, True, args.saves)
        kept = distributed.broadcast(kept_writer(writers))  # rank 0's figures decide for every rank
        synchronous = measure_saves(app, runtime, args.storage, kept, False, args.saves)
        if args.storage.startswith("s3://"):  # the kept writer again, each save beside a plain upload
            writers[kept] = measure_saves(app, runtime, args.storage, kept, True, args.saves, True)
    finally:
        distributed.stop(runtime)
    if not runtime.is_main:
        return None
    plain = writers[kept]["boto3_upload_seconds"]
    return {
        "parameters": sum(p.numel() for p in app.model.parameters()),
        "world_size": runtime.world_size,
        "storage": "s3" if args.storage.startswith("s3://") else "local disk",
        "kept_writer": kept,
        "sync": synchronous,
        "async": writers[kept],
        "async_thread": writers["thread"],
        "async_process": writers["process"],
        "boto3_upload_seconds": statistics.median(plain) if plain else None,
    }


def table(results: dict[str, Any]) -> str:
    mb = results["async"]["bytes"] / 1e6
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"Measured {when} on {os.cpu_count()} CPU cores, gloo, {results['world_size']} ranks, "
        f"{results['parameters'] / 1e6:.0f}M parameters ({mb:.0f} MB per checkpoint), {results['storage']} "
        f"(`python bench/trainer_checkpoint.py`, {len(results['sync']['blocked_seconds'])} saves per "
        "writer).",
        "",
        "| writer | training held up: first save / later saves (median) | step time just after a save / "
        "with no save in flight | save to durable (later saves) | throughput |",
        "|---|---|---|---|---|",
    ]
    for label, entry in (
        ("thread, asynchronous", results["async_thread"]),
        ("process, asynchronous", results["async_process"]),
        (f"{results['kept_writer']}, waited for at once (sync)", results["sync"]),
    ):
        blocked, durable = entry["blocked_seconds"], entry["durable_seconds"]
        during, quiet = entry["step_seconds_after_save"], entry["quiet_step_seconds"]
        after = "none (the save is over)" if during is None else f"{during * 1e3:.0f} ms"
        lines.append(
            f"| {label} | {blocked[0]:.3f} s / {steady(blocked):.3f} s "
            f"| {after} / {quiet * 1e3:.0f} ms "
            f"| {steady(durable):.2f} s | {mb / steady(durable):.0f} MB/s |"
        )
    sync_held = steady(results["sync"]["blocked_seconds"])
    async_held = steady(results["async"]["blocked_seconds"])
    lines += [
        "",
        f"Kept: the **{results['kept_writer']}** writer (the default of `CheckpointSaver`). Training held up "
        f"per checkpoint, asynchronous / synchronous: {async_held:.3f} s / {sync_held:.3f} s = "
        f"**{async_held / sync_held:.3f}**.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--storage", default=None, help="s3://bucket/prefix or a local path (default: a temp dir)"
    )
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md's table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "RANK" in os.environ:  # one of the ranks
        results = run_ranks(args)
        if results is not None and args.output:
            args.output.write_text(json.dumps(results))
        return
    launch(args)


def launch(args: argparse.Namespace) -> None:
    """Runs this script on 2 ranks under torchrun, then publishes its results."""
    from doc_section import publish

    workdir = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        output = workdir / "checkpoint.json"
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
            __file__,
            *("--storage", args.storage or str(workdir / "storage"), "--saves", str(args.saves)),
            *("--output", str(output)),
        ]
        subprocess.run(command, check=True)
        results = json.loads(output.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    publish(SECTION, results, table(results), args.output, write_doc=not args.no_doc)


if __name__ == "__main__":
    main()
