"""Gradient reduction per micro-step (fsdp.reduceEveryMicroStep) on CPU, 2 gloo ranks: reduce-scattering
after every micro-step gives the same gradients and the same updated weights as one reduce-scatter after
the last, and the gradients are reduced to each rank's shard as soon as the first micro-step ends. That is
the default (torchtitan's), and the memory held between micro-steps shows it: this rank's shard of the
gradients, not the whole unsharded fp32 gradients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_trainer import data, optim, parallelize
from fsdp_trainer.contract import FsdpSpec, TrainingSpec
from tests.support.net import free_port
from tests.support.tiny_model import tiny_lm

MICRO_STEPS = 3
VOCAB = 64


def held_gradient_bytes(lm: torch.nn.Module) -> int:
    """Bytes of the gradients FSDP holds on this rank: every parameter's sharded gradient and, while
    gradient sync is off, its unsharded gradient or fp32 accumulator (each storage counted once)."""
    states = {
        id(state): state for m in lm.modules() if isinstance(m, FSDPModule) for state in [m._get_fsdp_state()]
    }
    storages: dict[int, int] = {}
    for state in states.values():
        group = state._fsdp_param_group
        for param in group.fsdp_params if group is not None else []:
            unsharded = getattr(param, "_unsharded_param", None)
            for grad in (
                param.sharded_param.grad,
                None if unsharded is None else unsharded.grad,
                param.unsharded_accumulated_grad,
            ):
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if local is not None:
                    storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def one_step(rank: int, reduce_every_micro_step: bool) -> dict[str, object]:
    """One optimizer step from the same initial weights and this rank's own micro-batches."""
    lm = tiny_lm(vocab_size=VOCAB)
    mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=2), "cpu")
    root = parallelize.parallelize(lm, FsdpSpec(), mesh, torch.float32)
    optimizer = optim.build_optimizer(lm, TrainingSpec(learning_rate=1e-2))
    reduced_after_first: list[bool] = []
    held_between_micro_steps: list[int] = []

    forwards = 0

    def before_forward(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == 2:  # the first micro-step's backward is done
            reduced_after_first.append(all(p.grad is not None for p in lm.parameters()))
            held_between_micro_steps.append(held_gradient_bytes(lm))

    # Before FSDP's own hook, which gathers the root's parameters for the forward pass (in their place).
    lm.register_forward_pre_hook(before_forward, prepend=True, with_kwargs=True)
    generator = torch.Generator().manual_seed(100 + rank)
    micro_batches = [
        data.MicroBatch.of_tokens(torch.randint(0, VOCAB, (2, 16), generator=generator))
        for _ in range(MICRO_STEPS)
    ]
    loss = optim.accumulate_gradients(lm, root, micro_batches, reduce_every_micro_step)
    gradients = {name: p.grad.full_tensor() for name, p in lm.named_parameters() if p.grad is not None}
    optimizer.step()
    return {
        "loss": float(loss),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in lm.parameters()),
        "held_between_micro_steps": held_between_micro_steps[0],
        "reduced_after_first_micro_step": reduced_after_first[0],
        "gradients": gradients,
        "weights": {name: p.full_tensor().detach() for name, p in lm.named_parameters()},
    }


def run_rank(rank: int, port: int, output: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        modes = {"last": False, "every": True, "default": FsdpSpec().reduce_every_micro_step}
        results = {mode: one_step(rank, every) for mode, every in modes.items()}
        torch.save(results, output / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_reducing_every_micro_step_gives_the_same_step_with_sharded_accumulation(tmp_path: Path) -> None:
    multiprocessing.spawn(run_rank, args=(free_port(), tmp_path), nprocs=2)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        last, every = results["last"], results["every"]
        assert not last["reduced_after_first_micro_step"], "by default gradients wait for the last micro-step"
        assert every["reduced_after_first_micro_step"], "each micro-step's gradients are reduced at once"
        assert every["loss"] == last["loss"]
        assert every["gradients"].keys() == last["gradients"].keys() and last["gradients"]
        for name, gradient in last["gradients"].items():
            torch.testing.assert_close(every["gradients"][name], gradient, rtol=1e-5, atol=1e-7)
        for name, weight in last["weights"].items():  # AdamW's first step is ~lr * sign(g): atol << lr
            torch.testing.assert_close(every["weights"][name], weight, rtol=1e-5, atol=1e-5)


def test_by_default_only_this_ranks_gradient_shard_is_held_between_micro_steps(tmp_path: Path) -> None:
    multiprocessing.spawn(run_rank, args=(free_port(), tmp_path), nprocs=2)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        default, last = results["default"], results["last"]
        whole = default["parameter_bytes"]  # fp32: the unsharded gradients' size
        assert default["reduced_after_first_micro_step"], "the default reduces every micro-step"
        # This rank's half of the gradients (padded to equal shards) against all of them.
        assert default["held_between_micro_steps"] <= 0.55 * whole, default["held_between_micro_steps"]
        assert last["held_between_micro_steps"] >= whole, last["held_between_micro_steps"]
