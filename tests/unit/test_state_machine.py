"""The (phase, observation) -> (phase, actions) table for the cases that break a shared, busy cluster.

Each test is one row: a status, what a pass observed, and the decision the operator must take.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest

from fsdp_operator import api, builder, conditions, preflight
from fsdp_operator.jobs import job_not_found
from fsdp_operator.reconcile import ClusterObservation, Observation, PodProblem, PodsProgress, reconcile
from fsdp_operator.statuspatch import FIGURE_WRITES_PER_SECOND, figures_every, figures_wait, merge_patch
from fsdp_trainer.contract import LOGS_DIR, RUN_RECORD_FILE, CheckpointRef, RestartEntry
from tests.support.decision_inputs import JOB_ID, NOW, job, observe, record, spec, status


def condition(decision: Any, type_: str) -> api.Condition:
    found = conditions.condition(decision.status.conditions, type_)
    assert found is not None, f"no {type_} condition"
    return found


# -- intent before side effect -----------------------------------------------------------------------------


def test_a_job_ray_never_took_is_submitted_again_with_the_same_id_not_counted_as_lost() -> None:
    first = reconcile(spec(), status(api.Phase.CLUSTER_READY, attempt=0, job_submission_id=None), observe())
    assert first.submit_attempt == 1
    # The operator died (or Ray refused) before the job reached Ray: the next pass finds no such job.
    again = reconcile(
        spec(), first.status, observe(10, job=job(None), action_error="ConnectionError: refused")
    )
    assert again.submit_attempt == 1 and again.status.attempt == 1 and again.status.restarts.count == 0
    assert again.status.job_submission_id == first.status.job_submission_id
    assert condition(again, conditions.JOB_RUNNING).reason == "SubmissionFailed"
    seen = reconcile(spec(), again.status, observe(20, job=job("RUNNING")))
    assert seen.submit_attempt is None and condition(seen, conditions.JOB_RUNNING).status == "True"
    # Once Ray has reported it, losing it is JobLost (a restart).
    lost = reconcile(spec(), seen.status, observe(30, job=job(None)))
    assert lost.status.phase == api.Phase.RESTARTING and lost.status.restarts.history[-1].reason == "JobLost"


def test_the_replaced_attempt_must_have_ended_before_the_next_is_submitted() -> None:
    restarting = status(api.Phase.RESTARTING, next_check_time=NOW - dt.timedelta(seconds=1))
    for previous in (job("RUNNING"), job("PENDING")):
        decision = reconcile(spec(), restarting, observe(job=previous))
        assert decision.submit_attempt is None and decision.stop_job == JOB_ID
    unknown = reconcile(spec(), restarting, observe(dashboard_error="ReadTimeout"))
    assert unknown.submit_attempt is None  # cannot tell whether it still runs
    assert condition(unknown, conditions.JOB_RUNNING).reason == "DashboardUnreachable"
    ended = reconcile(spec(), restarting, observe(job=job("STOPPED")))
    assert ended.submit_attempt == 2 and ended.status.job_submission_id == "run-0f1e2d3c-2"


def test_every_status_field_is_set_by_reconcile_from_the_observation() -> None:
    """The status reconcile returns is the one written: where the records are, the cluster's name once one is
    created, the trainer package a submission ships."""
    where: dict[str, Any] = {
        "cluster_name": "run-0f1e2d3c",
        "run_uri": "s3://b/p/ns/run",
        "package_sha256": "abc",
    }
    pending = status(api.Phase.PENDING, attempt=0, job_submission_id=None)
    waiting = reconcile(spec(), pending, observe(cluster=None, **where))
    assert waiting.status.ray_cluster_name is None and not waiting.create_cluster
    assert waiting.status.record.uri == f"s3://b/p/ns/run/{RUN_RECORD_FILE}"
    assert waiting.status.record.logs_uri == f"s3://b/p/ns/run/{LOGS_DIR}"
    fits = preflight.PreflightResult(True, "CapacityAvailable", "fits", zone="us-west-2a")
    created = reconcile(spec(), pending, observe(cluster=None, preflight=fits, **where))
    assert created.create_cluster and created.status.ray_cluster_name == "run-0f1e2d3c"
    assert created.status.record.package_sha256 is None  # nothing shipped yet
    ready = status(api.Phase.CLUSTER_READY, attempt=0, job_submission_id=None)
    submitted = reconcile(spec(), ready, observe(**where))
    assert submitted.submit_attempt == 1 and submitted.status.record.package_sha256 == "abc"


def test_status_patch_clears_nested_fields_and_is_empty_when_nothing_changed() -> None:
    old = {"phase": "Running", "progress": {"step": 120, "loss": 2.31, "mfu": 0.4}, "zone": "a"}
    new = {"phase": "Running", "progress": {"step": 0}, "zone": "a"}
    assert merge_patch(old, new) == {"progress": {"step": 0, "loss": None, "mfu": None}}
    assert merge_patch(new, new) == {}
    assert merge_patch({"conditions": [1, 2]}, {"conditions": [2]}) == {"conditions": [2]}


# -- bounded waits and liveness ----------------------------------------------------------------------------


def test_dashboard_outage_is_unknown_and_clears_when_ray_answers_again() -> None:
    down = reconcile(
        spec(), status(), observe(dashboard_error="ReadTimeout: read timed out", progress=record())
    )
    assert condition(down, conditions.JOB_RUNNING).status == "Unknown"
    back = reconcile(spec(), down.status, observe(30, job=job("RUNNING"), progress=record()))
    assert (condition(back, conditions.JOB_RUNNING).status, back.status.phase) == ("True", api.Phase.RUNNING)


def test_slow_setup_with_heartbeats_is_not_a_hang_but_silence_is_a_setup_timeout() -> None:
    run_spec = spec(recovery={"forensicsSeconds": 0, "hangTimeoutSeconds": 600, "setupTimeoutSeconds": 900})
    long_setup = status(attempt_time=NOW - dt.timedelta(minutes=31))
    heartbeat = record("starting", seconds_ago=20, stage="downloading-model")
    alive = reconcile(run_spec, long_setup, observe(job=job("RUNNING", 31), progress=heartbeat))
    assert alive.status.phase == api.Phase.RUNNING and alive.stop_job is None
    assert alive.status.progress.stage == "downloading-model"
    # Heartbeats go on while a setup collective hangs: one stage lasting past the bound is stuck too.
    since = NOW - dt.timedelta(seconds=901)
    long_stage = long_setup.model_copy(
        update={"progress": api.ProgressStatus(stage="probing-transport", stage_since=since)}
    )
    probing = record("starting", seconds_ago=5, stage="probing-transport")
    hung = reconcile(run_spec, long_stage, observe(job=job("RUNNING", 31), progress=probing))
    assert hung.status.restarts.history[-1].reason == "SetupTimeout"
    assert "stage probing-transport took longer" in hung.status.restarts.history[-1].message
    silent = record("starting", seconds_ago=1000, stage="loading-checkpoint")
    stuck = reconcile(run_spec, long_setup, observe(job=job("RUNNING", 31), progress=silent))
    assert stuck.status.restarts.history[-1].reason == "SetupTimeout" and stuck.stop_job == JOB_ID
    assert "loading-checkpoint" in stuck.status.restarts.history[-1].message


def test_hang_counts_from_the_attempts_own_training_records_only() -> None:
    run_spec = spec(recovery={"forensicsSeconds": 0, "hangTimeoutSeconds": 600})
    # The previous attempt's record (another submission) is old, but this attempt is still setting up.
    previous_attempt = record(seconds_ago=3600, submission_id="run-0f1e2d3c-0")
    fresh = reconcile(run_spec, status(), observe(job=job("RUNNING"), progress=previous_attempt))
    assert fresh.status.phase == api.Phase.RUNNING
    hung = reconcile(run_spec, status(), observe(job=job("RUNNING"), progress=record(seconds_ago=700)))
    assert hung.status.restarts.history[-1].reason == "Hang"


def test_a_finished_trainer_is_not_a_hang_while_ray_cannot_be_asked() -> None:
    run_spec = spec(recovery={"forensicsSeconds": 0, "hangTimeoutSeconds": 600})
    finished = record("finished", seconds_ago=700, step=100)
    waiting = reconcile(run_spec, status(), observe(dashboard_error="ReadTimeout", progress=finished))
    assert waiting.status.phase == api.Phase.RUNNING and waiting.status.restarts.count == 0
    assert condition(waiting, conditions.JOB_RUNNING).reason == "DashboardUnreachable"
    # With Ray answering, a job still running long after the trainer's last record is stuck after all.
    stuck = reconcile(run_spec, status(), observe(job=job("RUNNING"), progress=finished))
    assert stuck.status.restarts.history[-1].reason == "Hang"


def test_neither_s3_nor_ray_readable_for_longer_than_the_bound_restarts() -> None:
    run_spec = spec(recovery={"forensicsSeconds": 0, "hangTimeoutSeconds": 600})
    blind = observe(storage_read=True, storage_error="s3: timeout", dashboard_error="ReadTimeout")
    first = reconcile(run_spec, status(), blind)
    assert first.status.phase == api.Phase.RUNNING and first.stop_job is None
    later = reconcile(run_spec, first.status, observe(601, **_fields(blind)))
    assert later.status.restarts.history[-1].reason == "Unobservable"


def _fields(obs: Observation) -> dict[str, Any]:
    return {
        "storage_read": obs.storage_read,
        "storage_error": obs.storage_error,
        "dashboard_error": obs.dashboard_error,
    }


def test_ray_reports_an_unknown_job_only_for_its_own_404() -> None:
    assert job_not_found(404, "Job r-1 does not exist", "r-1")
    proxy_404 = (
        '{"kind":"Status","status":"Failure","message":"services \\"x-head-svc\\" not found","code":404}'
    )
    assert not job_not_found(404, proxy_404, "r-1")
    assert not job_not_found(500, "error 404 in a message", "r-1")


# -- clusters ------------------------------------------------------------------------------------------------


def test_a_cluster_being_deleted_is_never_used() -> None:
    deleting = ClusterObservation(ready=False, message="", deleting=True)
    unsuspended = status(api.Phase.SUSPENDED, job_submission_id=None)
    decision = reconcile(spec(), unsuspended, observe(cluster=deleting))
    assert not decision.create_cluster and decision.submit_attempt is None and decision.requeue_after
    provisioning = status(api.Phase.PROVISIONING, attempt=0, job_submission_id=None)
    decision = reconcile(spec(), provisioning, observe(cluster=deleting))
    assert decision.submit_attempt is None and not decision.create_cluster


def test_a_cluster_edited_by_hand_is_replaced_and_the_attempt_restarted() -> None:
    drifted = ClusterObservation(ready=True, message="", drift="gpu-workers.replicas 1 (want 2)")
    decision = reconcile(spec(), status(), observe(cluster=drifted, job=job("RUNNING")))
    assert decision.delete_cluster and decision.stop_job == JOB_ID
    assert decision.status.restarts.history[-1].reason == "ClusterModified"
    assert "ClusterModified" in [e.reason for e in decision.events]


def test_cluster_drift_compares_what_the_run_needs() -> None:
    run = builder.RunRef("run", "ns", "uid-1")
    desired = builder.build_raycluster(spec(), run, "img@sha256:" + "a" * 64, "us-west-2a")
    assert builder.cluster_drift(desired, desired) is None
    edited = {
        "spec": {
            **desired["spec"],
            "workerGroupSpecs": [{**desired["spec"]["workerGroupSpecs"][0], "replicas": 1}],
        }
    }
    assert "replicas 1 (want 2)" in (builder.cluster_drift(desired, edited) or "")


def edited(desired: dict[str, Any], group: int, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of the RayCluster with one group's pod template (0: the head) changed in place by `change`."""
    copied = copy.deepcopy(desired)
    groups = [copied["spec"]["headGroupSpec"], *copied["spec"]["workerGroupSpecs"]]
    change(groups[group]["template"]["spec"])
    return copied


