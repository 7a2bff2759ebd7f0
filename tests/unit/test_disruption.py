"""A node going away, told from a failure whatever the order of events (issue 49, item 2): the marks on the
node that come before its pods' eviction, the operator's memory of them, and a restart counted before the
disruption was seen given back as a preemption, with goodput moving what it cost."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from fsdp_operator import api, conditions, drainwindow, goodput
from fsdp_operator.disruption import Disruptions, node_going_away
from fsdp_operator.jobs import JobObservation
from fsdp_operator.reconcile import ClusterObservation, Observation, reconcile
from fsdp_operator.reconcile.state import FINAL_FAILURE_HOLD_SECONDS
from fsdp_trainer.contract import CheckpointRef, ProgressRecord, RestartEntry

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)
ATTEMPT = NOW - dt.timedelta(minutes=10)
SPEC = api.FSDPTrainingRunSpec.model_validate(
    {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, "recovery": {"maxRestarts": 3}}
)
CKPT = (CheckpointRef(uri="s3://b/p/run/checkpoint_2", step=20, time=NOW - dt.timedelta(minutes=1)),)


def node(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "gpu-1a-7"}, "spec": spec}


def taint(key: str, effect: str = "NoSchedule", value: str | None = None) -> dict[str, Any]:
    return {"key": key, "effect": effect, **({"value": value} if value else {})}


@pytest.mark.parametrize(
    ("marked", "named"),
    [
        (node(taints=[taint("karpenter.sh/disrupted")]), "Karpenter is disrupting the node"),
        (
            node(taints=[taint("aws-node-termination-handler/spot-itn", value="1764-abc")]),
            "the Node Termination Handler is draining the node: "
            "taint aws-node-termination-handler/spot-itn=1764-abc:NoSchedule",
        ),
        (node(taints=[taint("ToBeDeletedByClusterAutoscaler")]), "cluster-autoscaler is removing the node"),
        (node(unschedulable=True), "the node is cordoned (a drain)"),
        (
            {"metadata": {"name": "gpu-1a-7", "deletionTimestamp": "2026-12-06T12:00:00Z"}},
            "the Node is being deleted",
        ),
    ],
)
def test_each_mark_of_a_node_going_away_is_named_with_the_node(marked: dict[str, Any], named: str) -> None:
    said = node_going_away(marked)
    assert said is not None and said.startswith("node gpu-1a-7 (") and named in said, said


def test_a_node_that_may_be_removed_some_day_or_has_other_taints_is_not_going_away() -> None:
    # cluster-autoscaler's candidate taint is PreferNoSchedule: a candidate, not a decision.
    assert (
        node_going_away(node(taints=[taint("DeletionCandidateOfClusterAutoscaler", "PreferNoSchedule")]))
        is None
    )
    assert (
        node_going_away(
            node(taints=[taint("nvidia.com/gpu"), taint("karpenter.sh/disrupted", "PreferNoSchedule")])
        )
        is None
    )
    assert node_going_away(node()) is None


def test_a_node_going_away_disrupts_the_clusters_on_it_from_when_it_was_first_seen() -> None:
    seen = Disruptions()
    here, elsewhere = ("team-a", "llm-a"), ("team-b", "llm-b")
    first = NOW - dt.timedelta(minutes=1)
    why = "node gpu-1a-7 (Karpenter is disrupting the node: taint karpenter.sh/disrupted:NoSchedule)"
    seen.node_seen("gpu-1a-7", why, [here], first)
    seen.node_seen("gpu-1a-7", why, [here], NOW)  # the node's next status update
    assert seen.since(here, ATTEMPT) == why and seen.clusters[here][0] == first
    assert seen.since(elsewhere, ATTEMPT) is None
    # An attempt that began after the node was marked (a node cordoned for a week) is not excused by it.
    assert seen.since(here, first + dt.timedelta(seconds=1)) is None
    # A pod's own DisruptionTarget, later, stands (it names the pod).
    evicted = "pod llm-a-workers-x7k2p on node gpu-1a-7 (EvictionByEvictionAPI: Eviction API: evicting)"
    seen.pod_seen(here, evicted, NOW)
    seen.node_seen("gpu-1a-7", why, [here], NOW)
    assert seen.since(here, ATTEMPT) == evicted
    # The mark taken back (uncordoned): forgotten, so a new mark starts a new time.
    seen.node_seen("gpu-1a-7", None, [], NOW)
    assert seen.nodes == {}


def failed_then_restarting(
    disruption: str | None, restart_time: dt.datetime = NOW
) -> api.FSDPTrainingRunStatus:
    """A run whose attempt's failure was counted (restart 1 of 3), in its backoff."""
    counted = RestartEntry(time=restart_time, reason="JobFailed", message="NCCL error", resumed_from_step=20)
    return api.FSDPTrainingRunStatus(
        phase=api.Phase.RESTARTING,
        attempt=1,
        attempt_time=ATTEMPT,
        job_submission_id="run-0f1e2d3c-1",
        next_check_time=NOW + dt.timedelta(seconds=30),
        restarts=api.RestartsStatus(count=1, history=[counted]),
        progress=api.ProgressStatus(step=30, max_steps=100, updated_at=NOW - dt.timedelta(seconds=40)),
        checkpoints=api.CheckpointsStatus(latest=CKPT[0]),
    )


