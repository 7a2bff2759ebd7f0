"""Storage access for s3:// URIs and local paths through pyarrow.fs, the filesystem layer Ray Train uses.

One code path for S3 and local disk, except uploads of whole directories to S3 (checkpoints, the exported
model), which go through boto3's managed transfer for throughput. S3 honours AWS_ENDPOINT_URL and the usual
AWS credential chain. boto3 is imported only for such an upload: a run on local storage (the GPU benchmark's
machine has no boto3) never needs it.

Byte ranges of a file (`Location.read_ranges`, what a resume reads of a checkpoint's shards) are read in parts
of READ_PART bytes, READ_THREADS at a time, each part a ranged GET on S3 bounded by the S3 client's connect
and request timeouts and retried READ_ATTEMPTS times in all, with backoff, before the read fails (OSError).
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import pyarrow.fs as pafs


@dataclass(frozen=True)
class Location:
    """A place in storage: the filesystem, the path inside it, and the URI it was given as."""

    fs: pafs.FileSystem
    path: str
    uri: str

    @classmethod
    def parse(cls, uri: str) -> Location:
        uri = uri.rstrip("/")
        if uri.startswith("hf://"):
            return cls(*_hub_filesystem(uri), uri)
        fs, path = pafs.FileSystem.from_uri(uri if "://" in uri else os.path.abspath(uri))
        return cls(fs, path, uri)

    def child(self, *names: str) -> Location:
        suffix = "/".join(name.strip("/") for name in names)
        return Location(self.fs, f"{self.path}/{suffix}", f"{self.uri}/{suffix}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def is_local(self) -> bool:
        """On this machine's disk: written in place, never through a staging copy."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def exists(self) -> bool:
        return bool(self.fs.get_file_info(self.path).type != pafs.FileType.NotFound)

    def is_file(self) -> bool:
        return bool(self.fs.get_file_info(self.path).type == pafs.FileType.File)

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as stream:
            return bytes(stream.read())

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def read_whole(self) -> bytes:
        """The file's bytes, retried as a ranged read is (read_bytes tries once: a missing manifest must not
        take READ_ATTEMPTS tries to report)."""
        return _retried(f"reading {self.uri}", self.read_bytes)

    def read_ranges(self, ranges: list[tuple[int, int]]) -> Iterator[bytes]:
        """The bytes of each (offset, length) range of this file, in the order given, read in parts of
        READ_PART bytes, READ_THREADS at a time and at most READ_AHEAD parts ahead of the range the caller
        is at: memory holds the range being handed out plus READ_AHEAD parts. Each part is one ranged read
        (a GET with a Range header on S3), retried as `_retried` says; a short read is an error."""
        handle = _retried(f"opening {self.uri}", lambda: self.fs.open_input_file(self.path))

        def part(offset: int, length: int) -> bytes:
            def read() -> bytes:
                data = bytes(handle.read_at(length, offset))
                if len(data) != length:
                    raise OSError(f"short read: {len(data)} of {length} bytes")
                return data

            return _retried(f"reading {self.uri} bytes {offset}-{offset + length - 1}", read)

        parts = iter(
            [
                (offset, min(READ_PART, start + length - offset))
                for start, length in ranges
                for offset in range(start, start + length, READ_PART)
            ]
        )
        try:
            with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="storage-read") as pool:
                ahead: collections.deque[tuple[int, Future[bytes]]] = collections.deque()

                def fill() -> None:
                    while len(ahead) < READ_AHEAD and (next_part := next(parts, None)) is not None:
                        ahead.append((next_part[1], pool.submit(part, *next_part)))

                fill()
                for _, length in ranges:
                    pieces: list[bytes] = []
                    got = 0
                    while got < length:
                        size, future = ahead.popleft()
                        pieces.append(future.result())
                        got += size
                        fill()
                    yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
        finally:
            handle.close()

    def write_bytes(self, data: bytes) -> None:
        """Readers see the old content or the new, never a partial file: an object store's PUT is atomic,
        and on local disk the file is written aside and renamed over the old one."""
        self._make_dir(self.path.rsplit("/", 1)[0])
        local = self.is_local
        target = f"{self.path}.partial-{os.getpid()}-{threading.get_ident()}" if local else self.path
        with self.fs.open_output_stream(target) as stream:
            stream.write(data)
        if local:
            self.fs.move(target, self.path)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def list_files(self) -> dict[str, int]:
        """Every file below this location (relative path -> size); empty when nothing is there."""
        selector = pafs.FileSelector(self.path, recursive=True, allow_not_found=True)
        prefix = self.path.rstrip("/") + "/"
        return {
            info.path.removeprefix(prefix): int(info.size)
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.File
        }

    def list_dirs(self) -> list[Location]:
        """The directories directly below this location."""
        selector = pafs.FileSelector(self.path, recursive=False, allow_not_found=True)
        return [
            self.child(info.path.rsplit("/", 1)[-1])
            for info in self.fs.get_file_info(selector)
            if info.type == pafs.FileType.Directory
        ]

    def download_to(self, local_dir: str) -> None:
        os.makedirs(local_dir, exist_ok=True)
        pafs.copy_files(
            self.path,
            local_dir,
            source_filesystem=self.fs,
            destination_filesystem=_LOCAL,
            chunk_size=COPY_CHUNK,
        )

    def upload_from(self, local_dir: str) -> None:
        """Every file below `local_dir`, at the same relative paths below this location. To S3 through
        boto3's managed transfer, which sends the parts of all files concurrently: pyarrow's S3 output
        stream reached 0.4 of its throughput on the same checkpoint shards."""
        if isinstance(self.fs, pafs.S3FileSystem):
            _upload_to_s3(local_dir, self.path, self.fs.region)
            return
        self._make_dir(self.path)
        pafs.copy_files(
            local_dir,
            self.path,
            source_filesystem=_LOCAL,
            destination_filesystem=self.fs,
            chunk_size=COPY_CHUNK,
        )

    def replace_with(self, local_dir: str) -> None:
        """Makes this directory hold exactly `local_dir`'s files: the new files are uploaded over the old
        ones first and only then are files the new set lacks deleted, so a failed upload never leaves less
        than the previous content."""
        previous = self.list_files()
        self.upload_from(local_dir)
        for stale in sorted(set(previous) - set(_files_below(local_dir))):
            self.fs.delete_file(self.child(stale).path)

    def _make_dir(self, path: str) -> None:
        """Local directories must exist before writing; object stores have none (creating one would leave
        an empty "dir/" marker object for every reader to skip)."""
        if self.is_local:
            self.fs.create_dir(path, recursive=True)

    def delete_dir(self) -> None:
        if self.exists():
            self.fs.delete_dir(self.path)


