"""Training and evaluation data: documents -> tokens -> packed fixed-length samples -> per-rank batches.

Determinism and resumption rest on one number, the data position: how many samples the whole job has
consumed. Sample `g` of the global stream is `order[g % n]` of epoch `g // n`, where each epoch's order is a
permutation seeded by (seed, epoch). Every optimizer step consumes `world * grad_accumulation *
micro_batch_size` consecutive global positions, laid out micro-step-major then rank-major, so a checkpoint
that stores the position resumes at the exact next sample, on any world size.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
import torch

from fsdp_trainer.contract import DataSpec
from fsdp_trainer.errors import ConfigError, DataError
from fsdp_trainer.storage import Location

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class Tokenizer(Protocol):
    eos_token_id: int | None

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Any: ...


class SampleSource(Protocol):
    """Fixed-length samples addressed by a global index (the index may exceed one epoch)."""

    def __len__(self) -> int: ...

    def samples(self, indices: Sequence[int]) -> torch.Tensor: ...


# ----------------------------------------------------------------------------------------------------------
# Reading documents


def read_documents(uri: str, text_field: str) -> list[str]:
    """All documents of a jsonl/parquet file, or of every such file below a directory, in name order."""
    try:
        location = Location.parse(uri)
        files = {} if location.is_file() else location.list_files()
    except (OSError, ValueError, ImportError) as error:
        raise DataError(f"cannot open data source {uri}: {error}") from error
    if files:
        names = sorted(name for name in files if name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES))
        if not names:
            raise DataError(f"no .jsonl, .json or .parquet files under {uri}")
        targets = [location.child(name) for name in names]
    else:
        targets = [location]
    documents: list[str] = []
    for target in targets:
        documents.extend(_read_file(target, text_field))
    if not documents:
        raise DataError(f"data source {uri} has no documents")
    return documents


def _read_file(location: Location, text_field: str) -> list[str]:
    try:
        if location.path.endswith(PARQUET_SUFFIXES):
            table = pq.read_table(location.path, filesystem=location.fs)
        else:
            with location.fs.open_input_stream(location.path) as stream:
                table = pajson.read_json(stream)
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"cannot read {location.uri}: {error}") from error
    if text_field not in table.column_names:
        raise DataError(f"{location.uri} has no column {text_field!r} (columns: {table.column_names})")
    return [text for text in table.column(text_field).to_pylist() if isinstance(text, str) and text]


def split_documents(documents: list[str], eval_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Holds out a seeded random share of whole documents for evaluation (independent of world size)."""
    if eval_fraction <= 0:
        return documents, []
    order = np.random.default_rng([seed, 0xE7A1]).permutation(len(documents))
    held_out = max(1, round(eval_fraction * len(documents)))
    if held_out >= len(documents):
        raise DataError(f"evalFraction {eval_fraction} leaves no training documents of {len(documents)}")
    eval_set = set(order[:held_out].tolist())
    train = [doc for i, doc in enumerate(documents) if i not in eval_set]
    return train, [documents[i] for i in sorted(eval_set)]


# ----------------------------------------------------------------------------------------------------------
# Tokenising and packing


def pack(token_lists: list[list[int]], eos_token_id: int | None, sequence_length: int) -> np.ndarray:
    """Concatenates documents (each followed by EOS when the tokenizer has one) and cuts the stream into
    rows of sequence_length tokens; the incomplete tail is dropped."""
    separator = [] if eos_token_id is None else [eos_token_id]
    stream = np.fromiter((token for tokens in token_lists for token in (*tokens, *separator)), dtype=np.int64)
    rows = len(stream) // sequence_length
    return stream[: rows * sequence_length].reshape(rows, sequence_length)


def tokenize_and_pack(documents: list[str], tokenizer: Tokenizer, sequence_length: int) -> np.ndarray:
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return pack(encoded, tokenizer.eos_token_id, sequence_length)


@dataclass
class PackedSamples:
    """Packed token rows, visited in a fresh seeded permutation every epoch."""

    rows: np.ndarray
    seed: int
    _order: tuple[int, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        n = len(self)
        picked = [self._epoch_order(g // n)[g % n] for g in indices]
        return torch.from_numpy(self.rows[picked])

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self)))
        return self._order[1]


