"""What a run may use beyond its own namespace's defaults, as the platform team grants it per namespace.

A user who may create FSDPTrainingRuns in a namespace gets no more through a run than that: the operator
creates pods with powers the user may not have (a Secret in their environment, a service account's token, a
priority that preempts others, a toleration onto dedicated nodes). So each of those is refused unless the
namespace's annotations grant it; the platform team, which owns Namespace objects, sets them. With no
annotation a run gets: no Secret, the namespace's `default` service account without its token, no priority
class, no Kueue workload priority class, no toleration beyond those the operator adds itself. Credentials go
only to the hosts of the operator's `allowed-hosts`, empty unless the platform sets it.

Annotations (on the Namespace; lists are comma-separated names, tolerations a JSON list):
  fsdp.training.dev/run-secrets                 Secrets runs may name (secretEnv, MLflow credentials)
  fsdp.training.dev/run-service-accounts        service accounts runs may name (their token is mounted)
  fsdp.training.dev/run-priority-classes        PriorityClasses runs may name
  fsdp.training.dev/run-workload-priority-classes   Kueue WorkloadPriorityClasses runs may name
  fsdp.training.dev/run-tolerations             tolerations runs may add, each exactly as listed
  fsdp.training.dev/run-s3-prefixes             s3:// prefixes runs may read and write, beside the platform's
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fsdp_operator import api, builder

PREFIX = "fsdp.training.dev/"
SECRETS = PREFIX + "run-secrets"
SERVICE_ACCOUNTS = PREFIX + "run-service-accounts"
PRIORITY_CLASSES = PREFIX + "run-priority-classes"
WORKLOAD_PRIORITY_CLASSES = PREFIX + "run-workload-priority-classes"
TOLERATIONS = PREFIX + "run-tolerations"
S3_PREFIXES = PREFIX + "run-s3-prefixes"
NOT_ALLOWED = "NotAllowed"
MAX_ANNOTATION = 16384  # a Namespace's annotations are the platform's, but a bound costs nothing


class PolicyError(ValueError):
    """A namespace annotation the operator cannot read: named, so the platform team can fix it."""


@dataclass(frozen=True)
class NamespacePolicy:
    namespace: str
    secrets: frozenset[str] = frozenset()
    service_accounts: frozenset[str] = frozenset()
    priority_classes: frozenset[str] = frozenset()
    workload_priority_classes: frozenset[str] = frozenset()
    tolerations: tuple[api.Toleration, ...] = ()
    s3_prefixes: frozenset[str] = frozenset()

    @classmethod
    def of(cls, namespace: str, annotations: Mapping[str, str]) -> NamespacePolicy:
        def names(key: str) -> frozenset[str]:
            return frozenset(n.strip() for n in _bounded(key, annotations).split(",") if n.strip())

        try:
            listed = json.loads(_bounded(TOLERATIONS, annotations) or "[]")
            tolerations = tuple(api.Toleration.model_validate(t) for t in listed)
        except (ValueError, TypeError) as error:
            raise PolicyError(
                f"namespace {namespace}: annotation {TOLERATIONS} is not a JSON list of tolerations: {error}"
            ) from error
        return cls(
            namespace=namespace,
            secrets=names(SECRETS),
            service_accounts=names(SERVICE_ACCOUNTS),
            priority_classes=names(PRIORITY_CLASSES),
            workload_priority_classes=names(WORKLOAD_PRIORITY_CLASSES),
            tolerations=tolerations,
            s3_prefixes=names(S3_PREFIXES),
        )


@dataclass(frozen=True)
class Platform:
    """What the platform team set for every namespace (operator settings)."""

    allowed_hosts: frozenset[str] = frozenset()
    head_tolerations: tuple[api.Toleration, ...] = ()
    s3_prefixes: tuple[str, ...] = ()  # may hold {namespace}

    def prefixes_of(self, policy: NamespacePolicy) -> list[str]:
        """The namespace's S3 prefixes, each ending in '/' so that s3://team-a/ never admits s3://team-a-x/."""
        own = [p.replace("{namespace}", policy.namespace) for p in self.s3_prefixes]
        return sorted({p if p.endswith("/") else p + "/" for p in [*own, *policy.s3_prefixes]})