@pytest.mark.parametrize(
    ("group", "change", "named"),
    [
        (1, lambda pod: pod.update(serviceAccountName="admin"), "gpu-workers serviceAccountName"),
        (0, lambda pod: pod.update(hostNetwork=True), "head hostNetwork"),
        (1, lambda pod: pod["tolerations"].append({"operator": "Exists"}), "gpu-workers tolerations"),
        (1, lambda pod: pod.setdefault("volumes", []).append({"name": "h", "hostPath": {"path": "/"}}),
         "gpu-workers volumes"),
        (0, lambda pod: pod["containers"][0]["securityContext"].update(privileged=True),
         "head container ray-head securityContext"),
        (1, lambda pod: pod["containers"][0].setdefault("env", []).append(
            {"name": "T", "valueFrom": {"secretKeyRef": {"name": "other-teams", "key": "token"}}}),
         "gpu-workers container ray-worker env"),
        (1, lambda pod: pod["containers"].append({"name": "sidecar", "image": "x"}),
         "gpu-workers container sidecar added"),
        (1, lambda pod: pod["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": "8"}),
         "gpu-workers container ray-worker limits.nvidia.com/gpu 8"),
    ],
    ids=["service-account", "host-network", "toleration", "host-path", "privileged", "secret-env", "sidecar",
         "more-gpus"],
)  # fmt: skip
def test_a_pod_template_edited_past_what_the_run_was_granted_is_drift(
    group: int, change: Callable[[dict[str, Any]], None], named: str
) -> None:
    """Issue 46: edits to the RayCluster's pod templates (a service account, privileged, hostPath,
    tolerations) went unnoticed; only images and replicas were compared."""
    run = builder.RunRef("run", "ns", "uid-1")
    desired = builder.build_raycluster(spec(), run, "img@sha256:" + "a" * 64, "us-west-2a")
    drift = builder.cluster_drift(desired, edited(desired, group, change))
    assert drift is not None and named in drift, drift


