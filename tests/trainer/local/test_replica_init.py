"""A model initialised from its config (model.fromConfig) starts with every replica of a shard equal (issue 47
item 3), on CPU with gloo, where each shard draws from its own stream: under NO_SHARD (2 ranks, each a whole
replica) and HYBRID_SHARD (4 ranks as 2 nodes of 2: 2 replicas of 2 shards) the ranks that hold one shard
hold the same weights, and different shards differ. Nothing broadcasts the weights, so replicas that started
apart would train apart for the whole run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
from torch.distributed.tensor import DTensor

from fsdp_trainer import distributed, model
from fsdp_trainer.contract import ShardingStrategy
from fsdp_trainer.sharded_model import build_sharded_model
from tests.support.net import free_port
from tests.support.trainer_runs import config


def run_rank(rank: int, port: int, world_size: int, sharding: str, output: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        trainer = config(output).model_copy(deep=True)
        trainer.fsdp.sharding = ShardingStrategy(sharding)
        node_size = 2 if sharding == ShardingStrategy.HYBRID_SHARD else world_size
        runtime = distributed.Runtime(
            "torchrun", rank, world_size, rank % node_size, node_size, torch.device("cpu")
        )
        model_config = model.model_config(trainer.model, runtime.local_rank, dist.barrier)
        sharded = build_sharded_model(trainer, model_config, runtime, "initialise")
        weights = {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in sharded.lm.named_parameters()
        }
        mesh = next(p.device_mesh for p in sharded.lm.parameters() if isinstance(p, DTensor))
        torch.save({"shard": mesh.get_local_rank("shard"), "weights": weights}, output / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("sharding", "world_size"), [(ShardingStrategy.NO_SHARD, 2), (ShardingStrategy.HYBRID_SHARD, 4)]
)
def test_replicas_of_a_shard_start_with_equal_weights(
    tmp_path: Path, sharding: ShardingStrategy, world_size: int
) -> None:
    multiprocessing.spawn(
        run_rank, args=(free_port(), world_size, sharding.value, tmp_path), nprocs=world_size
    )
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    by_shard: dict[int, list[dict[str, torch.Tensor]]] = {}
    for result in ranks:
        by_shard.setdefault(result["shard"], []).append(result["weights"])
    assert all(len(replicas) == 2 for replicas in by_shard.values()), {k: len(v) for k, v in by_shard.items()}
    for shard, (first, second) in by_shard.items():
        for name, weight in first.items():
            assert torch.equal(weight, second[name]), f"shard {shard}: the replicas' {name} differ"
    if len(by_shard) == 2:  # HYBRID_SHARD: the two shards of the layer weights are different draws
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(by_shard[0][0][name], by_shard[1][0][name])
