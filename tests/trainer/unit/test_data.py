"""Data: jsonl/parquet shards, the held-out split, packing, the position arithmetic and stream cursors that
make a resumed run (on any world size) continue at the exact next sample, and that each rank reads and
tokenises only its share of the corpus."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fsdp_trainer.contract import DataSpec
from fsdp_trainer.data import (
    LABELS,
    POSITIONS,
    TOKENS,
    BatchLayout,
    BatchLoader,
    Datasets,
    ShardPacker,
    StreamedSamples,
    SyntheticSamples,
    build_datasets,
    eval_batch_indices,
    merge_rank_states,
    pack,
)
from fsdp_trainer.errors import DataError
from fsdp_trainer.formats import Encoder
from fsdp_trainer.model import byte_level_tokenizer
from fsdp_trainer.shards import Shard, list_shards, read_shard, split_shards
from fsdp_trainer.storage import Location
from tests.support.corpus import CORPUS, CountingTokenizer, mixed_corpus, write_jsonl

CPU = torch.device("cpu")


def documents_of(uri: str, sequence_length: int = 16) -> list[str]:
    return [doc for shard in list_shards(uri, ["text"], sequence_length) for doc in read_shard(shard, "text")]


def test_jsonl_parquet_and_directories_are_read_in_name_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", ["third", "fourth"])
    pq.write_table(pa.table({"text": ["first", "second"]}), tmp_path / "a.parquet")
    (tmp_path / "notes.txt").write_text("ignored")
    assert documents_of(str(tmp_path / "b.jsonl")) == ["third", "fourth"]
    assert documents_of(str(tmp_path)) == ["first", "second", "third", "fourth"]


@pytest.mark.parametrize("shard_bytes", [1, 2, 7, 31, 64, 4096])
def test_jsonl_shards_hold_every_line_exactly_once_wherever_they_cut(
    tmp_path: Path, shard_bytes: int
) -> None:
    texts = [f"document {i} " + "é" * (i % 13) + "x" * (i * 7 % 50) for i in range(60)]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    size = corpus.stat().st_size
    location = Location.parse(str(corpus))
    shards = [Shard(location, "c.jsonl", a, min(a + shard_bytes, size)) for a in range(0, size, shard_bytes)]
    assert [doc for shard in shards for doc in read_shard(shard, "text")] == texts


def test_missing_source_or_field_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no column 'body'"):
        list_shards(str(write_jsonl(tmp_path / "d.jsonl", ["x"])), ["body"], 16)
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match="no column 'body'"):
        list_shards(str(tmp_path / "p.parquet"), ["body"], 16)
    with pytest.raises(DataError):
        list_shards(str(tmp_path / "absent.jsonl"), ["text"], 16)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("no data here")
    with pytest.raises(DataError, match=r"no \.jsonl"):
        list_shards(str(tmp_path / "empty"), ["text"], 16)


def test_held_out_split_is_seeded_disjoint_and_complete(tmp_path: Path) -> None:
    location = Location.parse(str(tmp_path))
    shards = [Shard(location, f"f{i}.jsonl", 0, 10) for i in range(100)]
    train, held_out = split_shards(shards, 0.1, seed=3)
    assert len(held_out) == 10 and not {s.name for s in train} & {s.name for s in held_out}
    assert sorted(train + held_out, key=shards.index) == shards
    assert split_shards(shards, 0.1, seed=3) == (train, held_out)
    assert split_shards(shards, 0.1, seed=4)[1] != held_out
    assert split_shards(shards, 0.0, seed=3) == (shards, [])
    with pytest.raises(DataError, match="leaves no training data"):
        split_shards(shards[:1], 0.05, seed=3)


def test_packing_keeps_documents_apart_and_drops_the_tail() -> None:
    """Documents end to end, each position restarting at a document (or a row) start, where no label is: no
    token is trained to predict the next document's first."""
    rows = pack([[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0]], sequence_length=4)
    assert rows[:, TOKENS].tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert rows[:, LABELS].tolist() == [[-100, 2, 3, 0], [-100, 5, 0, -100], [-100, 8, 9, 0]]
    assert rows[:, POSITIONS].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]
    assert pack([[1, 2, 3]], sequence_length=2)[:, TOKENS].tolist() == [[1, 2]]