def test_an_operator_upgrade_with_other_default_sizes_is_not_drift() -> None:
    """A cluster made by an operator whose default worker memory and CPU were others (176Gi before Karpenter's
    estimate, 170Gi now) is not restarted by the upgrade; only devices beyond what was built are drift."""
    run = builder.RunRef("run", "ns", "uid-1")
    desired = builder.build_raycluster(spec(), run, "img@sha256:" + "a" * 64, "us-west-2a")

    def older_defaults(pod: dict[str, Any]) -> None:
        for kind in ("requests", "limits"):
            pod["containers"][0]["resources"][kind].update(memory="176Gi", cpu="47")

    assert builder.cluster_drift(desired, edited(desired, 1, older_defaults)) is None


def test_kueues_tolerations_on_a_queued_runs_templates_are_not_drift() -> None:
    run = builder.RunRef("run", "ns", "uid-1")
    queued = builder.build_raycluster(spec(cluster={"queueName": "q"}), run, "img", None)
    flavor = {"key": "flavor", "operator": "Exists", "effect": "NoSchedule"}
    assert builder.cluster_drift(queued, edited(queued, 1, lambda p: p["tolerations"].append(flavor))) is None


def test_provisioning_past_its_deadline_deletes_the_cluster_and_waits_again() -> None:
    stuck = status(
        api.Phase.PROVISIONING,
        attempt=0,
        job_submission_id=None,
        phase_transition_time=NOW - dt.timedelta(seconds=901),
    )
    waiting = ClusterObservation(ready=False, message="HeadPodReady=False")
    decision = reconcile(spec(), stuck, observe(cluster=waiting))
    assert decision.delete_cluster and decision.status.phase == api.Phase.PENDING
    assert condition(decision, conditions.PREFLIGHT).reason == "ProvisioningTimeout"
    assert decision.status.active_since is None and decision.status.next_check_time is not None
    failing = reconcile(spec(preflight={"onInsufficientCapacity": "Fail"}), stuck, observe(cluster=waiting))
    assert failing.status.phase == api.Phase.FAILED and failing.delete_cluster


