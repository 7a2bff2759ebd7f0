"""Fixtures of the trainer's tests (the DLC's environment)."""

from __future__ import annotations

import uuid

import boto3
import pytest

from fsdp_trainer.storage import Location


@pytest.fixture
def s3_run(s3_endpoint: str) -> Location:
    """A run prefix in a fresh bucket of the test S3 server."""
    bucket = f"trainer-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
    )
    return Location.parse(f"s3://{bucket}/runs/run-1")