def observe(disruption: str | None, at: dt.datetime = NOW + dt.timedelta(seconds=5)) -> Observation:
    ended = JobObservation("run-0f1e2d3c-1", "FAILED", "NCCL error", "", NOW - dt.timedelta(minutes=1))
    return Observation(
        now=at,
        generation=1,
        cluster=ClusterObservation(ready=True, message=""),
        job=ended,
        checkpoints=CKPT,
        disruption=disruption,
    )


def test_a_failure_counted_before_its_disruption_was_seen_gives_the_restart_back_once() -> None:
    why = "node gpu-1a-7 (Karpenter is disrupting the node: taint karpenter.sh/disrupted:NoSchedule)"
    decision = reconcile(SPEC, failed_then_restarting(None), observe(why))
    status = decision.status
    assert (status.restarts.count, status.restarts.preemptions) == (0, 1), status.restarts
    [entry] = status.restarts.history
    assert entry.reason == "Preempted" and why in entry.message and "JobFailed" in entry.message, entry
    assert entry.resumed_from_step == 20
    assert [e.reason for e in decision.events].count("Preempted") == 1
    again = reconcile(SPEC, status, observe(why)).status  # the next pass: already recounted
    assert (again.restarts.count, again.restarts.preemptions) == (0, 1)
    # Without a disruption the restart stays spent.
    plain = reconcile(SPEC, failed_then_restarting(None), observe(None)).status
    assert (plain.restarts.count, plain.restarts.preemptions) == (1, 0)


def test_a_restart_of_an_earlier_attempt_is_not_recounted_by_a_later_disruption() -> None:
    earlier = failed_then_restarting(None, restart_time=ATTEMPT - dt.timedelta(minutes=5))
    status = reconcile(SPEC, earlier, observe("node gpu-1a-7 (the node is cordoned (a drain))")).status
    assert (status.restarts.count, status.restarts.preemptions) == (1, 0), status.restarts


def test_goodput_moves_a_recounted_restarts_cost_to_preemptions() -> None:
    old = failed_then_restarting(None, restart_time=NOW - dt.timedelta(seconds=20))
    old.goodput.seconds.lost_to_restarts = 20 + 10 * 3  # its 20 s so far and the 10 redone steps of 3 s
    old.goodput.accounted_until = NOW
    new = old.model_copy(deep=True)
    new.restarts.count, new.restarts.preemptions = 0, 1
    new.restarts.history = [new.restarts.history[-1].model_copy(update={"reason": "Preempted"})]
    trainer = ProgressRecord(
        run_name="r", phase="training", step=30, max_steps=100, updated_at=NOW, step_time_seconds=3.0
    )
    spent = goodput.account(SPEC, old, new, trainer, NOW + dt.timedelta(seconds=5), ATTEMPT, None).seconds
    # The 5 s since the last write are charged as the status read said (restarts); then the restart's whole
    # cost moves: the 25 s since it and its 10 redone steps (steps 21-30 at 3 s).
    assert (spent.lost_to_restarts, spent.lost_to_preemptions) == (0, 25 + 30)
    # From then on the restart's time is the preemption's.
    assert goodput.category(new) == "lost_to_preemptions"
    assert goodput.category(old) == "lost_to_restarts"


def saved(*seconds: float | None) -> list[CheckpointRef]:
    return [
        CheckpointRef(uri=f"s3://b/p/run/checkpoint_{i}", step=10 * i, time=NOW, save_seconds=s)
        for i, s in enumerate(seconds, start=1)
    ]


def test_the_drain_window_leaves_twice_the_slowest_recent_save_within_its_bounds() -> None:
    assert drainwindow.window(saved(1.2, 0.8), None) == 20  # 1 + 2.4 + 15 = 18.4: the least
    assert drainwindow.window(saved(12.5, 30.2, None), 3.0) == 77  # 1 + 60.4 + 15: measured, not estimated
    assert drainwindow.window(saved(900.0), None) == 300  # a save too slow for any drain: the most
    # Nothing measured: the estimate, else Kubernetes' and Ray's default.
    assert drainwindow.window(saved(None), 20.0) == 56
    assert drainwindow.window([], None) == 30


