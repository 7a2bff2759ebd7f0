"""Rows to examples: the data formats of spec.data (text, messages, promptCompletion), each row becoming its
tokens and, per token, whether the loss is on it; and the count of rows that did not parse or were too long.

Chat rows are rendered with the chat template, and the assistant turns are found the way TRL finds them for
templates without generation markers: the conversation up to an assistant turn, rendered with the generation
prompt, is a prefix of the conversation rendered through that turn, and the characters between the two are
the turn (its end-of-turn token included, so the model learns to stop). A template for which that does not
hold (one that rewrites earlier turns) makes those rows unparsable, counted like any other. Prompt and
completion are tokenised apart and joined, then EOS, as TRL does for plain prompt/completion rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_trainer.contract import DataFormat, DataSpec, LossOn, OverLength
from fsdp_trainer.errors import ConfigError

log = logging.getLogger(__name__)

ASSISTANT = "assistant"


@dataclass(frozen=True)
class Example:
    """One row's tokens and, for each, whether the model is trained to produce it."""

    tokens: list[int]
    learned: list[bool]


@dataclass
class RowCounts:
    """What became of the rows read: `unparsable` and `dropped` rows were left out, `truncated` ones cut to
    the sequence length. `first_problem` says what the first left-out row was."""

    rows: int = 0
    unparsable: int = 0
    truncated: int = 0
    dropped: int = 0
    first_problem: str | None = field(default=None, compare=False)

    def add(self, other: RowCounts) -> None:
        self.rows += other.rows
        self.unparsable += other.unparsable
        self.truncated += other.truncated
        self.dropped += other.dropped
        self.first_problem = self.first_problem or other.first_problem

    def __str__(self) -> str:
        counts = f"{self.unparsable} unparsable, {self.truncated} truncated, {self.dropped} dropped"
        return f"{counts} of {self.rows} rows" + (
            f" (first: {self.first_problem})" if self.first_problem else ""
        )


class UnusableRow(ValueError):
    """A row that does not hold what its format needs."""


class Encoder:
    """Turns rows of one format into examples of at most `sequence_length` tokens."""

    def __init__(self, spec: DataSpec, tokenizer: Any, sequence_length: int) -> None:
        self.spec, self.tokenizer, self.sequence_length = spec, tokenizer, sequence_length
        self.learn_all = spec.format == DataFormat.TEXT or spec.loss_on == LossOn.ALL
        self.template: str | None = None
        if spec.format == DataFormat.MESSAGES:
            self.template = spec.chat_template or getattr(tokenizer, "chat_template", None)
            if not self.template:
                raise ConfigError(
                    "data.format messages: the tokenizer has no chat template; set data.chatTemplate (Jinja) "
                    "or use a tokenizer that has one"
                )
            if not getattr(tokenizer, "is_fast", False):  # only fast tokenizers map tokens to characters
                raise ConfigError(
                    "data.format messages needs a fast tokenizer (tokenizer.json) to find the assistant "
                    "turns' tokens; this one is not"
                )

    def encode(self, rows: Sequence[Any]) -> tuple[list[Example], RowCounts]:
        """`rows`: non-empty texts for the text format, else each row's mapping of field -> value (None: a
        line that is not JSON)."""
        counts = RowCounts(rows=len(rows))
        if self.spec.format == DataFormat.TEXT:
            eos = self.eos()
            encoded = self.tokenizer(list(rows), add_special_tokens=False)["input_ids"]
            documents = [Example([*tokens, *eos], [True] * (len(tokens) + len(eos))) for tokens in encoded]
            if self.spec.packing:  # documents run on from one sequence into the next: none is too long
                return documents, counts
            return self.fitted(documents, counts), counts
        examples: list[Example] = []
        for row in rows:
            try:
                examples.append(self.example(row))
            except UnusableRow as problem:
                counts.unparsable += 1
                counts.first_problem = counts.first_problem or str(problem)
        return self.fitted(examples, counts), counts

    def fitted(self, examples: list[Example], counts: RowCounts) -> list[Example]:
        """The examples within the sequence length, longer ones truncated or dropped (and counted); one cut
        before any token it learns is dropped."""
        kept = []
        for example in examples:
            if len(example.tokens) > self.sequence_length:
                if self.spec.over_length == OverLength.DROP:
                    counts.dropped += 1
                    counts.first_problem = counts.first_problem or (
                        f"a row of {len(example.tokens)} tokens, over training.sequenceLength "
                        f"{self.sequence_length} (data.overLength drop)"
                    )
                    continue
                example = Example(
                    example.tokens[: self.sequence_length], example.learned[: self.sequence_length]
                )
                if not any(example.learned):  # cut before its answer: nothing left to learn from it
                    counts.dropped += 1
                    counts.first_problem = counts.first_problem or (
                        f"a row whose first {self.sequence_length} tokens (training.sequenceLength) hold "
                        "none of the tokens it learns"
                    )
                    continue
                counts.truncated += 1
            kept.append(example)
        return kept

    def example(self, row: Any) -> Example:
        if not isinstance(row, Mapping):
            raise UnusableRow("a line that is not a JSON object")
        if self.spec.format == DataFormat.PROMPT_COMPLETION:
            prompt = self.tokens(_text(row.get(self.spec.prompt_field), self.spec.prompt_field))
            completion = self.tokens(_text(row.get(self.spec.completion_field), self.spec.completion_field))
            completion += self.eos()
            return Example(prompt + completion, [self.learn_all] * len(prompt) + [True] * len(completion))
        return self.conversation(row.get(self.spec.messages_field))

    def conversation(self, messages: Any) -> Example:
        name = self.spec.messages_field
        if not isinstance(messages, list) or not messages:
            raise UnusableRow(f"{name} is not a non-empty list of turns")
        turns = []
        for turn in messages:
            if not isinstance(turn, Mapping) or not isinstance(turn.get("role"), str):
                raise UnusableRow(f"a turn of {name} without a role")
            if not isinstance(turn.get("content"), str):
                raise UnusableRow(f"a turn of {name} whose content is not text")
            turns.append({"role": turn["role"], "content": turn["content"]})
        if not any(turn["role"] == ASSISTANT for turn in turns):
            raise UnusableRow(f"{name} has no assistant turn")
        text = self.render(turns, generation_prompt=False)
        spans = []
        for index, turn in enumerate(turns):
            if turn["role"] != ASSISTANT:
                continue
            before = self.render(turns[:index], generation_prompt=True)
            through = self.render(turns[: index + 1], generation_prompt=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise UnusableRow(
                    "the chat template renders earlier turns differently once later ones follow: the "
                    "assistant turns cannot be told apart (set data.chatTemplate, or data.lossOn all)"
                )
            spans.append((len(before), len(through)))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        tokens = list(encoded["input_ids"])
        if self.learn_all:
            return Example(tokens, [True] * len(tokens))
        learned = [
            any(start <= begin < end for start, end in spans) for begin, _ in encoded["offset_mapping"]
        ]
        return Example(tokens, learned)

    def render(self, turns: list[dict[str, str]], generation_prompt: bool) -> str:
        if not turns:
            return ""
        try:
            rendered = self.tokenizer.apply_chat_template(
                turns, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:  # jinja2's errors, raised by the template on rows it does not accept
            raise UnusableRow(f"the chat template failed: {type(error).__name__}: {error}") from error
        return str(rendered)

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def eos(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise UnusableRow(f"{name} is not a non-empty string")
    return value
