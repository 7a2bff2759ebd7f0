"""Packing keeps examples apart (issue 48 item 2): an example's summed loss is the same packed into a row
with others as alone in a padded row, through the attention implementations the trainer runs on CPU (SDPA,
the default, and eager). Without position ids that restart per example (the loop before), a packed example
attends to the one before it and its loss changes."""

from __future__ import annotations

import pytest
import torch

from fsdp_trainer import data, optim
from fsdp_trainer.formats import Example
from tests.support.tiny_model import tiny_lm

VOCAB = 64
LENGTH = 48
CPU = torch.device("cpu")


def examples() -> list[Example]:
    """Three chat-like examples: a prompt that is not learned, then an answer that is."""
    generator = torch.Generator().manual_seed(4)
    made = []
    for prompt, answer in [(9, 7), (5, 11), (12, 4)]:
        tokens = torch.randint(1, VOCAB, (prompt + answer,), generator=generator).tolist()
        made.append(Example(tokens, [False] * prompt + [True] * answer))
    return made


def summed_loss(lm: torch.nn.Module, samples: torch.Tensor) -> float:
    """The cross-entropy summed over the samples' targets (num_items_in_batch=1)."""
    batch = data.MicroBatch.from_samples(torch.from_numpy(samples), CPU)
    with torch.no_grad():
        loss = lm(**optim.model_inputs(batch, lm.config), num_items_in_batch=torch.tensor(1)).loss
    return float(loss)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_an_examples_loss_is_the_same_packed_with_others_as_alone(attention: str) -> None:
    # use_cache off, as the trainer builds its models (model.empty_model): with a cache transformers
    # ignores the position ids when it builds the masks.
    lm = tiny_lm(vocab_size=VOCAB, attn_implementation=attention, use_cache=False).eval()
    parts = examples()
    packed = data.pack_examples(parts, pad_token_id=0, sequence_length=LENGTH, packing=True)
    assert len(packed) == 1, "the three examples share one row"
    alone = [data.pack_examples([part], 0, LENGTH, packing=False) for part in parts]
    together = summed_loss(lm, packed)
    separately = [summed_loss(lm, row) for row in alone]
    assert together == pytest.approx(sum(separately), rel=1e-5)
    # Packed with a different neighbour first, the same examples' loss is unchanged too.
    reordered = data.pack_examples(parts[::-1], 0, LENGTH, packing=True)
    assert summed_loss(lm, reordered) == pytest.approx(together, rel=1e-5)


def test_padding_has_no_target_and_a_row_of_one_example_needs_no_position_ids() -> None:
    part = examples()[0]  # 9 prompt tokens, then 7 of the answer
    row = data.pack_examples([part], pad_token_id=0, sequence_length=LENGTH, packing=False)
    labels = row[0, data.LABELS]
    assert (labels[:9] == -100).all() and (labels[len(part.tokens) :] == -100).all()
    assert labels[9 : len(part.tokens)].tolist() == part.tokens[9:]
    assert not data.MicroBatch.from_samples(torch.from_numpy(row), CPU).packed