def test_byte_level_tokenizer_maps_bytes_to_their_values() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer("Aé", add_special_tokens=False)["input_ids"]
    assert ids == [65, 0xC3, 0xA9]
    assert tokenizer.decode(ids) == "Aé"
    assert tokenizer.eos_token_id == 256 and len(tokenizer) == 257


def test_steps_tile_the_sample_stream_without_gaps_or_overlaps() -> None:
    layout = BatchLayout(world_size=2, micro_batch_size=3, grad_accumulation=2)
    seen: list[int] = []
    position = 0
    for _step in range(3):
        for micro_step in range(2):
            for rank in range(2):
                seen.extend(layout.micro_batch_indices(position, micro_step, rank))
        position += layout.samples_per_step
    assert seen == sorted(seen) and seen == list(range(36))


def corpus_datasets(
    source: Path, layout: BatchLayout, eval_fraction: float = 0.0, tokenizer: Any = None
) -> Datasets:
    spec = DataSpec(source=str(source), eval_fraction=eval_fraction)
    streams = layout.world_size * layout.micro_batch_size
    return build_datasets(spec, tokenizer or byte_level_tokenizer(), 320, 16, seed=1, streams=streams)


def job(source: Path, layout: BatchLayout) -> list[BatchLoader]:
    """Every rank's batch loader, each with data sources of its own, as on separate workers."""
    return [
        BatchLoader(corpus_datasets(source, layout).train, layout, rank, CPU)
        for rank in range(layout.world_size)
    ]


def global_batch(loaders: list[BatchLoader]) -> torch.Tensor:
    """One step of every rank, in global sample order (micro-step-major, then rank-major)."""
    per_rank = [[batch.input_ids for batch in loader.next_step()] for loader in loaders]
    micro_steps = loaders[0].layout.grad_accumulation
    return torch.cat([per_rank[rank][m] for m in range(micro_steps) for rank in range(len(loaders))])


@pytest.mark.parametrize(
    "after",
    [BatchLayout(2, 2, 1), BatchLayout(1, 2, 2), BatchLayout(4, 1, 1), BatchLayout(1, 2, 1)],
    ids=["same-world-size", "one-rank-accumulating", "four-ranks", "half-the-global-batch"],
)
def test_a_resumed_job_reads_the_samples_an_uninterrupted_one_reads(
    tmp_path: Path, after: BatchLayout
) -> None:
    mixed_corpus(tmp_path)
    before = BatchLayout(world_size=2, micro_batch_size=2, grad_accumulation=1)
    saved_at, then = 300, 200  # together more than an epoch (about 1,800 samples)
    straight = job(tmp_path, before)
    batches = [global_batch(straight) for _ in range(saved_at)]
    # What a checkpoint stores: every rank's state merged, as plain data.
    saved = json.loads(json.dumps(merge_rank_states([loader.state_dict() for loader in straight])))
    uninterrupted = torch.cat([global_batch(straight) for _ in range(then)])

    resumed = job(tmp_path, after)
    for loader in resumed:
        loader.load_state_dict(saved)
    steps = then * before.samples_per_step // after.samples_per_step
    continued = torch.cat([global_batch(resumed) for _ in range(steps)])
    assert saved["data_position"] == saved_at * before.samples_per_step
    assert torch.equal(continued, uninterrupted)
    assert not torch.equal(continued, torch.cat(batches)[: len(continued)]), "not the start again"


