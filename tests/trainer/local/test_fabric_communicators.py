"""The fabric check leaves no communicator behind (issue 47 item 6).

On NCCL, a lone isend/irecv (or send/recv) runs on a two-rank communicator that ProcessGroupNCCL creates
for that pair on first use and keeps for the rest of the run; a transfer inside batch_isend_irecv runs on
the group's own communicator (see the citation in trainer/fsdp_trainer/fabric.py's `_transfer`). Gloo has
no communicators to count, so this test runs the real fabric check on three gloo ranks (three pods) and
records, through wrappers that call torch.distributed's own functions, how every transfer was issued:
  - the point-to-point entry points (isend, irecv, send, recv) and whether each ran inside a
    batch_isend_irecv;
  - every send and recv that reached a process group (ProcessGroup.send / recv, whatever called them) and
    the group it ran on;
  - new_group / new_subgroups calls, and the process groups registered before and after the check.
It asserts what decides the communicator count on NCCL: no lone point-to-point call, every transfer in a
batch on the world group, no process group added. What only a GPU shows (the NCCL communicators
themselves) is in docs/benchmarks.md's GPU command (bench/gpu_nccl_paths.py, two GPUs or more)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from torch.distributed import distributed_c10d

from fsdp_trainer import distributed, fabric
from fsdp_trainer.contract import NetworkSpec, Versions
from tests.support.net import free_port

RANKS = 3
POINT_TO_POINT = ("isend", "irecv", "send", "recv")
GROUP_BUILDERS = ("new_group", "new_subgroups")


@dataclass
class Calls:
    """What one rank's fabric check called, in order."""

    entry_points: list[dict[str, Any]] = field(default_factory=list)  # {name, in_batch}
    transfers: list[dict[str, Any]] = field(default_factory=list)  # {operation, peer, in_batch, world_group}
    batches: int = 0
    group_builders: list[str] = field(default_factory=list)
    groups_before: int = 0
    groups_after: int = 0


@contextmanager
def recorded(calls: Calls) -> Iterator[None]:
    """torch.distributed's point-to-point and group-building functions wrapped to record each call, then
    call the real function. isend/irecv are replaced in torch.distributed and in distributed_c10d alike:
    P2POp checks its op against distributed_c10d's names, and the fabric check names them through
    torch.distributed."""
    depth = [0]  # batch_isend_irecv calls in progress
    saved: list[tuple[Any, str, Any]] = []

    def replace(owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapper)

    def entry_point(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.entry_points.append({"name": name, "in_batch": depth[0] > 0})
            return real(*args, **kwargs)

        return wrapper

    def batch(real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.batches += 1
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    def transfer(operation: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(group: dist.ProcessGroup, tensors: list[torch.Tensor], peer: int, *args: Any) -> Any:
            world = group is distributed_c10d._get_default_group()
            calls.transfers.append(
                {"operation": operation, "peer": peer, "in_batch": depth[0] > 0, "world_group": world}
            )
            return real(group, tensors, peer, *args)

        return wrapper

    def builder(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.group_builders.append(name)
            return real(*args, **kwargs)

        return wrapper

    for name in POINT_TO_POINT:
        wrapper = entry_point(name, getattr(distributed_c10d, name))
        replace(distributed_c10d, name, wrapper)
        replace(dist, name, wrapper)
    batched = batch(distributed_c10d.batch_isend_irecv)
    replace(distributed_c10d, "batch_isend_irecv", batched)
    replace(dist, "batch_isend_irecv", batched)
    for name in GROUP_BUILDERS:
        wrapper = builder(name, getattr(distributed_c10d, name))
        replace(distributed_c10d, name, wrapper)
        replace(dist, name, wrapper)
    for operation in ("send", "recv"):
        replace(dist.ProcessGroup, operation, transfer(operation, getattr(dist.ProcessGroup, operation)))
    try:
        yield
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


def check_on_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        runtime = distributed.Runtime("single", rank, RANKS, 0, 1, torch.device("cpu"))
        network = NetworkSpec(bandwidth_probe_mb=1)  # the links at their 1 MiB floor: the calls, not speed
        calls = Calls(groups_before=len(distributed_c10d._world.pg_map))
        with recorded(calls):
            report, _ = fabric.check(network, "run", runtime, Versions(), pod=f"pod-{rank}")
        calls.groups_after = len(distributed_c10d._world.pg_map)
        assert len(report.links) == RANKS * (RANKS - 1), report.links  # every link was measured
        Path(out, f"rank-{rank}.json").write_text(json.dumps(asdict(calls)))
    finally:
        dist.destroy_process_group()


def test_the_fabric_check_transfers_only_in_batches_on_the_world_group_and_adds_no_group(
    tmp_path: Path,
) -> None:
    multiprocessing.spawn(check_on_rank, args=(free_port(), str(tmp_path)), nprocs=RANKS, join=True)
    for rank in range(RANKS):
        calls = Calls(**json.loads((tmp_path / f"rank-{rank}.json").read_text()))
        lone = [call["name"] for call in calls.entry_points if not call["in_batch"]]
        # ProcessGroupNCCL's key for a lone transfer's communicator: the two ranks, lower first.
        pairs = sorted(
            {f"{min(rank, e['peer'])}:{max(rank, e['peer'])}" for e in calls.transfers if not e["in_batch"]}
        )
        assert not lone, (
            f"rank {rank}: {len(lone)} lone point-to-point calls ({', '.join(sorted(set(lone)))}): on NCCL "
            f"each pair of ranks they join gets a two-rank communicator of its own, kept for the run: {pairs}"
        )
        # Each of a rank's four links (to and from each other pod) is a warm-up batch and a timed one.
        assert calls.batches == 2 * 2 * (RANKS - 1), calls.batches
        assert calls.transfers, f"rank {rank}: no transfer reached a process group"
        outside = [entry for entry in calls.transfers if not (entry["in_batch"] and entry["world_group"])]
        assert not outside, f"rank {rank}: transfers outside a batch on the world group: {outside}"
        assert not calls.group_builders, f"rank {rank} built process groups: {calls.group_builders}"
        assert calls.groups_after == calls.groups_before, (
            f"rank {rank}: process groups {calls.groups_before} before the check, {calls.groups_after} after"
        )