def test_a_cluster_recreated_while_restarting_has_the_provisioning_bound_and_attempts() -> None:
    """A cluster lost under a running job is recreated with the run Restarting: if it never gets ready, the
    run is not left Restarting for ever; it gets the first cluster's bound, counted from the restart."""
    lost = status(api.Phase.RUNNING)
    restarting = reconcile(spec(), lost, observe(cluster=None))
    assert restarting.create_cluster and restarting.status.phase == api.Phase.RESTARTING
    waiting = ClusterObservation(ready=False, message="HeadPodReady=False")
    coming_up = PodsProgress(pods=3, placed=1, started=0, ready=0)
    early = reconcile(spec(), restarting.status, observe(600, cluster=waiting, pods_progress=coming_up))
    assert early.status.phase == api.Phase.RESTARTING and not early.delete_cluster
    assert early.status.provisioning is not None and early.status.provisioning.pods_placed == 1
    assert early.status.message == "waiting for KubeRay: 1/3 pods placed, 0 started, 0 ready"
    stuck = reconcile(spec(), early.status, observe(1501, cluster=waiting, pods_progress=coming_up))
    assert stuck.delete_cluster and stuck.status.phase == api.Phase.PENDING
    assert condition(stuck, conditions.PREFLIGHT).reason == "ProvisioningTimeout"
    assert stuck.status.provisioning_timeouts == 1


