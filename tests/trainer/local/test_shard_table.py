"""One rank builds the shard table (issue 34 item 4): rank 0 lists the corpus and reads the parquet footers,
the others receive the table by broadcast, so storage sees one listing per run, not one per rank. Two CPU
processes in a gloo group."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
import torch.multiprocessing as multiprocessing

from fsdp_trainer import data, shards
from fsdp_trainer.contract import DataSpec
from fsdp_trainer.errors import DataError
from fsdp_trainer.storage import Location
from tests.support.net import free_port


class ByteTokenizer:
    """Bytes as tokens: the spawned ranks need no transformers (the table is what is under test)."""

    eos_token_id: int | None = 0

    def __call__(self, text: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [list(document.encode()) for document in text]}


def counted(touches: Counter[str], name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        touches[name] += 1
        return function(*args, **kwargs)

    return call


def build_on_rank(rank: int, port: int, source: str, out: str) -> None:
    """Builds the datasets as the loop does, recording every storage access the shard table could make."""
    touches: Counter[str] = Counter()
    for owner, name in [
        (Location, "list_files"),
        (Location, "is_file"),
        (pq, "ParquetFile"),  # a parquet footer
        (shards, "read_records"),  # the first jsonl shard, read to check the text field
    ]:
        setattr(owner, name, counted(touches, name, getattr(owner, name)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        datasets = data.build_datasets(
            DataSpec(source=source, eval_fraction=0.2),
            ByteTokenizer(),
            320,
            16,
            seed=1,
            streams=2,
            list_source=data.shared_source_shards,
        )
        result: dict[str, Any] = {"fingerprint": datasets.fingerprint, "touches": dict(touches)}
    except DataError as error:
        result = {"error": str(error), "touches": dict(touches)}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(result, file)


def build_on_two_ranks(source: Path, out: Path) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=build_on_rank, args=(r, port, str(source), str(out))) for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
    assert [process.exitcode for process in ranks] == [0, 0]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_only_rank_0_touches_storage_for_the_shard_table(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [f"document {i}" for i in range(100)]
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[:50]))
    pq.write_table(pa.table({"text": texts[50:]}), corpus / "b.parquet", row_group_size=10)
    zero, one = build_on_two_ranks(corpus, tmp_path)
    assert zero["touches"] == {"list_files": 1, "is_file": 1, "ParquetFile": 1, "read_records": 1}
    assert one["touches"] == {}, "rank 1 received the table"
    assert zero["fingerprint"] == one["fingerprint"], "the same shards, split the same way"


def test_rank_0s_data_error_fails_every_rank_with_its_message(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    zero, one = build_on_two_ranks(empty, tmp_path)
    assert "no .jsonl, .json or .parquet files" in zero["error"]
    assert one["error"] == zero["error"] and one["touches"] == {}
