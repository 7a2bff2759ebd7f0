"""What Kueue says about a run's RayCluster, read from its Workload (pure; the glue lists the Workload).

Kueue makes one Workload per queued RayCluster, labelled with the RayCluster's uid. Its conditions carry the
answer: QuotaReserved False with the reason it waits (no quota, an unknown LocalQueue), Admitted True once it
may run, Evicted True when Kueue takes the admission back (a preemption by a higher priority, the
ClusterQueue stopped, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta1"
PLURAL = "workloads"
LABEL_JOB_UID = "kueue.x-k8s.io/job-uid"


@dataclass(frozen=True)
class WorkloadObservation:
    name: str
    admitted: bool
    reason: str  # Kueue's own reason: Admitted, Pending, Inadmissible, Preempted, ...
    message: str
    evicted: bool = False  # Kueue took the admission back
    cluster_queue: str | None = None
    flavors: tuple[str, ...] = ()  # pod-set:flavor, as admitted


def observe_workload(workload: dict[str, Any]) -> WorkloadObservation:
    status = workload.get("status") or {}
    by_type = {c.get("type"): c for c in status.get("conditions", [])}

    def true(type_: str) -> dict[str, Any] | None:
        found = by_type.get(type_)
        return found if found is not None and found.get("status") == "True" else None

    admission = status.get("admission") or {}
    flavors = sorted(
        {
            f"{assignment.get('name')}:{flavor}"
            for assignment in admission.get("podSetAssignments", [])
            for flavor in (assignment.get("flavors") or {}).values()
        }
    )
    admitted, evicted = true("Admitted"), true("Evicted")
    waiting = by_type.get("QuotaReserved") or {}
    shown = evicted or admitted or waiting
    reason = shown.get("reason") or ("Admitted" if admitted else "Pending")
    message = shown.get("message") or "waiting for Kueue to consider the workload"
    return WorkloadObservation(
        name=workload["metadata"]["name"],
        admitted=admitted is not None and evicted is None,
        reason=reason,
        message=message,
        evicted=evicted is not None,
        cluster_queue=admission.get("clusterQueue"),
        flavors=tuple(flavors),
    )
