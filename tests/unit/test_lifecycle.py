"""Job lifecycle transitions: success, failures, restarts, hangs, deadlines, suspend, image pinning."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fsdp_operator import api, conditions
from fsdp_operator.disruption import pod_disruption
from fsdp_operator.jobs import JobObservation
from fsdp_operator.reconcile import ClusterObservation, Observation, reconcile
from fsdp_operator.reconcile.state import FINAL_FAILURE_HOLD_SECONDS
from fsdp_operator.recovery import backoff_seconds, classify
from fsdp_trainer.contract import (
    CheckpointRef,
    NcclHangDetectorReport,
    ProgressRecord,
    RankStacks,
    TrainingData,
    TransportReport,
)

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
READY = ClusterObservation(ready=True, message="")
CKPT = (
    CheckpointRef(uri="s3://b/p/run/checkpoint_1", step=10, time=NOW - dt.timedelta(minutes=2)),
    CheckpointRef(uri="s3://b/p/run/checkpoint_2", step=20, time=NOW - dt.timedelta(minutes=1)),
)


def spec(**extra: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, **extra}
    )


def running(**extra: Any) -> api.FSDPTrainingRunStatus:
    fields: dict[str, Any] = {
        "phase": api.Phase.RUNNING,
        "attempt": 1,
        "job_submission_id": "run-0f1e2d3c-1",
        "start_time": NOW - dt.timedelta(minutes=10),
        **extra,
    }
    return api.FSDPTrainingRunStatus(**fields)


def job(status: str | None, message: str = "", logs: str = "") -> JobObservation:
    return JobObservation("run-0f1e2d3c-1", status, message, logs, NOW - dt.timedelta(minutes=5))


def progress(step: int = 20, **extra: Any) -> ProgressRecord:
    fields: dict[str, Any] = {
        "run_name": "run",
        "phase": "training",
        "step": step,
        "max_steps": 100,
        "loss": 2.5,
        "updated_at": NOW - dt.timedelta(seconds=30),
        **extra,
    }
    return ProgressRecord(**fields)


def observe(**fields: Any) -> Observation:
    return Observation(**{"now": NOW, "generation": 1, "cluster": READY, **fields})


def test_running_job_reports_progress_checkpoints_and_pins_the_image() -> None:
    obs = observe(
        job=job("RUNNING"),
        progress=progress(),
        checkpoints=CKPT,
        pod_image_ids=("repo/ray@sha256:" + "a" * 64,) * 3,
    )
    decision = reconcile(spec(), running(), obs)
    status = decision.status
    assert status.phase == api.Phase.RUNNING and status.progress.step == 20 and status.progress.loss == 2.5
    assert status.checkpoints.latest is not None and status.checkpoints.latest.step == 20
    assert [c.step for c in status.checkpoints.recent] == [20, 10]
    assert status.image.digest == "repo/ray@sha256:" + "a" * 64 and status.image.consistent is True
    assert [e.reason for e in decision.events] == ["ImagePinned"]


def test_pods_running_different_digests_are_flagged() -> None:
    obs = observe(job=job("RUNNING"), pod_image_ids=("r@sha256:" + "a" * 64, "r@sha256:" + "b" * 64))
    decision = reconcile(spec(), running(), obs)
    assert decision.status.image.consistent is False
    cond = conditions.condition(decision.status.conditions, conditions.IMAGE_CONSISTENT)
    assert cond is not None and cond.status == "False" and cond.reason == "PodsDisagree"


def test_success_finishes_and_deletes_the_cluster_by_default() -> None:
    decision = reconcile(
        spec(), running(), observe(job=job("SUCCEEDED"), progress=progress(100, phase="finished"))
    )
    assert decision.status.phase == api.Phase.SUCCEEDED and decision.delete_cluster
    assert decision.status.completion_time == NOW
    assert conditions.is_true(decision.status.conditions, conditions.SUCCEEDED)
    kept = reconcile(spec(cleanupPolicy="KeepCluster"), running(), observe(job=job("SUCCEEDED")))
    assert not kept.delete_cluster


def test_retryable_failure_restarts_from_the_latest_checkpoint_after_backoff() -> None:
    decision = reconcile(spec(), running(), observe(job=job("FAILED", "worker died"), checkpoints=CKPT))
    status = decision.status
    assert status.phase == api.Phase.RESTARTING and status.restarts.count == 1
    entry = status.restarts.history[0]
    assert (entry.reason, entry.resumed_from_step, entry.time) == ("JobFailed", 20, NOW)
    assert status.next_check_time == NOW + dt.timedelta(seconds=30) and decision.requeue_after == 30
    assert decision.events[-1].type == "Warning" and decision.events[-1].reason == "Restarting"
    # Before the backoff has passed nothing is submitted; after it, attempt 2 goes in.
    early = reconcile(
        spec(), status, Observation(now=NOW + dt.timedelta(seconds=10), generation=1, cluster=READY)
    )
    assert early.submit_attempt is None
    # Attempt 1's job has not been seen ended: it is stopped and waited for, never run beside attempt 2.
    later = NOW + dt.timedelta(seconds=31)
    still_running = JobObservation("run-0f1e2d3c-1", "RUNNING")
    waiting = reconcile(
        spec(), status, Observation(now=later, generation=1, cluster=READY, job=still_running)
    )
    assert waiting.submit_attempt is None and waiting.stop_job == "run-0f1e2d3c-1"
    ended = JobObservation("run-0f1e2d3c-1", "FAILED")
    due = reconcile(spec(), status, Observation(now=later, generation=1, cluster=READY, job=ended))
    assert due.submit_attempt == 2 and due.status.phase == api.Phase.RESTARTING
    confirmed = reconcile(
        spec(), due.status, Observation(now=later, generation=1, cluster=READY, job=job("RUNNING"))
    )
    assert confirmed.status.phase == api.Phase.RUNNING and confirmed.submit_attempt is None
    assert due.status.job_submission_id == "run-2"  # recorded in the status before it is submitted


def test_permanent_failure_fails_without_using_restarts() -> None:
    failed = progress(
        0,
        phase="failed",
        error="ConfigError: unknown dataset column",
        error_kind="config",
        updated_at=NOW - dt.timedelta(seconds=5),
    )
    decision = reconcile(spec(), running(), observe(job=job("FAILED"), progress=failed))
    assert decision.status.phase == api.Phase.FAILED and decision.status.restarts.count == 0
    failed_cond = conditions.condition(decision.status.conditions, conditions.FAILED)
    assert failed_cond is not None and failed_cond.reason == "InvalidConfig"


def test_restarts_run_out_once_the_last_failure_was_held_for_a_disruption() -> None:
    status = running(restarts={"count": 3, "history": []})
    held = reconcile(spec(), status, observe(job=job("FAILED", "boom"))).status
    assert held.phase == api.Phase.RESTARTING and held.restarts.count == 3, held.message
    later = NOW + dt.timedelta(seconds=FINAL_FAILURE_HOLD_SECONDS)
    decision = reconcile(spec(), held, observe(now=later, job=job("FAILED", "boom")))
    assert decision.status.phase == api.Phase.FAILED and decision.status.restarts.count == 3
    failed = conditions.condition(decision.status.conditions, conditions.FAILED)
    assert failed is not None and failed.status == "True" and failed.reason == "RestartsExhausted", failed
    assert "JobFailed after 3 restarts (maxRestarts 3)" in failed.message and "boom" in failed.message


def test_job_unknown_to_ray_is_a_lost_job_and_restarts() -> None:
    decision = reconcile(spec(), running(), observe(job=job(None)))
    assert decision.status.phase == api.Phase.RESTARTING
    assert decision.status.restarts.history[0].reason == "JobLost"


def test_hang_stops_the_job_and_restarts() -> None:
    stale = progress(updated_at=NOW - dt.timedelta(hours=1))
    old_job = JobObservation("run-0f1e2d3c-1", "RUNNING", start_time=NOW - dt.timedelta(hours=2))
    at_once = spec(recovery={"hangTimeoutSeconds": 600, "forensicsSeconds": 0})
    decision = reconcile(at_once, running(), observe(job=old_job, progress=stale))
    assert decision.stop_job == "run-0f1e2d3c-1" and decision.status.restarts.history[0].reason == "Hang"
    assert decision.request_forensics is None
    fresh = reconcile(spec(), running(), observe(job=job("RUNNING"), progress=progress()))
    assert fresh.stop_job is None and fresh.status.phase == api.Phase.RUNNING


def stacks(rank: int, in_collective: bool, top: str) -> RankStacks:
    return RankStacks(
        rank=rank,
        world_size=2,
        pod=f"run-worker-{rank}",
        node="node-a",
        step=14,
        in_collective=in_collective,
        training_thread_top=top,
        written_at=NOW,
    )


def test_a_hang_asks_every_rank_for_its_stacks_before_stopping_and_names_the_suspect() -> None:
    stale = progress(step=14, updated_at=NOW - dt.timedelta(hours=1), world_size=2)
    old_job = JobObservation("run-0f1e2d3c-1", "RUNNING", start_time=NOW - dt.timedelta(hours=2))
    hung = spec(recovery={"hangTimeoutSeconds": 600})
    asked = reconcile(hung, running(), observe(job=old_job, progress=stale, run_uri="s3://b/p/ns/run"))
    # Nothing stopped yet: the request goes under the run's prefix after this status is written.
    assert asked.stop_job is None and asked.status.phase == api.Phase.RUNNING
    assert asked.request_forensics is not None and asked.request_forensics.attempt == 1
    forensics = asked.status.forensics
    assert forensics is not None and forensics.world_size == 2
    assert forensics.uri == "s3://b/p/ns/run/forensics/attempt-1" and forensics.concluded_at is None
    assert "asking every rank for its stacks" in (asked.status.message or "")
    # One rank answered, the wait not over: still waiting.
    waiting = reconcile(hung, asked.status, observe(job=old_job, progress=stale, forensics_answered=1))
    assert waiting.stop_job is None and waiting.request_forensics is None
    # Both in: rank 1 waits in a collective, rank 0 is elsewhere; the attempt is stopped naming rank 0.
    answers = (
        stacks(0, False, "loop.py:480 in trigger"),
        stacks(1, True, "distributed_c10d.py:2800 in all_reduce"),
    )
    done = reconcile(
        hung,
        waiting.status,
        observe(job=old_job, progress=stale, forensics_answered=2, forensics_answers=answers),
    )
    assert done.stop_job == "run-0f1e2d3c-1" and done.status.phase == api.Phase.RESTARTING
    suspect = done.status.forensics.suspect if done.status.forensics else None
    assert suspect is not None and (suspect.rank, suspect.pod, suspect.node) == (0, "run-worker-0", "node-a")
    assert "loop.py:480 in trigger" in suspect.why and "ranks 1 wait in a collective" in suspect.why
    [entry] = done.status.restarts.history
    assert entry.reason == "Hang" and "suspect rank 0 (pod run-worker-0, node node-a)" in entry.message
    assert "2 of 2 ranks' stacks in s3://b/p/ns/run/forensics/attempt-1" in entry.message


def test_what_ray_trains_nccl_hang_detector_found_is_in_status_forensics_and_the_restarts_message() -> None:
    """Rank 0 answers with Ray Train's NCCL hang detector's findings (issue 47 item 1): they are the
    detector's, read from what it stored under the run's prefix, and the user sees them in status."""
    stale = progress(step=14, updated_at=NOW - dt.timedelta(hours=1), world_size=2)
    old_job = JobObservation("run-0f1e2d3c-1", "RUNNING", start_time=NOW - dt.timedelta(hours=2))
    hung = spec(recovery={"hangTimeoutSeconds": 600})
    asked = reconcile(hung, running(), observe(job=old_job, progress=stale, run_uri="s3://b/p/ns/run"))
    finding = (
        "communicator 0x514e98cf4e44862b: AllReduce: rank 1 (10.0.77.184 pid 8814) at 1447, others up to 1448"
    )
    detector = NcclHangDetectorReport(
        state="observe", confirmed=True, uri="s3://b/p/ns/run/hang_detector", finding=finding, report="..."
    )
    answers = (
        stacks(0, True, "loop.py:480 in trigger").model_copy(update={"nccl_hang_detector": detector}),
        stacks(1, True, "distributed_c10d.py:2800 in all_reduce"),
    )
    done = reconcile(
        hung,
        asked.status,
        observe(job=old_job, progress=stale, forensics_answered=2, forensics_answers=answers),
    )
    found = done.status.forensics.nccl_hang_detector if done.status.forensics else None
    assert found == api.NcclHangDetectorStatus(
        state="observe", confirmed=True, uri="s3://b/p/ns/run/hang_detector", finding=finding
    )
    [entry] = done.status.restarts.history
    assert f"NCCL RAS: {finding} (s3://b/p/ns/run/hang_detector)" in entry.message
    # Where the image's Ray lacks the detector, status says so, and the message adds nothing.
    unavailable = NcclHangDetectorReport(state="unavailable in Ray 2.58.0")
    plain = (answers[0].model_copy(update={"nccl_hang_detector": unavailable}), answers[1])
    done = reconcile(
        hung,
        asked.status,
        observe(job=old_job, progress=stale, forensics_answered=2, forensics_answers=plain),
    )
    found = done.status.forensics.nccl_hang_detector if done.status.forensics else None
    assert found is not None and found.state == "unavailable in Ray 2.58.0" and not found.confirmed
    assert "NCCL RAS" not in done.status.restarts.history[0].message


def test_unreadable_storage_is_a_condition_with_one_event_and_never_a_hang() -> None:
    old_job = JobObservation("run-0f1e2d3c-1", "RUNNING", start_time=NOW - dt.timedelta(hours=2))
    hang_spec = spec(recovery={"hangTimeoutSeconds": 600})
    unreadable = observe(job=old_job, storage_read=True, storage_error="s3://b/p/run: NoSuchBucket")
    first = reconcile(hang_spec, running(), unreadable)
    assert first.stop_job is None and first.status.phase == api.Phase.RUNNING
    assert first.status.restarts.count == 0
    cond = conditions.condition(first.status.conditions, conditions.STORAGE_READABLE)
    assert cond is not None and (cond.status, cond.reason) == ("False", "StorageError")
    assert "NoSuchBucket" in cond.message
    assert [(e.type, e.reason) for e in first.events] == [("Warning", "StorageUnreadable")]
    again = reconcile(hang_spec, first.status, unreadable)
    assert again.events == []  # said once, not every pass
    readable = reconcile(
        hang_spec, again.status, observe(job=job("RUNNING"), progress=progress(), storage_read=True)
    )
    assert conditions.is_true(readable.status.conditions, conditions.STORAGE_READABLE)


def test_unreachable_dashboard_is_unknown_not_failure() -> None:
    decision = reconcile(spec(), running(), observe(dashboard_error="ConnectionError: refused"))
    assert decision.status.phase == api.Phase.RUNNING and decision.status.restarts.count == 0
    cond = conditions.condition(decision.status.conditions, conditions.JOB_RUNNING)
    assert cond is not None and (cond.status, cond.reason) == ("Unknown", "DashboardUnreachable")


def test_deadline_fails_the_run_and_stops_the_job() -> None:
    decision = reconcile(spec(activeDeadlineSeconds=60), running(), observe(job=job("RUNNING")))
    assert decision.status.phase == api.Phase.FAILED and decision.stop_job == "run-0f1e2d3c-1"
    assert conditions.condition(decision.status.conditions, conditions.FAILED).reason == "DeadlineExceeded"  # type: ignore[union-attr]


def test_suspend_stops_the_job_and_unsuspend_goes_back_through_preflight() -> None:
    decision = reconcile(spec(suspend=True), running(), observe(job=job("RUNNING")))
    assert decision.stop_job == "run-0f1e2d3c-1" and decision.delete_cluster
    assert decision.status.phase == api.Phase.SUSPENDED
    from fsdp_operator.preflight import PreflightResult

    ok = PreflightResult(True, "CapacityAvailable", "fits", zone="us-west-2a")
    resumed = reconcile(
        spec(), decision.status, Observation(now=NOW, generation=2, cluster=None, preflight=ok)
    )
    assert resumed.create_cluster and resumed.status.phase == api.Phase.PROVISIONING
    again = reconcile(spec(), resumed.status, observe(checkpoints=CKPT))
    assert again.submit_attempt == 2 and "resuming from step 20" in (again.status.message or "")


def test_cluster_deleted_under_a_running_job_is_recreated_and_counted_as_a_restart() -> None:
    decision = reconcile(spec(), running(zone="us-west-2b"), observe(cluster=None))
    assert decision.create_cluster and decision.status.phase == api.Phase.RESTARTING
    assert decision.status.restarts.history[0].reason == "ClusterLost"
    assert decision.stop_job == "run-0f1e2d3c-1"


def test_socket_fallback_with_efa_is_transport_degraded() -> None:
    socket = TransportReport(observed="socket", evidence=["NCCL INFO Using network Socket"])
    decision = reconcile(spec(), running(), observe(job=job("RUNNING"), progress=progress(transport=socket)))
    assert conditions.is_true(decision.status.conditions, conditions.TRANSPORT_DEGRADED)
    assert [e.reason for e in decision.events] == ["TransportDegraded"]
    efa = TransportReport(observed="efa", evidence=["NET/OFI Selected Provider is efa"])
    fine = reconcile(spec(), running(), observe(job=job("RUNNING"), progress=progress(transport=efa)))
    assert not conditions.is_true(fine.status.conditions, conditions.TRANSPORT_DEGRADED)


def test_classification_reads_trainer_verdict_then_driver_logs() -> None:
    started = NOW - dt.timedelta(minutes=1)
    oom0 = progress(0, phase="failed", error_kind="oom", error="OutOfMemoryError", updated_at=NOW)
    assert classify("", "", oom0, started).permanent
    oom_late = progress(50, phase="failed", error_kind="oom", error="OutOfMemoryError", updated_at=NOW)
    assert not classify("", "", oom_late, started).permanent
    stale = progress(0, phase="failed", error_kind="config", updated_at=started - dt.timedelta(hours=1))
    assert not classify("exit 1", "", stale, started).permanent  # a verdict from an earlier attempt
    imports = classify(
        "", "Traceback...\nModuleNotFoundError: No module named 'fsdp_trainer'\n", None, started
    )
    assert imports.permanent and imports.reason == "ImportError"
    assert (
        classify(
            "Job entrypoint command failed with exit code 1", "RuntimeError: NCCL timeout", None, started
        ).reason
        == "JobFailed"
    )


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff_seconds(30, n) for n in range(4)] == [30, 60, 120, 240]
    assert backoff_seconds(30, 20) == 3600


def test_an_attempt_lost_with_a_disrupted_pod_restarts_without_spending_a_restart() -> None:
    no_restarts = spec(recovery={"maxRestarts": 0})
    lost = job("FAILED", "Job failed: a worker died unexpectedly")
    disruption = "pod llm-gpu-workers-x7k2p (PreemptionByScheduler: preempted by team-b/urgent on gpu-2a-0)"
    decision = reconcile(no_restarts, running(), observe(job=lost, checkpoints=CKPT, disruption=disruption))
    status = decision.status
    assert status.phase == api.Phase.RESTARTING, status.message
    assert status.restarts.count == 0 and status.restarts.preemptions == 1
    [entry] = status.restarts.history
    assert (
        entry.reason == "Preempted"
        and "PreemptionByScheduler" in entry.message
        and entry.resumed_from_step == 20
    )
    assert "Preempted" in [e.reason for e in decision.events]
    # The same loss without a disruption spends the (empty) budget, once the failure's hold is over.
    held = reconcile(no_restarts, running(), observe(job=lost, checkpoints=CKPT)).status
    later = NOW + dt.timedelta(seconds=FINAL_FAILURE_HOLD_SECONDS)
    plain = reconcile(no_restarts, held, observe(now=later, job=lost, checkpoints=CKPT))
    assert plain.status.phase == api.Phase.FAILED
    assert conditions.condition(plain.status.conditions, conditions.FAILED).reason == "RestartsExhausted"


def test_a_pods_disruption_names_the_pod_and_kubernetes_reason() -> None:
    pod = {
        "metadata": {"name": "llm-gpu-workers-x7k2p"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True"},
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                },
            ]
        },
    }
    assert pod_disruption(pod) == "pod llm-gpu-workers-x7k2p (EvictionByEvictionAPI: Eviction API: evicting)"
    assert pod_disruption({"metadata": {"name": "p"}, "status": {"conditions": [{"type": "Ready"}]}}) is None


def test_a_permanent_failure_names_its_reason_once() -> None:
    failed = progress(
        0,
        phase="failed",
        error="DataError: cannot read s3://b/missing.jsonl",
        error_kind="data",
        updated_at=NOW - dt.timedelta(seconds=5),
    )
    status = reconcile(spec(), running(), observe(job=job("FAILED"), progress=failed)).status
    assert status.message == "DataError: cannot read s3://b/missing.jsonl"
    config = progress(0, phase="failed", error="unknown column", error_kind="config", updated_at=NOW)
    named = reconcile(spec(), running(), observe(job=job("FAILED"), progress=config)).status
    assert named.message == "InvalidConfig: unknown column"


def test_every_permanent_trainer_verdict_fails_the_run_with_a_reason_of_its_own() -> None:
    """A trainer error kind the operator has no reason for would fail every pass (KeyError), not the run."""
    from fsdp_trainer.contract import PERMANENT_ERROR_KINDS

    started = NOW - dt.timedelta(minutes=1)
    for kind in sorted(PERMANENT_ERROR_KINDS):
        record = progress(0, phase="failed", error_kind=str(kind), error=f"step 4: {kind}", updated_at=NOW)
        failure = classify("", "", record, started)
        assert failure.permanent and failure.reason[0].isupper(), (kind, failure)
    nan = progress(4, phase="failed", error_kind="non-finite-loss", error="step 4: loss nan", updated_at=NOW)
    assert classify("", "", nan, started).reason == "NonFiniteLoss"
    skipped = reconcile(spec(), running(), observe(job=job("RUNNING"), progress=progress(non_finite_steps=2)))
    assert skipped.status.progress.non_finite_steps == 2


def test_when_every_rank_waits_the_flight_recorder_names_the_one_a_collective_behind() -> None:
    """Mismatched collectives: all ranks are inside torch.distributed, rank 1 one collective behind."""
    from fsdp_operator import hangs
    from fsdp_trainer.contract import CollectiveRecord

    def entered(rank: int, last: int) -> RankStacks:
        records = [
            CollectiveRecord(seq=seq, process_group="default_pg", op="nccl:all_reduce") for seq in (1, last)
        ]
        return stacks(rank, True, "fsdp.py:1 in reduce").model_copy(update={"collectives": records})

    found = hangs.suspect([entered(0, 41), entered(1, 40), entered(2, 41)], 3)
    assert found is not None and found.rank == 1, found
    assert "entered collective 40 of process group default_pg and ranks 0, 2 collective 41" in found.why
    assert hangs.suspect([entered(0, 41), entered(1, 41)], 2) is None  # agreeing ranks: no suspect from it


def test_without_a_rank_out_of_collectives_the_suspect_is_the_one_behind_or_the_silent_one() -> None:
    from fsdp_operator import hangs

    behind = [stacks(0, True, "a"), stacks(1, True, "b").model_copy(update={"step": 12})]
    found = hangs.suspect(behind, 2)
    assert found is not None and found.rank == 1 and "completed step 12, the others 14" in found.why
    silent = hangs.suspect([stacks(0, True, "a")], 2)
    assert silent is not None and silent.rank == 1 and "did not answer" in silent.why
    assert hangs.suspect([stacks(0, True, "a"), stacks(1, True, "b")], 2) is None
    assert hangs.suspect([], 2) is None


def test_a_runs_status_says_what_became_of_its_rows_and_how_large_its_adapter_is() -> None:
    """Issue 48: rows that do not parse or are too long are counted and reported, and a LoRA run's adapter
    size shows in the status (and so in `kubectl trainingrun describe`), not only in the trainer's record."""
    data = TrainingData(format="messages", learned="assistant turns", packed=True, rows=800, unparsable=3,
                        truncated=5, dropped=2)  # fmt: skip
    record = progress(training_data=data, adapter_bytes=4_194_304)
    seen = reconcile(spec(), running(), observe(job=job("RUNNING"), progress=record)).status.progress
    assert seen.data_rows == api.DataRowsStatus(read=800, unparsable=3, truncated=5, dropped=2)
    assert seen.adapter_bytes == 4_194_304