def test_pods_that_cannot_pull_show_at_once_and_fail_the_run_after_the_bound() -> None:
    pulling = (PodProblem("ImagePullBackOff", "pod r-head: ImagePullBackOff: Back-off pulling image"),)
    provisioning = status(
        api.Phase.PROVISIONING, attempt=0, job_submission_id=None, phase_transition_time=NOW
    )
    waiting = ClusterObservation(ready=False, message="")
    first = reconcile(spec(), provisioning, observe(cluster=waiting, pod_problems=pulling))
    assert condition(first, conditions.PODS_HEALTHY).reason == "ImagePullBackOff"
    assert first.status.phase == api.Phase.PROVISIONING and [e.reason for e in first.events] == [
        "ImagePullBackOff"
    ]
    later = reconcile(spec(), first.status, observe(301, cluster=waiting, pod_problems=pulling))
    assert later.status.phase == api.Phase.FAILED and later.delete_cluster
    assert condition(later, conditions.FAILED).reason == "ImagePullBackOff"


# -- finishing, restarts, deadlines -------------------------------------------------------------------------


def test_a_failed_run_is_finished_and_not_succeeded_so_kubectl_wait_returns() -> None:
    no_restarts = spec(recovery={"maxRestarts": 0})
    held = reconcile(no_restarts, status(), observe(job=job("FAILED")))  # waits for a disruption first
    decision = reconcile(no_restarts, held.status, observe(31, job=job("FAILED")))
    assert condition(decision, conditions.FINISHED).status == "True"
    assert condition(decision, conditions.SUCCEEDED).status == "False"
    done = reconcile(spec(), status(), observe(job=job("SUCCEEDED")))
    assert (condition(done, conditions.FINISHED).status, condition(done, conditions.SUCCEEDED).status) == (
        "True",
        "True",
    )


def test_restart_history_in_status_keeps_the_last_ten() -> None:
    old = [RestartEntry(time=NOW - dt.timedelta(hours=i), reason="JobFailed") for i in range(10, 0, -1)]
    many = status(restarts={"count": 10, "history": old})
    decision = reconcile(spec(recovery={"maxRestarts": 20}), many, observe(job=job("FAILED")))
    history = decision.status.restarts.history
    assert len(history) == 10 and history[-1].time == NOW and decision.status.restarts.count == 11
    with pytest.raises(ValueError, match=r"max_restarts|maxRestarts"):
        spec(recovery={"maxRestarts": 1000})


def test_the_deadline_counts_active_time_not_time_suspended() -> None:
    resumed = status(active_seconds=3000, active_since=NOW - dt.timedelta(seconds=500))
    within = reconcile(
        spec(activeDeadlineSeconds=3600), resumed, observe(job=job("RUNNING"), progress=record())
    )
    assert within.status.phase == api.Phase.RUNNING
    past = reconcile(
        spec(activeDeadlineSeconds=3400), resumed, observe(job=job("RUNNING"), progress=record())
    )
    assert (
        past.status.phase == api.Phase.FAILED
        and condition(past, conditions.FAILED).reason == "DeadlineExceeded"
    )
    suspended = reconcile(spec(suspend=True), resumed, observe(job=job("RUNNING")))
    assert suspended.status.active_seconds == 3500 and suspended.status.active_since is None


