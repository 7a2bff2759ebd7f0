"""GPU benchmark: our FSDP2 per-worker loop against a plain eager loop on the same model, in one run.

Runs without Ray (the loop's single-process / torchrun path): a Qwen2.5-1.5B-shaped model initialised from
its config, bf16 compute, synthetic tokens, sequence 2048. Prints tokens/s, MFU and peak memory of both and
their ratio as one JSON document (also written to --output).

    python bench/gpu_fsdp.py                          # one GPU
    torchrun --nproc-per-node 8 bench/gpu_fsdp.py     # FSDP over 8 GPUs (the eager baseline runs on rank 0)
    python bench/gpu_fsdp.py --tiny                   # a seconds-long smoke run, CPU is fine

MFU here uses the spec-sheet bf16 peak (fsdp_trainer.metrics.PEAK_BF16_FLOPS), like the trainer's records.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer"))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from fsdp_trainer.contract import ProgressRecord, TrainerConfig, TrainingSpec  # noqa: E402
from fsdp_trainer.loop import LoopInput, train_loop  # noqa: E402
from fsdp_trainer.metrics import flops_per_token, model_flops_utilisation, peak_flops  # noqa: E402
from fsdp_trainer.model import model_shape  # noqa: E402
from fsdp_trainer.optim import build_optimizer  # noqa: E402
from fsdp_trainer.storage import Location  # noqa: E402

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
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per loop (default 30)")
    parser.add_argument(
        "--warmup-steps", type=int, default=5, help="steps left out of the averages (default 5)"
    )
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--activation-checkpointing", choices=["none", "full", "selective"], default="none")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (FSDP loop)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short sequences: a smoke run")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON summary here")
    args = parser.parse_args()
    if args.tiny:
        args.sequence_length, args.micro_batch_size = 64, 2
        args.steps, args.warmup_steps = min(args.steps, 6), min(args.warmup_steps, 2)
    return args


def fsdp_loop(args: argparse.Namespace, model_config: dict[str, Any], storage: str) -> dict[str, Any]:
    """Our per-worker loop as the trainer runs it, reading its figures back from its own progress history."""
    config = TrainerConfig.model_validate(
        {
            "run_name": "bench",
            "gpus_per_worker": 1 if torch.cuda.is_available() else 0,
            "model": {"from_config": model_config},
            "fsdp": {"activation_checkpointing": args.activation_checkpointing, "compile": args.compile},
            "training": {
                "max_steps": args.steps,
                "micro_batch_size": args.micro_batch_size,
                "sequence_length": args.sequence_length,
                "learning_rate": 1e-4,
                "log_every": 1,
            },
            "data": {"source": "synthetic", "eval_fraction": 0},
            "checkpoint": {"storage_path": storage, "every_steps": args.steps, "export_model": False},
            "network": {"bandwidth_probe_mb": 256 if torch.cuda.is_available() else 1},
        }
    )
    started = time.perf_counter()
    train_loop(LoopInput(trainer=config, submission_id="bench").model_dump(mode="json"))
    wall = time.perf_counter() - started
    if int(os.environ.get("RANK", "0")) != 0:
        return {}  # rank 0 wrote the records
    run = Location.parse(storage).child("bench")
    history = [
        ProgressRecord.model_validate_json(line)
        for path in run.child("metrics").list_files()
        for line in run.child("metrics", path).read_text().splitlines()
    ]
    steady = [
        r for r in history if r.phase == "training" and r.step > args.warmup_steps and r.tokens_per_second
    ]
    final = history[-1]
    return {
        "tokens_per_second": statistics.median(r.tokens_per_second or 0.0 for r in steady),
        "tokens_per_second_per_device": statistics.median(
            r.tokens_per_second_per_device or 0.0 for r in steady
        ),
        "mfu": statistics.median(r.mfu for r in steady) if all(r.mfu is not None for r in steady) else None,
        "step_time_seconds": statistics.median(r.step_time_seconds or 0.0 for r in steady),
        "peak_memory_bytes": max(r.peak_memory_bytes or 0 for r in steady),
        "final_loss": final.loss,
        "bus_bandwidth_gbps": final.transport.bus_bandwidth_gbps if final.transport else None,
        "transport": final.transport.observed if final.transport else None,
        "wall_seconds_including_setup": wall,
    }


def eager_loop(args: argparse.Namespace, model_config: dict[str, Any]) -> dict[str, Any]:
    """The same model and optimizer without FSDP: fp32 weights, bf16 autocast, one device."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    settings = dict(model_config)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model.config.use_cache = False
    optimizer = build_optimizer(model, TrainingSpec(learning_rate=1e-4))
    tokens = args.micro_batch_size * args.sequence_length
    generator = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        batch = torch.randint(
            0, config.vocab_size, (args.micro_batch_size, args.sequence_length), generator=generator
        )
        batch = batch.to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())  # waits for the device
        times.append(time.perf_counter() - start)
    step_time = statistics.median(times[args.warmup_steps :])
    per_second = tokens / step_time
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    flops = flops_per_token(model_shape(model), args.sequence_length)
    return {
        "tokens_per_second": per_second,
        "mfu": model_flops_utilisation(per_second, flops, peak),
        "step_time_seconds": step_time,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "final_loss": float(loss.detach()),
    }


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_config = TINY if args.tiny else QWEN25_15B
    # One directory for all ranks of this launch (the loop's storage path, shared as S3 would be).
    launch = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    storage = os.path.join(tempfile.gettempdir(), f"bench-fsdp-{launch}")
    fsdp = fsdp_loop(args, model_config, storage)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    shutil.rmtree(storage, ignore_errors=True)
    gc.collect()  # the FSDP model and optimizer are garbage now: free their memory for the baseline
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    eager = eager_loop(args, model_config)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    summary = {
        "device": device,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "torch": torch.__version__,
        "model": "tiny qwen2" if args.tiny else "Qwen2.5-1.5B shape (random init)",
        "sequence_length": args.sequence_length,
        "micro_batch_size": args.micro_batch_size,
        "steps": args.steps,
        "fsdp2_loop": fsdp,
        "eager_baseline": eager,
        "fsdp_over_eager_tokens_per_second_per_device": fsdp["tokens_per_second_per_device"]
        / eager["tokens_per_second"],
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
