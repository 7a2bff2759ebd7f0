"""Training and evaluation data: shards -> rows -> examples (formats.py: the tokens and those the loss is
on) -> fixed-length samples -> per-rank micro-batches.

Samples. A sample is three rows of sequence_length: token ids, labels (IGNORE_INDEX where there is no
target: prompts unless data.lossOn is all, padding, each example's first token) and position ids, which
restart at each example so that packed examples neither attend to nor predict each other (see
optim.model_inputs for how each attention implementation is kept apart). Text documents are packed end to
end and cut at the sequence length (pre-training); messages and promptCompletion examples are never cut:
they are packed whole by best-fit decreasing, or one to a sample when data.packing is off.

Layout. The corpus is cut into shards that depend on the files alone, never on the world size: byte ranges
of each jsonl file (a shard holds the lines that begin in its range) and the row groups of each parquet
file. Samples are packed within a shard (each shard's incomplete last sequence is dropped). The training
sample stream is interleaved from `streams` streams: global sample `g` is sample `g // streams` of stream
`g % streams`. Stream `s` visits the shards at positions s, s + streams, s + 2 * streams, ... of the endless
shard sequence made of one seeded permutation of the training shards per epoch, and takes each visited
shard's rows in a seeded order of their own. A job's batches tile the global stream exactly as before
(BatchLayout: micro-step-major, then rank-major), and `streams` is the first attempt's world size times its
micro-batch size, so every rank reads only its own `micro_batch_size` streams: the shards it needs, one
at a time. A stream's next shard is read and tokenised by a background thread as soon as the stream enters
a shard, so a step that crosses into it does not wait for the read (bench/trainer_prefetch.py measures the
wait and the step times beside reading in the training thread); a rank holds at most two shards' rows per
stream.

Resumption. The data position (global samples consumed) alone fixes which samples come next, but reaching
a stream's next sample from it would mean tokenising the stream's earlier shards again; so the checkpoint
also stores each stream's cursor (its next sample's shard visit and row), gathered from the ranks that read
it, and `streams` itself. A resumed job, on any world size, continues the same global stream at the exact
next sample, reading only the shard each of its streams is in and those after it.

Trade-offs. The sample order depends on the first attempt's world size and micro-batch size (through
`streams`), not only on the seed. Each rank reads only its own streams while `streams` is a multiple of
world_size * micro_batch_size and divides a step's samples; a job resumed otherwise stays exact, but several
ranks walk the same stream and each tokenises its shards. Epochs are per stream: a stream whose shards hold
fewer rows reaches the next epoch's shards sooner. Shard sizes trade the loss of each shard's last partial
sequence (under 2 % at 4 bytes a token with the largest shards) against shards small enough that a small
corpus still has enough of them for its ranks and its held-out split. A parquet row group is one shard:
decoding is per row group, so write row groups of about a shard's size.

The held-out split and the data fingerprint need no tokenising either: evaluation holds out a seeded share
of whole shards (every rank reads the first of them, as many as its evaluation batches need), and the
fingerprint hashes the shard table (file names, byte sizes, parquet row counts) with the tokenizer's identity
and the sequence length, so a checkpoint's position is refused when the data under the same URI changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from fsdp_trainer import distributed
from fsdp_trainer.chunked_loss import IGNORE_INDEX
from fsdp_trainer.contract import FORMATTING_FIELDS, DataFormat, DataSpec
from fsdp_trainer.errors import ConfigError, DataError
from fsdp_trainer.formats import Encoder, Example, RowCounts
from fsdp_trainer.shards import SYNTHETIC, Shard, read_records, read_shard, source_shards

log = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # in the fingerprint: checkpoints of another layout hold positions in another order
# The domains of the seeded orders: of the shards in an epoch, of the rows in a visited shard (the split's is
# shards.HELD_OUT).
SHARD_ORDER, ROW_ORDER = 0x5EA4, 0x40D7
TOKENIZER_PROBE = "Tokenizer identity: ASCII, digits 0123456789, émigré, Straße, 東京, 🙂, \tcode(x) != y\n"


class Tokenizer(Protocol):
    eos_token_id: int | None

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Any: ...


# A sample is a (ROW_PARTS, sequence_length) int64 array: the token ids, the labels (the token each position
# is trained to produce, IGNORE_INDEX where none) and the position ids, which restart at each example.
TOKENS, LABELS, POSITIONS = range(3)
ROW_PARTS = 3


class TrainSamples(Protocol):
    """Fixed-length samples addressed by a global index, read in increasing order; the state is what a
    checkpoint needs to continue reading at any later index."""

    def samples(self, indices: Sequence[int]) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class EvalSamples(Protocol):
    def first(self, count: int) -> torch.Tensor:
        """The first `count` held-out samples, or all of them when there are fewer."""
        ...


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on this rank: token ids, labels (transformers': IGNORE_INDEX where a position has no
    target, such as padding, a masked prompt or an example's first token) and position ids (None: 0, 1, ...
    in every row). `packed`: some row holds several examples, which must not attend to each other."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    packed: bool = False

    @classmethod
    def of_tokens(cls, tokens: torch.Tensor) -> MicroBatch:
        """Rows of one sequence each, every token learned: pre-training's (and the tests') batches."""
        return cls(tokens, tokens)

    @classmethod
    def from_samples(cls, samples: torch.Tensor, device: torch.device) -> MicroBatch:
        """From samples in host memory: whether positions restart is read there, with no device sync."""
        positions = samples.numpy()[:, POSITIONS]  # numpy: not a tensor read that sync counters see
        packed = bool((positions[:, 1:] != positions[:, :-1] + 1).any())
        on_device = to_device(samples, device)
        return cls(
            on_device[:, TOKENS], on_device[:, LABELS], on_device[:, POSITIONS] if packed else None, packed
        )


# ----------------------------------------------------------------------------------------------------------
# Tokenising and packing


def example_rows(tokens: np.ndarray, learned: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Samples from rows of tokens cut at sequence boundaries: `learned` marks the targets, `starts` the
    positions where an example (or the part of one that a row holds) begins. An example's first token has no
    target (nothing before it in the example predicts it), and positions count from each start."""
    labels = np.where(learned & ~starts, tokens, IGNORE_INDEX)
    index = np.arange(tokens.shape[-1])
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    return np.stack([tokens, labels, index - last_start], axis=-2)