def test_a_new_image_while_suspended_drops_the_old_pin() -> None:
    pinned = status(
        api.Phase.SUSPENDED,
        image={"requested": "repo/ray:old", "digest": "repo/ray@sha256:" + "a" * 64, "consistent": True},
    )
    decision = reconcile(
        spec(image="repo/ray:new"), pinned, observe(cluster=None, requested_image="repo/ray:new")
    )
    assert decision.status.image.digest is None and decision.status.image.requested == "repo/ray:new"
    assert "ImageRequestChanged" in [e.reason for e in decision.events]


def test_a_changed_digest_is_announced_once() -> None:
    pinned = status(image={"requested": "r:1", "digest": "r@sha256:" + "a" * 64, "consistent": True})
    other = ("r@sha256:" + "b" * 64,)
    first = reconcile(spec(), pinned, observe(job=job("RUNNING"), pod_image_ids=other))
    again = reconcile(spec(), first.status, observe(job=job("RUNNING"), pod_image_ids=other))
    assert [e.reason for e in first.events] == ["ImageChanged"] and again.events == []


def test_checkpoints_of_another_configuration_fail_the_run_before_submission() -> None:
    ckpt = (CheckpointRef(uri="s3://b/p/ns/run/checkpoint_1", step=10, time=NOW),)
    ready = status(api.Phase.CLUSTER_READY, attempt=0, job_submission_id=None)
    other = observe(checkpoints=ckpt, latest_checkpoint_fingerprint="aaaa", expected_fingerprint="bbbb")
    decision = reconcile(spec(), ready, other)
    assert decision.submit_attempt is None and decision.status.phase == api.Phase.FAILED
    assert condition(decision, conditions.FAILED).reason == "CheckpointMismatch"
    same = observe(checkpoints=ckpt, latest_checkpoint_fingerprint="bbbb", expected_fingerprint="bbbb")
    assert reconcile(spec(), ready, same).submit_attempt == 1
    assert (
        reconcile(
            spec(checkpoint={"storagePath": "s3://b/p", "resume": "never"}), ready, other
        ).submit_attempt
        == 1
    )


# -- names ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2.5-ft", "1st-run", "a" * 70, "a." * 126 + "a", "x"])
def test_every_accepted_run_name_gets_a_valid_distinct_child_name(name: str) -> None:
    child = builder.ray_cluster_name(name)
    assert len(child) <= 40 and child[0].isalpha() and child[-1].isalnum()
    assert all(c.isalnum() or c == "-" for c in child) and child == child.lower()
    assert builder.ray_cluster_name(name + "0") != child
    label = builder.label_value(name)
    assert len(label) <= 63 and label[-1].isalnum()
    manifest = builder.build_raycluster(spec(), builder.RunRef(name, "ns", "u"), "img", None)
    assert manifest["metadata"]["annotations"][builder.ANNOTATION_RUN] == name


def test_dotted_and_undotted_names_do_not_share_a_cluster() -> None:
    assert builder.ray_cluster_name("qwen2.5-ft") != builder.ray_cluster_name("qwen2-5-ft")


def test_a_run_named_as_another_runs_hashed_child_gets_a_cluster_of_its_own() -> None:
    """llama.ft's child is llama-ft-<hash>: a run given that name must not adopt (or delete) it."""
    child = builder.ray_cluster_name("llama.ft")
    assert child.startswith("llama-ft-") and builder.ray_cluster_name(child) != child
    assert builder.ray_cluster_name("run-0f1e2d3c") == "run-0f1e2d3c"  # names that need no hash keep theirs


# -- capacity ------------------------------------------------------------------------------------------------


ZONE_A = [preflight.NodeFree(f"a{i}", "us-west-2a", 4, 1) for i in range(4)]  # four 4-GPU nodes: 4 slots


def _waiting(name: str, created: str, workers: int = 2, free: list[preflight.NodeFree] = ZONE_A) -> Any:
    other = spec(cluster={"workers": workers})
    return preflight.Competitor(
        name, created, "g6.12xlarge", False, None, workers, workers <= 4, spec=other, free=tuple(free)
    )