def test_each_rank_of_a_two_rank_job_tokenises_only_its_share(tmp_path: Path) -> None:
    texts = mixed_corpus(tmp_path, documents=400, parquet=False)
    layout = BatchLayout(world_size=2, micro_batch_size=1, grad_accumulation=2)
    tokenizers = [CountingTokenizer(), CountingTokenizer()]
    loaders = [
        BatchLoader(corpus_datasets(tmp_path, layout, tokenizer=tokenizer).train, layout, rank, CPU)
        for rank, tokenizer in enumerate(tokenizers)
    ]
    assert not set(texts) & {doc for t in tokenizers for doc in t.documents}, "setup tokenises no document"
    corpus_tokens = sum(len(text.encode()) + 1 for text in texts)  # bytes and an EOS each
    steps = corpus_tokens * 6 // 10 // (layout.samples_per_step * 16)  # the job reads 60 % of the corpus
    for _ in range(steps):
        global_batch(loaders)

    largest_shard = max(shard.stop - shard.start for shard in list_shards(str(tmp_path), ["text"], 16))
    consumed_per_rank = steps * layout.grad_accumulation * 16
    read = [set(tokenizer.documents) & set(texts) for tokenizer in tokenizers]
    assert not read[0] & read[1], "no shard is tokenised by both ranks"
    for documents in read:
        tokenised = sum(len(text.encode()) + 1 for text in documents)
        # Its share, the rest of the shard its stream is in, and the next one, read ahead.
        assert tokenised <= 1.1 * consumed_per_rank + 2 * largest_shard, "its share and the shard read ahead"
        assert len(documents) < 0.4 * len(texts)


