"""AdamW (built after sharding, so its state is sharded too) and the warmup + decay schedule."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_trainer.contract import Schedule, TrainingSpec

ADAM_BETAS = (0.9, 0.95)  # the usual choice for LLM training (GPT-3, Llama, Qwen)


def lr_factor(steps_taken: int, spec: TrainingSpec) -> float:
    """Multiplier of the peak learning rate for the optimizer step that follows `steps_taken` steps.

    Linear warmup reaches the peak on step `warmup_steps`; the decay then reaches
    `min_learning_rate_ratio` on the last step (`max_steps`).
    """
    if steps_taken < spec.warmup_steps:
        return (steps_taken + 1) / spec.warmup_steps
    if spec.schedule == Schedule.CONSTANT:
        return 1.0
    decay_steps = max(1, spec.max_steps - spec.warmup_steps - 1)
    progress = min(1.0, (steps_taken - spec.warmup_steps) / decay_steps)
    floor = spec.min_learning_rate_ratio
    if spec.schedule == Schedule.LINEAR:
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, spec: TrainingSpec) -> torch.optim.AdamW:
    """Weight decay on matrices only: biases and norm weights are not decayed. On CUDA the fused kernel
    (one launch for all parameters, torchtitan's default); elsewhere torch's foreach implementation."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = all(p.device.type == "cuda" for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=spec.learning_rate, betas=ADAM_BETAS, fused=on_cuda or None)


def accumulate_gradients(
    lm: torch.nn.Module,
    root: FSDPModule,
    micro_batches: Iterable[torch.Tensor],
    micro_steps: int,
    reduce_every_micro_step: bool,
) -> torch.Tensor:
    """Forward and backward over one optimizer step's `micro_steps` micro-batches, each loss scaled by
    1 / micro_steps; returns the sum of the scaled losses as a device tensor.

    With reduce_every_micro_step (the default, torchtitan's way) gradients are reduce-scattered after every
    micro-step and accumulate as this rank's shard; without, they are reduce-scattered once, after the last
    micro-step, and accumulate unsharded in fp32 before it (the fewest collectives, shard-size times the
    gradient memory)."""
    losses = []
    for micro_step, batch in enumerate(micro_batches):
        root.set_requires_gradient_sync(reduce_every_micro_step or micro_step == micro_steps - 1)
        loss = lm(input_ids=batch, labels=batch).loss / micro_steps
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses).sum()


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips the gradients to `max_norm` (0 disables clipping) and returns their total norm before clipping,
    as a tensor (a DTensor under FSDP; reading it is a collective). Without clipping the gradients are left
    untouched: scaling by max_norm / norm with an infinite max_norm would turn an overflowed norm into NaN
    gradients (inf / inf)."""
    with_grads = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grads if p.grad is not None])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm)
    return norm


def all_finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
    """Whether a step's loss and gradient norm are finite on every rank, so that every rank applies or skips
    the update alike (a rank deciding alone would update only some of the model's shards, or fail alone and
    leave the others waiting in a collective): one all-reduce of one number and one host sync."""
    # The global norm: clip_gradients' DTensor comes replicated, so this is no collective.
    norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
    # On the loss's device: with cpu_offload the gradients, and so their norm, are in host memory.
    values = torch.stack([loss.float(), norm.to(loss.device, torch.float32)])
    non_finite = (~torch.isfinite(values)).any().to(torch.int32)
    dist.all_reduce(non_finite, op=dist.ReduceOp.MAX)
    return not non_finite.item()


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: TrainingSpec
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, spec=spec))
