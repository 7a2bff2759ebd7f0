"""What the trainer left in S3, read with boto3 alone: progress, complete checkpoints; and run.json.

The boto3 client is built with connect and read timeouts (handlers.py), so a slow or unreachable bucket
costs one run's pass a bounded time. The run's prefix is the tenant's: its Ray pods run the tenant's code and
write there. So every object is read with a Range of at most its cap (one request, never the whole object),
and the listing of the checkpoints stops after MAX_LIST_PAGES pages: a multi-GB progress.json or a prefix
of millions of objects costs a bounded amount of memory and requests, and its own run a RecordTooLarge
condition (StorageReadable False) that names the object and the cap, never the operator.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from fsdp_trainer.contract import (
    MANIFEST_FILE,
    MLFLOW_RUN_FILE,
    PROGRESS_FILE,
    RUN_RECORD_FILE,
    CheckpointManifest,
    CheckpointRef,
    MlflowRunRef,
    ProgressRecord,
    RankStacks,
    RestartEntry,
    RunRecord,
    checkpoint_is_complete,
    forensics_dir,
    split_s3_uri,
)

CHECKPOINT_DIR_PREFIX = "checkpoint_"
RESTART_ENTRY_KEYS = frozenset(field.alias or name for name, field in RestartEntry.model_fields.items())
STACKS_FILE = "rank-*.json"  # a rank's answer to a forensics request (its cap's key)
# The most the operator reads of each object the trainer (or anyone with the run's prefix) writes. Each is
# many times what a real one holds: progress.json and mlflow.json a few KiB, a manifest ~50 bytes per file of
# the checkpoint (a 512-rank one ~30 KiB), run.json the config (fromConfig at most 64 KiB) and the restarts
# (~300 bytes each: 1 MiB keeps some 3,000). Parsing JSON costs 10-20 times its size at its worst shapes.
MAX_RECORD_BYTES = {
    PROGRESS_FILE: 256 << 10,
    STACKS_FILE: 1 << 20,  # every thread's stack and 40 log lines: a few KiB to ~100 KiB
    MLFLOW_RUN_FILE: 16 << 10,
    MANIFEST_FILE: 1 << 20,
    RUN_RECORD_FILE: 1 << 20,
}
# What one pass reads in all of the objects that come many to a run: checkpoint manifests not yet known
# complete, and the ranks' forensics answers (a 512-rank run's are a few MiB). A run that keeps a hundred
# manifests or a thousand answers of just under their caps costs its own pass a refusal, not the operator its
# memory.
MANIFEST_BYTES_PER_PASS = 8 << 20
STACKS_BYTES_PER_PASS = 16 << 20
# The checkpoints' listing per pass: pages of LIST_PAGE_KEYS keys, at most MAX_LIST_PAGES of them (20,000
# objects; `keep` checkpoints of a 512-rank run are ~1,600).
LIST_PAGE_KEYS = 1000
MAX_LIST_PAGES = 20

Record = TypeVar("Record", bound=BaseModel)


class RecordTooLarge(Exception):
    """An object under the run's prefix (or its listing) beyond what the operator reads: the run's storage
    is unreadable until it is removed; the message names the object and the cap."""

    reason = "RecordTooLarge"


class NotModified(Exception):
    """The object still has the ETag it was last read with (S3 answered 304, with no body)."""


@dataclass(frozen=True)
class Fetched:
    body: bytes
    etag: str | None  # None for an empty object (no byte in range, so no answer to take it from)


@dataclass(frozen=True)
class StoredCheckpoint:
    ref: CheckpointRef
    fingerprint: str | None  # the resume fingerprint of the run that wrote it


class RunStorage:
    """One run's directory in S3 (`<storagePath>/<namespace>/<runName>/`)."""

    def __init__(self, s3: Any, uri: str) -> None:
        self.s3 = s3
        self.uri = uri
        self.bucket, prefix = split_s3_uri(self.uri)
        self.prefix = prefix.rstrip("/") + "/"
        # A complete checkpoint's summary (not its manifest), by directory, with the listing it was judged
        # complete from: read again only when that changes. Nothing is kept of an incomplete one.
        self._complete: dict[str, tuple[frozenset[tuple[str, int]], StoredCheckpoint]] = {}
        # The records read at every pass (progress.json, mlflow.json), by key: the ETag each was last read
        # with and what it validated to (None: an incompatible record).
        self._kept: dict[str, tuple[str, BaseModel | None]] = {}

    def _get_json(self, key: str) -> Any | None:
        """The object parsed, None when there is none (see _get_bytes)."""
        fetched = self._get_bytes(key)
        return None if fetched is None else self._parsed(key, fetched.body)

    def _record(self, key: str, model: type[Record]) -> Record | None:
        """The object validated as `model`; None when there is none, or it does not validate (written by an
        incompatible trainer: the status says nothing rather than lie). It is asked for only if its ETag
        changed since the last read, so an unchanged record (most passes of a quiet run) costs a 304 with
        no body and no parse."""
        kept = self._kept.get(key)
        try:
            fetched = self._get_bytes(key, if_none_match=kept[0] if kept else None)
        except NotModified:
            assert kept is not None
            return kept[1] if isinstance(kept[1], model) else None
        self._kept.pop(key, None)
        if fetched is None:
            return None
        try:
            record: Record | None = model.model_validate(self._parsed(key, fetched.body))
        except ValidationError:
            record = None
        if fetched.etag:
            self._kept[key] = (fetched.etag, record)
        return record

    def _parsed(self, key: str, body: bytes) -> Any:
        try:
            return json.loads(body)
        except RecursionError:
            uri = f"s3://{self.bucket}/{key}"
            raise RecordTooLarge(f"{uri} is nested too deeply to read: it is not read; remove it") from None

    def _get_bytes(self, key: str, if_none_match: str | None = None) -> Fetched | None:
        """The object's bytes and ETag, None when there is none; NotModified when it still has the ETag
        `if_none_match`. At most its cap (MAX_RECORD_BYTES by file name) is asked for, and one byte more,
        which tells an object beyond the cap: that one is refused unread."""
        name = key.rpartition("/")[2]
        cap = MAX_RECORD_BYTES[STACKS_FILE if name.startswith("rank-") else name]
        uri = f"s3://{self.bucket}/{key}"
        request = {"Bucket": self.bucket, "Key": key, "Range": f"bytes=0-{cap}"}
        if if_none_match is not None:
            request["IfNoneMatch"] = if_none_match
        try:
            answer = self.s3.get_object(**request)
        except self.s3.exceptions.NoSuchKey:
            return None
        except self.s3.exceptions.ClientError as error:
            if error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 304:
                raise NotModified(uri) from None
            if error.response.get("Error", {}).get("Code") != "InvalidRange":
                raise
            answer = None  # an empty object: no byte is in range
        body = b"" if answer is None else answer["Body"].read(cap + 1)
        if answer is not None:
            answer["Body"].close()
        if len(body) > cap:
            size = str(answer.get("ContentRange", "")).rpartition("/")[2] if answer else ""
            raise RecordTooLarge(
                f"{uri} is {size + ' bytes' if size.isdigit() else 'larger than that'}, over the "
                f"operator's cap of {cap} bytes for {key.rpartition('/')[2]}: it is not read; remove it"
            )
        return Fetched(body, None if answer is None else answer.get("ETag"))

    def progress(self) -> ProgressRecord | None:
        return self._record(self.prefix + PROGRESS_FILE, ProgressRecord)

    def mlflow_run(self) -> MlflowRunRef | None:
        """The MLflow run the trainer logs to (tracking on), once it has created one."""
        return self._record(self.prefix + MLFLOW_RUN_FILE, MlflowRunRef)

    def _manifest(self, directory: str) -> CheckpointManifest | None:
        raw = self._get_json(f"{self.prefix}{directory}/{MANIFEST_FILE}")
        try:
            return CheckpointManifest.model_validate(raw)
        except ValidationError:
            return None

    def complete_checkpoints(self) -> list[StoredCheckpoint]:
        """Checkpoints with a manifest, DCP metadata and every file at its size, oldest first. Manifests not
        yet known complete are read within MANIFEST_BYTES_PER_PASS (their listed sizes)."""
        listing: dict[str, dict[str, int]] = defaultdict(dict)
        for obj in self._checkpoint_objects():
            relative = obj["Key"][len(self.prefix) :]
            directory, _, name = relative.partition("/")
            if directory.startswith(CHECKPOINT_DIR_PREFIX) and name:
                listing[directory][name] = obj["Size"]
        for gone in self._complete.keys() - listing.keys():  # pruned by the trainer
            del self._complete[gone]
        found, budget = [], MANIFEST_BYTES_PER_PASS
        for directory, files in listing.items():
            if MANIFEST_FILE not in files:
                continue
            seen = frozenset(files.items())
            known = self._complete.get(directory)
            if known is not None and known[0] == seen:
                found.append(known[1])
                continue
            self._complete.pop(directory, None)
            budget -= min(files[MANIFEST_FILE], MAX_RECORD_BYTES[MANIFEST_FILE])  # a larger one is refused
            if budget < 0:
                where = f"s3://{self.bucket}/{self.prefix}{CHECKPOINT_DIR_PREFIX}*/{MANIFEST_FILE}"
                raise RecordTooLarge(
                    f"{where}: the manifests of checkpoints not yet complete add up to more than the "
                    f"operator reads in a pass ({MANIFEST_BYTES_PER_PASS} bytes): they are not judged; "
                    "remove what is not a checkpoint"
                )
            manifest = self._manifest(directory)
            if manifest is not None and checkpoint_is_complete(manifest, files):
                ref = CheckpointRef(
                    uri=f"{self.uri}/{directory}",
                    step=manifest.step,
                    time=manifest.created_at,
                    save_seconds=manifest.save_seconds,
                )
                stored = StoredCheckpoint(ref, manifest.fingerprint)
                self._complete[directory] = (seen, stored)
                found.append(stored)
        return sorted(found, key=lambda stored: (stored.ref.step, stored.ref.time))

    def _checkpoint_objects(self) -> list[dict[str, Any]]:
        """The objects of the checkpoint directories (not the logs, metrics or model beside them), in at
        most MAX_LIST_PAGES requests; more than that is refused rather than judged from a part."""
        found: list[dict[str, Any]] = []
        prefix = self.prefix + CHECKPOINT_DIR_PREFIX
        request: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE_KEYS}
        for _ in range(MAX_LIST_PAGES):
            page = self.s3.list_objects_v2(**request)
            found += page.get("Contents", [])[:LIST_PAGE_KEYS]
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return found
            request["ContinuationToken"] = page["NextContinuationToken"]
        raise RecordTooLarge(
            f"s3://{self.bucket}/{prefix}* holds more than {MAX_LIST_PAGES * LIST_PAGE_KEYS} objects, over "
            f"the operator's cap for the checkpoints' listing ({MAX_LIST_PAGES} pages of {LIST_PAGE_KEYS}): "
            "it is not judged; remove what is not a checkpoint"
        )

    def answered_ranks(self, attempt: int) -> list[str]:
        """The keys of the ranks' answers to the attempt's forensics request (one listing, at most a page)."""
        prefix = f"{self.prefix}{forensics_dir(attempt)}/rank-"
        page = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=LIST_PAGE_KEYS)
        return [obj["Key"] for obj in page.get("Contents", [])[:LIST_PAGE_KEYS]]

    def rank_stacks(self, keys: list[str]) -> list[RankStacks]:
        """The ranks' answers, each read within its cap and all within STACKS_BYTES_PER_PASS; one that does
        not parse, or beyond that, is left out (a rank that did not answer, as far as the verdict goes)."""
        found, budget = [], STACKS_BYTES_PER_PASS
        for key in keys:
            try:
                fetched = self._get_bytes(key)
                if fetched is None:
                    continue
                budget -= len(fetched.body)
                if budget < 0:
                    break
                found.append(RankStacks.model_validate(self._parsed(key, fetched.body)))
            except (ValidationError, RecordTooLarge, ValueError):
                continue
        return found

    def read_run_restarts(self, uid: str) -> list[RestartEntry] | None:
        """The restarts run.json keeps, if it is the run's of this uid: all the operator reads back of it.
        Nothing else of the record is read, and no entry with a key a restart entry has not is validated
        (then None): pydantic makes an error of each such key, and a 4 MiB run.json of 400k of them, validated
        whole, cost the operator 150 MiB. So a record of any shape under its cap costs about its parse."""
        raw = self._get_json(self.prefix + RUN_RECORD_FILE)
        restarts = raw.get("restarts", []) if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or raw.get("uid") != uid or not isinstance(restarts, list):
            return None
        if not all(isinstance(entry, dict) and entry.keys() <= RESTART_ENTRY_KEYS for entry in restarts):
            return None
        try:
            return [RestartEntry.model_validate(entry) for entry in restarts]
        except ValidationError:
            return None

    def write_text(self, name: str, text: str) -> str:
        """An object below the run's prefix; returns its URI."""
        self.s3.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=text.encode())
        return f"{self.uri}/{name}"

    def write_run_record(self, record: RunRecord) -> str:
        key = self.prefix + RUN_RECORD_FILE
        self.s3.put_object(
            Bucket=self.bucket,
            Key=key,
            Body=record.model_dump_json(by_alias=True, exclude_none=True, indent=2),
        )
        return f"s3://{self.bucket}/{key}"
