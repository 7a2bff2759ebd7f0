"""The training loss is torchtitan's token-weighted mean (issue 47 item 4), on CPU, 2 gloo ranks: with padded
rows and masked labels spread unevenly over ranks and micro-steps, the step's loss and the sharded
gradients are those of one unsharded model computing the mean cross-entropy over every target of the global
batch at once. A mean of per-micro-batch means (the loss before) weighs a target by how few others share
its micro-batch, and differs."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
import torch.nn.functional as F

from fsdp_trainer import data, optim, parallelize
from fsdp_trainer.chunked_loss import IGNORE_INDEX
from fsdp_trainer.contract import FsdpSpec
from tests.support.net import free_port
from tests.support.tiny_model import tiny_lm

VOCAB = 64
RANKS = 2
MICRO_STEPS = 2
ROWS, LENGTH = 2, 16


def micro_batch(rank: int, micro_step: int) -> data.MicroBatch:
    """Rank 0's first micro-batch keeps 3 targets in a row of padding, the rest keep most: the micro-batches
    hold very different target counts."""
    generator = torch.Generator().manual_seed(10 * rank + micro_step)
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    labels = tokens.clone()
    if (rank, micro_step) == (0, 0):
        labels[:, 4:] = IGNORE_INDEX  # a short sequence padded to the length
    else:
        labels[:, : 2 + rank + micro_step] = IGNORE_INDEX  # a masked prompt of a few tokens
    return data.MicroBatch(tokens, labels)


def reference(lm: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole global batch through one unsharded model: the summed cross-entropy over every target,
    divided by the number of targets."""
    batches = [micro_batch(rank, step) for rank in range(RANKS) for step in range(MICRO_STEPS)]
    logits = lm(input_ids=torch.cat([b.input_ids for b in batches])).logits
    labels = torch.cat([b.labels for b in batches])
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in lm.named_parameters() if p.grad is not None}


def run_rank(rank: int, port: int, output: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        lm = tiny_lm(vocab_size=VOCAB)
        unsharded = copy.deepcopy(lm)
        mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=RANKS), "cpu")
        root = parallelize.parallelize(lm, FsdpSpec(), mesh, torch.float32)
        mine = [micro_batch(rank, step) for step in range(MICRO_STEPS)]
        loss = optim.global_loss(optim.accumulate_gradients(lm, root, mine, True))
        gradients = {name: p.grad.full_tensor() for name, p in lm.named_parameters() if p.grad is not None}
        expected_loss, expected_gradients = reference(unsharded)
        torch.save(
            {
                "loss": loss,
                "gradients": gradients,
                "expected_loss": expected_loss,
                "expected_gradients": expected_gradients,
            },
            output / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_the_loss_and_gradients_are_the_token_mean_over_the_global_batch(tmp_path: Path) -> None:
    multiprocessing.spawn(run_rank, args=(free_port(), tmp_path), nprocs=RANKS)
    for rank in range(RANKS):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(result["loss"], result["expected_loss"], rtol=1e-5, atol=1e-6)
        expected = result["expected_gradients"]
        assert result["gradients"].keys() == expected.keys() and expected
        for name, gradient in result["gradients"].items():
            torch.testing.assert_close(gradient, expected[name], rtol=1e-4, atol=1e-6, msg=name)
