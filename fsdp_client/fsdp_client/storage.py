"""The one reader of what a run leaves in S3 (its logs, metric histories and run.json), with the reader's own
AWS identity (boto3's default chain: a profile, SSO, environment variables, a pod's role), never the
operator's. The kubectl plugin and the Python client both read through it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
)

from fsdp_client.errors import NotRecordedYet, StorageNotReadable
from fsdp_trainer.contract import (
    METRICS_DIR,
    RUN_RECORD_FILE,
    ProgressRecord,
    RunRecord,
    run_prefix,
    split_s3_uri,
)

S3_TIMEOUTS = {"connect_timeout": 5, "read_timeout": 15, "retries": {"max_attempts": 3}}
# S3's answers that mean "not with this identity" rather than "not there".
_REFUSED = {
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
}


def s3_client() -> Any:
    import boto3
    from botocore.config import Config

    bounded = Config(**S3_TIMEOUTS)  # type: ignore[arg-type]
    return boto3.client("s3", config=bounded)


def storage_prefix(run: Mapping[str, Any]) -> str:
    """The run's prefix in S3, from its spec: known before the operator has written any status."""
    storage = run["spec"]["checkpoint"]["storagePath"]
    return run_prefix(storage, run["metadata"]["namespace"], run["metadata"]["name"])


def not_readable(error: Exception, where: str) -> StorageNotReadable:
    """One line on why `where` could not be read and what to do about it."""
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return StorageNotReadable(
            f"S3 not readable: no AWS credentials in this environment to read {where}: set AWS_PROFILE (or "
            "run `aws sso login`), or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, then read again"
        )
    if isinstance(error, EndpointConnectionError):
        return StorageNotReadable(
            f"S3 not reachable to read {where} ({error}): check the network, AWS_ENDPOINT_URL and the region"
        )
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code in _REFUSED:
            return StorageNotReadable(
                f"S3 not readable: {where} refused this environment's AWS identity ({code}): it needs "
                "s3:GetObject and s3:ListBucket there; use a profile that has them (AWS_PROFILE), or ask"
            )
        if code == "NoSuchBucket":
            return StorageNotReadable(
                f"S3 not readable: the bucket of {where} does not exist here: check the run's "
                "spec.checkpoint.storagePath, and AWS_ENDPOINT_URL when the storage is not AWS's"
            )
    return StorageNotReadable(f"S3 not readable: {where}: {error}")


class RunObjects:
    """Objects below one run's prefix."""

    def __init__(self, s3: Any, prefix: str) -> None:
        self.s3 = s3
        try:
            self.bucket, key_prefix = split_s3_uri(prefix)
        except ValueError as error:
            raise StorageNotReadable(str(error)) from error
        self.prefix = key_prefix.rstrip("/") + "/"

    def uri(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"

    def text(self, name: str) -> str | None:
        """The object's text; None while it does not exist."""
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None
        except (BotoCoreError, ClientError) as error:
            raise not_readable(error, self.uri(name)) from error
        return str(body.decode(errors="replace"))

    def names(self, below: str) -> list[str]:
        """Object names (relative to the run) below a directory of the run, in name order."""
        found = []
        paginator = self.s3.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}{below.rstrip('/')}/"):
                found += [obj["Key"][len(self.prefix) :] for obj in page.get("Contents", [])]
        except (BotoCoreError, ClientError) as error:
            raise not_readable(error, self.uri(below)) from error
        return sorted(found)


def metric_histories(objects: RunObjects) -> list[list[ProgressRecord]]:
    """Each trainer attempt's records, in the order the attempts ran (their files are named by start time)."""
    histories = []
    for name in objects.names(METRICS_DIR):
        text = objects.text(name) or ""
        histories.append([ProgressRecord.model_validate_json(line) for line in text.splitlines() if line])
    return [history for history in histories if history]


def run_record(objects: RunObjects) -> RunRecord:
    text = objects.text(RUN_RECORD_FILE)
    if text is None:
        raise NotRecordedYet(f"no {RUN_RECORD_FILE} in {objects.uri()} yet")
    return RunRecord.model_validate_json(text)
