"""The shard table of a data source: its files cut into shards from the listing and parquet footers alone,
and the held-out split (data.py's docstring tells the layout). No torch: the Ray driver checks a run's data
here before any worker starts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from fsdp_trainer.contract import DataSpec
from fsdp_trainer.errors import DataError
from fsdp_trainer.storage import Location

SYNTHETIC = "synthetic"
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
# A jsonl shard holds between 32 and 256 sequences' worth of bytes, aiming at MIN_SHARDS shards.
SHARD_BYTES_PER_TOKEN = (32, 256)
MIN_SHARDS = 64
LINE_END = b"\n"
TAIL_READ_BYTES = 64 << 10  # read past a shard's range in steps of this size to finish its last line
HELD_OUT = 0xE7A1  # the domain of the split's seeded order


@dataclass(frozen=True)
class Shard:
    """Part of one file: the jsonl lines that begin in bytes [start, stop), or parquet row group
    `row_group`, rows [start, stop) of the file."""

    location: Location
    name: str  # the file's path below the data source
    start: int
    stop: int
    row_group: int | None = None


def list_shards(uri: str, fields: Sequence[str], sequence_length: int) -> list[Shard]:
    """The shards of a jsonl/parquet file, or of every such file below a directory in name order, from the
    listing and parquet footers alone (and the first jsonl shard, read to check that `fields` are there)."""
    try:
        location = Location.parse(uri)
        if location.is_file():  # read as jsonl unless it is named .parquet
            files = {location.name: (location, location.fs.get_file_info(location.path).size)}
        else:
            listing = location.list_files()
            files = {
                name: (location.child(name), size)
                for name, size in listing.items()
                if name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)
            }
    except (OSError, ValueError, ImportError) as error:
        raise DataError(f"cannot open data source {uri}: {error}") from error
    if not files:
        raise DataError(f"no .jsonl, .json or .parquet files under {uri}")
    names = sorted(files)
    jsonl_bytes = sum(files[name][1] for name in names if not name.endswith(PARQUET_SUFFIXES))
    low, high = (factor * sequence_length for factor in SHARD_BYTES_PER_TOKEN)
    shard_bytes = min(max(jsonl_bytes // MIN_SHARDS, low), high)
    shards: list[Shard] = []
    for name in names:
        file, size = files[name]
        if name.endswith(PARQUET_SUFFIXES):
            shards.extend(_parquet_shards(file, name, fields))
        else:
            shards.extend(
                Shard(file, name, start, min(start + shard_bytes, size))
                for start in range(0, size, shard_bytes)
            )
    if not shards:
        raise DataError(f"data source {uri} has no documents")
    # A misnamed field fails here, not at the first step: the first jsonl shard must have it (parquet files
    # were checked by their schema).
    jsonl = [shard for shard in shards if shard.row_group is None]
    if jsonl:
        present = {key for row in read_records(jsonl[0], fields) if row is not None for key in row}
        for name in fields:
            if present and name not in present:
                raise DataError(
                    f"{jsonl[0].location.uri} has no column {name!r} (columns: {sorted(present)})"
                )
    return shards


def _parquet_shards(file: Location, name: str, fields: Sequence[str]) -> list[Shard]:
    try:
        parquet = pq.ParquetFile(file.path, filesystem=file.fs)
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"cannot read {file.uri}: {error}") from error
    for field in fields:
        if field not in parquet.schema_arrow.names:
            raise DataError(f"{file.uri} has no column {field!r} (columns: {parquet.schema_arrow.names})")
    shards, first_row = [], 0
    for row_group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(row_group).num_rows
        shards.append(Shard(file, name, first_row, first_row + rows, row_group))
        first_row += rows
    return shards


def read_shard(shard: Shard, text_field: str) -> list[str]:
    """The shard's non-empty text documents, in file order."""
    try:
        if shard.row_group is not None:
            parquet = pq.ParquetFile(shard.location.path, filesystem=shard.location.fs)
            table = parquet.read_row_group(shard.row_group, columns=[text_field])
        else:
            lines = _jsonl_lines(shard)
            if not lines:
                return []
            # One block for the whole shard: a long line never straddles pyarrow's block boundaries.
            options = pajson.ReadOptions(block_size=len(lines))
            table = pajson.read_json(pa.BufferReader(lines), read_options=options)
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"cannot read {shard.location.uri} [{shard.start}, {shard.stop}): {error}") from error
    if text_field not in table.column_names:
        raise DataError(f"{shard.location.uri} has no column {text_field!r} (columns: {table.column_names})")
    return [text for text in table.column(text_field).to_pylist() if isinstance(text, str) and text]


