"""The loss over the tokens that count is the same at any world size (issue 48 item 3): chat rows whose
answers differ in length, read through the trainer's data path, give one rank (a micro-batch of 4) and two
gloo ranks (2 each) with the same global batch the same training loss and gradients, and the same held-out
loss, each the summed cross-entropy over the learned tokens divided by their number (checked against one
unsharded model over the whole batch). A mean of per-micro-batch (or per-batch) means would differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing
import torch.nn.functional as F

from fsdp_trainer import data, distributed, optim, parallelize
from fsdp_trainer.chunked_loss import IGNORE_INDEX
from fsdp_trainer.contract import DataSpec, FsdpSpec
from fsdp_trainer.model import byte_level_tokenizer
from fsdp_trainer.validate import Validator
from tests.support.corpus import write_chat_jsonl
from tests.support.manifests import CHATML
from tests.support.net import free_port
from tests.support.tiny_model import tiny_lm

GLOBAL_BATCH, LENGTH, VOCAB = 4, 128, 320
STREAMS = 4  # fixed, so that both world sizes read the same global samples


def datasets(corpus: Path) -> data.Datasets:
    spec = DataSpec(
        source=str(corpus), format="messages", chat_template=CHATML, eval_fraction=0.2, packing=False
    )
    return data.build_datasets(spec, byte_level_tokenizer(), VOCAB, LENGTH, seed=0, streams=STREAMS)


def run_rank(rank: int, world_size: int, port: int, corpus: Path, output: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        micro_batch_size = GLOBAL_BATCH // world_size
        lm = tiny_lm(vocab_size=VOCAB, use_cache=False)
        mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=world_size), "cpu")
        root = parallelize.parallelize(lm, FsdpSpec(), mesh, torch.float32)
        sources = datasets(corpus)
        layout = data.BatchLayout(world_size, micro_batch_size, grad_accumulation=1)
        loader = data.BatchLoader(sources.train, layout, rank, torch.device("cpu"))
        loss = optim.global_loss(optim.accumulate_gradients(lm, root, list(loader.next_step()), True))
        gradients = {name: p.grad.full_tensor() for name, p in lm.named_parameters() if p.grad is not None}
        runtime = distributed.Runtime("single", rank, world_size, rank, world_size, torch.device("cpu"))
        # The same 8 held-out samples: 2 batches of 4 on one rank, 2 batches of 2 on each of two.
        evaluated = Validator(sources.eval, 2, micro_batch_size, runtime).validate(lm, 1)
        assert evaluated is not None
        torch.save(
            {"loss": loss, "gradients": gradients, "eval": evaluated.loss}, output / f"{world_size}-{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


FLOAT32 = {"rtol": 1.3e-6, "atol": 1e-5}  # torch.testing's own for float32


def summed_mean(samples: torch.Tensor) -> torch.Tensor:
    """One unsharded model over the samples at once: cross-entropy summed over the learned tokens, divided
    by their number."""
    lm = tiny_lm(vocab_size=VOCAB, use_cache=False)
    logits = lm(input_ids=samples[:, data.TOKENS]).logits
    labels = samples[:, data.LABELS]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    ).detach()


def test_one_rank_and_two_give_the_same_loss_over_the_learned_tokens(tmp_path: Path) -> None:
    corpus = write_chat_jsonl(tmp_path / "chat.jsonl", 400)
    for world_size in (1, 2):
        multiprocessing.spawn(run_rank, args=(world_size, free_port(), corpus, tmp_path), nprocs=world_size)
    one: dict[str, Any] = torch.load(tmp_path / "1-0.pt")
    two = [torch.load(tmp_path / f"2-{rank}.pt") for rank in range(2)]
    sources = datasets(corpus)
    train = sources.train.samples(range(GLOBAL_BATCH))
    assert sources.eval is not None
    held_out = sources.eval.first(8)
    learned = (train[:, data.LABELS, 1:] != IGNORE_INDEX).sum(-1)
    assert learned.max() > 2 * learned.min(), "rows with very different numbers of learned tokens"

    torch.testing.assert_close(one["loss"], summed_mean(train))
    # The eval loss comes back a Python float (a float64 to assert_close) reduced from float32 sums in another
    # order on each world size: float32's tolerances, as for the tensors.
    torch.testing.assert_close(float(one["eval"]), float(summed_mean(held_out)), **FLOAT32)
    for result in two:
        torch.testing.assert_close(result["loss"], one["loss"])
        torch.testing.assert_close(result["eval"], one["eval"], **FLOAT32)
        for name, gradient in one["gradients"].items():
            torch.testing.assert_close(result["gradients"][name], gradient, rtol=1e-4, atol=1e-6)