def test_runs_competing_for_nodes_are_admitted_in_creation_order_many_in_one_pass() -> None:
    mine = spec(cluster={"workers": 2})
    # An earlier waiting run that fits is placed first: this run takes what it leaves, in the same pass.
    earlier = _waiting("ns/a", "2026-11-30T10:00:00Z")
    result = preflight.admit(mine, "2026-11-30T11:00:00Z", "ns/b", ZONE_A, [earlier])
    assert result.ok and result.zone == "us-west-2a", result
    # Two earlier runs take all four slots: this run waits for capacity (not for them: they will be admitted).
    second = _waiting("ns/c", "2026-11-30T10:30:00Z")
    result = preflight.admit(mine, "2026-11-30T11:00:00Z", "ns/b", ZONE_A, [earlier, second])
    assert not result.ok and result.reason == "InsufficientCapacity", result
    # Created first (or in the same second with a smaller name), this run is placed before them.
    assert preflight.admit(mine, "2026-11-30T09:00:00Z", "ns/b", ZONE_A, [earlier, second]).ok
    assert preflight.admit(mine, "2026-11-30T10:00:00Z", "ns/0", ZONE_A, [earlier, second]).ok
    # An earlier run that does not fit now holds every later run back, even one that would fit (no backfill).
    big = _waiting("ns/big", "2026-11-30T10:00:00Z", workers=4, free=ZONE_A[:3])
    result = preflight.admit(mine, "2026-11-30T11:00:00Z", "ns/b", ZONE_A[:3], [big])
    assert not result.ok and result.reason == preflight.WAITING_FOR_EARLIER_RUN
    assert "ns/big" in result.message
    # ... of its own namespace only: another team's big run holds no one here back.
    theirs = _waiting("other/big", "2026-11-30T10:00:00Z", workers=4, free=ZONE_A[:3])
    assert preflight.admit(mine, "2026-11-30T11:00:00Z", "ns/b", ZONE_A[:3], [theirs]).ok
    # A run that could not fit even on empty nodes never holds others up.
    impossible = _waiting("ns/huge", "2026-11-30T10:00:00Z", workers=9)
    assert preflight.admit(mine, "2026-11-30T11:00:00Z", "ns/b", ZONE_A, [impossible]).ok
    # Admitted runs whose workers are not placed yet keep their slots.
    admitted = preflight.Competitor("ns/a", "2026-11-30T10:00:00Z", "g6.12xlarge", True, "us-west-2a", 3)
    result = preflight.admit(mine, "2026-11-30T11:00:00Z", "ns/b", ZONE_A, [admitted])
    assert not result.ok and result.reason == "InsufficientCapacity", result


def test_admission_agrees_with_each_earlier_runs_own_pass() -> None:
    """Twenty runs created together on room for ten: every pass, in any order, admits exactly the first ten,
    and no admitted set overcommits the nodes."""
    nodes = [preflight.NodeFree(f"n{i}", "us-west-2a", 4, 1) for i in range(5)] + [
        preflight.NodeFree(f"m{i}", "us-west-2b", 4, 1) for i in range(5)
    ]
    runs = [_waiting(f"ns/r{i:02d}", "2026-11-30T10:00:00Z", workers=1, free=nodes) for i in range(20)]
    admitted: list[preflight.Competitor] = []
    for run in reversed(runs):  # the latest first: the worst order for a serial queue
        others = [c for c in runs if c.name != run.name and c not in admitted] + admitted
        assert run.spec is not None
        result = preflight.admit(run.spec, run.created, run.name, nodes, others)
        if result.ok:
            admitted.append(preflight.Competitor(run.name, run.created, "g6.12xlarge", True, result.zone, 1))
    assert sorted(c.name for c in admitted) == [f"ns/r{i:02d}" for i in range(10)]
    per_zone = {z: sum(1 for c in admitted if c.zone == z) for z in ("us-west-2a", "us-west-2b")}
    assert per_zone == {"us-west-2a": 5, "us-west-2b": 5}