@dataclass(frozen=True)
class SyntheticSamples:
    """Uniform random tokens, a pure function of (seed, index): the AWS sample's data, resumable for free."""

    vocab_size: int
    sequence_length: int
    seed: int
    size: int = 1 << 40

    def __len__(self) -> int:
        return self.size

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        rows = [
            np.random.default_rng([self.seed, index]).integers(0, self.vocab_size, self.sequence_length)
            for index in indices
        ]
        return torch.from_numpy(np.stack(rows))


# ----------------------------------------------------------------------------------------------------------
# Positions


@dataclass(frozen=True)
class BatchLayout:
    world_size: int
    micro_batch_size: int
    grad_accumulation: int

    @property
    def samples_per_step(self) -> int:
        return self.world_size * self.micro_batch_size * self.grad_accumulation

    def micro_batch_indices(self, position: int, micro_step: int, rank: int) -> list[int]:
        """Global sample indices of one rank's micro-batch in the step that starts at `position`."""
        start = position + (micro_step * self.world_size + rank) * self.micro_batch_size
        return list(range(start, start + self.micro_batch_size))


def eval_batch_indices(
    num_samples: int, batches: int, micro_batch_size: int, rank: int, world_size: int
) -> list[list[int]]:
    """The evaluation set split across ranks; every rank runs the same number of batches (FSDP forwards
    are collective), so a small set is cycled rather than truncated unevenly."""
    per_round = micro_batch_size * world_size
    rounds = max(1, min(batches, num_samples // per_round))
    return [
        [(r * per_round + rank * micro_batch_size + i) % num_samples for i in range(micro_batch_size)]
        for r in range(rounds)
    ]


# ----------------------------------------------------------------------------------------------------------
# Building the sources from the spec


@dataclass
class Datasets:
    train: SampleSource
    eval: SampleSource | None
    description: str
    fingerprint: str  # of the training samples: a checkpoint's data position is valid only while it holds


def build_datasets(
    spec: DataSpec, tokenizer: Tokenizer | None, vocab_size: int, sequence_length: int, seed: int
) -> Datasets:
    if spec.source == SYNTHETIC:
        train = SyntheticSamples(vocab_size, sequence_length, seed)
        held_out = SyntheticSamples(vocab_size, sequence_length, seed + 1, size=1 << 20)
        synthetic = f"{SYNTHETIC}:{vocab_size}:{sequence_length}:{seed}".encode()
        return Datasets(
            train,
            held_out if spec.eval_fraction > 0 else None,
            "synthetic random tokens",
            hashlib.sha256(synthetic).hexdigest()[:16],
        )
    if tokenizer is None:
        raise ConfigError("real data needs a tokenizer: set model.tokenizer or model.source")
    documents = read_documents(spec.source, spec.text_field)
    if spec.eval_source:
        train_docs, eval_docs = documents, read_documents(spec.eval_source, spec.text_field)
    else:
        train_docs, eval_docs = split_documents(documents, spec.eval_fraction, seed)
    train_rows = tokenize_and_pack(train_docs, tokenizer, sequence_length)
    if len(train_rows) == 0:
        raise DataError(f"{spec.source} holds fewer than {sequence_length} training tokens")
    eval_rows = tokenize_and_pack(eval_docs, tokenizer, sequence_length) if eval_docs else None
    if eval_docs and (eval_rows is None or len(eval_rows) == 0):
        log.warning("held-out documents hold fewer than %d tokens: evaluation disabled", sequence_length)
        eval_rows = None
    description = json.dumps(
        {
            "source": spec.source,
            "documents": len(train_docs),
            "train_samples": len(train_rows),
            "eval_samples": 0 if eval_rows is None else len(eval_rows),
        }
    )
    return Datasets(
        PackedSamples(train_rows, seed),
        None if eval_rows is None else PackedSamples(eval_rows, seed),
        description,
        # The packed rows themselves: a changed corpus or tokenizer changes them even under the same URI.
        hashlib.sha256(np.ascontiguousarray(train_rows).data).hexdigest()[:16],
    )
