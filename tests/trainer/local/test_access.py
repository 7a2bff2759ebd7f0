"""The trainer's first act: an S3 access check of the run's prefixes as the pod's AWS identity.

Against moto servers of the test's own: one that enforces IAM (INITIAL_NO_AUTH_ACTION_COUNT) for what a role
may do, one that does not for IRSA's web-identity exchange (moto authenticates every call when IAM is
enforced, the unsigned AssumeRoleWithWebIdentity too, and fails it). `python -m fsdp_trainer` runs as the
operator's job runs it: a refusal exits 2 before Ray starts, with the line the operator classes as permanent
(StorageAccessDenied)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest

from fsdp_trainer.access import check_storage_access
from fsdp_trainer.contract import TrainerConfig
from tests.support.net import answers, free_port
from tests.support.paths import REPO
from tests.support.processes import stop_process
from tests.support.waiting import wait_until

BUCKET = "team-a"
# The unauthenticated calls that set an IAM-enforcing server up (set_up): a user, its key and policy, the
# role and its policy, the bucket and a data file.
SETUP_CALLS = 7
ROLE = "team-a-training"
REFUSED = "storage access refused (error kind storage-access)"
CONFIG = {
    "runName": "run",
    "namespace": "team-a",
    "model": {"fromConfig": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}},
    "data": {"source": f"s3://{BUCKET}/data/corpus.jsonl"},
    "checkpoint": {"storagePath": f"s3://{BUCKET}/runs"},
}
Moto = Callable[[int | None], str]


@pytest.fixture
def moto() -> Iterator[Moto]:
    """Starts moto servers on loopback (IAM enforced after that many calls, or never); stops them by pid."""
    servers: list[subprocess.Popen[bytes]] = []

    def start(no_auth_calls: int | None) -> str:
        port = free_port()
        env = dict(os.environ)
        if no_auth_calls is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(no_auth_calls)
        servers.append(
            subprocess.Popen(
                [Path(sys.executable).with_name("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        endpoint = f"http://127.0.0.1:{port}"
        wait_until(f"moto at {endpoint}", lambda: answers(f"{endpoint}/moto-api/"), timeout=30, interval=0.3)
        return endpoint

    try:
        yield start
    finally:
        for server in servers:
            stop_process(server)


def set_up(endpoint: str, allowed: list[str]) -> dict[str, str]:
    """The bucket, a data file, and a role that may do `allowed` on the bucket; credentials of a session of
    that role (as AWS_* variables), taken by a user that may assume it."""
    setup = {"aws_access_key_id": "setup", "aws_secret_access_key": "setup", "region_name": "us-west-2"}
    iam = boto3.client("iam", endpoint_url=endpoint, **setup)
    iam.create_user(UserName="platform")
    key = iam.create_access_key(UserName="platform")["AccessKey"]
    may_assume = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}],
    }
    iam.put_user_policy(UserName="platform", PolicyName="assume", PolicyDocument=json.dumps(may_assume))
    trust = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}],
    }
    arn = iam.create_role(RoleName=ROLE, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    bucket = [f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"]
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": allowed, "Resource": bucket}],
    }
    iam.put_role_policy(RoleName=ROLE, PolicyName="s3", PolicyDocument=json.dumps(policy))
    s3 = boto3.client("s3", endpoint_url=endpoint, **setup)
    s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    s3.put_object(Bucket=BUCKET, Key="data/corpus.jsonl", Body=b'{"text": "hello"}\n')
    user = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    sts = boto3.client("sts", endpoint_url=endpoint, region_name="us-west-2", **user)
    session = sts.assume_role(RoleArn=arn, RoleSessionName="pod")["Credentials"]
    return {
        "AWS_ACCESS_KEY_ID": session["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": session["SecretAccessKey"],
        "AWS_SESSION_TOKEN": session["SessionToken"],
    }


def open_bucket(endpoint: str) -> None:
    """The bucket on a server that does not enforce IAM."""
    keys = {"aws_access_key_id": "any", "aws_secret_access_key": "any", "region_name": "us-west-2"}
    boto3.client("s3", endpoint_url=endpoint, **keys).create_bucket(
        Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"}
    )


def pod_env(endpoint: str, tmp_path: Path) -> dict[str, str]:
    """A pod's AWS environment less its credentials: the endpoint, the region, no IMDS, no config files."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-west-2",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }


