"""The fabric check's operator side (issue 36 item 1): the threshold a run gets, what a failed check leads to
(the slow node labelled and avoided, or the run failed saying why), and what the status keeps of a report."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from fsdp_operator import api, builder, conditions, fabric, preflight, submission
from fsdp_operator.jobs import JobObservation
from fsdp_operator.kube import Indexes
from fsdp_operator.observe import ray_pods
from fsdp_operator.reconcile import ClusterObservation, Observation, reconcile
from fsdp_operator.watched import pod_summary
from fsdp_trainer.contract import FabricLink, FabricPod, FabricReport, ProgressRecord, SweepPoint

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 12, 4, 18, 0, tzinfo=dt.UTC)
SUBMISSION = "run-0f1e2d3c-1"
RUN = builder.RunRef(name="run", namespace="team-a", uid="0f1e2d3c-0000")
PODS = {"w0": "node-a", "w1": "node-b", "w2": "node-c"}


def spec(**network: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"source": "m"},
            "checkpoint": {"storagePath": "s3://b/p"},
            "cluster": {"instanceType": "p5.48xlarge", "workers": 3},
            "network": network,
        }
    )


def slow_into_w1(passed: bool = False, suspect: str | None = "w1") -> FabricReport:
    links = [
        FabricLink(source_pod=a, target_pod=b, gbps=0.4 if b == "w1" else 50.0)
        for a in PODS
        for b in PODS
        if a != b
    ]
    return FabricReport(
        backend="nccl",
        transport="efa",
        pods=[FabricPod(pod=pod, node=node, ranks=[i]) for i, (pod, node) in enumerate(PODS.items())],
        sweep=[SweepPoint(size_bytes=64 << 20, bus_bandwidth_gbps=0.9, seconds=0.2)],
        links=links,
        bus_bandwidth_gbps=0.9,
        min_bus_bandwidth_gbps=110.0,
        passed=passed,
        suspect_pod=suspect,
        suspect_node=PODS.get(suspect or ""),
        message="bus bandwidth 0.9 GB/s at 64 MiB over 3 pod(s), 110 GB/s required; "
        "every slow link touches w1",
        seconds=2.5,
    )


# The operator's defaults: 2 nodes per run, 4 per namespace, in a day.
BUDGET = fabric.LabelBudget(max_per_run=2, max_per_namespace=4, window_seconds=86400, namespace_labelled=0)


def failed_attempt(
    report: FabricReport,
    run_spec: api.FSDPTrainingRunSpec,
    pods: dict[str, str] = PODS,
    budget: fabric.LabelBudget | None = BUDGET,
    labelled_before: tuple[dt.timedelta, ...] = (),
):
    record = ProgressRecord(
        run_name="run",
        phase="failed",
        max_steps=100,
        submission_id=SUBMISSION,
        fabric=report,
        error=f"FabricError: {report.message}",
        error_kind="fabric",
        updated_at=NOW - dt.timedelta(seconds=5),
    )
    earlier = [
        api.AvoidedNode(node=f"node-{i}", labelled_at=NOW - ago, why="an earlier attempt's check")
        for i, ago in enumerate(labelled_before)
    ]
    status = api.FSDPTrainingRunStatus(
        phase=api.Phase.RUNNING,
        attempt=1,
        job_submission_id=SUBMISSION,
        start_time=NOW - dt.timedelta(minutes=3),
        fabric=api.FabricStatus(attempt=0, report=report, avoided_nodes=earlier) if earlier else None,
    )
    job = JobObservation(SUBMISSION, "FAILED", "job failed", "", NOW - dt.timedelta(minutes=2))
    obs = Observation(
        now=NOW,
        generation=1,
        cluster=ClusterObservation(ready=True, message=""),
        job=job,
        progress=record,
        pod_nodes=pods,
        run_uri="s3://b/p/team-a/run",
        fabric_labels=budget,
    )
    return reconcile(run_spec, status, obs)


def training_pass(**reported: Any) -> api.FSDPTrainingRunStatus:
    """The status after a pass that reads the running attempt's progress record with what it `reported`."""
    record = ProgressRecord(
        run_name="run", phase="training", max_steps=100, submission_id=SUBMISSION, updated_at=NOW, **reported
    )
    status = api.FSDPTrainingRunStatus(phase=api.Phase.RUNNING, attempt=1, job_submission_id=SUBMISSION)
    obs = Observation(
        now=NOW,
        generation=1,
        cluster=ClusterObservation(ready=True, message=""),
        job=JobObservation(SUBMISSION, "RUNNING", "", "", NOW),
        progress=record,
    )
    return reconcile(spec(), status, obs).status


