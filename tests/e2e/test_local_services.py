"""The local S3/EC2 server and the local Ray head answer like the real services the operator talks to."""

from __future__ import annotations

import os
import re
import subprocess
import urllib.error
import urllib.request
import uuid

import boto3
import pytest
from ray.job_submission import JobStatus

from tests.support.local_cluster import LocalCluster
from tests.support.net import answers
from tests.support.paths import cluster_settings, state_dir
from tests.support.waiting import wait_until


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


def ray_daemons_listening(head_pid: int) -> dict[int, str]:
    """Port -> process of every TCP port the Ray head's own servers listen on (GCS, raylet, dashboard, agents,
    monitors): the process group `ray start` leads. Job drivers and workers get groups of their own, and
    their code may listen anywhere."""
    listening: dict[int, str] = {}
    sockets = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    for line in sockets.splitlines():
        address, users = line.split()[3], line.split("users:", 1)[-1]
        for name, pid in re.findall(r'"([^"]+)",pid=(\d+)', users):
            try:
                if os.getpgid(int(pid)) != head_pid:
                    continue
            except ProcessLookupError:
                continue  # exited meanwhile
            listening[int(address.rsplit(":", 1)[1])] = f"{name} (pid {pid})"
    return listening


def test_the_ray_head_listens_only_on_the_ports_its_instance_was_given(local_cluster: LocalCluster) -> None:
    # The suite's two local clusters start their Ray heads at the same moment; a port Ray picks for itself
    # (it did for the dashboard agent's gRPC server) or takes by default (the autoscaler's and the dashboard's
    # metrics ports) is then wanted by both, and one head loses a server or dies at start.
    head_ports, first_worker_port, last_worker_port = cluster_settings(
        "RAY_HEAD_PORTS", "RAY_MIN_WORKER_PORT", "RAY_MAX_WORKER_PORT"
    )
    given = {int(port) for port in head_ports.split()}
    head_pid = int((state_dir() / "pids" / "ray.pid").read_text())

    listening: dict[int, str] = {}

    def every_server_up() -> bool:  # the GCS, raylet, dashboard and its agents, client server, monitors
        listening.clear()
        listening.update(ray_daemons_listening(head_pid))
        return given <= set(listening)

    wait_until(f"the Ray head's servers on each of {sorted(given)}", every_server_up, timeout=60)
    strays = {
        port: process
        for port, process in listening.items()
        if port not in given and not int(first_worker_port) <= port <= int(last_worker_port)
    }
    assert not strays, f"Ray head processes listen on ports hack/lib.sh did not give this instance: {strays}"
