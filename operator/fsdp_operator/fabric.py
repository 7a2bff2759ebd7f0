"""The fabric check's operator side (pure): the threshold a run is judged against, and the label that keeps
every run's workers off a node whose link the check found slow.

The trainer measures and judges (fsdp_trainer/fabric.py); the operator decides what a failed check leads to
(reconcile/running.py) and labels the node (actions.py).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_operator.api import GROUP
from fsdp_operator.bounds import bounded_text
from fsdp_trainer.contract import FabricPod, FabricReport

# The label is the node's mark (its value says when); the annotation of the same key says why, and the
# label below which namespace's run it was, so that a namespace's labels are counted from the nodes.
DEGRADED_LABEL = f"{GROUP}/fabric-degraded"
DEGRADED_BY_LABEL = f"{GROUP}/fabric-degraded-by"
LABEL_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
MAX_WHY = 1024
# What of a report the status keeps.
MAX_LINKS = 8
MAX_PODS = 16
MAX_SWEEP_POINTS = 12
MAX_LIBRARIES = 8

# All-reduce bus bandwidth (GB/s) below which a two-node-or-more run is refused, by instance type: a quarter
# of the figure published for two nodes at 1 GiB messages (aws-samples/awsome-distributed-training,
# micro-benchmarks/nccl-tests: p5.48xlarge 437 GB/s, p4de.24xlarge 78 GB/s; p5e/p5en and p4d have the same
# EFA bandwidth as their siblings). The check's messages are smaller (64 MiB by default, where nccl-tests'
# curves are at about half their 1 GiB figure), so these catch a fabric off by an order of magnitude (NCCL on
# TCP sockets, the OFI plugin not loaded, a node with its EFA devices down), not one slow NIC of 32: a
# platform calibrates its own figures with the setting fabric-min-bus-bandwidth-gbps. Types without EFA have
# no default: their figures are recorded, not judged.
DEFAULT_MIN_BUS_BANDWIDTH_GBPS: dict[str, float] = {
    "p4d.24xlarge": 20.0,
    "p4de.24xlarge": 20.0,
    "p5.48xlarge": 110.0,
    "p5e.48xlarge": 110.0,
    "p5en.48xlarge": 110.0,
}


def threshold(spec_value: float | None, instance_type: str, platform: Mapping[str, float]) -> float | None:
    """The run's own figure, else the platform's for its instance type, else the table's."""
    if spec_value is not None:
        return spec_value
    return platform.get(instance_type, DEFAULT_MIN_BUS_BANDWIDTH_GBPS.get(instance_type))


def node_to_avoid(report: FabricReport, pod_nodes: Mapping[str, str]) -> str | None:
    """The node of the pod every slow link touches, as the operator saw that pod placed (pod_nodes holds only
    pods the run's RayCluster owns, by UID: observe.py). The trainer's word alone never names a node: the
    run's storage is the tenant's to write, and a forged report could otherwise mark any node of the
    cluster."""
    if report.passed or report.suspect_pod is None:
        return None
    return pod_nodes.get(report.suspect_pod)


@dataclass(frozen=True)
class LabelBudget:
    """How many nodes the operator may still label for a run: at most max_per_run per run and
    max_per_namespace per namespace within window_seconds (a forged failing report costs the tenant a restart
    each, and every node it labels is lost to every team). `namespace_labelled`: the namespace's labels in
    the window, as the nodes show them."""

    max_per_run: int
    max_per_namespace: int
    window_seconds: int
    namespace_labelled: int

    def refusal(self, run_labelled: list[dt.datetime], now: dt.datetime) -> str | None:
        """Why no node may be labelled for the run now (its own labels so far given), or None."""
        since = now - dt.timedelta(seconds=self.window_seconds)
        recent = sum(1 for when in run_labelled if when >= since)
        window = f"in {self.window_seconds}s"
        if recent >= self.max_per_run:
            return f"the run labelled {recent} node(s) {window}, the operator's limit per run"
        if self.namespace_labelled >= self.max_per_namespace:
            return (
                f"the namespace's runs labelled {self.namespace_labelled} node(s) {window}, the operator's "
                "limit per namespace"
            )
        return None