def test_before_any_save_the_window_is_estimated_from_a_workers_checkpoint_shards() -> None:
    """Qwen2.5-1.5B on two workers: 1.54e9 parameters x 12 bytes (fp32 weights, AdamW's two moments) / 2 is
    9.3 GB a worker, 37 s at 250 MB/s: 1 + 74 + 15 s. An unknown model gets the default."""
    qwen = api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "Qwen/Qwen2.5-1.5B"}, "checkpoint": {"storagePath": "s3://b/p"}}
    )
    assert drainwindow.window([], drainwindow.estimated_save_seconds(qwen)) == 88
    assert drainwindow.estimated_save_seconds(SPEC) is None  # model.source "m" names no size


def test_a_restarts_new_cluster_gets_the_window_of_the_saves_seen_and_records_it_first() -> None:
    lost = failed_then_restarting(None)
    lost.next_check_time = NOW  # the backoff is over
    seen = tuple(saved(4.0, 6.0))  # the checkpoints in storage, their manifests' save times
    no_cluster = Observation(now=NOW + dt.timedelta(seconds=5), generation=1, cluster=None, checkpoints=seen)
    decision = reconcile(SPEC, lost, no_cluster)
    assert decision.create_cluster, decision.status.message
    assert decision.status.drain_seconds == 1 + 12 + 15


def exhausted_and_held() -> api.FSDPTrainingRunStatus:
    """A run whose last restart's attempt failed before its disruption was seen: the failure is held."""
    status = failed_then_restarting(None, restart_time=NOW - dt.timedelta(minutes=5))  # of attempt 3
    status.phase, status.attempt, status.attempt_time = api.Phase.RUNNING, 4, NOW - dt.timedelta(minutes=2)
    status.restarts.count, status.next_check_time = 3, None
    held = reconcile(SPEC, status, observe(None))
    assert held.stop_job == "run-0f1e2d3c-1" and held.requeue_after == FINAL_FAILURE_HOLD_SECONDS
    return held.status


def test_a_failure_past_max_restarts_waits_for_its_disruption_before_it_fails_the_run() -> None:
    held = exhausted_and_held()
    failed = conditions.condition(held.conditions, conditions.FAILED)
    assert held.phase == api.Phase.RESTARTING and held.restarts.count == 3, held.message
    assert failed is not None and (failed.status, failed.reason) == ("Unknown", "JobFailed"), failed
    assert f"failing in {FINAL_FAILURE_HOLD_SECONDS}s unless" in held.message
    # Seen within the hold, the node going away makes the failure a preemption: no restart spent.
    why = "node gpu-1a-7 (Karpenter is disrupting the node: taint karpenter.sh/disrupted:NoSchedule)"
    status = reconcile(SPEC, held, observe(why)).status
    assert status.phase == api.Phase.RESTARTING and (status.restarts.count, status.restarts.preemptions) == (
        3,
        1,
    )
    assert status.restarts.history[-1].reason == "Preempted" and why in status.restarts.history[-1].message
    assert conditions.condition(status.conditions, conditions.FAILED).status == "False"  # type: ignore[union-attr]
    # After the backoff the attempt after it is submitted, as after any preemption.
    assert status.next_check_time is not None
    resumed = reconcile(SPEC, status, observe(why, at=status.next_check_time))
    assert resumed.submit_attempt == 5, resumed.status.message


def test_a_held_failure_with_no_disruption_fails_the_run_when_the_hold_ends_and_not_before() -> None:
    held = exhausted_and_held()
    assert held.next_check_time is not None
    end = held.next_check_time  # the hold's end: FINAL_FAILURE_HOLD_SECONDS after the failure was seen
    early = reconcile(SPEC, held, observe(None, at=end - dt.timedelta(seconds=1)))
    assert early.status.phase == api.Phase.RESTARTING and early.submit_attempt is None
    assert early.requeue_after is not None and early.requeue_after <= 1
    over = reconcile(SPEC, held, observe(None, at=end))
    failed = conditions.condition(over.status.conditions, conditions.FAILED)
    assert over.status.phase == api.Phase.FAILED and over.status.restarts.count == 3
    assert failed is not None and (failed.status, failed.reason) == ("True", "RestartsExhausted"), failed
    assert "JobFailed after 3 restarts (maxRestarts 3): NCCL error" in failed.message


def test_a_failure_held_when_the_run_is_suspended_is_not_held_after_it_resumes() -> None:
    suspended = api.FSDPTrainingRunSpec.model_validate({**SPEC.model_dump(by_alias=True), "suspend": True})
    status = reconcile(suspended, exhausted_and_held(), observe(None)).status
    assert status.phase == api.Phase.SUSPENDED
    assert conditions.condition(status.conditions, conditions.FAILED).status == "False"  # type: ignore[union-attr]
