"""FSDP2 (fully_shard) in torchtitan's order and layout: activation checkpointing, torch.compile (each
decoder layer whole: a graph break is an error), then one FSDP group per decoder layer, then the ends of the
model, then the root. An untied model shards its input embedding alone (gathered for the first op, reduced
as soon as backward is done with it) and the final norm with the output projection as one group, as
torchtitan does; a tied embedding is the output projection and stays with the norm in the root, which is
not resharded after forward (backward starts with it)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from fsdp_trainer.contract import ActivationCheckpointing, FsdpSpec, Precision, ShardingStrategy
from fsdp_trainer.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16, Precision.FP32: torch.float32}


@dataclass(frozen=True)
class MeshShape:
    """(replicate, shard) sizes; replicate 1 is plain FSDP."""

    replicate: int
    shard: int


def mesh_shape(sharding: ShardingStrategy, world_size: int, local_world_size: int) -> MeshShape:
    if sharding == ShardingStrategy.NO_SHARD:
        return MeshShape(replicate=world_size, shard=1)
    if sharding == ShardingStrategy.HYBRID_SHARD:
        if world_size % local_world_size:
            raise ConfigError(
                f"HYBRID_SHARD needs the same number of processes on every node "
                f"({world_size} processes, {local_world_size} on this node)"
            )
        return MeshShape(replicate=world_size // local_world_size, shard=local_world_size)
    return MeshShape(replicate=1, shard=world_size)


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    if shape.replicate == 1:
        return init_device_mesh(device_type, (shape.shard,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (shape.replicate, shape.shard), mesh_dim_names=("replicate", "shard")
    )


def shard_index(mesh: DeviceMesh) -> int:
    """This rank's coordinate along the shard dimension: which shard of the parameters it holds."""
    return mesh.get_local_rank("shard")


def compute_dtype(requested: Precision, device_type: str) -> torch.dtype:
    """The parameter dtype for compute. On CPU, gloo cannot reduce bf16/fp16 and CPU matmuls gain nothing,
    so CPU runs train in fp32 (and say so)."""
    if device_type == "cpu" and requested != Precision.FP32:
        log.warning("mixed precision %s is not used on CPU: training in fp32", requested)
        return torch.float32
    return _DTYPES[Precision(requested)]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ModuleList of transformer blocks, found by the class names transformers marks as unsplittable."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) > 0
            and all(type(child).__name__ in block_names for child in module)
        ):
            return module
    raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (looked for {block_names})")


def checkpointed_layer_indices(mode: ActivationCheckpointing, count: int) -> list[int]:
    if mode in (ActivationCheckpointing.FULL, ActivationCheckpointing.SELECTIVE_OP):
        return list(range(count))
    if mode == ActivationCheckpointing.SELECTIVE:
        return list(range(0, count, 2))
    return []


_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default}
# Outputs kept by per-operation selective checkpointing (torchtitan's list, plus CPU attention and addmm for
# projections with a bias): costly to recompute; everything else (norms, activations, elementwise) is cheap.
_KEPT_OPS = _MATMULS | {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_attention_and_every_other_matmul(
    matmuls: dict[bool, int], context: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    """torchtitan's per-operation policy: the first, third, ... matmul of a layer's forward are kept and
    the others recomputed, halving the matmul activations for a share of the matmul time; counted
    separately in forward and in recomputation, which must make the same choices."""
    if op in _MATMULS:
        matmuls[context.is_recompute] += 1
        keep = matmuls[context.is_recompute] % 2 == 1
    else:
        keep = op in _KEPT_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _per_operation_contexts() -> tuple[Any, Any]:
    """Fresh matmul counts for each checkpointed forward (and its recomputation)."""
    policy = functools.partial(_keep_attention_and_every_other_matmul, {False: 0, True: 0})
    contexts: tuple[Any, Any] = create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]
    return contexts


def parallelize(model: torch.nn.Module, spec: FsdpSpec, mesh: DeviceMesh, dtype: torch.dtype) -> FSDPModule:
    """Shards `model` in place and returns it as the FSDP root. Gradients always reduce in fp32, as sums."""
    layers = decoder_layers(model)
    mode = ActivationCheckpointing(spec.activation_checkpointing)
    for index in checkpointed_layer_indices(mode, len(layers)):
        if mode == ActivationCheckpointing.SELECTIVE_OP:
            layers[index] = checkpoint_wrapper(layers[index], context_fn=_per_operation_contexts)
        else:
            layers[index] = checkpoint_wrapper(layers[index])
    if spec.compile:
        for layer in layers:
            layer.compile(fullgraph=True)  # a graph break fails the first step instead of going unnoticed
    # Inputs are not cast: each layer gets the previous one's activations in the compute dtype already, and
    # the casts would be per-layer copies for nothing (torchtitan turns them off too).
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    offload: OffloadPolicy = CPUOffloadPolicy() if spec.cpu_offload else OffloadPolicy()
    reshard = ShardingStrategy(spec.sharding) in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
    for index, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keeping them saves a gather.
        fully_shard(
            layer,
            mesh=mesh,
            reshard_after_forward=reshard and index < len(layers) - 1,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
    lm: Any = model
    embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    norm = getattr(lm.get_decoder(), "norm", None)
    if head is not None and embedding.weight is not head.weight and isinstance(norm, torch.nn.Module):
        fully_shard(
            embedding, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy, offload_policy=offload
        )
        # Backward starts with them: gathering them again after forward would be a wasted all-gather.
        fully_shard(
            [norm, head], mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload
        )
    # The root's reshard_after_forward is left to FSDP (None): it keeps the root's parameters (a tied
    # embedding and the final norm) after forward, since backward starts with them; True gathers them again.
    root = fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    # Gradients are summed over ranks, not averaged: the loss is already divided by the global batch's
    # target count (optim.accumulate_gradients), as torchtitan does. Forcing plain SUM collectives keeps a
    # divide factor of 1 from becoming NCCL's PreMulSum(1) (a scaling for nothing), which gloo lacks.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root
