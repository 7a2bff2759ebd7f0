"""FSDP layout choices that need no process group."""

from __future__ import annotations

import pytest
import torch

from fsdp_trainer.contract import ActivationCheckpointing, Precision, ShardingStrategy
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.model import model_shape
from fsdp_trainer.parallelize import (
    MeshShape,
    checkpointed_layer_indices,
    compute_dtype,
    decoder_layers,
    mesh_shape,
)
from tests.support.tiny_model import tiny_lm


@pytest.mark.parametrize(
    ("sharding", "shape"),
    [
        (ShardingStrategy.FULL_SHARD, MeshShape(replicate=1, shard=8)),
        (ShardingStrategy.SHARD_GRAD_OP, MeshShape(replicate=1, shard=8)),
        (ShardingStrategy.HYBRID_SHARD, MeshShape(replicate=2, shard=4)),
        (ShardingStrategy.NO_SHARD, MeshShape(replicate=8, shard=1)),
    ],
)
def test_mesh_shape_for_two_nodes_of_four_gpus(sharding: ShardingStrategy, shape: MeshShape) -> None:
    assert mesh_shape(sharding, world_size=8, local_world_size=4) == shape


def test_hybrid_shard_needs_equal_nodes() -> None:
    with pytest.raises(ConfigError):
        mesh_shape(ShardingStrategy.HYBRID_SHARD, world_size=6, local_world_size=4)


def test_activation_checkpointing_layers() -> None:
    assert checkpointed_layer_indices(ActivationCheckpointing.NONE, 4) == []
    assert checkpointed_layer_indices(ActivationCheckpointing.FULL, 4) == [0, 1, 2, 3]
    assert checkpointed_layer_indices(ActivationCheckpointing.SELECTIVE, 5) == [0, 2, 4]
    assert checkpointed_layer_indices(ActivationCheckpointing.SELECTIVE_OP, 3) == [0, 1, 2]


def test_cpu_trains_in_fp32_and_gpus_in_the_requested_dtype() -> None:
    assert compute_dtype(Precision.BF16, "cpu") == torch.float32
    assert compute_dtype(Precision.BF16, "cuda") == torch.bfloat16
    assert compute_dtype(Precision.FP16, "cuda") == torch.float16


@pytest.mark.parametrize("tied", [True, False])
def test_decoder_layers_and_the_flops_parameter_count(tied: bool) -> None:
    model = tiny_lm(vocab_size=300, num_hidden_layers=3, tie_word_embeddings=tied)
    assert len(decoder_layers(model)) == 3
    shape = model_shape(model)
    total = sum(p.numel() for p in model.parameters())
    assert (shape.layers, shape.heads, shape.head_dim) == (3, 4, 8)
    assert shape.params == (total if tied else total - 300 * 32), "an untied input embedding does no matmul"