def _bounded(key: str, annotations: Mapping[str, str]) -> str:
    value = annotations.get(key, "")
    if len(value) > MAX_ANNOTATION:
        raise PolicyError(f"annotation {key} is longer than {MAX_ANNOTATION} characters")
    return value


def refusals(spec: api.FSDPTrainingRunSpec, policy: NamespacePolicy, platform: Platform) -> list[str]:
    """Each thing the run asks for that its namespace does not grant, as 'spec.<field>: why'. Tolerations the
    operator gives the pods anyway (the GPU and EFA taints' for workers, the platform's `head_tolerations` for
    heads) need no grant."""
    refused: list[str] = []

    def grant(field: str, kind: str, name: str | None, granted: frozenset[str], annotation: str) -> None:
        if name is not None and name not in granted:
            listed = ", ".join(sorted(granted)) or "none"
            refused.append(
                f"spec.{field}: {kind} {name!r} is not granted to runs in namespace {policy.namespace} "
                f"(annotation {annotation} on the namespace lists: {listed})"
            )

    runtime_env = spec.runtime_env
    for variable, ref in runtime_env.secret_env.items():
        grant(f"runtimeEnv.secretEnv.{variable}.name", "Secret", ref.name, policy.secrets, SECRETS)
    mlflow = spec.tracking.mlflow
    if mlflow is not None:
        credentials = mlflow.credentials
        for field in ("token", "username", "password"):
            ref = getattr(credentials, field)
            if ref is not None:
                where = f"tracking.mlflow.credentials.{field}.name"
                grant(where, "Secret", ref.name, policy.secrets, SECRETS)
        host = urlsplit(mlflow.tracking_uri).hostname or ""
        if credentials.env() and host not in platform.allowed_hosts:
            allowed = ", ".join(sorted(platform.allowed_hosts)) or "none"
            refused.append(
                f"spec.tracking.mlflow.trackingUri: credentials go only to hosts the platform allows "
                f"(operator setting allowed-hosts: {allowed}), not {host!r}"
            )
    cluster = spec.cluster
    grant(
        "cluster.serviceAccountName",
        "service account",
        cluster.service_account_name,
        policy.service_accounts,
        SERVICE_ACCOUNTS,
    )
    grant(
        "cluster.priorityClassName",
        "PriorityClass",
        cluster.priority_class_name,
        policy.priority_classes,
        PRIORITY_CLASSES,
    )
    grant(
        "cluster.workloadPriorityClass",
        "WorkloadPriorityClass",
        cluster.workload_priority_class,
        policy.workload_priority_classes,
        WORKLOAD_PRIORITY_CLASSES,
    )
    own_workers = tuple(builder.accelerator_tolerations())
    for field, tolerations, given in (
        ("cluster.tolerations", cluster.tolerations, own_workers),
        ("cluster.head.tolerations", cluster.head.tolerations, platform.head_tolerations),
    ):
        for index, toleration in enumerate(tolerations):
            if toleration not in policy.tolerations + given:
                refused.append(
                    f"spec.{field}[{index}]: toleration {_shown(toleration)} is not granted to runs in "
                    f"namespace {policy.namespace} (annotation {TOLERATIONS} on the namespace)"
                )
    refused.extend(_s3_refusals(spec, platform.prefixes_of(policy), policy.namespace))
    return refused


def _s3_refusals(spec: api.FSDPTrainingRunSpec, prefixes: list[str], namespace: str) -> list[str]:
    """Every s3:// URI of the run outside the namespace's prefixes. A '.' or '..' segment is refused too: S3
    keeps it literally, but a client library that normalises paths would not."""
    refused = []
    granted = ", ".join(prefixes) or "none"
    for field, uri in spec.s3_uris().items():
        path = uri.removeprefix("s3://")
        if any(segment in (".", "..") for segment in path.split("/")):
            refused.append(f"spec.{field}: {uri} has a '.' or '..' segment")
        elif not any((uri if uri.endswith("/") else uri + "/").startswith(p) for p in prefixes):
            refused.append(
                f"spec.{field}: {uri} is outside the S3 prefixes granted to runs in namespace {namespace} "
                f"({granted}; operator setting s3-prefixes, annotation {S3_PREFIXES} on the namespace)"
            )
    return refused


def _shown(toleration: api.Toleration) -> str:
    dumped: dict[str, Any] = toleration.model_dump(by_alias=True, exclude_none=True)
    return json.dumps(dumped, sort_keys=True)
