"""What the trainer left in S3, read with boto3 alone: progress, complete checkpoints; and run.json.

The boto3 client is built with connect and read timeouts (handlers.py), so a slow or unreachable bucket
costs one run's pass a bounded time.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

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
    RunRecord,
    checkpoint_is_complete,
)

CHECKPOINT_DIR_PREFIX = "checkpoint_"


@dataclass(frozen=True)
class StoredCheckpoint:
    ref: CheckpointRef
    fingerprint: str | None  # the resume fingerprint of the run that wrote it


def split_s3_uri(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3:// URI: {uri!r}")
    return parsed.netloc, parsed.path.lstrip("/")


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
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None
        return json.loads(body)

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
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
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