def test_the_threshold_is_the_runs_else_the_platforms_else_the_table() -> None:
    assert fabric.threshold(42.0, "p5.48xlarge", {"p5.48xlarge": 300.0}) == 42.0
    assert fabric.threshold(None, "p5.48xlarge", {"p5.48xlarge": 300.0}) == 300.0
    assert fabric.threshold(None, "p5.48xlarge", {}) == fabric.DEFAULT_MIN_BUS_BANDWIDTH_GBPS["p5.48xlarge"]
    assert fabric.threshold(None, "g6.12xlarge", {}) is None  # no EFA, no published figure: not judged
    config = submission.trainer_config(
        spec(), RUN, cpu_only=False, min_bus_bandwidth_gbps={"p5.48xlarge": 9.5}
    )
    assert config.network.min_bus_bandwidth_gbps == 9.5


def test_a_slow_node_is_labelled_and_the_attempt_restarts_on_a_cluster_that_avoids_it() -> None:
    decision = failed_attempt(slow_into_w1(), spec())
    status = decision.status
    assert status.phase == api.Phase.RESTARTING and status.restarts.count == 1
    assert decision.avoid_node is not None and decision.avoid_node.node == "node-b"
    assert decision.delete_cluster, "the replacement cluster's pods must be scheduled afresh"
    assert status.fabric is not None and [n.node for n in status.fabric.avoided_nodes] == ["node-b"]
    entry = status.restarts.history[-1]
    assert entry.reason == "FabricBelowThreshold" and "node node-b labelled" in entry.message
    verified = conditions.condition(status.conditions, conditions.FABRIC_VERIFIED)
    assert verified is not None and verified.status == "False" and verified.reason == "BelowThreshold"
    assert "w1 (node-b) 0.4 GB/s" in verified.message
    assert "SlowNodeAvoided" in [event.reason for event in decision.events]


def test_under_the_fail_policy_a_slow_fabric_fails_the_run_naming_the_node() -> None:
    decision = failed_attempt(slow_into_w1(), spec(slowFabric="fail"))
    assert decision.status.phase == api.Phase.FAILED and decision.avoid_node is None
    assert "touches w1" in (decision.status.message or "") and "network.slowFabric is fail" in (
        decision.status.message or ""
    )


def test_without_one_pod_to_blame_the_run_fails_saying_so() -> None:
    decision = failed_attempt(slow_into_w1(suspect=None), spec())
    assert decision.status.phase == api.Phase.FAILED and decision.avoid_node is None
    assert "no node to avoid" in (decision.status.message or "")


def test_a_forged_report_cannot_mark_a_node_the_runs_pods_were_not_on() -> None:
    forged = slow_into_w1().model_copy(update={"suspect_pod": "someone-elses-pod", "suspect_node": "node-z"})
    decision = failed_attempt(forged, spec())
    assert decision.avoid_node is None and decision.status.phase == api.Phase.FAILED


def test_a_passing_check_sets_fabric_verified_with_its_figures() -> None:
    report = slow_into_w1(passed=True, suspect=None).model_copy(update={"message": "bus bandwidth 300 GB/s"})
    new = training_pass(fabric=report)
    verified = conditions.condition(new.conditions, conditions.FABRIC_VERIFIED)
    assert verified is not None and verified.status == "True" and verified.reason == "Measured"
    assert "bus bandwidth 300 GB/s" in verified.message and "checked in 2.5 s" in verified.message
    assert new.fabric is not None and new.fabric.attempt == 1 and new.fabric.report.bus_bandwidth_gbps == 0.9


