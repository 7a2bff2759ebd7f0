"""The whole product on the local cluster: operator + KubeRay + local Ray head + local S3 + the trainer.

Each run is the CPU demo (tiny Qwen2, byte tokenizer, real text): 40 steps, a checkpoint every 10. The first
trains on two Ray Train workers, as the demo does; the rest, about what the operator does, on one (SMALL):
each worker is a process importing torch and transformers, a quarter of an attempt's CPU.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from tests.support.demo import (
    BUCKET,
    RUN_TIMEOUT,
    SMALL,
    checkpoint_steps_in_s3,
    checkpoints_at_first_restart,
    demo_manifest,
    demo_run,
    final_run_record,
    progress_record,
    run_record,
    wait_for_step,
)
from tests.support.gitops import drift, fields_others_own
from tests.support.kube import kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import example
from tests.support.mlflow import MlflowServer
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.reliability import Recorder, seconds_between
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until

EVERY_STEPS = example("cpu-demo")["spec"]["checkpoint"]["everySteps"]
# How far above the corpus's byte entropy a run that has learned the byte frequencies may end: a step's loss
# is one batch's, the eval loss two batches' (the demo on two workers, deterministic: loss 3.29, eval loss
# 3.44 at step 40; on one worker 3.04 and 3.57; one batch's loss moved 3.36 -> 3.04 between steps 34 and 40).
LOSS_NOISE = 0.3


def byte_entropy() -> float:
    """The demo corpus's byte-unigram entropy in nats (3.29): the loss, under the demo's byte tokenizer, of a
    model that has learned how often each byte occurs and nothing of the context."""
    corpus = REPO / "examples" / "data" / "stdlib-docstrings.jsonl"
    data = b"".join(json.loads(line)["text"].encode() for line in corpus.read_text().splitlines())
    counts = Counter(data)
    return -sum(n / len(data) * math.log(n / len(data)) for n in counts.values())


def test_run_goes_from_preflight_to_succeeded_with_its_record(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, tmp_path: Path
) -> None:
    name = demo_run(namespace, cleanupPolicy="KeepCluster")

    def trains_in_the_message_column() -> str | None:
        row = kubectl("get", "trainingruns", name, "-n", namespace, "--no-headers").stdout
        return row if "training, step" in row else None

    # The daily view says the run trains at its step, not the job's state when it was submitted.
    row = wait_until(
        "`kubectl get trainingruns` saying the run trains", trains_in_the_message_column, RUN_TIMEOUT
    )
    assert "is PENDING" not in row, row
    run = wait_for_phase(namespace, name, "Succeeded", timeout=RUN_TIMEOUT)
    status = run["status"]
    conditions = conditions_of(run)
    for passed in ("Preflight", "ClusterReady", "PodsHealthy", "Succeeded", "Finished"):
        assert conditions[passed]["status"] == "True", conditions[passed]
    assert conditions["JobRunning"]["status"] == "False" and conditions["JobRunning"]["reason"] == "Completed"
    # Learned at least the corpus's byte frequencies (a model that knows them scores 3.29 nats, one that knows
    # nothing ln 260 = 5.56; the bound was 5.5, which a run with a 20x smaller learning rate passes).
    progress, bound = status["progress"], byte_entropy() + LOSS_NOISE
    assert progress["step"] == 40 and progress["loss"] < bound, (progress, bound)
    assert progress["evalLoss"] is not None and progress["evalLoss"] < bound, (progress, bound)
    assert status["transport"]["observed"] == "gloo"
    assert status["attempt"] == 1 and status["restarts"]["count"] == 0
    # GitOps: after the whole life, the manifest as applied still describes the live run exactly.
    manifest = demo_manifest(name, cleanupPolicy="KeepCluster")
    assert drift(namespace, manifest, field_manager=None) == ""  # applied client-side
    assert fields_others_own(namespace, manifest, applier="kubectl-client-side-apply") == []

    # Only the operator reaches the run's dashboard: its pods read the run's token Secret, and a NetworkPolicy
    # (accepted by the apiserver) admits to them only each other; both go with the run.
    cluster = status["rayClusterName"]
    uid = run["metadata"]["uid"]
    for kind, child in (("secret", f"{cluster}-ray-auth"), ("networkpolicy", cluster)):
        owners = kubectl_json("get", kind, child, "-n", namespace)["metadata"]["ownerReferences"]
        assert [o["uid"] for o in owners] == [uid], (kind, owners)

    # Every checkpoint the status lists exists, complete, in S3.
    listed = {c["step"] for c in status["checkpoints"]["recent"]}
    assert status["checkpoints"]["latest"]["step"] == 40 and listed <= checkpoint_steps_in_s3(
        s3, namespace, name
    )

    # The digest is what the pods ran (KWOK records imageID as a kubelet would).
    pods = kubectl_json("get", "pods", "-n", namespace, "-l", f"ray.io/cluster={status['rayClusterName']}")
    image_ids = {cs["imageID"] for p in pods["items"] for cs in p["status"]["containerStatuses"]}
    assert image_ids == {status["image"]["digest"]} and status["image"]["consistent"] is True

    record = final_run_record(s3, namespace, name, "Succeeded")
    assert record.image_digest == status["image"]["digest"]
    assert record.trainer_package_sha256 == status["record"]["packageSha256"]
    # The trainer ran in the DLC's environment (the local Ray head's): its Python and torch.
    assert record.versions.torch and record.versions.torch.startswith("2.13")
    assert record.versions.python and record.versions.python.startswith("3.13")
    assert [c.step for c in record.checkpoints][-1] == 40
    assert status["record"]["exportedModelUri"] == f"s3://{BUCKET}/runs/{namespace}/{name}/model"
    # The logs outlive the cluster, where the status and run.json say.
    logs = f"s3://{BUCKET}/runs/{namespace}/{name}/logs"
    assert status["record"]["logsUri"] == record.logs_uri == logs
    assert "step 40/40" in s3_log(s3, namespace, name, "attempt-1/rank-0.log")
    assert "rank 1/2" in s3_log(s3, namespace, name, "attempt-1/rank-1.log")  # each rank's own log
    assert s3_log(s3, namespace, name, "attempt-1/driver.log")
    summary = trainingrun("describe", name, "-n", namespace)
    assert "Succeeded" in summary and status["image"]["digest"] in summary and logs in summary
    assert "step 40/40" in trainingrun("logs", name, "-n", namespace, "-f")  # ends: the run has
    trainingrun("plot", name, "-n", namespace, "-o", str(tmp_path / "loss.png"))
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def trainingrun(*args: str) -> str:
    """`kubectl trainingrun ARGS` as a user runs it: kubectl on PATH, the session's kubeconfig, S3 access."""
    path = f"{REPO / 'bin'}{os.pathsep}{os.environ['PATH']}"
    done = subprocess.run(
        [sys.executable, "-m", "kubectl_trainingrun", *args],
        env={
            **os.environ,
            "PATH": path,
            "PYTHONPATH": os.pathsep.join(
                str(REPO / folder) for folder in ("kubectl_trainingrun", "fsdp_client", "operator", "trainer")
            ),
        },
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def s3_log(s3: Any, namespace: str, name: str, log: str) -> str:
    key = f"runs/{namespace}/{name}/logs/{log}"
    return str(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read().decode())


def first_submission(namespace: str, name: str) -> str | None:
    """The first attempt's Ray job submission id, once the status records it (before the submission)."""
    status = run_of(namespace, name).get("status", {})
    return status.get("jobSubmissionId") if status.get("attempt") == 1 else None


def test_killed_job_is_resubmitted_and_resumes_from_the_latest_checkpoint(
    namespace: str,
    lifecycle_operator: OperatorProcess,
    s3: Any,
    mlflow: MlflowServer,
    tmp_path: Path,
    reliability: Recorder,
) -> None:
    # The rank dies at step 25, once; with no in-job retries the whole job fails. Checkpoints are async:
    # by step 25 the one of step 10 is complete (a save waits for the one before), that of step 20 may be.
    # Tracked in a real MLflow server, as an ML engineer would: both attempts are one MLflow run.
    fault = f"rank=0,step=25,marker={tmp_path / 'killed'}"
    experiment = f"e2e-{namespace}"
    name = demo_run(
        namespace,
        **SMALL,
        **{
            "recovery.inJobMaxFailures": 0,
            "runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": fault}},
            "tracking": {"mlflow": {"trackingUri": mlflow.url, "experimentName": experiment}},
        },
    )
    first = wait_until(
        f"run {name}'s first submission", lambda: first_submission(namespace, name), RUN_TIMEOUT
    )
    completed = checkpoints_at_first_restart(s3, namespace, name, first)
    run = wait_for_phase(namespace, name, "Succeeded", timeout=2 * RUN_TIMEOUT)
    status = run["status"]
    assert (tmp_path / "killed").exists(), "the fault was never injected"
    assert status["restarts"]["count"] == 1 and status["attempt"] == 2
    [restart] = status["restarts"]["history"]
    assert restart["reason"] in ("JobFailed", "TrainerFailed") and restart.get("resumedFromStep") in (10, 20)
    assert status["progress"]["step"] == 40
    # The trainer resumed from the latest checkpoint the dead attempt completed (the operator's record may lag
    # behind it), which is the latest complete one: nothing of the dead job saves after its only rank died.
    progress = progress_record(s3, namespace, name)
    assert completed and progress["resumedFromStep"] == max(completed), (progress, sorted(completed))
    assert progress["resumedFromStep"] >= restart["resumedFromStep"]
    # Nothing was lost: the checkpoint resumed from is still there with the later ones (keep: 3).
    assert {30, 40} <= checkpoint_steps_in_s3(s3, namespace, name)
    events = kubectl_json("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    assert "Restarting" in {e["reason"] for e in events["items"]}
    assert run_record(s3, namespace, name).restarts[0].resumed_from_step == restart["resumedFromStep"]
    # Each attempt has its own logs, the failed one's driver log too. The killed rank's process exits at once
    # (os._exit): its log holds what was stored before, at most 15 s behind.
    assert "step 40/40" in s3_log(s3, namespace, name, "attempt-2/rank-0.log")
    assert "rank 0/1" in s3_log(s3, namespace, name, "attempt-1/rank-0.log")
    assert s3_log(s3, namespace, name, "attempt-1/driver.log")
    assert "restart (from step" in trainingrun("plot", name, "-n", namespace)
    # One MLflow run for both attempts, every step in it, and the status says which run it is.
    [tracked] = mlflow.runs(experiment)
    info = tracked["info"]
    assert info["status"] == "FINISHED" and info["run_name"] == f"{namespace}/{name}"
    assert status["record"]["mlflowRun"] == {
        "trackingUri": mlflow.url,
        "experimentId": info["experiment_id"],
        "runId": info["run_id"],
        "url": f"{mlflow.url}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}",
    }
    # logEvery 2. The killed attempt's last uploads may be lost with its process (os._exit, as its log is), so
    # what is sure is every step from the resumed checkpoint on (a whole run once had none of attempt 1's).
    logged = {m["step"] for m in mlflow.history(info["run_id"], "loss")}
    resumed = restart["resumedFromStep"]
    assert set(range(resumed + 2, 41, 2)) <= logged <= set(range(2, 41, 2)), sorted(logged)
    assert {t["key"]: t["value"] for t in tracked["data"]["tags"]}["fsdp.training.dev/attempt"] == "2"
    described = trainingrun("describe", name, "-n", namespace)
    assert status["record"]["mlflowRun"]["url"] in described
    # Goodput: the run's wall time to the second, by category; the restart's time and the steps it redid are
    # not training; the cost at the operator's price for the instance type (lifecycle_env).
    goodput = status["goodput"]
    wall = seconds_between(run["metadata"]["creationTimestamp"], status["completionTime"])
    assert sum(goodput["seconds"].values()) == wall and goodput["accountedUntil"] == status["completionTime"]
    assert goodput["seconds"]["training"] > 0 and goodput["seconds"]["lostToRestarts"] > 0, goodput
    assert 0 < goodput["fraction"] < 1 and goodput["costUsd"] > 0 and goodput["progressPercent"] == 100.0
    assert "Goodput:" in described and "lostToRestarts" in described
    reliability.record(
        "A rank dies at step 25 (its process exits); no retries inside the job",
        "the job fails; resubmitted once, resumed from the latest complete checkpoint; none deleted",
        f"restart {seconds_between(tmp_path / 'killed', restart['time']):.0f} s after the death, "
        f"resumed from step {progress['resumedFromStep']}",
    )


def test_hung_job_is_stopped_after_the_hang_timeout_with_every_ranks_stacks_and_resumes(
    namespace: str,
    lifecycle_operator: OperatorProcess,
    s3: Any,
    local_cluster: LocalCluster,
    tmp_path: Path,
    reliability: Recorder,
) -> None:
    # Rank 0 of two stops making progress at step 15, its process alive (rank 1 then waits for it in a
    # collective): Ray sees a RUNNING job, so only the operator's hang timeout (60 s, the smallest allowed)
    # can end it; before it does, every rank stores what its threads are doing.
    fault = f"rank=0,step=15,marker={tmp_path / 'hung'},action=hang"
    name = demo_run(
        namespace,
        **{**SMALL, "cluster.workers": 2},
        **{"recovery.hangTimeoutSeconds": 60, "runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": fault}}},
    )
    first = wait_for_phase(namespace, name, "Running", timeout=RUN_TIMEOUT)["status"]["jobSubmissionId"]
    run = wait_for_phase(namespace, name, "Succeeded", timeout=2 * RUN_TIMEOUT)
    status = run["status"]
    assert (tmp_path / "hung").exists(), "the hang was never injected"
    hang = status["restarts"]["history"][0]
    assert hang["reason"] == "Hang" and hang["resumedFromStep"] == 10, hang
    assert progress_record(s3, namespace, name)["resumedFromStep"] == 10  # the trainer's own resume point
    assert status["progress"]["step"] == 40
    # The hung job was stopped, not left holding the workers.
    client = local_cluster.ray_jobs()
    assert str(client.get_job_status(first)) in ("STOPPED", "JobStatus.STOPPED")
    assert run_record(s3, namespace, name).restarts[0].reason == "Hang"
    # Forensics: both ranks answered before the job was stopped; rank 0, out of any collective while rank 1
    # waits in one, is named, in the status and the restart's message.
    forensics = status["forensics"]
    assert (forensics["attempt"], forensics["ranksAnswered"], forensics["worldSize"]) == (1, 2, 2), forensics
    assert (
        forensics["suspect"]["rank"] == 0
        and "while ranks 1 wait in a collective" in forensics["suspect"]["why"]
    )
    assert "suspect rank 0" in hang["message"], hang
    stored = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{namespace}/{name}/forensics/attempt-1/")
    assert {o["Key"].rpartition("/")[2] for o in stored["Contents"]} == {
        "request.json",
        "rank-0.json",
        "rank-1.json",
    }
    printed = trainingrun("forensics", name, "-n", namespace)
    assert "suspect: rank 0" in printed and "time.sleep(3600)" in printed and "=== rank 1/2" in printed
    assert "last collectives entered (torch's flight recorder)" in printed, printed[-3000:]
    collected = seconds_between(forensics["requestedAt"], forensics["concludedAt"])
    reliability.record(
        "Rank 0 of two stops making progress at step 15, every process alive (Ray reports RUNNING)",
        "every rank's stacks stored and rank 0 named before the job is stopped after the hang timeout (60 s, "
        "the least allowed); resumed from the checkpoint of step 10",
        f"stacks of 2 ranks {collected:.0f} s after the hang was declared; restart "
        f"{seconds_between(tmp_path / 'hung', hang['time']):.0f} s after the hang began, resumed from step "
        f"{hang['resumedFromStep']}",
    )