def test_the_held_out_shards_are_deterministic_and_never_trained_on(tmp_path: Path) -> None:
    texts = mixed_corpus(tmp_path)
    layout = BatchLayout(world_size=1, micro_batch_size=1, grad_accumulation=1)  # one stream reads all
    tokenizer = CountingTokenizer()
    datasets = corpus_datasets(tmp_path, layout, eval_fraction=0.1, tokenizer=tokenizer)
    again = corpus_datasets(tmp_path, layout, eval_fraction=0.1)
    assert datasets.eval is not None and again.eval is not None
    tokenizer.documents.clear()
    held_out = datasets.eval.first(100_000)
    held_out_documents = set(tokenizer.documents)
    assert torch.equal(held_out, again.eval.first(100_000))
    assert torch.equal(datasets.eval.first(8), held_out[:8])

    tokenizer.documents.clear()
    loader = BatchLoader(datasets.train, layout, 0, CPU)
    corpus_tokens = sum(len(text.encode()) + 1 for text in texts)
    for _ in range(corpus_tokens // 16):  # more than an epoch
        list(loader.next_step())
    trained_documents = set(tokenizer.documents)
    assert not held_out_documents & trained_documents
    assert held_out_documents | trained_documents == set(texts)
    assert 0.05 < len(held_out_documents) / len(texts) < 0.2


def test_every_epoch_visits_every_row_once_in_a_seeded_order(tmp_path: Path) -> None:
    mixed_corpus(tmp_path)
    packer = ShardPacker(Encoder(DataSpec(), byte_level_tokenizer(), 16))
    shards = list_shards(str(tmp_path), ["text"], 16)
    rows = sorted(tuple(row) for shard in shards for row in packer.rows(shard)[:, TOKENS].tolist())
    one_stream = BatchLayout(world_size=1, micro_batch_size=1, grad_accumulation=1)
    samples = corpus_datasets(tmp_path, one_stream).train
    first_epoch = samples.samples(range(len(rows)))[:, TOKENS].tolist()
    second_epoch = samples.samples(range(len(rows), 2 * len(rows)))[:, TOKENS].tolist()
    assert sorted(map(tuple, first_epoch)) == sorted(map(tuple, second_epoch)) == rows
    assert first_epoch != second_epoch
    assert (
        corpus_datasets(tmp_path, one_stream).train.samples(range(50))[:, TOKENS].tolist() == first_epoch[:50]
    )


class RecordingPacker(ShardPacker):
    """Says of every shard it has read whether the training thread (the caller of `samples`) read it."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__(encoder)
        self.reads: queue.Queue[bool] = queue.Queue()

    def rows(self, shard: Shard) -> Any:
        rows = super().rows(shard)
        self.reads.put(threading.current_thread() is threading.main_thread())
        return rows


def test_a_streams_next_shard_is_read_in_the_background_before_the_stream_reaches_it(tmp_path: Path) -> None:
    mixed_corpus(tmp_path)
    shards = list_shards(str(tmp_path), ["text"], 16)
    packer = RecordingPacker(Encoder(DataSpec(), byte_level_tokenizer(), 16))
    samples = StreamedSamples(shards, packer, seed=1, streams=1)
    first = samples.samples([0])
    assert packer.reads.get_nowait() is True, "the first shard: nothing was there to read it earlier"
    assert packer.reads.get(timeout=60) is False, "the next shard, read while the stream is in the first"

    later = samples.samples(range(1, 400))  # across several shards
    reads = [packer.reads.get(timeout=60) for _ in range(packer.reads.qsize())]
    assert len(reads) >= 5 and not any(reads), "no shard was read in the training thread"
    in_one_thread = StreamedSamples(
        shards, ShardPacker(Encoder(DataSpec(), byte_level_tokenizer(), 16)), 1, 1
    )
    assert torch.equal(torch.cat([first, later]), in_one_thread.samples(range(400)))


def test_synthetic_samples_are_a_pure_function_of_seed_and_index() -> None:
    synthetic = SyntheticSamples(vocab_size=100, sequence_length=16, seed=2)
    again = SyntheticSamples(vocab_size=100, sequence_length=16, seed=2)
    assert synthetic.samples([7, 1_000_000]).tolist() == again.samples([7, 1_000_000]).tolist()
    assert synthetic.samples([7]).tolist() != synthetic.samples([8]).tolist()
    assert int(synthetic.samples(range(4))[:, TOKENS].max()) < 100


def test_every_rank_runs_the_same_number_of_eval_batches() -> None:
    small = [eval_batch_indices(5, batches=8, micro_batch_size=2, rank=r, world_size=4) for r in range(4)]
    assert {len(batches) for batches in small} == {1}
    big = [eval_batch_indices(100, batches=3, micro_batch_size=2, rank=r, world_size=2) for r in range(2)]
    assert [len(b) for b in big] == [3, 3]
    flat = [i for batches in big for batch in batches for i in batch]
    assert len(set(flat)) == len(flat), "ranks evaluate different samples"


def test_real_corpus_builds_train_and_held_out_samples() -> None:
    spec = DataSpec(source=str(CORPUS), eval_fraction=0.05)
    datasets = build_datasets(
        spec, byte_level_tokenizer(), vocab_size=320, sequence_length=64, seed=0, streams=2
    )
    assert datasets.eval is not None
    description = json.loads(datasets.description)
    assert description["train_shards"] > 10 * description["eval_shards"] > 0
    assert datasets.eval.first(100).shape == (100, 3, 64)
    batch = datasets.train.samples([0, 1])
    assert batch.shape == (2, 3, 64) and int(batch[:, TOKENS].max()) <= 256


def test_the_data_fingerprint_follows_the_samples_not_the_uri(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"

    def fingerprint(texts: list[str], tokenizer: Any = None, sequence_length: int = 16) -> str:
        write_jsonl(corpus, texts)
        spec = DataSpec(source=str(corpus), eval_fraction=0)
        return build_datasets(
            spec, tokenizer or byte_level_tokenizer(), 320, sequence_length, seed=0, streams=1
        ).fingerprint

    original = ["the first document, long enough to pack", "and a second one of some length"]
    assert fingerprint(original) == fingerprint(original)
    assert fingerprint([*original, "a third document appended later"]) != fingerprint(original)
    assert fingerprint(original, sequence_length=8) != fingerprint(original)
    other_tokenizer = CountingTokenizer()
    other_tokenizer.eos_token_id = None  # no separator between documents: other samples
    assert fingerprint(original, other_tokenizer) != fingerprint(original)
    assert not set(original) & set(other_tokenizer.documents), "without tokenising the corpus"
