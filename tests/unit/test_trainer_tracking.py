"""What the trainer logs to MLflow and when an attempt continues the MLflow run of an earlier one (pure: the
real server's tests are tests/unit/test_tracking_mlflow.py, in the operator's environment)."""

from __future__ import annotations

from fsdp_trainer.contract import AttemptInfo, MlflowConfig, MlflowRunRef, TrainerConfig
from fsdp_trainer.tracking import auth_headers, config_params, continues, proxied_artifact_path, run_tags

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