def read_records(shard: Shard, fields: Sequence[str]) -> list[dict[str, Any] | None]:
    """The shard's rows, in file order, as mappings that hold `fields` (a row may lack some); a jsonl line
    that is not a JSON object is None: counted as unparsable by its reader, not a failure of the shard."""
    try:
        if shard.row_group is not None:
            parquet = pq.ParquetFile(shard.location.path, filesystem=shard.location.fs)
            rows: list[dict[str, Any] | None] = parquet.read_row_group(
                shard.row_group, columns=fields
            ).to_pylist()
            return rows
        lines = _jsonl_lines(shard)
    except (OSError, pa.ArrowInvalid) as error:
        raise DataError(f"cannot read {shard.location.uri} [{shard.start}, {shard.stop}): {error}") from error
    return [_json_object(line) for line in lines.splitlines() if line.strip()]


def _json_object(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _jsonl_lines(shard: Shard) -> bytes:
    """The lines that begin in the shard's byte range: the byte before the range tells whether one begins at
    its start, and the last one may end past it."""
    with shard.location.fs.open_input_file(shard.location.path) as file:
        size = file.size()
        offset = max(shard.start - 1, 0)
        head = bytes(file.read_at(shard.stop - offset, offset))
        if shard.start == 0:
            lines = head
        elif LINE_END in head:
            lines = head[head.index(LINE_END) + 1 :]
        else:
            return b""  # a line that began in an earlier shard covers the whole range
        position = shard.stop
        while lines and not lines.endswith(LINE_END) and position < size:
            more = bytes(file.read_at(min(TAIL_READ_BYTES, size - position), position))
            end = more.find(LINE_END)
            lines += more if end < 0 else more[: end + 1]
            position += len(more)
            if end >= 0:
                break
        return lines


def split_shards(shards: list[Shard], eval_fraction: float, seed: int) -> tuple[list[Shard], list[Shard]]:
    """Holds out a seeded random share of whole shards for evaluation (independent of world size); both
    parts keep the shards' order."""
    if eval_fraction <= 0:
        return shards, []
    held_out = max(1, round(eval_fraction * len(shards)))
    if held_out >= len(shards):
        raise DataError(
            f"evalFraction {eval_fraction} leaves no training data of the {len(shards)} shard(s) of the "
            "source (a jsonl file is cut into byte ranges, a parquet file into its row groups): use more "
            "files or row groups, set evalSource, or set evalFraction to 0"
        )
    chosen = set(np.random.default_rng([seed, HELD_OUT]).permutation(len(shards))[:held_out].tolist())
    train = [shard for i, shard in enumerate(shards) if i not in chosen]
    return train, [shard for i, shard in enumerate(shards) if i in chosen]


def source_shards(spec: DataSpec, sequence_length: int, seed: int) -> tuple[list[Shard], list[Shard]]:
    """The training and held-out shards: evalSource's, or a seeded share of the source's."""
    shards = list_shards(spec.source, spec.fields(), sequence_length)
    if spec.eval_source:
        return shards, list_shards(spec.eval_source, spec.fields(), sequence_length)
    return split_shards(shards, spec.eval_fraction, seed)
