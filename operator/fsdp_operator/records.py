"""What the trainer left in S3, read with boto3 alone: progress, complete checkpoints; and run.json."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any
from urllib.parse import urlparse

from pydantic import ValidationError

from fsdp_trainer.contract import (
    MANIFEST_FILE,
    PROGRESS_FILE,
    RUN_RECORD_FILE,
    CheckpointManifest,
    CheckpointRef,
    ProgressRecord,
    RunRecord,
    checkpoint_is_complete,
)

CHECKPOINT_DIR_PREFIX = "checkpoint_"


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

    def complete_checkpoints(self) -> list[CheckpointRef]:
        """Checkpoints with a manifest, DCP metadata and every file at its size, oldest first."""
        listing: dict[str, dict[str, int]] = defaultdict(dict)
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                relative = obj["Key"][len(self.prefix) :]
                directory, _, name = relative.partition("/")
                if directory.startswith(CHECKPOINT_DIR_PREFIX) and name:
                    listing[directory][name] = obj["Size"]
        found = []
        for directory, files in listing.items():
            if MANIFEST_FILE not in files:
                continue
            raw = self._get_json(f"{self.prefix}{directory}/{MANIFEST_FILE}")
            try:
                manifest = CheckpointManifest.model_validate(raw)
            except ValidationError:
                continue
            if checkpoint_is_complete(manifest, files):
                found.append(
                    CheckpointRef(uri=f"{self.uri}/{directory}", step=manifest.step, time=manifest.created_at)
                )
        return sorted(found, key=lambda ref: (ref.step, ref.time))

    def write_run_record(self, record: RunRecord) -> str:
        key = self.prefix + RUN_RECORD_FILE
        self.s3.put_object(
            Bucket=self.bucket,
            Key=key,
            Body=record.model_dump_json(by_alias=True, exclude_none=True, indent=2),
        )
        return f"s3://{self.bucket}/{key}"
