"""The ranks' agreement on a drain notice (preemption.DrainWatch), 2 gloo ranks on CPU: Ray Train's watcher
reaches each worker at its own moment, so one rank may know of the drain a step before another; every rank
must checkpoint at the same step (a checkpoint is a collective), with the same deadline to hold until."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as multiprocessing

from fsdp_trainer.preemption import UNKNOWN_DEADLINE_SECONDS, DrainWatch
from tests.support.net import free_port

BOUNDARIES = 6
DEADLINE_MS = 1_900_000_000_000  # an epoch millisecond far ahead


def notice_from(boundary: int, deadline_ms: int) -> list[int | None]:
    """What one rank's Ray Train context holds at each step boundary: nothing, then the notice."""
    return [None if index < boundary else deadline_ms for index in range(BOUNDARIES)]


# What each rank's context holds, per case: rank 1 hears of the drain at the third boundary with its
# deadline, rank 0 two boundaries later and without one (Ray reported none to it yet).
CASES = {
    "staggered": [notice_from(4, 0), notice_from(2, DEADLINE_MS)],
    "no deadline": [notice_from(1, 0), notice_from(1, 0)],
}


def run_rank(rank: int, port: int, output: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for case, readings in CASES.items():
        reads = iter(readings[rank])
        watch = DrainWatch(reads.__next__)
        answers = [watch.noticed() for _ in range(BOUNDARIES)]
        deadline = None if watch.notice is None else watch.notice.deadline
        results[case] = {"answers": answers, "deadline": deadline, "checked_at": time.time()}
    results["torchrun"] = {"answers": [DrainWatch.for_launcher("torchrun").noticed() for _ in range(3)]}
    (output / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_every_rank_takes_the_notice_at_the_same_boundary_with_the_latest_deadline(tmp_path: Path) -> None:
    multiprocessing.spawn(run_rank, args=(free_port(), tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        # The first boundary at which any rank knows, once: the checkpoint is taken at one step.
        assert rank["staggered"]["answers"] == [False, False, True, False, False, False]
        assert rank["staggered"]["deadline"] == DEADLINE_MS / 1000
        assert rank["no deadline"]["answers"] == [False, True, False, False, False, False]
        # Without a deadline the hold ends when Ray Train's controller stops waiting for the node.
        held_until = rank["no deadline"]["deadline"] - rank["no deadline"]["checked_at"]
        assert UNKNOWN_DEADLINE_SECONDS - 5 < held_until <= UNKNOWN_DEADLINE_SECONDS
        assert rank["torchrun"]["answers"] == [False, False, False]
