"""Prompt tokens contribute no gradient (issue 48 item 3): for chat rows read through the trainer's data
path, the loss's gradient with respect to the logits is exactly zero at every position whose next token is
part of a prompt (system or user turn, or the template's markup around it), and not at the answers'."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdp_trainer import data, optim
from fsdp_trainer.contract import DataSpec
from fsdp_trainer.data import LABELS, TOKENS, build_datasets
from fsdp_trainer.model import byte_level_tokenizer
from tests.support.corpus import write_chat_jsonl
from tests.support.manifests import CHATML
from tests.support.tiny_model import tiny_lm

CPU = torch.device("cpu")


def test_prompt_tokens_contribute_no_gradient(tmp_path: Path) -> None:
    spec = DataSpec(
        source=str(write_chat_jsonl(tmp_path / "chat.jsonl", 40)),
        format="messages",
        chat_template=CHATML,
        eval_fraction=0,
    )
    datasets = build_datasets(spec, byte_level_tokenizer(), 320, 512, seed=0, streams=1)
    samples = datasets.train.samples(range(2))
    batch = data.MicroBatch.from_samples(samples, CPU)
    assert batch.packed, "several conversations to a row"
    lm = tiny_lm(vocab_size=320, use_cache=False)
    logits: list[torch.Tensor] = []
    lm.lm_head.register_forward_hook(lambda _m, _i, output: logits.append(output) or output.retain_grad())
    inputs = optim.model_inputs(batch, lm.config)
    lm(**inputs, num_items_in_batch=optim.target_count(batch.labels)).loss.backward()
    gradient = logits[0].grad
    assert gradient is not None
    per_position = gradient.abs().sum(-1)  # position i predicts token i + 1
    predicts_prompt = samples[:, LABELS, 1:] == -100
    assert torch.all(per_position[:, :-1][predicts_prompt] == 0), "no gradient from any prompt token"
    assert torch.all(per_position[:, :-1][~predicts_prompt] > 0), "every answer token has one"
    tokenizer = byte_level_tokenizer()
    learned = tokenizer.decode(samples[0, TOKENS][samples[0, LABELS] != -100].tolist())
    assert "user" not in learned and "q" not in learned, "no question (q<n>: ...) nor user turn is learned"
    assert learned.count("<|im_end|>") >= 2, "the answers of several conversations, each with its end"
