"""Storage operations whose order matters to the user: the exported model is replaced, never emptied first;
uploads to S3 (a real S3 server on loopback) store every file whole; ranged reads are retried, then fail."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_trainer import storage
from fsdp_trainer.storage import Location


def exported(tmp_path: Path) -> tuple[Location, Path]:
    destination = tmp_path / "model"
    destination.mkdir()
    (destination / "model.safetensors").write_text("old weights")
    (destination / "pytorch_model.bin").write_text("an older format")
    new = tmp_path / "new"
    new.mkdir()
    (new / "model.safetensors").write_text("new weights")
    (new / "config.json").write_text("{}")
    return Location.parse(str(destination)), new


def test_replacing_a_model_leaves_exactly_the_new_files(tmp_path: Path) -> None:
    destination, new = exported(tmp_path)
    destination.replace_with(str(new))
    assert destination.list_files() == {"model.safetensors": 11, "config.json": 2}
    assert (tmp_path / "model" / "model.safetensors").read_text() == "new weights"


def test_a_failed_upload_keeps_the_previous_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    destination, new = exported(tmp_path)

    def no_connection(self: Location, local_dir: str) -> None:
        raise OSError("connection refused")

    monkeypatch.setattr(Location, "upload_from", no_connection)
    with pytest.raises(OSError):
        destination.replace_with(str(new))
    assert (tmp_path / "model" / "model.safetensors").read_text() == "old weights"


def test_a_directory_uploaded_to_s3_arrives_byte_for_byte(tmp_path: Path, s3_run: Location) -> None:
    contents = {
        "__0_0.distcp": os.urandom(9 << 20),  # above boto3's 8 MiB threshold: a multipart upload
        "__1_0.distcp": os.urandom(1000),
        ".metadata": b"dcp metadata",
        "nested/rng_rank00000.pt": b"rng",
    }
    local = tmp_path / "checkpoint"
    for name, content in contents.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(content)
    destination = s3_run.child("checkpoint_00000001_a")
    destination.upload_from(str(local))
    assert destination.list_files() == {name: len(content) for name, content in contents.items()}
    for name, content in contents.items():
        assert destination.child(name).read_bytes() == content, name


def test_replacing_a_model_in_s3_leaves_exactly_the_new_files(tmp_path: Path, s3_run: Location) -> None:
    destination = s3_run.child("model")
    destination.child("pytorch_model.bin").write_text("an older format")
    destination.child("model.safetensors").write_text("old weights")
    _, new = exported(tmp_path)
    destination.replace_with(str(new))
    assert destination.list_files() == {"model.safetensors": 11, "config.json": 2}
    assert destination.child("model.safetensors").read_text() == "new weights"


class FlakyFile:
    """A random-access file whose first `failures` reads fail as a reset connection does."""

    def __init__(self, data: bytes, failures: int) -> None:
        self.data, self.failures, self.reads = data, failures, 0

    def read_at(self, length: int, offset: int) -> bytes:
        self.reads += 1
        if self.failures:
            self.failures -= 1
            raise OSError("Connection reset by peer")
        return self.data[offset : offset + length]

    def close(self) -> None:
        pass


class FlakyFs:
    def __init__(self, file: FlakyFile) -> None:
        self.file = file

    def open_input_file(self, path: str) -> FlakyFile:
        return self.file


def test_ranged_reads_come_in_parts_and_are_retried_before_they_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "READ_PART", 16)
    monkeypatch.setattr(storage, "READ_BACKOFF_S", 0.0)
    monkeypatch.setattr(storage, "READ_THREADS", 1)  # the failures in a known order
    data = os.urandom(100)
    file = FlakyFile(data, failures=storage.READ_ATTEMPTS - 1)
    location = Location(FlakyFs(file), "bucket/f", "s3://bucket/f")  # type: ignore[arg-type]
    assert list(location.read_ranges([(60, 5), (10, 40), (99, 0)])) == [data[60:65], data[10:50], b""]
    assert file.reads == storage.READ_ATTEMPTS - 1 + 1 + 3, "3 parts of 16 bytes for 40, after the retries"
    file.failures = storage.READ_ATTEMPTS
    with pytest.raises(OSError, match=r"s3://bucket/f bytes 0-15: Connection reset .*tried 4 times"):
        list(location.read_ranges([(0, 16)]))
