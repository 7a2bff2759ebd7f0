"""What the trainer logs to MLflow and when an attempt continues the MLflow run of an earlier one (pure: the
real server's tests are tests/cluster/test_tracking_mlflow.py, in the operator's environment)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, cast

import pytest

from fsdp_trainer import tracking
from fsdp_trainer.contract import AttemptInfo, MlflowConfig, MlflowRunRef, TrainerConfig
from fsdp_trainer.storage import Location
from fsdp_trainer.tracking import (
    Metric,
    MlflowError,
    auth_headers,
    config_params,
    continues,
    proxied_artifact_path,
    run_tags,
)

CONFIG = TrainerConfig.model_validate(
    {
        "runName": "qwen-sft",
        "namespace": "team-a",
        "model": {"fromConfig": {"model_type": "qwen2", "hidden_size": 64}, "tokenizer": "byte-level"},
        "training": {"maxSteps": 10, "learningRate": 1e-4},
        "data": {"source": "s3://data/corpus.jsonl"},
        "checkpoint": {"storagePath": "s3://ckpt/runs"},
        "network": {"ncclEnv": {"NCCL_DEBUG": "WARN"}},
        "tracking": {"mlflow": {"trackingUri": "http://mlflow:5000"}},
    }
)
MLFLOW = MlflowConfig(tracking_uri="http://mlflow:5000")


def test_every_resolved_config_field_is_a_param_by_its_dotted_name() -> None:
    params = config_params(CONFIG)
    assert params["training.maxSteps"] == "10"
    assert params["training.learningRate"] == "0.0001"
    assert params["training.schedule"] == "cosine"  # a default, resolved
    assert params["model.fromConfig.hidden_size"] == "64"
    assert params["network.ncclEnv.NCCL_DEBUG"] == "WARN"
    assert params["fsdp.compile"] == "false"
    assert params["data.source"] == "s3://data/corpus.jsonl"


def test_tags_name_the_run_the_attempt_the_code_the_image_and_the_data() -> None:
    attempt = AttemptInfo(attempt=2, image_digest="repo@sha256:" + "1" * 64, trainer_package_sha256="2" * 64)
    tags = run_tags(CONFIG, attempt, "qwen-sft-abc-2", "d" * 16)
    prefix = "fsdp.training.dev/"
    assert tags[prefix + "run"] == "team-a/qwen-sft"
    assert tags[prefix + "attempt"] == "2"
    assert tags[prefix + "image-digest"] == "repo@sha256:" + "1" * 64
    assert tags[prefix + "trainer-package-sha256"] == "2" * 64
    assert tags[prefix + "data-fingerprint"] == "d" * 16
    by_hand = run_tags(CONFIG, AttemptInfo(), "local", "d" * 16)
    assert prefix + "attempt" not in by_hand and prefix + "image-digest" not in by_hand


def test_a_later_attempt_continues_the_recorded_mlflow_run_unless_it_starts_afresh_or_elsewhere() -> None:
    recorded = MlflowRunRef(
        tracking_uri="http://mlflow:5000", experiment_id="1", run_id="r", submission_id="s-1"
    )
    assert continues(recorded, MLFLOW, "auto", "s-2")
    assert continues(recorded, MLFLOW, "s3://ckpt/other/checkpoint_000010", "s-2")
    assert not continues(None, MLFLOW, "auto", "s-2")
    assert not continues(recorded, MLFLOW, "never", "s-2")  # a fresh start is a new MLflow run
    assert continues(recorded, MLFLOW, "never", "s-1")  # ... but Ray Train's retry inside it is not
    assert not continues(recorded, MlflowConfig(tracking_uri="http://other:5000"), "auto", "s-2")


def test_the_model_goes_through_the_servers_artifact_api_only_when_the_server_serves_artifacts() -> None:
    assert proxied_artifact_path("mlflow-artifacts:/3/abc/artifacts") == "3/abc/artifacts"
    assert proxied_artifact_path("mlflow-artifacts://host:5000/3/abc/artifacts") == "3/abc/artifacts"
    served = "https://mlflow.example.com/api/2.0/mlflow-artifacts/artifacts/3/abc/artifacts"
    assert proxied_artifact_path(served) == "3/abc/artifacts"
    assert proxied_artifact_path("s3://bucket/3/abc/artifacts") is None


def test_credentials_come_from_mlflows_own_variables() -> None:
    assert auth_headers({"MLFLOW_TRACKING_TOKEN": "t"}) == {"Authorization": "Bearer t"}
    assert auth_headers({"MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "p"}) == {
        "Authorization": "Basic dTpw"
    }
    assert auth_headers({}) == {}


class FlakyServer:
    """The MlflowClient calls the tracker makes, refused while `down`."""

    def __init__(self, tracking_uri: str) -> None:
        self.down = True
        self.refused = 0
        self.metrics: list[tuple[str, float, int]] = []
        self.status: tuple[str, bool] | None = None

    def answer(self) -> None:
        if self.down:
            self.refused += 1
            raise MlflowError("connection refused")

    def experiment_id(self, name: str) -> str:
        self.answer()
        return "1"

    def create_run(self, experiment_id: str, run_name: str) -> dict[str, Any]:
        self.answer()
        return {"info": {"run_id": "r-1", "artifact_uri": "mlflow-artifacts:/1/r-1/artifacts"}}

    def log_batch(self, run_id: str, metrics: list[Metric] | None = None, **_: Any) -> None:
        self.answer()
        self.metrics += [(m.key, m.value, m.step) for m in metrics or []]

    def update_run(self, run_id: str, status: str, end: bool) -> None:
        self.answer()
        self.status = (status, end)


def test_a_server_that_is_down_costs_one_warning_and_gets_every_metric_once_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tracking, "MlflowClient", FlakyServer)
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.05)
    monkeypatch.setattr(tracking, "FLUSH_INTERVAL_SECONDS", 0.01)
    caplog.set_level(logging.INFO, logger=tracking.__name__)
    tracker = tracking.MlflowTracker(CONFIG, AttemptInfo(), "s-1", Location.parse(str(tmp_path)), "d" * 16)
    server = cast(FlakyServer, tracker.client)
    tracker.log_metrics(1, {"loss": 2.5, "mfu": None, "grad_norm": math.inf})
    deadline = time.monotonic() + 10
    while server.refused < 3:  # the run is opened at once, then retried every RETRY_SECONDS
        assert time.monotonic() < deadline, "no retries"
        time.sleep(0.01)
    server.down = False
    tracker.log_metrics(2, {"loss": 2.0})
    tracker.close("FAILED")
    assert server.metrics == [("loss", 2.5, 1), ("loss", 2.0, 2)], "finite values, each once"
    assert server.status == ("FAILED", True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("mlflow: tracking degraded, training goes on")
    assert warnings[1] == "mlflow: the tracking server answers again"
    assert MlflowRunRef.model_validate_json((tmp_path / "mlflow.json").read_text()).run_id == "r-1"
