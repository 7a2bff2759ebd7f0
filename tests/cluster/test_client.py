"""The Python client against the local apiserver: the verbs on a run, waiting (on a run that fails, on one no
operator watches), and the errors a notebook user meets, each one line saying what to do."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import boto3
import pytest
import yaml

from fsdp_client import (
    Client,
    InvalidSpec,
    NamespaceNotGranted,
    NoClusterAccess,
    RunExists,
    RunFailed,
    RunNotFound,
    StorageNotReadable,
    WaitTimedOut,
)
from tests.support.image import service_account_files
from tests.support.kube import kubectl
from tests.support.local_cluster import LocalCluster
from tests.support.operator_process import OperatorProcess

SPEC = {
    "model": {"source": "Qwen/Qwen3-0.6B"},
    "checkpoint": {"storagePath": "s3://fsdp-client-test/runs"},
    "training": {"maxSteps": 10},
}


def one_line(error: pytest.ExceptionInfo[Exception]) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_a_run_is_created_read_suspended_resumed_and_deleted_through_the_client(
    namespace: str, crd_installed: None
) -> None:
    client = Client(namespace)
    run = client.create("first", labels={"team": "a"}, **SPEC)
    assert (run.name, run.namespace, run.spec.training.max_steps) == ("first", namespace, 10)
    with pytest.raises(RunExists) as exists:
        client.create("first", **SPEC)
    assert "exists already" in one_line(exists)

    assert [r.name for r in client.list(label_selector="team=a")] == ["first"]
    assert client.suspend("first").spec.suspend is True
    assert client.get("first").spec.suspend is True
    assert client.resume(run).spec.suspend is False

    client.delete("first")
    with pytest.raises(RunNotFound) as gone:
        client.get("first")
    assert f"no run {namespace}/first" in one_line(gone)


def test_a_spec_the_cluster_refuses_is_refused_before_it_is_sent(namespace: str, crd_installed: None) -> None:
    client = Client(namespace)
    with pytest.raises(InvalidSpec) as refused:
        client.create("bad", **{**SPEC, "training": {"maxSteps": -1}})
    # The client's words, from the CRD's models, not the apiserver's refusal ("the cluster refused ...").
    assert one_line(refused).startswith("invalid spec: spec.training.maxSteps: Input should be greater than")
    assert client.list() == []


def test_waiting_on_a_run_no_operator_watches_says_so(namespace: str, crd_installed: None) -> None:
    client = Client(namespace)
    client.create("unwatched", **SPEC)
    started = time.monotonic()
    with pytest.raises(WaitTimedOut) as timed_out:
        client.wait("unwatched", phase="Running", timeout=3)
    assert time.monotonic() - started < 15
    message = one_line(timed_out)
    assert (
        f"did not reach Running in 3 s: the operator has not written its status: is namespace {namespace}"
        in (message)
    )


def test_waiting_on_a_run_that_fails_raises_its_status_reason(
    namespace: str, operator: OperatorProcess
) -> None:
    """A Secret the namespace does not grant: the operator fails the run at once, with reason NotAllowed."""
    client = Client(namespace)
    client.create(
        "needs-a-secret", **SPEC, runtimeEnv={"secretEnv": {"HF_TOKEN": {"name": "hf", "key": "t"}}}
    )
    with pytest.raises(RunFailed) as failed:
        client.wait("needs-a-secret", timeout=60)
    assert failed.value.reason == "NotAllowed" and failed.value.run.phase == "Failed"
    assert one_line(failed).startswith(f"run {namespace}/needs-a-secret failed: NotAllowed: ")
    assert "hf" in failed.value.message


def kubeconfig_of(local_cluster: LocalCluster, namespace: str, service_account: str, into: Path) -> Path:
    """A kubeconfig that is the service account: its token, the cluster's CA."""
    files = service_account_files(local_cluster.kubeconfig, namespace, service_account, into)
    server = yaml.safe_load(Path(local_cluster.kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": server, "certificate-authority": str(files / "ca.crt")}}
        ],
        "users": [{"name": "u", "user": {"token": (files / "token").read_text()}}],
        "contexts": [{"name": "u", "context": {"cluster": "c", "user": "u", "namespace": namespace}}],
        "current-context": "u",
    }
    path = into / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_namespace_not_granted_says_whom_to_ask(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path
) -> None:
    kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    client = Client(kubeconfig=str(kubeconfig_of(local_cluster, namespace, "nobody", tmp_path)))
    assert client.namespace == namespace  # the context's
    with pytest.raises(NamespaceNotGranted) as refused:
        client.list()
    message = one_line(refused)
    assert f"namespace {namespace} not granted: you may not list FSDPTrainingRuns there" in message
    assert "edit role" in message


def test_no_cluster_access_says_what_to_set(tmp_path: Path, local_cluster: LocalCluster) -> None:
    with pytest.raises(NoClusterAccess) as missing:
        Client(kubeconfig=str(tmp_path / "absent"))
    assert "set KUBECONFIG" in one_line(missing)

    with socket.socket() as closed:  # a loopback port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    config = yaml.safe_load(Path(local_cluster.kubeconfig).read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    client = Client("team-a", kubeconfig=str(tmp_path / "kubeconfig"))
    with pytest.raises(NoClusterAccess) as unreachable:
        client.get("any")
    assert f"cannot reach the apiserver at https://127.0.0.1:{port}" in one_line(unreachable)


def test_s3_not_readable_says_why(
    namespace: str, crd_installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = Client(namespace)
    client.create(
        "nowhere", **{**SPEC, "checkpoint": {"storagePath": f"s3://absent-{uuid.uuid4().hex[:8]}/r"}}
    )
    with pytest.raises(StorageNotReadable) as absent:
        client.log("nowhere")
    message = one_line(absent)
    assert "the bucket of s3://absent-" in message and "spec.checkpoint.storagePath" in message

    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StorageNotReadable) as anonymous:
        Client(namespace, s3=boto3.session.Session().client("s3")).log("nowhere")  # a fresh credential chain
    assert "no AWS credentials in this environment" in one_line(anonymous)
