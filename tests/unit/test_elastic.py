"""Elastic runs (cluster.minWorkers): the spec's bound, what the trainer is told, and the history of sizes."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from pydantic import ValidationError

from fsdp_operator import api, submission
from fsdp_operator.builder import RunRef
from fsdp_operator.reconcile import ClusterObservation, Observation, reconcile
from fsdp_operator.runpass import RefusedSpec, parse
from fsdp_trainer.contract import ProgressRecord

NOW = dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.UTC)
SPEC: dict[str, Any] = {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}}


def spec(**cluster: Any) -> api.FSDPTrainingRunSpec:
    return api.FSDPTrainingRunSpec.model_validate({**SPEC, "cluster": cluster})


def test_min_workers_above_workers_is_refused_naming_both_fields() -> None:
    with pytest.raises(ValidationError, match=r"cluster\.minWorkers 3 is more than cluster\.workers 2"):
        spec(workers=2, minWorkers=3)
    with pytest.raises(RefusedSpec, match=r"spec\.cluster: .*minWorkers 3 is more than cluster\.workers 2"):
        parse({}, {"spec": {**SPEC, "cluster": {"workers": 2, "minWorkers": 3}}})


def test_the_elastic_range_is_checked_as_the_trainer_will_be_told_it() -> None:
    """Ray Train may start on any size in the range: g6.12xlarge's 4 GPUs x 1..2 workers is 4 to 8 processes,
    and 24 sequences divide among 4, 6 and 8 but not 5 or 7. Where the platform trains on CPU (one process
    per worker) the same spec's range is 1 to 2, which 24 divides."""
    run = RunRef(name="r", namespace="ns", uid="u")
    elastic = spec(workers=2, minWorkers=1).model_copy(
        update={"training": api.TrainingSpec(global_batch_size=24)}
    )
    refusal = submission.trainer_config(elastic, run, cpu_only=False).unusable_world_sizes()
    assert refusal is not None and refusal.startswith("cluster.minWorkers 1: the run may train on 4 to 8")
    assert "5 (training.globalBatchSize 24 is not divisible" in refusal and "7 (" in refusal
    assert "6 (" not in refusal
    assert submission.trainer_config(elastic, run, cpu_only=True).unusable_world_sizes() is None


def test_the_trainer_is_told_the_elastic_range() -> None:
    run = RunRef("r", "team-a", "uid-r")
    config = submission.trainer_config(spec(workers=4, minWorkers=2), run, cpu_only=False)
    assert (config.workers, config.min_workers) == (4, 2)
    assert submission.trainer_config(spec(workers=4), run, cpu_only=False).min_workers is None


def running(world_size: int, updated: dt.datetime) -> api.FSDPTrainingRunStatus:
    return api.FSDPTrainingRunStatus(
        phase=api.Phase.RUNNING,
        attempt=1,
        attempt_time=NOW - dt.timedelta(minutes=10),
        job_submission_id="run-1",
        progress=api.ProgressStatus(step=30, world_size=world_size, updated_at=updated),
    )


def pass_seeing(
    status: api.FSDPTrainingRunStatus, world_size: int, phase: str = "training"
) -> api.FSDPTrainingRunStatus:
    progress = ProgressRecord(
        run_name="r",
        phase=phase,
        submission_id="run-1",
        step=31,
        max_steps=100,
        world_size=world_size,
        resumed_from_step=30,
        updated_at=NOW,
    )
    observation = Observation(
        now=NOW,
        generation=1,
        cluster=ClusterObservation(ready=True, message=""),
        progress=progress,
        storage_read=True,
    )
    return reconcile(spec(workers=2, minWorkers=1), status, observation).status


def test_a_resize_within_an_attempt_is_in_the_history_with_the_size_it_ran_at_and_costs_no_restart() -> None:
    shrunk = pass_seeing(running(8, NOW - dt.timedelta(minutes=1)), world_size=4)
    [entry] = shrunk.restarts.history
    assert (entry.reason, entry.world_size, entry.resumed_from_step) == ("Resized", 8, 30)
    assert "from 8 to 4 training processes" in entry.message and shrunk.restarts.count == 0
    assert shrunk.progress.world_size == 4
    # Ray Train restarting the group on fewer workers: its setup heartbeats do not change the size shown, so
    # the first training record after them is the resize.
    starting = pass_seeing(running(8, NOW - dt.timedelta(minutes=1)), world_size=4, phase="starting")
    assert starting.progress.world_size == 8 and starting.restarts.history == []
    [after_setup] = pass_seeing(starting, world_size=4).restarts.history
    assert (after_setup.reason, after_setup.world_size) == ("Resized", 8)
    # The same size again: nothing new. The size shown being the previous attempt's: nothing either.
    assert pass_seeing(shrunk, world_size=4).restarts.history == [entry]
    stale = running(8, NOW - dt.timedelta(minutes=20))
    assert pass_seeing(stale, world_size=4).restarts.history == []