def trainer(endpoint: str, tmp_path: Path, credentials: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m fsdp_trainer` on a run in the bucket with only `credentials` for AWS."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run(
        [sys.executable, "-m", "fsdp_trainer", "--config", json.dumps(CONFIG)],
        # RAY_ADDRESS names a port where nothing listens: a trainer that went on to Ray would fail otherwise.
        env={
            **clean,
            **pod_env(endpoint, tmp_path),
            **credentials,
            "PYTHONPATH": str(REPO / "trainer"),
            "RAY_ADDRESS": f"127.0.0.1:{free_port()}",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = [ln for ln in done.stderr.splitlines() if REFUSED in ln]
    return line


def use(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process's AWS environment is `env` alone."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_a_pod_without_credentials_is_refused_naming_the_prefix_and_no_identity(
    moto: Moto, tmp_path: Path
) -> None:
    endpoint = moto(None)
    open_bucket(endpoint)
    started = time.monotonic()
    line = refusal(trainer(endpoint, tmp_path, {}))
    print(f"refused {time.monotonic() - started:.1f}s after the trainer started")
    assert f"s3:ListBucket refused on s3://{BUCKET}/runs/team-a/run" in line, line
    assert "no identity" in line and "no AWS credentials" in line, line
    assert "eks.amazonaws.com/role-arn" in line, line


def test_a_role_that_may_not_write_the_run_prefix_is_refused_naming_the_role_and_the_permission(
    moto: Moto, tmp_path: Path
) -> None:
    endpoint = moto(SETUP_CALLS)
    role = set_up(endpoint, ["s3:ListBucket", "s3:GetObject"])
    line = refusal(trainer(endpoint, tmp_path, role))
    assert f"s3:PutObject refused on s3://{BUCKET}/runs/team-a/run" in line, line
    assert f"assumed-role/{ROLE}/pod" in line and "AccessDenied" in line, line


def test_a_role_that_may_not_read_the_data_is_refused_naming_the_data(moto: Moto, tmp_path: Path) -> None:
    endpoint = moto(SETUP_CALLS)
    role = set_up(endpoint, ["s3:ListBucket", "s3:PutObject", "s3:DeleteObject"])
    line = refusal(trainer(endpoint, tmp_path, role))
    # The run's own prefix is read back first (its checkpoints): the refusal names it, and the permission.
    assert f"s3:GetObject refused on s3://{BUCKET}/runs/team-a/run" in line, line


def test_a_role_that_may_read_and_write_passes_and_leaves_nothing_behind(
    moto: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = moto(SETUP_CALLS)
    role = set_up(endpoint, ["s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"])
    use(monkeypatch, {**pod_env(endpoint, tmp_path), **role})
    identity = check_storage_access(TrainerConfig.model_validate(CONFIG))
    assert identity is not None and identity.endswith(f":assumed-role/{ROLE}/pod"), identity
    # A session of its own: boto3's default one keeps the credentials of whichever test made it first.
    s3 = boto3.session.Session().client("s3")
    left = s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/").get("Contents") or []
    assert left == [], left


def test_irsa_web_identity_credentials_are_the_identity_checked(
    moto: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the pod identity webhook gives a container: the role and a token file (moto's STS does not check
    the token's signature)."""
    endpoint = moto(None)
    open_bucket(endpoint)
    token = tmp_path / "token"
    token.write_text("header.payload.signature")
    role_arn = f"arn:aws:iam::123456789012:role/{ROLE}"
    web_identity = {"AWS_ROLE_ARN": role_arn, "AWS_WEB_IDENTITY_TOKEN_FILE": str(token)}
    use(monkeypatch, {**pod_env(endpoint, tmp_path), **web_identity})
    config = TrainerConfig.model_validate({**CONFIG, "data": {"source": "synthetic"}})
    identity = check_storage_access(config)
    assert identity is not None and f":assumed-role/{ROLE}/" in identity, identity