def test_cluster_lost_mid_run_is_recreated_and_training_resumes(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, reliability: Recorder
) -> None:
    name = demo_run(namespace, cleanupPolicy="KeepCluster", **SMALL, **{"training.maxSteps": 80})
    run = wait_for_step(namespace, name, 10)
    [lost] = rayclusters(namespace)
    step_at_loss = run["status"]["progress"]["step"]
    deleted = dt.datetime.now(dt.UTC)
    kubectl("delete", "raycluster", lost["metadata"]["name"], "-n", namespace, "--wait=false")
    first = run["status"]["jobSubmissionId"]
    completed = checkpoints_at_first_restart(s3, namespace, name, first)
    run = wait_for_phase(namespace, name, "Succeeded", timeout=2 * RUN_TIMEOUT)
    status = run["status"]
    [restart] = status["restarts"]["history"]
    assert restart["reason"] == "ClusterLost" and restart["resumedFromStep"] >= 10
    assert status["attempt"] == 2 and status["progress"]["step"] == 80
    # The trainer resumed from the latest checkpoint of the lost attempt, or a later one it completed before
    # it was stopped (its job ran on, on the local Ray head, until the restart stopped it).
    resumed = progress_record(s3, namespace, name)["resumedFromStep"]
    assert resumed >= max(completed), f"resumed from {resumed}; complete at the restart: {sorted(completed)}"
    [recreated] = rayclusters(namespace)
    assert recreated["metadata"]["uid"] != lost["metadata"]["uid"]
    assert recreated["metadata"]["name"] == lost["metadata"]["name"]
    # The recreated cluster runs the digest pinned from the first one.
    worker = recreated["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["image"] == status["image"]["digest"]
    reliability.record(
        "The run's RayCluster deleted by hand while it trains",
        "recreated under the same name with the pinned image digest, resumed from the latest checkpoint",
        f"restart {seconds_between(deleted, restart['time']):.0f} s after the delete, resumed from step "
        f"{resumed} (at least step {step_at_loss} reached before)",
    )


def test_permanent_error_fails_without_using_up_restarts(
    namespace: str,
    lifecycle_operator: OperatorProcess,
    local_cluster: LocalCluster,
    s3: Any,
    reliability: Recorder,
) -> None:
    name = demo_run(namespace, **SMALL, **{"data.source": f"s3://{BUCKET}/data/no-such-file.jsonl"})
    run = wait_for_phase(namespace, name, "Failed", timeout=RUN_TIMEOUT)
    failed = conditions_of(run)["Failed"]
    assert failed["reason"] == "DataError", failed
    assert "no-such-file.jsonl" in failed["message"]
    assert run["status"]["restarts"]["count"] == 0 and run["spec"]["recovery"]["maxRestarts"] == 3
    # At once: its first job's failure ends the run, with no job submitted after it.
    jobs = [j for j in local_cluster.ray_jobs().list_jobs() if (j.metadata or {}).get("run") == name]
    assert run["status"]["attempt"] == 1 and [j.submission_id for j in jobs] == [
        run["status"]["jobSubmissionId"]
    ], (run["status"], jobs)
    reliability.record(
        "The training data does not exist (a permanent error)",
        "Failed at once with reason DataError naming the file; none of the 3 restarts spent",
        f"Failed {seconds_between(run['metadata']['creationTimestamp'], failed['lastTransitionTime']):.0f} s "
        f"after creation, {run['status']['restarts']['count']} restarts",
    )


def test_retryable_failure_restarts_exactly_max_restarts_times_then_fails(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, reliability: Recorder
) -> None:
    # The rank dies at step 12 in every attempt (no marker): one restart allowed, the second failure ends it.
    fault = "rank=0,step=12"
    name = demo_run(
        namespace,
        **SMALL,
        **{
            "recovery.maxRestarts": 1,
            "recovery.inJobMaxFailures": 0,
            "runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": fault}},
        },
    )
    run = wait_for_phase(namespace, name, "Failed", timeout=2 * RUN_TIMEOUT)
    status = run["status"]
    failed = conditions_of(run)["Failed"]
    assert failed["reason"] == "RestartsExhausted", failed
    assert status["restarts"]["count"] == 1 and status["attempt"] == 2
    assert status["restarts"]["history"][0]["resumedFromStep"] == 10
    final_run_record(s3, namespace, name, "Failed")
    reliability.record(
        "A rank dies at step 12 in every attempt; maxRestarts 1",
        "exactly maxRestarts restarts, then Failed with reason RestartsExhausted",
        f"{status['restarts']['count']} restart, {status['attempt']} attempts, {failed['reason']}",
    )