def pack(documents: list[list[int]], sequence_length: int) -> np.ndarray:
    """Pre-training packing: documents (each ending in EOS when the tokenizer has one) end to end, cut into
    rows of sequence_length tokens; the incomplete tail is dropped. A document cut by a row boundary goes on
    in the next row, from position 0; no document attends to or predicts another."""
    stream = np.fromiter((token for document in documents for token in document), dtype=np.int64)
    document_starts = np.zeros(len(stream), dtype=bool)
    document_starts[np.cumsum([0, *(len(document) for document in documents[:-1])])] = True
    rows = len(stream) // sequence_length
    starts = document_starts[: rows * sequence_length].reshape(rows, sequence_length)
    starts[:, 0] = True
    tokens = stream[: rows * sequence_length].reshape(rows, sequence_length)
    return example_rows(tokens, np.ones_like(starts), starts)


def pack_examples(
    examples: list[Example], pad_token_id: int, sequence_length: int, packing: bool
) -> np.ndarray:
    """Fine-tuning rows: examples (each at most sequence_length tokens) never split, several to a row by
    best-fit decreasing (TRL's packing) or one to a row; the rest of a row is padding, which has no target
    and to which no example attends (it comes after them, under causal attention). The padding's positions
    go on from the last example's, so a row of one example is an ordinary row: no mask to build for it."""
    if packing:
        bins: list[list[Example]] = []
        space: list[int] = []
        for example in sorted(examples, key=lambda example: len(example.tokens), reverse=True):
            fits = [i for i, free in enumerate(space) if free >= len(example.tokens)]
            if fits:
                best = min(fits, key=space.__getitem__)
                bins[best].append(example)
                space[best] -= len(example.tokens)
            else:
                bins.append([example])
                space.append(sequence_length - len(example.tokens))
    else:
        bins = [[example] for example in examples]
    tokens = np.full((len(bins), sequence_length), pad_token_id, dtype=np.int64)
    learned = np.zeros((len(bins), sequence_length), dtype=bool)
    starts = np.zeros((len(bins), sequence_length), dtype=bool)
    for row, held in enumerate(bins):
        at = 0
        for example in held:
            end = at + len(example.tokens)
            tokens[row, at:end] = example.tokens
            learned[row, at:end] = example.learned
            starts[row, at] = True
            at = end
    return example_rows(tokens, learned, starts)


