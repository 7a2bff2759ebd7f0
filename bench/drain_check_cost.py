"""What asking for Ray's drain notice at every step boundary costs, in a Ray Train run of 2 CPU workers.

Compares the trainer's check (preemption.DrainWatch.noticed: the worker's own context read, then one
all-reduce of two integers on a gloo group) with Ray's public `ray.train.get_preemption_info()` (a round
trip through Ray Train's synchronisation actor for every rank, every call). Prints each one's median and
99th percentile per call in milliseconds, from rank 0.

    PYTHONPATH=trainer:. ~/.cache/fsdp-operator/dlc-venv/bin/python bench/drain_check_cost.py [--calls 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(call: Callable[[], object], calls: int) -> dict[str, float]:
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    seconds.sort()
    return {
        "median_ms": statistics.median(seconds) * 1000,
        "p99_ms": seconds[int(len(seconds) * 0.99) - 1] * 1000,
    }


def worker(config: dict[str, Any]) -> None:
    import ray.train

    from fsdp_trainer.preemption import DrainWatch

    watch = DrainWatch.for_launcher("ray")
    calls = int(config["calls"])
    results = {
        "DrainWatch.noticed": timed(watch.noticed, calls),
        "ray.train.get_preemption_info": timed(ray.train.get_preemption_info, calls),
    }
    if ray.train.get_context().get_world_rank() == 0:
        print(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        TorchTrainer(
            worker,
            train_loop_config={"calls": args.calls},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
        ).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
