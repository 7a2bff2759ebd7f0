"""Will a run's pods have AWS credentials? Said before any GPU is held, from what the operator can see (pure).

On EKS a pod gets credentials from its service account: an IAM role through IRSA (the annotation
eks.amazonaws.com/role-arn, which the pod identity webhook turns into a web-identity token) or an EKS Pod
Identity association (kept by EKS, which this operator does not read). IMDS is blocked for pods, as it should
be. A run whose service account has no role, and whose pods get no static keys, cannot write a checkpoint;
the trainer's access check fails it (fsdp_trainer.access), but only once the cluster is up. This says so
earlier, as a warning: keys may still come from somewhere the operator cannot see.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_operator import api

ROLE_ARN_ANNOTATION = "eks.amazonaws.com/role-arn"
DEFAULT_SERVICE_ACCOUNT = "default"
NO_POD_CREDENTIALS = "NoPodCredentials"  # the Warning event's reason
STATIC_KEY = "AWS_ACCESS_KEY_ID"


def service_account_of(spec: api.FSDPTrainingRunSpec) -> str:
    """The service account the run's pods run as."""
    return spec.cluster.service_account_name or DEFAULT_SERVICE_ACCOUNT


def missing_credentials(
    namespace: str,
    spec: api.FSDPTrainingRunSpec,
    service_account: Mapping[str, Any] | None,
    ray_pod_env: Mapping[str, str],
) -> str | None:
    """The warning for a run whose pods will have no AWS credentials the operator can see; None when they will
    (a role on the service account, static keys in the operator's ray-pod-env: spec.runtimeEnv refuses AWS_
    names) or when the run keeps nothing in S3."""
    if not spec.checkpoint.storage_path.startswith("s3://"):
        return None
    name = service_account_of(spec)
    annotations = ((service_account or {}).get("metadata") or {}).get("annotations") or {}
    if annotations.get(ROLE_ARN_ANNOTATION):
        return None
    if STATIC_KEY in ray_pod_env:
        return None
    account = (
        f"service account {namespace}/{name}"
        if service_account is not None
        else f"service account {namespace}/{name} (not found)"
    )
    return (
        f"the run's pods may have no AWS credentials for {spec.checkpoint.storage_path}: {account} has no "
        f"{ROLE_ARN_ANNOTATION} annotation and the operator's ray-pod-env sets no {STATIC_KEY}. Unless it "
        "has an EKS Pod Identity association (which the operator cannot see), annotate the service account "
        "with an IAM role that may read and write the prefix, or name one that has it in "
        "spec.cluster.serviceAccountName; the trainer's first act is an S3 access check that fails the run "
        "without retries"
    )
