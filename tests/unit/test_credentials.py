"""Pod credentials as EKS gives them: the operator's warning before any GPU is held, and the trainer's refused
S3 access classed as permanent."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fsdp_operator import api, credentials
from fsdp_operator.recovery import classify

ROLE = "arn:aws:iam::123456789012:role/team-a-training"


def spec(**cluster: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/runs"}, "cluster": cluster}
    )


def account(name: str, **annotations: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team-a", "annotations": annotations}}


def test_a_service_account_with_an_irsa_role_needs_no_warning() -> None:
    trainer = account("trainer", **{credentials.ROLE_ARN_ANNOTATION: ROLE})
    assert credentials.missing_credentials("team-a", spec(serviceAccountName="trainer"), trainer, {}) is None


def test_the_default_service_account_without_a_role_is_named_with_the_prefix() -> None:
    warning = credentials.missing_credentials("team-a", spec(), account("default"), {})
    assert warning is not None
    assert "service account team-a/default" in warning and "s3://b/runs" in warning
    assert credentials.ROLE_ARN_ANNOTATION in warning and "Pod Identity" in warning


def test_a_service_account_that_does_not_exist_is_said_so() -> None:
    warning = credentials.missing_credentials("team-a", spec(serviceAccountName="gone"), None, {})
    assert warning is not None and "team-a/gone (not found)" in warning


def test_static_keys_in_the_operators_pod_env_are_credentials() -> None:
    keys = {"AWS_ACCESS_KEY_ID": "AKIA...", "AWS_SECRET_ACCESS_KEY": "..."}
    assert credentials.missing_credentials("team-a", spec(), account("default"), keys) is None


def test_a_role_annotation_on_another_account_does_not_count() -> None:
    other = account("default", **{"eks.amazonaws.com/audience": "sts.amazonaws.com"})
    assert credentials.missing_credentials("team-a", spec(), other, {}) is not None


def test_the_trainers_refused_storage_access_is_permanent_and_named() -> None:
    line = (
        "storage access refused (error kind storage-access): s3:ListBucket refused on s3://b/runs/team-a/run "
        "(checkpoints, progress and logs, which the run must read and write) for no identity "
        "(NoCredentialsError: Unable to locate credentials; the environment sets no credentials)"
    )
    started = dt.datetime.now(dt.UTC)
    failure = classify(
        "Job entrypoint command failed with exit code 2", f"Traceback...\n{line}\n", None, started
    )
    assert failure.permanent and failure.reason == "StorageAccessDenied"
    assert "s3://b/runs/team-a/run" in failure.message and "no identity" in failure.message
