"""Text corpora for the trainer's data tests: the example corpus, and a generated one in jsonl and parquet."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fsdp_trainer.model import byte_level_tokenizer
from tests.support.paths import REPO

CORPUS = REPO / "examples" / "data" / "stdlib-docstrings.jsonl"


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text, "n": i}) + "\n" for i, text in enumerate(texts)))
    return path


WORDS = ["shard", "stream", "rank", "token", "epoch", "cursor", "sample", "resume", "pack", "ÿ", "東京"]


def mixed_corpus(directory: Path, documents: int = 200, parquet: bool = True) -> list[str]:
    """Unique documents of 30 to 250 bytes, the first half in a jsonl file, the rest in a parquet file of
    ten-row row groups (or a second jsonl file)."""
    rng = random.Random(7)
    texts = [
        f"doc {i:04d}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
        for i in range(documents)
    ]
    half = documents // 2
    write_jsonl(directory / "a.jsonl", texts[:half])
    if parquet:
        pq.write_table(pa.table({"text": texts[half:]}), directory / "b.parquet", row_group_size=10)
    else:
        write_jsonl(directory / "b.jsonl", texts[half:])
    return texts


class CountingTokenizer:
    """The byte-level tokenizer, recording every document it tokenises."""

    def __init__(self) -> None:
        self.inner = byte_level_tokenizer()
        self.eos_token_id = self.inner.eos_token_id
        self.documents: list[str] = []

    def __call__(self, text: list[str], add_special_tokens: bool = False) -> Any:
        self.documents.extend(text)
        return self.inner(text, add_special_tokens=add_special_tokens)


def write_chat_jsonl(path: Path, conversations: int, seed: int = 5) -> Path:
    """Conversations in the messages format, their answers of very different lengths (1 to 30 words)."""
    rng = random.Random(seed)
    rows = []
    for i in range(conversations):
        question = f"q{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        rows.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