def labelled_by(nodes: Iterable[Mapping[str, Any]], namespace: str, since: dt.datetime) -> int:
    """Nodes a run of `namespace` labelled since then, as their labels say."""
    count = 0
    for node in nodes:
        labels = node["metadata"].get("labels") or {}
        if labels.get(DEGRADED_BY_LABEL) != namespace or DEGRADED_LABEL not in labels:
            continue
        try:
            when = dt.datetime.strptime(labels[DEGRADED_LABEL], LABEL_TIME_FORMAT).replace(tzinfo=dt.UTC)
        except ValueError:  # a label set by hand: counted, the platform's word is that it is degraded
            when = since
        count += when >= since
    return count


def label_patch(why: str, now: dt.datetime, namespace: str) -> dict[str, Any]:
    """The merge patch that marks a node: the label's value says when (label values allow no colons), the
    annotation of the same key why, and a second label which namespace's run."""
    when = now.astimezone(dt.UTC).strftime(LABEL_TIME_FORMAT)
    labels = {DEGRADED_LABEL: when, DEGRADED_BY_LABEL: namespace}
    return {"metadata": {"labels": labels, "annotations": {DEGRADED_LABEL: why[:MAX_WHY]}}}


def avoid_degraded_nodes() -> dict[str, Any]:
    """The node-selector requirement every worker carries: no node a fabric check marked."""
    return {"key": DEGRADED_LABEL, "operator": "DoesNotExist"}


def is_degraded(labels: Mapping[str, str]) -> bool:
    return DEGRADED_LABEL in labels


def bounded_report(report: FabricReport) -> FabricReport:
    """The trainer's report as the status keeps it: the slowest links and the largest sizes first, every
    name and figure bounded (the run's storage is the tenant's to write)."""
    links = sorted((link for link in report.links if math.isfinite(link.gbps)), key=lambda link: link.gbps)
    return FabricReport(
        backend=bounded_text(report.backend, 32),
        transport=report.transport,
        libraries=[bounded_text(name, 128) for name in report.libraries[:MAX_LIBRARIES]],
        pods=[
            FabricPod(
                pod=bounded_text(pod.pod, 253),
                node=pod.node and bounded_text(pod.node, 253),
                ranks=pod.ranks[:8],
            )
            for pod in report.pods[:MAX_PODS]
        ],
        sweep=[
            point for point in report.sweep[-MAX_SWEEP_POINTS:] if math.isfinite(point.bus_bandwidth_gbps)
        ],
        links=[
            link.model_copy(
                update={
                    "source_pod": bounded_text(link.source_pod, 253),
                    "target_pod": bounded_text(link.target_pod, 253),
                }
            )
            for link in links[:MAX_LINKS]
        ],
        bus_bandwidth_gbps=_finite(report.bus_bandwidth_gbps),
        min_bus_bandwidth_gbps=_finite(report.min_bus_bandwidth_gbps),
        passed=report.passed,
        suspect_pod=report.suspect_pod and bounded_text(report.suspect_pod, 253),
        suspect_node=report.suspect_node and bounded_text(report.suspect_node, 253),
        message=bounded_text(report.message, MAX_WHY),
        seconds=_finite(report.seconds) or 0.0,
    )


def verdict(report: FabricReport) -> tuple[bool, str, str]:
    """FabricVerified's status, reason and message: the verdict, the figures, each pod's slowest link in."""
    slowest_in: dict[str, float] = {}
    for link in report.links:
        slowest_in[link.target_pod] = min(link.gbps, slowest_in.get(link.target_pod, link.gbps))
    per_pod = ", ".join(
        f"{pod.pod}" + (f" ({pod.node})" if pod.node else "") + f" {slowest_in[pod.pod]:.3g} GB/s"
        for pod in report.pods
        if pod.pod in slowest_in
    )
    message = report.message + (f"; slowest link into each pod: {per_pod}" if per_pod else "")
    message += f"; transport {report.transport}; checked in {report.seconds:.1f} s"
    if not report.passed:
        return False, "BelowThreshold", message
    return True, "Measured" if report.min_bus_bandwidth_gbps is not None else "NoThreshold", message


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None