class ShardPacker:
    """A shard's samples in the run's format (formats.Encoder), and what became of the rows of the shards
    read so far (each shard counted once, however often it is read)."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.sequence_length = encoder.sequence_length
        self._counts: dict[tuple[str, int, int, int | None], RowCounts] = {}
        self._lock = threading.Lock()  # the prefetch thread and the training thread both read shards

    def rows(self, shard: Shard) -> np.ndarray:
        spec, tokenizer = self.encoder.spec, self.encoder.tokenizer
        if spec.format == DataFormat.TEXT:
            rows: list[Any] = read_shard(shard, spec.text_field)
        else:
            rows = list(read_records(shard, spec.fields()))
        examples, counts = self.encoder.encode(rows)
        with self._lock:
            key = (shard.location.uri, shard.start, shard.stop, shard.row_group)
            if key not in self._counts and (counts.unparsable or counts.truncated or counts.dropped):
                log.warning("data %s [%d, %d): %s", shard.name, shard.start, shard.stop, counts)
            self._counts[key] = counts
        if not examples:
            return np.empty((0, ROW_PARTS, self.sequence_length), dtype=np.int64)
        if spec.format == DataFormat.TEXT and spec.packing:
            return pack([example.tokens for example in examples], self.sequence_length)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return pack_examples(examples, int(pad or 0), self.sequence_length, spec.packing)

    def counts(self) -> RowCounts:
        total = RowCounts()
        with self._lock:
            for counts in self._counts.values():
                total.add(counts)
        return total


@functools.lru_cache(maxsize=8)  # streams advance at different rates, so a few epochs are in use at once
def _shard_order(seed: int, epoch: int, shards: int) -> np.ndarray:
    return np.random.default_rng([seed, SHARD_ORDER, epoch]).permutation(shards)


class StreamedSamples:
    """Training samples from shards read as the streams reach them (see the module docstring). Each stream
    keeps its cursor, the rows of the one shard it is in, and the read of its next shard in flight: the only
    data a rank holds."""

    def __init__(self, shards: list[Shard], packer: ShardPacker, seed: int, streams: int) -> None:
        self.shards, self.packer, self.seed, self.streams = shards, packer, seed, streams
        self._cursors: dict[int, tuple[int, int, int]] = {}  # stream -> (next sample, its visit, its row)
        self._visited: dict[int, tuple[int, np.ndarray]] = {}  # stream -> (visit, that shard's rows)
        self._ahead: dict[int, tuple[int, Future[np.ndarray]]] = {}  # stream -> (next visit, its rows)
        # One thread: reads queue behind each other, one per stream at most, never ahead of the training.
        self._prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.from_numpy(np.stack([self._sample(index) for index in indices]))

    def state_dict(self) -> dict[str, Any]:
        """Every stream's cursor, from the rank that read it furthest: a collective when distributed."""
        mine = {
            "data_streams": self.streams,
            "data_cursors": [[s, *c] for s, c in sorted(self._cursors.items())],
        }
        return merge_rank_states(distributed.all_gather(mine) if dist.is_initialized() else [mine])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.streams = int(state_dict["data_streams"])
        self._cursors = {int(s): (int(i), int(v), int(r)) for s, i, v, r in state_dict["data_cursors"]}
        self._visited.clear()
        self._ahead.clear()  # reads of a position that no longer applies: their results are never used

    def _sample(self, index: int) -> np.ndarray:
        stream, wanted = index % self.streams, index // self.streams
        at, visit, row = self._cursors.get(stream, (0, 0, 0))
        if wanted < at:
            raise ValueError(f"stream {stream} has passed sample {wanted} (it is at {at}): read in order")
        empty_visits = 0
        while True:
            rows = self._visit_rows(stream, visit)
            if row + wanted - at < len(rows):
                row += wanted - at
                self._cursors[stream] = (wanted + 1, visit, row + 1)
                return np.asarray(rows[row])
            empty_visits = empty_visits + 1 if len(rows) == 0 else 0
            if empty_visits > len(self.shards):
                raise DataError(
                    f"{empty_visits} shards in a row hold fewer than {self.packer.sequence_length} tokens: "
                    "the data is too small for this sequence length"
                )
            at, visit, row = at + len(rows) - row, visit + 1, 0

    def _visit_rows(self, stream: int, visit: int) -> np.ndarray:
        cached = self._visited.get(stream)
        if cached is not None and cached[0] == visit:
            return cached[1]
        ahead = self._ahead.pop(stream, None)
        if ahead is not None and ahead[0] == visit:
            rows = ahead[1].result()  # raises what the read raised, when the stream needs the shard
        else:
            rows = self._read_visit(stream, visit)
        self._visited[stream] = (visit, rows)
        self._ahead[stream] = (visit + 1, self._prefetch.submit(self._read_visit, stream, visit + 1))
        return rows

    def _read_visit(self, stream: int, visit: int) -> np.ndarray:
        """The rows of a stream's `visit`-th shard, in their seeded order."""
        slot = stream + visit * self.streams  # in the endless shard sequence
        epoch, place = divmod(slot, len(self.shards))
        rows = self.packer.rows(self.shards[int(_shard_order(self.seed, epoch, len(self.shards))[place])])
        return rows[np.random.default_rng([self.seed, ROW_ORDER, slot]).permutation(len(rows))]


