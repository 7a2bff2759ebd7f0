"""AdamW (built after sharding, so its state is sharded too) and the warmup + decay schedule."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_trainer.chunked_loss import IGNORE_INDEX
from fsdp_trainer.contract import Schedule, TrainingSpec
from fsdp_trainer.data import MicroBatch
from fsdp_trainer.model import prepared_attention_masks

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
    """Weight decay on matrices only: biases and norm weights are not decayed. The fused kernel (one launch
    for all parameters on CUDA, torchtitan's default), on every device: it alone can skip a step on a flag
    that stays on the device (apply_update)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # A weightless (meta) model, whose optimizer state is only counted, cannot have the fused kernel.
    weightless = any(p.is_meta for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=spec.learning_rate, betas=ADAM_BETAS, fused=not weightless)


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """Positions with a target, as the causal-LM loss counts them: position i predicts label i + 1."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def all_targets(micro_batches: Sequence[MicroBatch]) -> torch.Tensor:
    """The targets of these micro-batches on every rank together: what the loss is divided by. At least 1:
    a batch without a target (every row cut before its answer) has a loss of 0, not 0 / 0."""
    targets = torch.stack([target_count(batch.labels) for batch in micro_batches]).sum()
    dist.all_reduce(targets)
    return targets.clamp(min=1)


# Attention implementations that keep packed examples apart by the position ids of one flattened row (varlen
# kernels, as TRL's padding-free batches do); the others get a block-diagonal mask that transformers builds
# from the position ids of each row.
_VARLEN = ("flash_attention_2", "flash_attention_3")


def model_inputs(batch: MicroBatch, config: Any) -> dict[str, Any]:
    """The causal LM's keyword arguments for a micro-batch. Rows of one example each take the ready-made
    masks (no host sync); packed rows take their position ids, from which each attention implementation
    keeps the examples apart: transformers' masks for SDPA, eager and flex attention (it reads where the
    positions restart, a host sync per micro-batch), the sequence lengths for flash attention."""
    if not batch.packed:
        masks = prepared_attention_masks(config)
        return {"input_ids": batch.input_ids, "labels": batch.labels} | (
            {} if masks is None else {"attention_mask": masks}
        )
    assert batch.position_ids is not None  # packed rows carry them
    if getattr(config, "_attn_implementation", None) in _VARLEN:
        # Every row starts an example and its first label is IGNORE_INDEX: nothing crosses a row boundary.
        return {
            "input_ids": batch.input_ids.reshape(1, -1),
            "labels": batch.labels.reshape(1, -1),
            "position_ids": batch.position_ids.reshape(1, -1),
        }
    return {"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids}


def accumulate_gradients(
    lm: torch.nn.Module,
    root: FSDPModule,
    micro_batches: Sequence[MicroBatch],
    reduce_every_micro_step: bool,
) -> torch.Tensor:
    """Forward and backward over one optimizer step's micro-batches; returns this rank's share of the step's
    loss as a device tensor (the shares of all ranks sum to the step's loss).

    The loss is torchtitan's: the cross-entropy summed over every target of the global batch and divided by
    their number, all-reduced before the first forward (on the device: no host sync). A mean of per-micro-
    batch means would weigh a target by how many others share its micro-batch, which padding and masked
    labels make unequal. The gradients are reduced as sums (parallelize sets FSDP's divide factor to 1), so
    they are exactly those of this loss.

    With reduce_every_micro_step (the default, torchtitan's way) gradients are reduce-scattered after every
    micro-step and accumulate as this rank's shard; without, they are reduce-scattered once, after the last
    micro-step, and accumulate unsharded in fp32 before it (the fewest collectives, shard-size times the
    gradient memory)."""
    targets = all_targets(micro_batches)
    config = getattr(lm, "config", None)
    losses = []
    last = len(micro_batches) - 1
    for micro_step, batch in enumerate(micro_batches):
        root.set_requires_gradient_sync(reduce_every_micro_step or micro_step == last)
        loss = lm(**model_inputs(batch, config), num_items_in_batch=targets).loss
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses).sum()


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clips the gradients to `max_norm` (0 disables clipping) and returns their total norm before clipping,
    as a plain tensor, the same on every rank. Without clipping the gradients are left untouched: scaling by
    max_norm / norm with an infinite max_norm would turn an overflowed norm into NaN gradients (inf / inf).

    Under FSDP the norm comes as a partial DTensor; it is reduced once here (torchtitan's way), and the
    clipping and the finiteness check use that tensor: left partial, each of them would all-reduce it
    again."""
    with_grads = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grads if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, norm)
    return norm


def global_loss(loss_share: torch.Tensor) -> torch.Tensor:
    """The step's loss, the same on every rank: the sum of the ranks' shares (an all-reduce on the device,
    no host sync). A non-finite share makes the sum non-finite on every rank."""
    total = loss_share.detach().float().clone()
    dist.all_reduce(total)
    return total


def non_finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 if the step's loss (global_loss) or gradient norm (clip_gradients) is not finite, else 0.0: a
    device tensor, computed without a host sync or a collective. Both inputs are the same on every rank, so
    every rank skips or applies the update alike (a rank deciding alone would update only some of the
    model's shards, or fail alone and leave the others waiting in a collective)."""
    # On the loss's device: with cpu_offload the gradients, and so their norm, are in host memory.
    values = torch.stack([loss.float(), grad_norm.to(loss.device, torch.float32)])
    return (~torch.isfinite(values)).any().to(torch.float32)


def apply_update(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step(), which changes nothing (parameters, moments, step count) where `skip` is 1, as
    decided on the device: the fused AdamW's found_inf, through which torch's GradScaler skips a step whose
    gradients overflowed, set on the optimizer and removed as GradScaler does."""
    parameters_device = optimizer.param_groups[0]["params"][0].device
    if skip.device != parameters_device:
        # cpu_offload: a blocking copy. torch's own non-blocking one lands in pinned memory that the fused
        # kernel on the host would read before the copy completes.
        skip = skip.to(parameters_device)
    optimizer.found_inf = skip  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: TrainingSpec
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, spec=spec))
