"""The local S3/EC2 server and the local Ray head answer like the real services the operator talks to."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid

import boto3
import pytest
from ray.job_submission import JobStatus

from tests.harness import LocalCluster, answers, wait_until


def test_s3_bucket_put_and_get(local_cluster: LocalCluster) -> None:
    s3 = boto3.client("s3", endpoint_url=local_cluster.s3_endpoint)
    bucket = f"harness-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    try:
        s3.put_object(Bucket=bucket, Key="dir/hello.txt", Body=b"checkpoint bytes")
        assert s3.get_object(Bucket=bucket, Key="dir/hello.txt")["Body"].read() == b"checkpoint bytes"
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="dir/")
        assert [o["Key"] for o in listed["Contents"]] == ["dir/hello.txt"]
    finally:
        s3.delete_object(Bucket=bucket, Key="dir/hello.txt")
        s3.delete_bucket(Bucket=bucket)


def test_ec2_api_knows_g6_12xlarge_and_its_efa_support(local_cluster: LocalCluster) -> None:
    ec2 = boto3.client("ec2", endpoint_url=local_cluster.s3_endpoint, region_name="us-west-2")
    info = ec2.describe_instance_types(InstanceTypes=["g6.12xlarge"])["InstanceTypes"][0]
    assert info["NetworkInfo"]["EfaSupported"] is True
    assert info["GpuInfo"]["Gpus"][0]["Count"] == 4


def test_the_local_dashboard_refuses_callers_without_the_ray_token(local_cluster: LocalCluster) -> None:
    # As on every run's cluster (RAY_AUTH_MODE=token): the job API, which runs code, needs the token; the
    # health endpoints (KubeRay's probes) do not.
    jobs = f"{local_cluster.ray_dashboard_url}/api/jobs/"
    for headers, code in (({}, 401), ({"X-Ray-Authorization": "Bearer not-the-token"}, 403)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(jobs, headers=headers), timeout=10)
        assert refused.value.code == code, refused.value
    assert answers(jobs, local_cluster.ray_token_header)
    assert answers(f"{local_cluster.ray_dashboard_url}/api/gcs_healthz")


def test_ray_job_submitted_to_the_local_dashboard_succeeds(local_cluster: LocalCluster) -> None:
    client = local_cluster.ray_jobs()
    job_id = client.submit_job(
        entrypoint='python -c "import ray; ray.init(); '
        "print('sum', ray.get(ray.remote(lambda: 40 + 2).remote()))\"",
        submission_id=f"harness-{uuid.uuid4().hex[:8]}",
    )
    status = wait_until(
        "the Ray job to finish",
        lambda: (
            (s := client.get_job_status(job_id)) in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
            and s
        ),
        timeout=180,
        interval=2,
    )
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs
    assert "sum 42" in logs