def merge_rank_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from every rank's (the rest of which is the same everywhere): each stream's cursor from the
    rank that read it furthest; a rank that has not read a stream since the last load holds the loaded one."""
    furthest: dict[int, list[int]] = {}
    for state in states:
        for cursor in state["data_cursors"]:
            stream = cursor[0]
            if stream not in furthest or cursor[1] > furthest[stream][1]:
                furthest[stream] = list(cursor)
    return {**states[0], "data_cursors": [furthest[stream] for stream in sorted(furthest)]}


@dataclass(frozen=True)
class HeldOutSamples:
    """Evaluation samples: the held-out shards in order, read only as far as asked."""

    shards: list[Shard]
    packer: ShardPacker

    def first(self, count: int) -> torch.Tensor:
        taken = [np.empty((0, ROW_PARTS, self.packer.sequence_length), dtype=np.int64)]
        held = 0
        for shard in self.shards:
            if held >= count:
                break
            rows = self.packer.rows(shard)[: count - held]
            taken.append(rows)
            held += len(rows)
        return torch.from_numpy(np.concatenate(taken))


@dataclass(frozen=True)
class SyntheticSamples:
    """Uniform random tokens, a pure function of (seed, index): the AWS sample's data, resumable for free."""

    vocab_size: int
    sequence_length: int
    seed: int

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        tokens = np.stack(
            [
                np.random.default_rng([self.seed, index]).integers(0, self.vocab_size, self.sequence_length)
                for index in indices
            ]
        )
        positions = np.broadcast_to(np.arange(self.sequence_length), tokens.shape)
        return torch.from_numpy(np.stack([tokens, tokens, positions], axis=1))

    def first(self, count: int) -> torch.Tensor:
        return self.samples(range(count))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


# ----------------------------------------------------------------------------------------------------------
# Positions and batches


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


