"""Data: reading jsonl/parquet, the held-out split, packing, and the position arithmetic that makes a resumed
run (on any world size) continue at the exact next sample."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdp_trainer.contract import DataSpec
from fsdp_trainer.data import (
    BatchLayout,
    PackedSamples,
    SyntheticSamples,
    build_datasets,
    eval_batch_indices,
    pack,
    read_documents,
    split_documents,
)
from fsdp_trainer.errors import DataError
from fsdp_trainer.model import byte_level_tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "data" / "stdlib-docstrings.jsonl"


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text, "n": i}) + "\n" for i, text in enumerate(texts)))
    return path


def test_jsonl_parquet_and_directories_are_read_in_name_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", ["third", "fourth"])
    pq.write_table(pa.table({"text": ["first", "second"]}), tmp_path / "a.parquet")
    (tmp_path / "notes.txt").write_text("ignored")
    assert read_documents(str(tmp_path / "b.jsonl"), "text") == ["third", "fourth"]
    assert read_documents(str(tmp_path), "text") == ["first", "second", "third", "fourth"]


def test_missing_source_or_field_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no column 'body'"):
        read_documents(str(write_jsonl(tmp_path / "d.jsonl", ["x"])), "body")
    with pytest.raises(DataError):
        read_documents(str(tmp_path / "absent.jsonl"), "text")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.md").write_text("no data here")
    with pytest.raises(DataError, match=r"no \.jsonl"):
        read_documents(str(tmp_path / "empty"), "text")


def test_held_out_split_is_seeded_disjoint_and_complete() -> None:
    documents = [f"doc {i}" for i in range(100)]
    train, held_out = split_documents(documents, 0.1, seed=3)
    assert len(held_out) == 10 and not set(train) & set(held_out)
    assert sorted(train + held_out) == sorted(documents)
    assert split_documents(documents, 0.1, seed=3) == (train, held_out)
    assert split_documents(documents, 0.1, seed=4)[1] != held_out
    assert split_documents(documents, 0.0, seed=3) == (documents, [])


def test_packing_separates_documents_with_eos_and_drops_the_tail() -> None:
    rows = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], eos_token_id=0, sequence_length=4)
    assert rows.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert pack([[1, 2, 3]], eos_token_id=None, sequence_length=2).tolist() == [[1, 2]]


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


def test_resuming_at_a_saved_position_continues_the_same_stream_on_any_world_size() -> None:
    samples = PackedSamples(np.arange(50).reshape(10, 5), seed=1)
    before = BatchLayout(world_size=2, micro_batch_size=2, grad_accumulation=1)
    position = 3 * before.samples_per_step  # saved after three steps
    after = BatchLayout(world_size=1, micro_batch_size=2, grad_accumulation=2)
    continued = [i for m in range(2) for i in after.micro_batch_indices(position, m, 0)]
    uninterrupted = [i for r in range(2) for i in before.micro_batch_indices(position, 0, r)]
    assert sorted(continued) == sorted(uninterrupted) == [12, 13, 14, 15]
    assert samples.samples(continued).tolist() == samples.samples(uninterrupted).tolist()


def test_every_epoch_visits_every_row_once_in_a_seeded_order() -> None:
    rows = np.arange(40).reshape(8, 5)
    samples = PackedSamples(rows, seed=5)
    first_epoch = samples.samples(range(8))[:, 0].tolist()
    second_epoch = samples.samples(range(8, 16))[:, 0].tolist()
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(0, 40, 5))
    assert first_epoch != second_epoch
    assert PackedSamples(rows, seed=5).samples([9, 3]).tolist() == samples.samples([9, 3]).tolist()


def test_synthetic_samples_are_a_pure_function_of_seed_and_index() -> None:
    synthetic = SyntheticSamples(vocab_size=100, sequence_length=16, seed=2)
    again = SyntheticSamples(vocab_size=100, sequence_length=16, seed=2)
    assert synthetic.samples([7, 1_000_000]).tolist() == again.samples([7, 1_000_000]).tolist()
    assert synthetic.samples([7]).tolist() != synthetic.samples([8]).tolist()
    assert int(synthetic.samples(range(4)).max()) < 100


def test_every_rank_runs_the_same_number_of_eval_batches() -> None:
    small = [eval_batch_indices(5, batches=8, micro_batch_size=2, rank=r, world_size=4) for r in range(4)]
    assert {len(batches) for batches in small} == {1}
    big = [eval_batch_indices(100, batches=3, micro_batch_size=2, rank=r, world_size=2) for r in range(2)]
    assert [len(b) for b in big] == [3, 3]
    flat = [i for batches in big for batch in batches for i in batch]
    assert len(set(flat)) == len(flat), "ranks evaluate different samples"


def test_real_corpus_builds_train_and_held_out_samples() -> None:
    spec = DataSpec(source=str(CORPUS), eval_fraction=0.05)
    datasets = build_datasets(spec, byte_level_tokenizer(), vocab_size=320, sequence_length=64, seed=0)
    assert datasets.eval is not None
    assert len(datasets.train) > 10 * len(datasets.eval) > 0
    batch = datasets.train.samples([0, 1])
    assert batch.shape == (2, 64) and int(batch.max()) <= 256


def test_the_data_fingerprint_follows_the_samples_not_the_uri(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"

    def fingerprint(texts: list[str]) -> str:
        write_jsonl(corpus, texts)
        spec = DataSpec(source=str(corpus), eval_fraction=0)
        return build_datasets(
            spec, byte_level_tokenizer(), vocab_size=320, sequence_length=16, seed=0
        ).fingerprint

    original = ["the first document, long enough to pack", "and a second one of some length"]
    assert fingerprint(original) == fingerprint(original)
    assert fingerprint([*original, "a third document appended later"]) != fingerprint(original)
