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
from typing import Any

from pydantic import ValidationError

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
    RunRecord,
    checkpoint_is_complete,
    forensics_dir,
    split_s3_uri,
)

CHECKPOINT_DIR_PREFIX = "checkpoint_"
STACKS_FILE = "rank-*.json"  # a rank's answer to a forensics request (its cap's key)
# The most the operator reads of each object the trainer (or anyone with the run's prefix) writes. Each is
# many times what a real one holds: progress.json and mlflow.json a few KiB, a manifest ~50 bytes per file of
# the checkpoint (a 512-rank one ~30 KiB), run.json the config (fromConfig at most 64 KiB) and the restarts.
MAX_RECORD_BYTES = {
    PROGRESS_FILE: 256 << 10,
    STACKS_FILE: 1 << 20,  # every thread's stack and 40 log lines: a few KiB to ~100 KiB
    MLFLOW_RUN_FILE: 16 << 10,
    MANIFEST_FILE: 1 << 20,
    RUN_RECORD_FILE: 4 << 20,
}
# The checkpoints' listing per pass: pages of LIST_PAGE_KEYS keys, at most MAX_LIST_PAGES of them (20,000
# objects; `keep` checkpoints of a 512-rank run are ~1,600).
LIST_PAGE_KEYS = 1000
MAX_LIST_PAGES = 20


class RecordTooLarge(Exception):
    """An object under the run's prefix (or its listing) beyond what the operator reads: the run's storage
    is unreadable until it is removed; the message names the object and the cap."""

    reason = "RecordTooLarge"


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
        # Manifests never change once written (a checkpoint directory is never reused): read each once.
        self._manifests: dict[str, CheckpointManifest | None] = {}

    def _get_json(self, key: str) -> Any | None:
        """The object parsed, None when there is none. At most its cap (MAX_RECORD_BYTES by file name) is
        asked for, and one byte more, which tells an object beyond the cap: that one is refused unread."""
        name = key.rpartition("/")[2]
        cap = MAX_RECORD_BYTES[STACKS_FILE if name.startswith("rank-") else name]
        uri = f"s3://{self.bucket}/{key}"
        try:
            answer = self.s3.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{cap}")
        except self.s3.exceptions.NoSuchKey:
            return None
        except self.s3.exceptions.ClientError as error:
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
        try:
            return json.loads(body)
        except RecursionError:
            raise RecordTooLarge(f"{uri} is nested too deeply to read: it is not read; remove it") from None

    def progress(self) -> ProgressRecord | None:
        raw = self._get_json(self.prefix + PROGRESS_FILE)
        try:
            return None if raw is None else ProgressRecord.model_validate(raw)
        except ValidationError:
            return None  # written by an incompatible trainer; the status says no progress rather than lie

    def mlflow_run(self) -> MlflowRunRef | None:
        """The MLflow run the trainer logs to (tracking on), once it has created one."""
        raw = self._get_json(self.prefix + MLFLOW_RUN_FILE)
        try:
            return None if raw is None else MlflowRunRef.model_validate(raw)
        except ValidationError:
            return None

    def _manifest(self, directory: str) -> CheckpointManifest | None:
        if directory not in self._manifests:
            raw = self._get_json(f"{self.prefix}{directory}/{MANIFEST_FILE}")
            try:
                self._manifests[directory] = CheckpointManifest.model_validate(raw)
            except ValidationError:
                self._manifests[directory] = None
        return self._manifests[directory]

    def complete_checkpoints(self) -> list[StoredCheckpoint]:
        """Checkpoints with a manifest, DCP metadata and every file at its size, oldest first."""
        listing: dict[str, dict[str, int]] = defaultdict(dict)
        for obj in self._checkpoint_objects():
            relative = obj["Key"][len(self.prefix) :]
            directory, _, name = relative.partition("/")
            if directory.startswith(CHECKPOINT_DIR_PREFIX) and name:
                listing[directory][name] = obj["Size"]
        for gone in self._manifests.keys() - listing.keys():  # pruned by the trainer
            del self._manifests[gone]
        found = []
        for directory, files in listing.items():
            manifest = self._manifest(directory) if MANIFEST_FILE in files else None
            if manifest is not None and checkpoint_is_complete(manifest, files):
                ref = CheckpointRef(
                    uri=f"{self.uri}/{directory}", step=manifest.step, time=manifest.created_at
                )
                found.append(StoredCheckpoint(ref, manifest.fingerprint))
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
        """The ranks' answers (each read within its cap); one that does not parse is left out."""
        found = []
        for key in keys:
            try:
                found.append(RankStacks.model_validate(self._get_json(key)))
            except (ValidationError, RecordTooLarge):
                continue
        return found

    def read_run_record(self) -> RunRecord | None:
        raw = self._get_json(self.prefix + RUN_RECORD_FILE)
        try:
            return None if raw is None else RunRecord.model_validate(raw)
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
