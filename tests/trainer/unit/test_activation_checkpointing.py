"""Activation checkpointing under FSDP2 on CPU (a one-rank gloo group): every mode computes the same loss and
gradients, and per-operation selective checkpointing (selective-op) recomputes at most half of the matmuls
that full checkpointing recomputes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_trainer import parallelize
from fsdp_trainer.contract import ActivationCheckpointing, FsdpSpec
from tests.support.tiny_model import tiny_lm

LAYERS = 2
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class MatmulCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def train_step(mode: ActivationCheckpointing) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """Matmuls run by one forward and backward, the loss and the gradients."""
    # use_cache off as model.empty_model builds it: a KV cache would grow again in recomputation
    lm = tiny_lm(vocab_size=64, num_hidden_layers=LAYERS, use_cache=False)
    mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=1), "cpu")
    parallelize.parallelize(lm, FsdpSpec(activation_checkpointing=mode), mesh, torch.float32)
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with MatmulCount() as matmuls:
        loss = lm(input_ids=batch, labels=batch).loss
        loss.backward()
    gradients = {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()  # named as without the wrapper
        for name, p in lm.named_parameters()
        if p.grad is not None
    }
    return matmuls.count, loss.detach(), gradients


def test_per_operation_checkpointing_recomputes_less_than_full_and_trains_the_same() -> None:
    plain, plain_loss, plain_gradients = train_step(ActivationCheckpointing.NONE)
    full, full_loss, full_gradients = train_step(ActivationCheckpointing.FULL)
    per_operation, per_operation_loss, per_operation_gradients = train_step(
        ActivationCheckpointing.SELECTIVE_OP
    )

    full_recomputed, per_operation_recomputed = full - plain, per_operation - plain
    assert full_recomputed > 0
    assert 0 < per_operation_recomputed <= full_recomputed // 2
    for loss, gradients in ((full_loss, full_gradients), (per_operation_loss, per_operation_gradients)):
        torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
        assert gradients.keys() == plain_gradients.keys() and gradients
        for name, gradient in plain_gradients.items():
            torch.testing.assert_close(gradients[name], gradient, rtol=1e-6, atol=1e-7, msg=name)
