"""A Ray pod or its node being taken away, told from a failure: the pod's DisruptionTarget condition (an
eviction, a preemption, the taint manager, the kubelet's shutdown) and the marks that come before it on the
node (Karpenter's disruption taint, the Node Termination Handler's, cluster-autoscaler's scale-down, a
cordon, the Node's deletion). An attempt lost to either restarts without spending a restart."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Taints that announce the node is going, by who sets them (a key, or a key's prefix ending in "/").
GOING_AWAY_TAINTS = {
    "karpenter.sh/disrupted": "Karpenter is disrupting the node",
    "aws-node-termination-handler/": "the Node Termination Handler is draining the node",
    "ToBeDeletedByClusterAutoscaler": "cluster-autoscaler is removing the node",
    "node.kubernetes.io/out-of-service": "the node is out of service",
    "node.kubernetes.io/unschedulable": "the node is cordoned (a drain)",
}


def pod_disruption(body: Mapping[str, Any]) -> str | None:
    """Why the pod is being taken away, from its DisruptionTarget condition, with the node it ran on."""
    for condition in (body.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            why = f"{condition.get('reason', 'Disrupted')}: {condition.get('message', '')}".strip(": ")
            node = (body.get("spec") or {}).get("nodeName")
            return f"pod {body['metadata']['name']}" + (f" on node {node}" if node else "") + f" ({why})"
    return None


def node_going_away(node: Mapping[str, Any]) -> str | None:
    """Why the node is going, in the words of what marked it (the taint's key and value), or None."""
    meta, spec = node["metadata"], node.get("spec") or {}
    if meta.get("deletionTimestamp"):
        return f"node {meta['name']} (the Node is being deleted)"
    for taint in spec.get("taints") or []:
        key = str(taint.get("key", ""))
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue  # PreferNoSchedule: a candidate (cluster-autoscaler's), not a decision
        for marker, who in GOING_AWAY_TAINTS.items():
            if key == marker or (marker.endswith("/") and key.startswith(marker)):
                value = f"={taint['value']}" if taint.get("value") else ""
                return f"node {meta['name']} ({who}: taint {key}{value}:{taint['effect']})"
    if spec.get("unschedulable"):
        return f"node {meta['name']} ({GOING_AWAY_TAINTS['node.kubernetes.io/unschedulable']})"
    return None


ClusterKey = tuple[str, str]  # (namespace, RayCluster name)


@dataclass
class Disruptions:
    """What the operator saw taken away, remembered: a disrupted pod is deleted soon after, often before the
    job it served is seen failing, and a node going away may be gone by then too."""

    # when and how a pod of the cluster was last disrupted (or the node under it marked)
    clusters: dict[ClusterKey, tuple[dt.datetime, str]] = field(default_factory=dict)
    # node name -> when it was first seen going away, and why, while it is
    nodes: dict[str, tuple[dt.datetime, str]] = field(default_factory=dict)

    def pod_seen(self, key: ClusterKey, why: str, now: dt.datetime) -> None:
        self.clusters[key] = (now, why)

    def node_seen(
        self, name: str, going_away: str | None, on_it: Iterable[ClusterKey], now: dt.datetime
    ) -> None:
        """A node's event: while it is going away, each cluster with a Ray pod on it is disrupted as of when
        that was first seen (a node cordoned before an attempt began does not excuse that attempt's failure;
        a pod's own DisruptionTarget, which comes later, is newer and stands)."""
        if going_away is None:
            self.nodes.pop(name, None)
            return
        since, why = self.nodes.setdefault(name, (now, going_away))
        for key in on_it:
            seen = self.clusters.get(key)
            if seen is None or seen[0] < since:
                self.clusters[key] = (since, why)

    def node_gone(self, name: str) -> None:
        self.nodes.pop(name, None)

    def since(self, key: ClusterKey, moment: dt.datetime | None) -> str | None:
        """The cluster's disruption seen at or after `moment` (an attempt's start), if any."""
        seen = self.clusters.get(key)
        return seen[1] if seen is not None and moment is not None and seen[0] >= moment else None

    def forget(self, key: ClusterKey) -> None:
        self.clusters.pop(key, None)
