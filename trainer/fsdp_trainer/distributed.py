"""Where the per-worker loop runs: a Ray Train worker (Ray has set up the process group), a torchrun
process (torch.distributed env vars), or a lone `python` process (a one-process group of its own)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from fsdp_trainer.errors import DeviceError

Launcher = Literal["ray", "torchrun", "single"]
# How long a collective may wait before the process group aborts it (and the attempt fails, to be retried).
# Setup (downloads, data listing, loading a checkpoint), the first step (torch.compile) and the end (export)
# have ranks wait on one another's long work; steps do not, and a hang in one should not hold every GPU of
# the run for half an hour (torchtitan likewise shortens it after the first step).
SETUP_TIMEOUT = timedelta(minutes=30)
STEP_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class Runtime:
    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return str(dist.get_backend())


def ray_train_context() -> Any | None:
    """The Ray Train context when running inside a Ray Train worker (Ray may not even be installed)."""
    try:
        import ray.train
    except ImportError:
        return None
    try:
        return ray.train.get_context()
    except RuntimeError:  # not a Ray Train worker
        return None


def require_cuda(use_gpu: bool, device_type: str) -> None:
    """GPUs asked for and none usable (a driver too old for the CUDA build, a device not visible) is an
    error: training on the CPU with gloo instead would look like a very slow run, not a broken node."""
    if use_gpu and device_type != "cuda":
        cuda = torch.version.cuda or "none (a CPU build of torch)"
        raise DeviceError(
            "GPUs were asked for (gpusPerWorker > 0) but CUDA is not usable here: "
            f"torch {torch.__version__}, CUDA {cuda}, {torch.cuda.device_count()} device(s) visible. "
            "Check the node's NVIDIA driver against the image's CUDA version and the pod's nvidia.com/gpu "
            "request."
        )


def process_group_backend(use_gpu: bool, cpu_offload: bool) -> str:
    """The process group's backend. With GPUs, NCCL; with cpu_offload also gloo for CPU tensors: FSDP's own
    collectives stay on the GPU, but the gradients, and so the norm and clipping (collectives on DTensors),
    the non-finite check and export's full_tensor, live in host memory, and NCCL has no CPU backend."""
    if not use_gpu:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def start(use_gpu: bool, cpu_offload: bool = False) -> Runtime:
    context = ray_train_context()
    if context is not None:
        from ray.train.torch import get_device

        device = get_device()
        require_cuda(use_gpu, device.type)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return Runtime(
            "ray",
            context.get_world_rank(),
            context.get_world_size(),
            context.get_local_rank(),
            context.get_local_world_size(),
            device,
        )
    require_cuda(use_gpu, "cuda" if torch.cuda.is_available() else "cpu")
    backend = process_group_backend(use_gpu, cpu_offload)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun (or any env:// launcher)
        launcher: Launcher = "torchrun"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
        if use_gpu:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=SETUP_TIMEOUT)
    else:
        launcher, local_rank, local_world_size = "single", 0, 1
        device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        if use_gpu:
            torch.cuda.set_device(device)
        # A one-process group: its own rendezvous on any free loopback port.
        dist.init_process_group(
            backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1, timeout=SETUP_TIMEOUT
        )
    return Runtime(launcher, dist.get_rank(), dist.get_world_size(), local_rank, local_world_size, device)


def set_collective_timeout(timeout: timedelta, groups: Sequence[dist.ProcessGroup]) -> None:
    """The timeout of the default group and of `groups` (the device mesh's), after a barrier: no rank may
    wait under a shorter limit for one still doing the work the longer one was for."""
    dist.barrier()
    for group in (None, *groups):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def stop(runtime: Runtime) -> None:
    """Ray Train tears its process group down itself; other launchers' groups are ours to destroy."""
    if runtime.launcher != "ray" and dist.is_initialized():
        dist.destroy_process_group()


def all_gather(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast(value: Any) -> Any:
    """Rank 0's value on every rank."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def maximum(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