_LOCAL = pafs.LocalFileSystem()
# pyarrow copies in 1 MiB chunks by default: 16 MiB means 16 times fewer requests per copy.
COPY_CHUNK = 16 << 20
# Ranged reads: parts of 16 MiB, 8 in flight (a single S3 GET streams at about 90 MB/s; several in parallel
# are what S3's guidance gives for throughput), at most 16 parts (256 MiB) read ahead of the consumer.
READ_PART = 16 << 20
READ_THREADS = 8
READ_AHEAD = 16
# Every read of a part is tried this many times in all, waiting READ_BACKOFF_S, then twice that, and so on
# between tries (about 7 s of waiting in all); each try is bounded by the S3 client's own timeouts.
READ_ATTEMPTS = 4
READ_BACKOFF_S = 1.0

T = TypeVar("T")


def _retried(what: str, attempt: Callable[[], T]) -> T:
    """`attempt()`, tried READ_ATTEMPTS times while it raises OSError; a missing file is not retried."""
    for tried in range(1, READ_ATTEMPTS + 1):
        try:
            return attempt()
        except FileNotFoundError:
            raise
        except OSError as error:
            if tried == READ_ATTEMPTS:
                raise OSError(f"{what}: {error} (tried {READ_ATTEMPTS} times)") from error
            time.sleep(READ_BACKOFF_S * 2 ** (tried - 1))
    raise AssertionError("unreachable")


def _upload_to_s3(local_dir: str, path: str, region: str) -> None:
    """Uploads every file below `local_dir` to `path` ("bucket/prefix") and returns once all are stored;
    the first failure cancels the rest (a multipart upload cut short leaves no object behind)."""
    import boto3
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    bucket, _, prefix = path.partition("/")
    # A session of its own: boto3's default session is not safe to share between threads.
    client = boto3.session.Session().client("s3", region_name=region)
    # TransferConfig's defaults: 8 MiB parts, 10 at a time.
    with create_transfer_manager(client, TransferConfig()) as transfers:
        uploads = [
            transfers.upload(os.path.join(local_dir, file), bucket, f"{prefix}/{file}" if prefix else file)
            for file in _files_below(local_dir)
        ]
        for upload in uploads:
            upload.result()


def _files_below(local_dir: str) -> list[str]:
    """The relative paths of every file below a local directory."""
    return [
        os.path.relpath(os.path.join(root, name), local_dir)
        for root, _, names in os.walk(local_dir)
        for name in names
    ]


NODE_CACHE = os.environ.get("FSDP_TRAINER_CACHE", "/tmp/fsdp-trainer-cache")


def node_local_copy(uri: str, local_rank: int, barrier: Callable[[], None]) -> str:
    """A node-local directory holding `uri`: local rank 0 downloads it once, the other local ranks wait.

    Kept between restarts on the same node; a crash mid-download leaves only a staging directory.
    """
    target = os.path.join(NODE_CACHE, hashlib.sha256(uri.encode()).hexdigest()[:16])
    if local_rank == 0 and not os.path.isdir(target):
        staging = f"{target}.partial-{os.getpid()}"
        Location.parse(uri).download_to(staging)
        os.replace(staging, target)
    barrier()
    return target


def _hub_filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """hf://datasets/<org>/<name>/<path> through huggingface_hub's fsspec filesystem (needs the hub)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path