def test_deleting_a_running_run_removes_cluster_and_job_and_keeps_checkpoints(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, local_cluster: LocalCluster
) -> None:
    name = demo_run(namespace, **SMALL, **{"training.maxSteps": 200})
    run = wait_for_step(namespace, name, 10)
    submission = run["status"]["jobSubmissionId"]
    kubectl("delete", "fsdptrainingrun", name, "-n", namespace, "--timeout=60s")
    wait_until("the RayCluster to be deleted", lambda: rayclusters(namespace) == [], timeout=60)
    client = local_cluster.ray_jobs()
    wait_until(
        "the Ray job to be stopped",
        lambda: str(client.get_job_status(submission)) in ("STOPPED", "JobStatus.STOPPED"),
        timeout=60,
    )
    assert checkpoint_steps_in_s3(s3, namespace, name), "deleting the run must leave its checkpoints"
    assert run_record(s3, namespace, name).run_name == name


def test_an_attempt_lost_with_an_evicted_worker_restarts_without_spending_a_restart(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, tmp_path: Path, reliability: Recorder
) -> None:
    # maxRestarts 0: a counted restart would fail the run. A worker pod is evicted through the Eviction API
    # (the apiserver marks it DisruptionTarget: EvictionByEvictionAPI, as a drain does) and, as with a lost
    # node, its rank dies: at step 30, once.
    fault = f"rank=0,step=30,marker={tmp_path / 'killed'}"
    changes = {**SMALL, "recovery.maxRestarts": 0, "recovery.inJobMaxFailures": 0}
    name = demo_run(namespace, **changes, runtimeEnv={"env": {"FSDP_TRAINER_FAULT": fault}})
    status = wait_for_step(namespace, name, 10)["status"]
    cluster, first = status["rayClusterName"], status["jobSubmissionId"]
    selector = f"ray.io/cluster={cluster},ray.io/node-type=worker"
    worker = kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"][0]["metadata"]["name"]
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": worker}}
    path = f"/api/v1/namespaces/{namespace}/pods/{worker}/eviction"
    kubectl("create", "--raw", path, "-f", "-", input=json.dumps(eviction))
    completed = checkpoints_at_first_restart(s3, namespace, name, first)

    done = wait_for_phase(namespace, name, "Succeeded", timeout=2 * RUN_TIMEOUT)
    status = done["status"]
    assert (tmp_path / "killed").exists(), "the fault was never injected"
    assert status["restarts"]["count"] == 0 and status["restarts"]["preemptions"] == 1
    assert status["attempt"] == 2 and status["progress"]["step"] == 40
    [entry] = status["restarts"]["history"]
    assert entry["reason"] == "Preempted" and "EvictionByEvictionAPI" in entry["message"], entry
    # Resumed, not started over: from the latest checkpoint the lost attempt had completed at the restart.
    resumed = progress_record(s3, namespace, name)["resumedFromStep"]
    assert completed and resumed >= max(completed), f"resumed from {resumed}; complete: {sorted(completed)}"
    reliability.record(
        "A worker pod evicted (Eviction API, as a drain does) and its rank lost; maxRestarts 0",
        "a preemption: the run resumes from its latest checkpoint without spending a restart",
        f"{status['restarts']['count']} restarts, {status['restarts']['preemptions']} preemption, "
        f"resumed from step {resumed}",
    )