def test_the_status_keeps_a_bounded_report() -> None:
    huge = slow_into_w1().model_copy(
        update={
            "links": [
                FabricLink(source_pod="p" * 5000, target_pod=f"q{i}", gbps=float(i)) for i in range(500)
            ],
            "message": "m\x1b[2J" * 5000,
            "bus_bandwidth_gbps": float("inf"),
        }
    )
    kept = fabric.bounded_report(huge)
    assert len(kept.links) == fabric.MAX_LINKS and [link.gbps for link in kept.links][:2] == [0.0, 1.0]
    assert len(kept.links[0].source_pod) <= 253 and len(kept.message) <= fabric.MAX_WHY
    assert "\x1b" not in kept.message and kept.bus_bandwidth_gbps is None


def test_workers_avoid_labelled_nodes_and_preflight_does_not_count_them() -> None:
    manifest = builder.build_raycluster(spec(), RUN, "image", zone="us-west-2a")
    worker = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    terms = worker["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert {"key": fabric.DEGRADED_LABEL, "operator": "DoesNotExist"} in terms[0]["matchExpressions"]

    def node(name: str, **labels: str) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": {builder.LABEL_INSTANCE_TYPE: "p5.48xlarge", **labels}},
            "status": {
                "allocatable": {builder.GPU: "8"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }

    marked = node("slow", **{fabric.DEGRADED_LABEL: "20261204T180000Z"})
    free = preflight.free_worker_nodes(spec(), [node("healthy"), marked], [])
    assert [n.name for n in free] == ["healthy"]


def test_the_label_says_when_and_its_annotation_why() -> None:
    patch = fabric.label_patch("x" * 5000, dt.datetime(2026, 12, 4, 18, 30, 5, tzinfo=dt.UTC), "team-a")
    assert patch["metadata"]["labels"] == {
        fabric.DEGRADED_LABEL: "20261204T183005Z",
        fabric.DEGRADED_BY_LABEL: "team-a",
    }
    assert len(patch["metadata"]["annotations"][fabric.DEGRADED_LABEL]) == fabric.MAX_WHY


@pytest.mark.parametrize(
    ("labelled_before", "budget", "why"),
    [
        ((dt.timedelta(hours=1), dt.timedelta(hours=2)), BUDGET, "the operator's limit per run"),
        ((), fabric.LabelBudget(2, 4, 86400, namespace_labelled=4), "the operator's limit per namespace"),
        ((), None, "operator setting fabric-label-nodes"),
    ],
    ids=["run-at-its-limit", "namespace-at-its-limit", "labelling-off"],
)
def test_a_forged_failing_report_repeated_labels_no_more_than_the_limits(
    labelled_before: tuple[dt.timedelta, ...], budget: fabric.LabelBudget | None, why: str
) -> None:
    """Issue 46: each restart with a forged failing report labelled one more node, for every team, without
    end (maxRestarts up to 100, backoff 0). Past the limits the attempt fails as under slowFabric fail."""
    decision = failed_attempt(slow_into_w1(), spec(), budget=budget, labelled_before=labelled_before)
    assert decision.avoid_node is None, "a node was labelled past the limits"
    assert decision.status.phase == api.Phase.FAILED
    assert "node node-b not labelled" in (decision.status.message or "") and why in (
        decision.status.message or ""
    )


def test_labels_older_than_the_window_do_not_count() -> None:
    decision = failed_attempt(slow_into_w1(), spec(), labelled_before=(dt.timedelta(days=2),) * 3)
    assert decision.avoid_node is not None and decision.avoid_node.node == "node-b"


def test_a_namespaces_labels_are_counted_from_the_nodes_within_the_window() -> None:
    def node(**labels: str) -> dict[str, Any]:
        return {"metadata": {"name": "n", "labels": labels}}

    since = NOW - dt.timedelta(days=1)
    nodes = [
        node(**{fabric.DEGRADED_LABEL: "20261204T170000Z", fabric.DEGRADED_BY_LABEL: "team-a"}),
        node(**{fabric.DEGRADED_LABEL: "20261201T170000Z", fabric.DEGRADED_BY_LABEL: "team-a"}),  # too old
        node(**{fabric.DEGRADED_LABEL: "20261204T170000Z", fabric.DEGRADED_BY_LABEL: "team-b"}),
        node(**{fabric.DEGRADED_BY_LABEL: "team-a"}),  # the platform removed the mark
        node(),
    ]
    assert fabric.labelled_by(nodes, "team-a", since) == 1


def test_a_pod_with_the_runs_labels_but_not_owned_by_its_raycluster_names_no_node() -> None:
    """Issue 46: the pod index trusts labels; a pod the tenant creates with the run's labels and any
    spec.nodeName made that node the one a forged report names."""
    cluster = {"metadata": {"name": "run", "namespace": "team-a", "uid": "rc-uid"}}

    def pod(name: str, node: str, owner: str) -> dict[str, Any]:
        owners = [{"kind": "RayCluster", "name": "run", "uid": owner, "controller": True}]
        return {"metadata": {"name": name, "ownerReferences": owners}, "spec": {"nodeName": node}}

    pods = [pod("w0", "node-a", "rc-uid"), pod("forged", "node-z", "someone-else")]
    indexes = Indexes(
        runs={},
        rayclusters={("team-a", "run"): [cluster]},
        ray_pods={("team-a", "run"): [pod_summary(p) for p in pods]},
    )
    assert [p["name"] for p in ray_pods(RUN, indexes)] == ["w0"]
    forged = slow_into_w1().model_copy(update={"suspect_pod": "forged"})
    nodes = {p["name"]: p["node"] for p in ray_pods(RUN, indexes)}
    assert failed_attempt(forged, spec(), pods=nodes).avoid_node is None


def test_the_pods_that_fell_back_to_sockets_are_named_in_the_status_bounded() -> None:
    from fsdp_trainer.contract import TransportReport

    transport = TransportReport(
        observed="socket", evidence=["via NET/Socket/0"], fallback_pods=["w1", "x" * 900] * 20
    )
    new = training_pass(transport=transport)
    assert new.transport is not None and new.transport.fallback_pods[0] == "w1"
    assert len(new.transport.fallback_pods) <= 8 and all(
        len(pod) <= 253 for pod in new.transport.fallback_pods
    )
    degraded = conditions.condition(new.conditions, conditions.TRANSPORT_DEGRADED)
    assert degraded is not None and degraded.status == "True" and "(on w1, " in degraded.message


def test_a_runs_first_failing_check_meets_its_namespaces_labels_as_the_nodes_show_them() -> None:
    """Each run's first failed check counts the namespace's labels too: a namespace of many runs, each
    failing once, labels no more nodes than the limit."""
    from typing import cast

    from fsdp_operator.context import Context
    from fsdp_operator.observe import fabric_label_budget
    from fsdp_operator.settings import Settings

    ctx = Context(settings=Settings(), kube=cast(Any, None), s3=None, ec2=cast(Any, None), package_sha256="x")
    marked = {fabric.DEGRADED_LABEL: "20261204T170000Z", fabric.DEGRADED_BY_LABEL: "team-a"}
    nodes = [{"metadata": {"name": f"n{i}", "labels": marked}} for i in range(4)]
    indexes = Indexes(runs={}, rayclusters={}, ray_pods={}, nodes={None: nodes})
    record = ProgressRecord(
        run_name="run", phase="failed", max_steps=100, submission_id=SUBMISSION, fabric=slow_into_w1(),
        updated_at=NOW,
    )  # fmt: skip
    budget = fabric_label_budget(ctx, RUN, spec(), record, indexes, NOW)
    assert budget is not None and budget.namespace_labelled == 4
    assert budget.refusal([], NOW) is not None, "a fifth node of the namespace would be labelled"