def test_the_pod_index_keeps_only_what_preflight_subtracts() -> None:
    def pod(node: str | None, gpus: str | None, phase: str = "Running") -> dict[str, Any]:
        requests = {"cpu": "1", **({"nvidia.com/gpu": gpus} if gpus else {})}
        spec: dict[str, Any] = {
            "containers": [{"name": "c", "image": "i", "resources": {"requests": requests}}]
        }
        if node:
            spec["nodeName"] = node
        return {
            "metadata": {"name": "p", "namespace": "ns", "labels": {}},
            "spec": spec,
            "status": {"phase": phase},
        }

    assert preflight.counted_by_preflight(pod("gpu-1", "3"))
    daemon = pod("gpu-1", None)
    daemon["metadata"]["ownerReferences"] = [{"kind": "DaemonSet", "name": "ds", "uid": "u"}]
    assert preflight.counted_by_preflight(daemon)
    assert preflight.placement_of(daemon)["metadata"]["ownerReferences"] == [{"kind": "DaemonSet"}]
    for ignored in (pod(None, "3"), pod("gpu-1", None), pod("gpu-1", "3", "Succeeded")):
        assert not preflight.counted_by_preflight(ignored)
    node = {
        "metadata": {
            "name": "gpu-1",
            "labels": {
                "node.kubernetes.io/instance-type": "g6.12xlarge",
                "topology.kubernetes.io/zone": "us-west-2a",
            },
        },
        "status": {
            "allocatable": {"nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "1"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    indexed = preflight.node_facts({**node, "status": {**node["status"], "images": [{"names": ["x"] * 50}]}})
    assert "images" not in indexed["status"]
    [free] = preflight.free_worker_nodes(spec(), [indexed], [preflight.placement_of(pod("gpu-1", "3"))])
    assert (free.gpus, free.efa) == (1, 1)


def test_a_runs_figures_alone_are_written_at_most_every_two_observe_intervals() -> None:
    training = {
        "phase": "Running",
        "attempt": 2,
        "message": "attempt 2: training, step 40 of 1000, loss 2.1",
        "progress": {"step": 40, "loss": 2.1},
    }
    # The message that says the step moves with it: one of the figures (without it, every pass of a training
    # run wrote its status: 1,300 writes a minute at 1,000 runs).
    figures = {
        "progress": {"step": 44, "loss": 2.0},
        "goodput": {"fraction": 0.81},
        "message": "attempt 2: training, step 44 of 1000, loss 2",
    }
    assert figures_every(15.0, runs=1) == 30.0

    def waits(
        patch: dict[str, Any], old: dict[str, Any], since: float | None = 15.0, acts: bool = False
    ) -> bool:
        return figures_wait(patch, acts, old, since, every=30.0)

    assert waits(figures, training)
    assert not waits(figures, training, since=30.0)  # their turn
    assert not waits(figures, training, since=None)  # not written by this process
    # Anything beyond the figures is written at once, with them: a checkpoint, a phase, a condition...
    assert not waits({**figures, "checkpoints": {"latest": {"step": 40}}}, training)
    # A message that says anything else is news, written at once.
    assert not waits(
        {**figures, "message": "attempt 2: no training record for 600 s (hang suspected)"}, training
    )
    # ...and whatever the pass does, whose intent goes first.
    assert not waits(figures, training, acts=True)
    # The first step, and a setup stage's figures, are not held back: goodput counts training from the first
    # step the status shows, and a stage's hang bound from when the status first showed it.
    assert not waits(figures, {"phase": "Running", "progress": {"stage": "loading-model"}})
    assert not waits(figures, {"phase": "ClusterReady"})
    assert not waits({}, training)
    # Any other run's goodput alone waits too: refreshed every minute while the run waits or provisions, it
    # was a status write a minute for each of 1,000 runs starting at once.
    for phase in ("Pending", "Provisioning", "ClusterReady", "Restarting"):
        assert waits({"goodput": {"accountedUntil": "2026-12-07T04:39:21Z"}}, {"phase": phase}), phase


def test_the_figures_of_all_runs_together_are_written_at_a_bounded_rate() -> None:
    """However many runs hold clusters, their figures together cost the apiserver at most
    FIGURE_WRITES_PER_SECOND writes; a few runs still show theirs every two observe intervals."""
    assert figures_every(15.0, runs=60) == 30.0
    for runs in (200, 1000, 5000):
        assert runs / figures_every(15.0, runs=runs) <= FIGURE_WRITES_PER_SECOND
    assert figures_every(15.0, runs=1000) == 500.0
