"""MLflow tracking against a real MLflow server (the PyPI `mlflow` package on loopback: SQLite backend,
artifacts proxied by the server into the test S3), the trainer run by the command line the operator submits
(`--launcher direct`: one CPU process, a tiny Qwen2): a run that dies once and resumes shows one MLflow
run, with every step, the params, the tags and the model; a server that is down costs a warning only.

The server lives in a venv of its own (hack/venv.sh, hack/mlflow/requirements.lock): mlflow pins pyarrow
below the operator environment's 26.0.1, so it cannot share it. Its cost per step is measured by
bench/trainer_mlflow.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from fsdp_operator import api, submission
from fsdp_operator.builder import RunRef
from fsdp_trainer.contract import MLFLOW_RUN_FILE, AttemptInfo, MlflowRunRef, ProgressRecord
from tests.support.demo import complete_checkpoint_manifests
from tests.support.manifests import tiny_qwen2
from tests.support.mlflow import MlflowServer
from tests.support.net import free_port
from tests.support.paths import REPO, dlc_python
from tests.support.waiting import wait_until

TINY_QWEN2 = tiny_qwen2()
MAX_STEPS = 16
CHECKPOINT_EVERY = 4
FAULT_STEP = 11  # after the checkpoint of step 8: the second attempt resumes at step 9
IMAGE_DIGEST = "registry.test/dlc@sha256:" + "ab" * 32
TAG = "fsdp.training.dev/"
RUN_TIMEOUT_S = 300


def run_spec(
    storage: str, tracking_uri: str, experiment: str, registered_model: str | None = None
) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"fromConfig": TINY_QWEN2, "tokenizer": "byte-level"},
            "cluster": {"workers": 1},
            "training": {
                "maxSteps": MAX_STEPS,
                "microBatchSize": 2,
                "sequenceLength": 32,
                "learningRate": 3e-3,
                "logEvery": 1,
            },
            "data": {"source": "synthetic", "evalEvery": 8, "evalBatches": 2},
            "checkpoint": {"storagePath": storage, "everySteps": CHECKPOINT_EVERY},
            "network": {"bandwidthProbeMb": 0},
            "tracking": {
                "mlflow": {
                    "trackingUri": tracking_uri,
                    "experimentName": experiment,
                    "registeredModelName": registered_model,
                }
            },
        }
    )


def start_attempt(
    spec: api.FSDPTrainingRunSpec, run: RunRef, attempt: int, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """One attempt as the operator submits it (its entrypoint), in one local process logging to `log`."""
    config = submission.trainer_config(spec, run, cpu_only=True)
    info = AttemptInfo(
        attempt=attempt, image_digest=IMAGE_DIGEST, trainer_package_sha256=submission.package_sha256()
    )
    command = shlex.split(submission.entrypoint(config, f"{run.name}-{attempt}", info))
    assert command[:3] == ["python", "-m", "fsdp_trainer"]
    with log.open("w") as out:
        return subprocess.Popen(
            [str(dlc_python()), *command[1:], "--launcher", "direct"],
            env={**os.environ, "PYTHONPATH": str(REPO / "trainer"), "HF_HUB_OFFLINE": "1", **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def run_attempt(spec: api.FSDPTrainingRunSpec, run: RunRef, attempt: int, log: Path) -> str:
    """Runs an attempt to its end; returns its log, which says why when it fails."""
    process = start_attempt(spec, run, attempt, log)
    returncode = process.wait(timeout=RUN_TIMEOUT_S)
    assert returncode == 0, log.read_text()[-3000:]
    return log.read_text()


def read_s3(uri: str) -> str:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return str(boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read().decode())


def test_a_run_that_restarts_once_is_one_mlflow_run_with_every_step_its_params_tags_and_model(
    mlflow: MlflowServer, s3_storage: str, tmp_path: Path
) -> None:
    experiment = f"restart-{uuid.uuid4().hex[:6]}"
    registered_model = f"tiny-qwen2-{experiment}"
    spec = run_spec(s3_storage, mlflow.url, experiment, registered_model)
    run = RunRef(name="tiny-restart", namespace="team-a", uid=uuid.uuid4().hex)
    # The first attempt stops making progress at step 11 (after the checkpoint of step 8) and is killed
    # once MLflow shows its step 10 and its checkpoint of step 8 is complete (written in the background: on
    # a loaded machine it completed after step 10 was logged, and the second attempt resumed from step 4), as
    # a lost node is: no cleanup, no last flush.
    first = start_attempt(
        spec,
        run,
        1,
        tmp_path / "attempt-1.log",
        {"FSDP_TRAINER_FAULT": f"rank=0,step={FAULT_STEP},action=hang"},
    )
    try:
        wait_until(
            "the first attempt's step 10 in MLflow and its checkpoint of step 8 complete in S3",
            lambda: (
                max(mlflow.logged_steps(experiment, "loss"), default=0) >= FAULT_STEP - 1
                and 8 in complete_checkpoint_steps(s3_storage)
            ),
            timeout=RUN_TIMEOUT_S,
        )
    finally:
        first.kill()
        first.wait()
    second = run_attempt(spec, run, 2, tmp_path / "attempt-2.log")
    assert re.search(r"resumed from \S+ at step 8\b", second), second[-3000:]

    runs = mlflow.runs(experiment)
    assert len(runs) == 1, [r["info"]["run_name"] for r in runs]
    mlflow_run = runs[0]
    info, data = mlflow_run["info"], mlflow_run["data"]
    assert info["run_name"] == "team-a/tiny-restart" and info["status"] == "FINISHED"
    config = submission.trainer_config(spec, run, cpu_only=True)
    recorded = MlflowRunRef.model_validate_json(read_s3(f"{config.run_uri()}/{MLFLOW_RUN_FILE}"))
    assert recorded.run_id == info["run_id"]

    # Continuous steps across the restart: every step once at least; steps after the checkpoint of step 8
    # that the first attempt logged before it died are logged again by the second, which trained them again.
    loss_steps = sorted(m["step"] for m in mlflow.history(info["run_id"], "loss"))
    assert set(loss_steps) == set(range(1, MAX_STEPS + 1)), loss_steps
    assert len(loss_steps) >= MAX_STEPS
    for metric in ("learning_rate", "tokens_per_second", "grad_norm", "step_time_seconds"):
        assert {m["step"] for m in mlflow.history(info["run_id"], metric)} == set(range(1, 17))
    eval_steps = {m["step"] for m in mlflow.history(info["run_id"], "eval_loss")}
    assert {8, 16} <= eval_steps

    params = {p["key"]: p["value"] for p in data["params"]}
    assert params["training.maxSteps"] == str(MAX_STEPS)
    assert params["training.learningRate"] == "0.003"
    assert params["model.fromConfig.hidden_size"] == "32"
    assert params["tracking.mlflow.trackingUri"] == mlflow.url
    assert params["checkpoint.storagePath"] == s3_storage

    tags = {t["key"]: t["value"] for t in data["tags"]}
    manifests = [k for k in _keys(s3_storage) if k.endswith("fsdp_manifest.json")]
    data_fingerprint = json.loads(read_s3(f"s3://{s3_storage.split('/')[2]}/{manifests[0]}"))[
        "dataFingerprint"
    ]
    assert tags[TAG + "run"] == "team-a/tiny-restart"
    assert tags[TAG + "attempt"] == "2"  # the latest attempt
    assert tags[TAG + "image-digest"] == IMAGE_DIGEST
    assert tags[TAG + "trainer-package-sha256"] == submission.package_sha256()
    assert tags[TAG + "data-fingerprint"] == data_fingerprint
    assert tags[TAG + "model-uri"] == f"{config.run_uri()}/model"

    # The exported model, served back by the tracking server's artifact API.
    listing = mlflow.get(
        "mlflow-artifacts/artifacts", path=f"{info['experiment_id']}/{info['run_id']}/artifacts/model"
    )
    names = {f["path"] for f in listing.get("files", [])}
    assert {"config.json", "model.safetensors"} <= names, names
    exported = {k.rsplit("/", 1)[-1]: k for k in _keys(s3_storage) if "/model/" in k}
    with urllib.request.urlopen(
        f"{mlflow.url}/api/2.0/mlflow-artifacts/artifacts/{info['experiment_id']}/{info['run_id']}"
        "/artifacts/model/config.json",
        timeout=10,
    ) as response:
        assert response.read().decode() == read_s3(
            f"s3://{s3_storage.split('/')[2]}/{exported['config.json']}"
        )

    # Registered, as asked: one version, made from this run's model/ artifacts.
    found = mlflow.get("mlflow/model-versions/search", filter=f"name='{registered_model}'")
    [version] = found["model_versions"]
    assert version["run_id"] == info["run_id"]
    assert version["source"] == f"{info['artifact_uri']}/model"
    assert tags[TAG + "registered-model"] == f"{registered_model}/{version['version']}"


def _keys(storage: str) -> list[str]:
    bucket = storage.removeprefix("s3://").split("/")[0]
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def complete_checkpoint_steps(storage: str) -> set[int]:
    """The steps of the checkpoints under `storage` that are complete (their manifest written last)."""
    bucket = storage.removeprefix("s3://").split("/")[0]
    return {manifest["step"] for manifest in complete_checkpoint_manifests(boto3.client("s3"), bucket, "")}


@pytest.fixture(params=["refusing", "silent"])
def down_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """A tracking URI where nothing listens (connections refused), or where a socket accepts connections
    and never answers (each request runs into its timeout)."""
    if request.param == "refusing":
        yield f"http://127.0.0.1:{free_port()}"
        return
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes the handshakes; nobody reads
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"


def test_a_tracking_server_that_is_down_costs_a_warning_not_the_training(
    down_server: str, s3_storage: str, tmp_path: Path
) -> None:
    spec = run_spec(s3_storage, down_server, "never-reached")
    run = RunRef(name="tiny-down", namespace="team-a", uid=uuid.uuid4().hex)
    started = time.monotonic()
    log = run_attempt(spec, run, 1, tmp_path / "attempt-1.log")
    print(f"the run took {time.monotonic() - started:.1f} s with a {down_server} tracking server")
    assert log.count("mlflow: tracking degraded, training goes on") == 1  # once, however many retries
    config = submission.trainer_config(spec, run, cpu_only=True)
    progress = ProgressRecord.model_validate_json(read_s3(f"{config.run_uri()}/progress.json"))
    assert progress.phase == "finished" and progress.step == MAX_STEPS
