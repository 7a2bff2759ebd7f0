"""Kubernetes-style conditions: one per type, lastTransitionTime kept while the status does not change."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from fsdp_operator.api import MAX_CONDITION_REASON, MAX_MESSAGE, Condition
from fsdp_operator.bounds import inert

PREFLIGHT = "Preflight"
CLUSTER_READY = "ClusterReady"
PODS_HEALTHY = "PodsHealthy"
PODS_SCHEDULED = "PodsScheduled"  # False while a worker pod waits for a node: the scheduler says why
JOB_RUNNING = "JobRunning"
FINISHED = "Finished"  # True once the run ended, either way: `kubectl wait --for=condition=Finished`
SUCCEEDED = "Succeeded"
FAILED = "Failed"
SUSPENDED = "Suspended"
TRANSPORT_DEGRADED = "TransportDegraded"
FABRIC_VERIFIED = "FabricVerified"  # the attempt's fabric check: True passed, False below the threshold
IMAGE_CONSISTENT = "ImageConsistent"
STORAGE_READABLE = "StorageReadable"
QUEUE_ADMITTED = "Admitted"  # Kueue admitted the RayCluster (runs with spec.cluster.queueName only)


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: bool | Literal["Unknown"],
    reason: str,
    message: str,
    now: dt.datetime,
    generation: int | None,
) -> list[Condition]:
    """Returns the conditions with `type_` set; other types keep their order and values. Reason and message
    are cut to the API's bounds."""
    value: Literal["True", "False", "Unknown"] = (
        "Unknown" if status == "Unknown" else ("True" if status else "False")
    )
    previous = next((c for c in conditions if c.type == type_), None)
    changed = previous is None or previous.status != value
    updated = Condition(
        type=type_,
        status=value,
        reason=reason[:MAX_CONDITION_REASON],
        message=bounded(message),
        last_transition_time=now if changed or previous is None else previous.last_transition_time,
        observed_generation=generation,
    )
    if previous is None:
        return [*conditions, updated]
    return [updated if c.type == type_ else c for c in conditions]


def condition(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: list[Condition], type_: str) -> bool:
    found = condition(conditions, type_)
    return found is not None and found.status == "True"


def bounded(message: str) -> str:
    """A status or Event message: inert (it quotes what tenants wrote: Ray's job message, the trainer's
    error) and within the API's bound."""
    message = inert(message)
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."