class BatchLoader:
    """This rank's micro-batches, one optimizer step at a time, and the data position: the global samples the
    job has consumed. Stateful for DCP: the checkpoint's AppState saves and restores it with the samples'
    own state (a collective for streamed data, so every rank calls state_dict together)."""

    def __init__(self, samples: TrainSamples, layout: BatchLayout, rank: int, device: torch.device) -> None:
        self.samples, self.layout, self.rank, self.device = samples, layout, rank, device
        self.position = 0

    def next_step(self) -> Iterator[MicroBatch]:
        """The next step's micro-batches, each read as it is requested; the position moves past the step at
        once, so a checkpoint saved after the step resumes after it."""
        start = self.position
        self.position += self.layout.samples_per_step
        return (
            MicroBatch.from_samples(
                self.samples.samples(self.layout.micro_batch_indices(start, micro_step, self.rank)),
                self.device,
            )
            for micro_step in range(self.layout.grad_accumulation)
        )

    def state_dict(self) -> dict[str, Any]:
        return {"data_position": self.position, **self.samples.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["data_position"])
        self.samples.load_state_dict(state_dict)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """On CUDA, pinned and copied without blocking: a copy from pageable memory waits for everything queued
    on the GPU to finish, a step's worth of work, before the host can queue the next forward."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


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
    train: TrainSamples
    eval: EvalSamples | None
    description: str
    fingerprint: str  # of the training samples: a checkpoint's data position is valid only while it holds
    # What became of the rows of the shards this rank has read so far (formats.RowCounts).
    row_counts: Callable[[], RowCounts] = RowCounts


ShardTable = tuple[list[Shard], list[Shard]]  # the training and the held-out shards


def shared_source_shards(spec: DataSpec, sequence_length: int, seed: int) -> ShardTable:
    """source_shards listed by rank 0 alone and broadcast to the others: the listing and each parquet
    footer are read once per run, not once per rank (files x ranks requests, which S3 throttles at scale).
    Rank 0's DataError fails every rank with its message, none left waiting in a collective."""
    table: ShardTable | None = None
    refusal: str | None = None
    if dist.get_rank() == 0:
        try:
            table = source_shards(spec, sequence_length, seed)
        except DataError as error:
            refusal = str(error)
    table, refusal = distributed.broadcast((table, refusal))
    if refusal is not None:
        raise DataError(refusal)
    assert table is not None  # rank 0 sends a table or a refusal
    return table


def build_datasets(
    spec: DataSpec,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    sequence_length: int,
    seed: int,
    streams: int,
    list_source: Callable[[DataSpec, int, int], ShardTable] = source_shards,
) -> Datasets:
    """The sources; `streams` (world size x micro-batch size) applies to a new run, a checkpoint's replaces
    it. `list_source` gives the shard table (the loop's: shared_source_shards)."""
    if spec.source == SYNTHETIC:
        synthetic = f"{SYNTHETIC}:{vocab_size}:{sequence_length}:{seed}".encode()
        return Datasets(
            SyntheticSamples(vocab_size, sequence_length, seed),
            SyntheticSamples(vocab_size, sequence_length, seed + 1) if spec.eval_fraction > 0 else None,
            "synthetic random tokens",
            hashlib.sha256(synthetic).hexdigest()[:16],
        )
    if tokenizer is None:
        raise ConfigError("real data needs a tokenizer: set model.tokenizer or model.source")
    train_shards, eval_shards = list_source(spec, sequence_length, seed)
    packer = ShardPacker(Encoder(spec, tokenizer, sequence_length))
    description = json.dumps(
        {
            "source": spec.source,
            "train_shards": len(train_shards),
            "eval_shards": len(eval_shards),
            "streams": streams,
        }
    )
    table = [[shard.name, shard.start, shard.stop, shard.row_group] for shard in train_shards]
    identity = {
        "layout": LAYOUT_VERSION,
        "shards": table,
        "tokenizer": [
            tokenizer.eos_token_id,
            tokenizer([TOKENIZER_PROBE], add_special_tokens=False)["input_ids"],
        ],
        "sequence_length": sequence_length,
        "seed": seed,
    }
    formatting = spec.model_dump(mode="json", exclude_defaults=True, include=set(FORMATTING_FIELDS))
    if formatting:  # a text run's fingerprint stays what it was
        identity["formatting"] = formatting
    return Datasets(
        StreamedSamples(train_shards, packer, seed, streams),
        HeldOutSamples(eval_shards, packer) if eval_shards else None,
        description,
        # What the samples depend on: a changed corpus or tokenizer changes it even under the same URI.
        hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16],
        packer.counts,
    )
