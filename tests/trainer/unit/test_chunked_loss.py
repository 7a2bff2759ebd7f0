"""Chunked cross-entropy (training.lossChunkTokens) on CPU: the same loss and gradients as transformers'
own loss, plain and under FSDP2 (a one-rank gloo group), without keeping a whole micro-batch's logits for
backward; models whose logits are transformed are refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from fsdp_trainer import chunked_loss, parallelize
from fsdp_trainer.contract import FsdpSpec
from fsdp_trainer.errors import ConfigError
from tests.support.tiny_model import tiny_lm

VOCAB = 96  # unlike every hidden width below, so logits are recognisable by their last dimension
CHUNK = 7  # does not divide the 3 x 10 tokens: the last chunk is shorter


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    labels[0, :4] = chunked_loss.IGNORE_INDEX  # positions without a target count in neither loss
    return input_ids, labels


def loss_and_gradients(lm: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    input_ids, labels = batch()
    loss = lm(input_ids=input_ids, labels=labels).loss
    loss.backward()
    gradients = {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for name, p in lm.named_parameters()
        if p.grad is not None
    }
    return loss.detach(), gradients


def assert_same(chunked: torch.nn.Module, whole: torch.nn.Module) -> None:
    chunked_loss_value, chunked_gradients = loss_and_gradients(chunked)
    whole_loss_value, whole_gradients = loss_and_gradients(whole)
    torch.testing.assert_close(chunked_loss_value, whole_loss_value, rtol=1e-6, atol=1e-6)
    assert chunked_gradients.keys() == whole_gradients.keys() and whole_gradients
    for name, gradient in whole_gradients.items():
        torch.testing.assert_close(chunked_gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


def test_the_chunked_loss_and_gradients_match_the_unchunked_ones() -> None:
    chunked = tiny_lm(vocab_size=VOCAB)
    chunked_loss.install(chunked, CHUNK)
    assert_same(chunked, tiny_lm(vocab_size=VOCAB))


def test_the_chunked_loss_matches_under_fsdp(one_rank_group: None) -> None:
    mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=1), "cpu")
    chunked, whole = tiny_lm(vocab_size=VOCAB), tiny_lm(vocab_size=VOCAB)
    for lm in (chunked, whole):
        parallelize.parallelize(lm, FsdpSpec(), mesh, torch.float32)
    chunked_loss.install(chunked, CHUNK)
    assert_same(chunked, whole)


def largest_saved_logits(lm: torch.nn.Module) -> int:
    """Rows of the largest logits tensor autograd keeps for backward during one forward (the output
    projection's weight, also VOCAB wide, is a parameter: not counted)."""
    rows = [0]
    parameters = {p.untyped_storage().data_ptr() for p in lm.parameters()}

    def pack(saved: torch.Tensor) -> torch.Tensor:
        if saved.shape and saved.shape[-1] == VOCAB and saved.untyped_storage().data_ptr() not in parameters:
            rows.append(saved.numel() // VOCAB)
        return saved

    input_ids, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        lm(input_ids=input_ids, labels=labels)
    return max(rows)


def test_no_more_than_one_chunks_logits_are_kept_for_backward() -> None:
    chunked = tiny_lm(vocab_size=VOCAB)
    chunked_loss.install(chunked, CHUNK)
    assert largest_saved_logits(tiny_lm(vocab_size=VOCAB)) == 30, "unchunked, every token's logits are kept"
    assert largest_saved_logits(chunked) == 0, "each chunk's logits are recomputed in backward"


def test_a_model_with_transformed_logits_is_refused() -> None:
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        chunked_loss.install(tiny_lm(vocab_size=VOCAB, final_logit_softcapping=30.0), CHUNK)
