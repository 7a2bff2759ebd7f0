"""The S3 access check the trainer makes before anything else: can this pod's AWS identity read and write the
run's prefixes?

A pod without credentials (a service account with no IAM role, no Pod Identity association, no keys) or
with a role that lacks a permission fails the same way on every attempt, so it is a permanent configuration
failure, said once with the prefix, the identity and the permission missing: not a NoCredentialsError minutes
later, after the model is loaded, retried three times. Errors that another attempt may not meet (the network,
S3's 5xx, a missing bucket) end the check with a warning and are left to the training itself.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from fsdp_trainer.contract import TrainerConfig, split_s3_uri

log = logging.getLogger(__name__)

# S3's and STS's answers that mean this identity may not do this (or is no identity at all).
DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "InvalidIdentityToken",
        "InvalidClientTokenId",
        "AccessDeniedException",
        "403",
    }
)
NO_CREDENTIALS = "no AWS credentials"
# The credential chain's sources a pod's environment can name (IRSA, Pod Identity, static keys, a profile).
CREDENTIAL_VARIABLES = (
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
)
CHECK_PREFIX = ".access-check"  # under the run's prefix: the object the write check puts and deletes


@dataclass(frozen=True)
class Prefix:
    uri: str
    purpose: str
    writes: bool  # the run's own prefix: checkpoints, progress, logs, run.json


class StorageAccessRefused(Exception):
    """This pod's AWS identity cannot do what the run needs on one of its S3 prefixes."""


def run_prefixes(config: TrainerConfig) -> list[Prefix]:
    """The S3 prefixes the run reads and writes; local paths and hub ids are not this check's."""
    wanted = [Prefix(config.run_uri(), "checkpoints, progress and logs", True)]
    reads = [
        (config.data.source, "data.source"),
        (config.data.eval_source, "data.evalSource"),
        (config.model.source, "model.source"),
        (config.model.tokenizer, "model.tokenizer"),
    ]
    if config.checkpoint.resume not in ("auto", "never"):
        reads.append((config.checkpoint.resume, "checkpoint.resume"))
    seen = {wanted[0].uri}
    for uri, purpose in reads:
        if uri and uri.startswith("s3://") and uri not in seen:
            seen.add(uri)
            wanted.append(Prefix(uri, purpose, False))
    return wanted


def check_storage_access(config: TrainerConfig) -> str | None:
    """The identity's S3 access to the run's prefixes, checked with the calls the run makes (list, get, put,
    delete); the identity it was checked as (logged), or None when the run keeps nothing in S3.
    StorageAccessRefused names what is missing; any other error ends the check with a warning."""
    prefixes = run_prefixes(config)
    if not prefixes[0].uri.startswith("s3://"):
        return None
    import boto3
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        CredentialRetrievalError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    session = boto3.session.Session()
    identity = _identity(session)
    s3 = session.client("s3")
    for prefix in prefixes:
        for action, call in _calls(s3, prefix):
            try:
                call()
            except (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError) as error:
                raise StorageAccessRefused(
                    _refusal(prefix, identity, action, f"{NO_CREDENTIALS}: {error}")
                ) from error
            except ClientError as error:
                code = str(error.response.get("Error", {}).get("Code", ""))
                if code in DENIED_CODES:
                    raise StorageAccessRefused(
                        _refusal(prefix, identity, action, f"{code}: {error}")
                    ) from error
                return _not_checked(identity, action, prefix, error)
            except BotoCoreError as error:  # the network, S3's outage: the run's own retries meet it
                return _not_checked(identity, action, prefix, error)
    log.info("S3 access checked as %s: %s", identity, ", ".join(p.uri for p in prefixes))
    return identity


def _not_checked(identity: str, action: str, prefix: Prefix, error: Exception) -> str:
    log.warning("S3 access not checked (%s on %s as %s): %s", action, prefix.uri, identity, error)
    return identity


def _identity(session: Any) -> str:
    """Who this pod is to AWS (STS GetCallerIdentity), or why it is no one."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return str(session.client("sts").get_caller_identity()["Arn"])
    except (BotoCoreError, ClientError) as error:
        return f"no identity ({type(error).__name__}: {error}; {_credential_sources()})"


def _credential_sources() -> str:
    """Which of the credential chain's sources the pod's environment offers, by name (never a value)."""
    offered = [name for name in CREDENTIAL_VARIABLES if os.environ.get(name)]
    return f"the environment sets {', '.join(offered)}" if offered else "the environment sets no credentials"


def _calls(s3: Any, prefix: Prefix) -> list[tuple[str, Any]]:
    """(the IAM action, the call) for each thing the run does on the prefix, in the order it does them."""
    bucket, key = split_s3_uri(prefix.uri)
    listed = key.rstrip("/") + "/" if key else ""
    calls: list[tuple[str, Any]] = [
        ("s3:ListBucket", lambda: s3.list_objects_v2(Bucket=bucket, Prefix=listed, MaxKeys=1)),
    ]
    if prefix.writes:
        probe = f"{listed}{CHECK_PREFIX}/{uuid.uuid4().hex}"
        calls += [
            ("s3:PutObject", lambda: s3.put_object(Bucket=bucket, Key=probe, Body=b"")),
            ("s3:GetObject", lambda: s3.get_object(Bucket=bucket, Key=probe)["Body"].read()),
            ("s3:DeleteObject", lambda: s3.delete_object(Bucket=bucket, Key=probe)),  # keep=N prunes
        ]
    else:
        calls.append(("s3:GetObject", lambda: _read_first_byte(s3, bucket, key)))
    return calls


def _read_first_byte(s3: Any, bucket: str, key: str) -> None:
    """A one-byte GET of the source's first object (the key itself when it names a file)."""
    found = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("Contents") or []
    if found:
        s3.get_object(Bucket=bucket, Key=found[0]["Key"], Range="bytes=0-0")["Body"].read()


def _refusal(prefix: Prefix, identity: str, action: str, error: str) -> str:
    needed = "read and write" if prefix.writes else "read"
    return (
        f"{action} refused on {prefix.uri} ({prefix.purpose}, which the run must {needed}) for {identity}: "
        f"{error}. Give the run's service account (spec.cluster.serviceAccountName) an IAM role that allows "
        "it: the annotation eks.amazonaws.com/role-arn (IRSA) or an EKS Pod Identity association"
    )
