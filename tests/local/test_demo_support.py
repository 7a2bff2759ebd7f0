"""The e2e tests' reading of a run's checkpoints in S3 holds while the trainer's retention deletes some."""

from __future__ import annotations

import json
from typing import Any

import boto3

from tests.support.demo import BUCKET, checkpoint_steps_in_s3


def test_a_checkpoint_pruned_between_listing_and_read_is_left_out_not_an_error(s3_endpoint: str) -> None:
    # The cold run's one failure (test_cluster_lost_mid_run_is_recreated_and_training_resumes): the resumed
    # attempt's retention deleted step 10's checkpoint after the listing named its manifest.
    s3 = boto3.client("s3")
    if BUCKET not in {bucket["Name"] for bucket in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    run = "runs/team-a/pruned"
    for step in (10, 20, 30):
        s3.put_object(
            Bucket=BUCKET,
            Key=f"{run}/checkpoint_{step:08d}/fsdp_manifest.json",
            Body=json.dumps({"step": step, "submissionId": "job-1"}).encode(),
        )
    pruned: list[str] = []

    def retention_runs_now(params: dict[str, Any], **_: Any) -> None:
        if not pruned:
            pruned.append(params["Key"])
            boto3.client("s3").delete_object(Bucket=BUCKET, Key=params["Key"])

    s3.meta.events.register("before-parameter-build.s3.GetObject", retention_runs_now)
    try:
        steps = checkpoint_steps_in_s3(s3, "team-a", "pruned", written_by="job-1")
    finally:
        for step in (10, 20, 30):
            s3.delete_object(Bucket=BUCKET, Key=f"{run}/checkpoint_{step:08d}/fsdp_manifest.json")
    assert pruned, "no manifest was read"
    gone = int(pruned[0].split("checkpoint_")[1].split("/")[0])
    assert steps == {10, 20, 30} - {gone}