HEAD_ONLY = {
    "status": {
        "conditions": [
            {"type": "HeadPodReady", "status": "True"},
            {"type": "RayClusterProvisioned", "status": "False"},
        ]
    }
}


def test_an_elastic_cluster_is_ready_for_a_job_with_its_head_and_min_workers_ready() -> None:
    """KubeRay's RayClusterProvisioned waits for every worker; a worker waiting for a node does not hold
    an elastic run (minWorkers 1 of 2) out of training."""
    from fsdp_operator.reconcile import observe_cluster, ready_for_elastic

    cluster = observe_cluster(HEAD_ONLY)
    assert not cluster.ready and cluster.head_ready
    ready = ready_for_elastic(cluster, spec(workers=2, minWorkers=1), ready_workers=1)
    assert ready.ready and "the head and 1 of 2 workers are ready" in ready.message
    assert not ready_for_elastic(cluster, spec(workers=2, minWorkers=1), ready_workers=0).ready
    assert not ready_for_elastic(cluster, spec(workers=2), ready_workers=1).ready  # not elastic
    assert not ready_for_elastic(cluster, spec(workers=2, minWorkers=2), ready_workers=1).ready


def test_a_ray_pods_readiness_is_kept_for_the_pass() -> None:
    from fsdp_operator.watched import pod_summary

    pod = {
        "metadata": {"name": "w", "labels": {"ray.io/node-type": "worker"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert pod_summary(pod)["ready"] is True
    pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    assert pod_summary(pod)["ready"] is False


def test_a_provisioning_run_waits_for_its_workers_though_kuberay_calls_the_cluster_provisioned() -> None:
    """KubeRay sets RayClusterProvisioned once, when every pod its cache holds is ready, without counting
    them: a reconcile that saw the ready head and not yet the workers set it while both workers could not be
    scheduled, and the run submitted its job instead of saying "Insufficient cpu" (a whole run's failure of
    test_a_worker_the_scheduler_cannot_place_is_named_in_the_status_and_the_daily_view). KubeRay's own count
    of ready workers, from that reconcile, holds the run until they are."""
    from fsdp_operator.api import Phase
    from fsdp_operator.reconcile import observe_cluster, ready_for_a_job
    from fsdp_operator.watched import cluster_reaction

    def raycluster(ready_workers: int) -> dict[str, Any]:
        conditions = [
            {"type": "HeadPodReady", "status": "True"},
            {"type": "RayClusterProvisioned", "status": "True"},
        ]
        status = {"conditions": conditions, "readyWorkerReplicas": ready_workers, "desiredWorkerReplicas": 2}
        return {"metadata": {"name": "c", "generation": 1}, "status": status}

    early = observe_cluster(raycluster(ready_workers=0))
    assert early.ready  # KubeRay's conditions alone
    held = ready_for_a_job(early, spec(workers=2), Phase.PROVISIONING, ready_workers=0)
    assert not held.ready and "provisioned with 0 of 2 workers ready" in held.message
    ready = observe_cluster(raycluster(ready_workers=2))
    assert ready_for_a_job(ready, spec(workers=2), Phase.PROVISIONING, ready_workers=2).ready
    # An elastic run takes its job with minWorkers ready, as before.
    assert ready_for_a_job(early, spec(workers=2, minWorkers=1), Phase.PROVISIONING, ready_workers=1).ready
    # Once a run is past provisioning, a worker that restarts is the job's business, not a cluster not ready.
    assert ready_for_a_job(early, spec(workers=2), Phase.RUNNING, ready_workers=1).ready
    # The workers becoming ready is a RayCluster event a pass reacts to at once.
    assert cluster_reaction(raycluster(ready_workers=0)) != cluster_reaction(raycluster(ready_workers=2))
