"""The sharded model as a worker builds it from the config: the training loop's and baseline A's (the
benchmarks' minimal loop, bench/trainer_baseline.py), so the benchmark measures the same model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from transformers import PretrainedConfig, PreTrainedModel

from fsdp_trainer import adapter, chunked_loss, distributed, model, parallelize
from fsdp_trainer.contract import Precision, TrainerConfig
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.metrics import ModelShape


@dataclass(frozen=True)
class ShardedModel:
    lm: PreTrainedModel  # called for forward passes
    root: FSDPModule  # the same object seen as the FSDP root (gradient sync control)
    dtype: torch.dtype  # of the computation
    shape: ModelShape  # for the FLOPs estimate
    mesh: DeviceMesh  # of the sharding: its process groups carry FSDP's collectives


def build_sharded_model(
    config: TrainerConfig,
    model_config: PretrainedConfig,
    runtime: distributed.Runtime,
    weights: model.Weights,
) -> ShardedModel:
    """Built on the meta device and sharded before it has storage, then given `weights`: a resumed run
    reads only the checkpoint next, a new one initialises or loads each rank's shards directly. With an
    adapter, the pretrained weights are always loaded (a checkpoint holds only the adapter) and the adapter
    initialised; a resumed run's checkpoint replaces it next."""
    lm = model.empty_model(model_config)
    shape = model.model_shape(lm)
    lora = config.fsdp.adapter
    if lora is not None:
        if config.model.source is None:
            raise ConfigError("fsdp.adapter needs model.source: the pretrained model the adapter adapts")
        adapter.inject(lm, lora)
        weights = "load"
    device_type = runtime.device.type
    dtype = parallelize.compute_dtype(Precision(config.fsdp.mixed_precision), device_type)
    mesh = parallelize.build_mesh(
        parallelize.mesh_shape(config.fsdp.sharding, runtime.world_size, runtime.local_world_size),
        device_type,
    )
    root = parallelize.parallelize(lm, config.fsdp, mesh, dtype)
    training = config.training
    if training.loss_chunk_tokens:
        chunked_loss.install(lm, training.loss_chunk_tokens)
    model.materialise(
        lm,
        runtime.device,
        weights,
        config.model,
        training.seed,
        parallelize.shard_index(mesh),
        runtime.local_rank,
        dist.barrier,
        config.fsdp.cpu_offload,
    )
    if lora is not None:
        shard = parallelize.shard_index(mesh)
        with model.seeded_for_shards(runtime.device, config.fsdp.cpu_offload, training.seed, shard):
            adapter.initialise(lm)
        if lora.init_from is not None:
            directory = model.resolve(lora.init_from, runtime.local_rank, dist.barrier)
            adapter.load_exported(lm, lora, directory)
    return ShardedModel(lm, root, dtype, shape, mesh)
