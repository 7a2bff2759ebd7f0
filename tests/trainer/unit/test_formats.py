"""Data formats (issue 48 item 1): chat rows rendered with a chat template and prompt/completion rows learn
only the answers unless the run says otherwise; rows that do not parse or are too long are counted and
reported, never a failure mid-run; a tokenizer without a chat template is refused, naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_trainer.contract import DataSpec
from fsdp_trainer.data import LABELS, TOKENS, build_datasets
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.formats import Encoder, Example
from fsdp_trainer.model import byte_level_tokenizer
from tests.support.manifests import CHATML

TOKENIZER = byte_level_tokenizer()
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan?"},
    {"role": "assistant", "content": "東京."},
]


def learned_text(example: Example) -> str:
    return str(
        TOKENIZER.decode([t for t, learned in zip(example.tokens, example.learned, strict=True) if learned])
    )


def encode(spec: DataSpec, rows: list[Any], length: int = 256) -> Example:
    examples, counts = Encoder(spec, TOKENIZER, length).encode(rows)
    assert counts.unparsable == counts.truncated == counts.dropped == 0
    return examples[0]


def test_a_conversation_learns_its_assistant_turns_only_by_default() -> None:
    spec = DataSpec(format="messages", chat_template=CHATML)
    example = encode(spec, [{"messages": CHAT}])
    assert TOKENIZER.decode(example.tokens) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd of Japan?<|im_end|>\n"
        "<|im_start|>assistant\n東京.<|im_end|>\n"
    )
    assert learned_text(example) == "Paris.<|im_end|>\n東京.<|im_end|>\n"
    everything = encode(spec.model_copy(update={"loss_on": "all"}), [{"messages": CHAT}])
    assert all(everything.learned) and everything.tokens == example.tokens


def test_prompt_and_completion_learn_the_completion_and_eos() -> None:
    spec = DataSpec(format="promptCompletion", prompt_field="question", completion_field="answer")
    example = encode(spec, [{"question": "2+2=", "answer": "4"}])
    assert TOKENIZER.decode(example.tokens) == "2+2=4<|endoftext|>"
    assert learned_text(example) == "4<|endoftext|>"


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"data\.chatTemplate"):
        Encoder(DataSpec(format="messages"), TOKENIZER, 64)


def test_rows_that_do_not_parse_or_are_too_long_are_counted_and_the_rest_trained_on(tmp_path: Path) -> None:
    good = {"messages": CHAT}
    long = {"messages": [CHAT[1], {"role": "assistant", "content": "x" * 300}]}
    long_question = {
        "messages": [{"role": "user", "content": "y" * 300}, {"role": "assistant", "content": "z"}]
    }
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"messages": "a string"}),
        json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"other": 1}),
        json.dumps(long),
        json.dumps(long_question),
    ] * 3
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")

    def read(over_length: str) -> tuple[torch.Tensor, str]:
        spec = DataSpec(
            source=str(tmp_path / "chat.jsonl"),
            format="messages",
            chat_template=CHATML,
            eval_fraction=0,
            over_length=over_length,
            packing=False,
        )
        datasets = build_datasets(spec, TOKENIZER, 320, 256, seed=0, streams=1)
        samples = datasets.train.samples(range(3))
        return samples, str(datasets.row_counts())

    samples, truncated = read("truncate")
    # The long question is cut before its answer: nothing left to learn, so it is dropped, not trained on.
    assert truncated.startswith("15 unparsable, 3 truncated, 3 dropped of 24 rows")
    assert samples.shape == (3, 3, 256)
    learned = {TOKENIZER.decode(row[TOKENS][row[LABELS] != -100].tolist()) for row in samples}
    assert "Paris.<|im_end|>\n東京.<|im_end|>\n" in learned
    assert all(
        text.startswith("x") and not text.endswith("<|im_end|>\n")
        for text in learned - {"Paris.<|im_end|>\n東京.<|im_end|>\n"}
    ), "a long answer cut at 256 tokens"
    _, dropped = read("drop")
    assert dropped.startswith("15 unparsable, 0 truncated, 6 dropped of 24 rows")
