"""Step-time jitter from reading shards: a tiny Qwen2 trains on CPU from the trainer's streamed samples of
a real corpus (examples/data), each shard read with added latency (an S3 GET and a decode of a larger
shard); the step times' p50, p99 and maximum say how much crossing into a new shard costs a step, and the
time each step waited for its samples says the same without the noise of the host's other load. Its peer,
in the same run: the same samples read when a stream reaches its next shard, in the training thread (the
trainer before the background read).

    python bench/trainer_prefetch.py [--output prefetch.json] [--shard-latency 0.2] [--steps 400] [--no-doc]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tests.support.tiny_model import tiny_lm

from fsdp_trainer.contract import DataSpec
from fsdp_trainer.data import BatchLayout, BatchLoader, ShardPacker, StreamedSamples
from fsdp_trainer.formats import Encoder
from fsdp_trainer.model import byte_level_tokenizer
from fsdp_trainer.shards import Shard, list_shards

REPO = Path(__file__).resolve().parents[1]

CORPUS = REPO / "examples" / "data" / "stdlib-docstrings.jsonl"
SEQUENCE_LENGTH = 128
MICRO_BATCH = 4  # one rank, four streams: a stream crosses a shard every ~130 steps, some stream every ~30
WARMUP_STEPS = 10  # the first read of every stream and the allocator's warm-up, not measured


class SlowShardPacker(ShardPacker):
    """Reads a shard after `latency_seconds` of waiting, as on a remote store (the GIL is free meanwhile)."""

    def __init__(self, encoder: Encoder, latency_seconds: float) -> None:
        super().__init__(encoder)
        self.latency_seconds = latency_seconds

    def rows(self, shard: Shard) -> np.ndarray:
        time.sleep(self.latency_seconds)
        return super().rows(shard)


class ReadOnDemand:
    """The peer: an executor whose read runs when its result is asked for, in the asking (training) thread."""

    def submit(self, read: Callable[..., np.ndarray], *args: Any) -> Future[np.ndarray]:
        return _Deferred(read, args)


class _Deferred(Future[np.ndarray]):
    def __init__(self, read: Callable[..., np.ndarray], args: tuple[Any, ...]) -> None:
        super().__init__()
        self._read, self._args = read, args

    def result(self, timeout: float | None = None) -> np.ndarray:
        if not self.done():
            self.set_result(self._read(*self._args))
        return super().result(timeout)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def measure(steps: int, shard_latency: float, prefetch: bool) -> dict[str, Any]:
    torch.set_num_threads(1)  # as on a GPU worker, the training thread leaves the host's other cores free
    lm = tiny_lm(hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    shards = list_shards(str(CORPUS), ["text"], SEQUENCE_LENGTH)
    packer = SlowShardPacker(Encoder(DataSpec(), byte_level_tokenizer(), SEQUENCE_LENGTH), shard_latency)
    samples = StreamedSamples(shards, packer, seed=0, streams=MICRO_BATCH)
    if not prefetch:
        samples._prefetch = ReadOnDemand()  # type: ignore[assignment]
    batches = BatchLoader(samples, BatchLayout(1, MICRO_BATCH, 1), 0, torch.device("cpu"))
    step_seconds, data_seconds = [], []
    for step in range(WARMUP_STEPS + steps):
        started = time.perf_counter()
        waited = 0.0
        micro_batches = batches.next_step()
        while True:
            asked = time.perf_counter()
            batch = next(micro_batches, None)
            waited += time.perf_counter() - asked
            if batch is None:
                break
            lm(input_ids=batch.input_ids, labels=batch.labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP_STEPS:
            step_seconds.append(time.perf_counter() - started)
            data_seconds.append(waited)
    p50 = statistics.median(step_seconds)
    return {
        "prefetch": prefetch,
        "steps": steps,
        "shards": len(shards),
        "shard_latency_seconds": shard_latency,
        "step_p50_seconds": p50,
        "step_p99_seconds": percentile(step_seconds, 0.99),
        "step_max_seconds": max(step_seconds),
        "steps_over_twice_p50": sum(seconds > 2 * p50 for seconds in step_seconds),
        # The share of the step spent waiting for samples: what prefetching removes, and what the host's
        # other load (which moves every step's time) barely touches.
        "data_wait_p50_seconds": statistics.median(data_seconds),
        "data_wait_p99_seconds": percentile(data_seconds, 0.99),
        "data_wait_max_seconds": max(data_seconds),
        "data_wait_total_seconds": sum(data_seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--shard-latency", type=float, default=0.2, help="seconds added to every shard read")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md's table")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from doc_section import publish

    on_demand = measure(args.steps, args.shard_latency, prefetch=False)
    ahead = measure(args.steps, args.shard_latency, prefetch=True)
    rows = [
        (label, key, on_demand[key], ahead[key])
        for label, key in [
            ("step p50 (s)", "step_p50_seconds"),
            ("step p99 (s)", "step_p99_seconds"),
            ("step max (s)", "step_max_seconds"),
            ("steps over 2 x p50", "steps_over_twice_p50"),
            ("wait for samples, p99 (s)", "data_wait_p99_seconds"),
            ("wait for samples, total (s)", "data_wait_total_seconds"),
        ]
    ]
    table = "\n".join(
        [
            f"Shard reads ahead of the stream (`python bench/trainer_prefetch.py`): {args.steps} CPU "
            f"steps of a tiny Qwen2, {on_demand['shards']} shards, {args.shard_latency} s added to every "
            "shard read.",
            "",
            "| | read when reached | read ahead | ratio |",
            "|---|---|---|---|",
            *(
                f"| {label} | {before:.3f} | {after:.3f} | {after / before if before else float('nan'):.2f} |"
                for label, _, before, after in rows
            ),
        ]
    )
    publish("trainer-prefetch", {"read_when_reached": on_demand, "read_ahead": ahead}, table, args.output,
            not args.no_doc)  # fmt: skip


if __name__ == "__main__":
    main()
