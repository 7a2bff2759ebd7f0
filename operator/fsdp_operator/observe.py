"""Observation: everything a pass reads about a run, reduced to `reconcile.Observation`. It only reads: the
watched objects from kopf's indexes, the job from the run's Ray dashboard, progress and checkpoints from S3
(each call bounded by a timeout); a read that fails is an observation too."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from fsdp_operator import api, builder, goodput, submission
from fsdp_operator.context import Context
from fsdp_operator.kube import Indexes
from fsdp_operator.kueue import WorkloadObservation, observe_workload
from fsdp_operator.reconcile import (
    ClusterObservation,
    Observation,
    OomKill,
    PodProblem,
    job_to_observe,
    needs_workload,
    observe_cluster,
    ready_for_elastic,
)
from fsdp_operator.records import RecordTooLarge, RunStorage
from fsdp_trainer.contract import CheckpointRef, RankStacks, TrainerConfig

log = logging.getLogger("fsdp_operator")
# What autoscalers say on a pod they are adding a node for (cluster-autoscaler, Karpenter), and on one they
# cannot add a node for.
AUTOSCALER_ADDING = ("TriggeredScaleUp", "Nominated")
AUTOSCALER_REFUSED = ("NotTriggerScaleUp",)
AUTOSCALER_PODS_READ = 3


def observe(
    ctx: Context,
    run: builder.RunRef,
    body: Mapping[str, Any],
    spec: api.FSDPTrainingRunSpec,
    status: api.FSDPTrainingRunStatus,
    config: TrainerConfig,
    indexes: Indexes,
) -> Observation:
    """The run's observation, without admission's verdict (the pass asks admission when it is due)."""
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    cluster_name = builder.ray_cluster_name(run.name)
    cluster = observe_raycluster(ctx, run, spec, status, indexes)
    pods = indexes.pods(run.namespace, cluster_name) if cluster is not None else []
    if cluster is not None:
        cluster = ready_for_elastic(cluster, spec, sum(1 for p in pods if not p["head"] and p.get("ready")))
    workload = observe_kueue_workload(ctx, run, indexes) if needs_workload(spec, status, cluster) else None
    active = status.phase in api.ACTIVE_PHASES  # finished, pending or suspended runs have nothing new to read
    job, dashboard_error = None, None
    watched = job_to_observe(status)
    if watched and not spec.suspend:
        try:
            job = ctx.jobs(run.namespace, cluster_name).observe(watched)
        except Exception as error:  # the head may be down, restarting or black-holed; the machine decides
            dashboard_error = f"{type(error).__name__}: {error}"[:500]
    progress, latest_fingerprint, storage_error, mlflow_run = None, None, None, None
    answered, answers = 0, None
    storage_error_reason = "StorageError"
    checkpoints: tuple[CheckpointRef, ...] = ()
    storage = ctx.storage(spec, run)
    if active:
        try:
            progress = storage.progress()
            if spec.tracking.mlflow is not None:
                mlflow_run = storage.mlflow_run()
            if forensics_pending(status):
                answered, answers = observe_forensics(storage, spec, status, now)
            stored = storage.complete_checkpoints()
            checkpoints = tuple(s.ref for s in stored)
            latest_fingerprint = stored[-1].fingerprint if stored else None
        except RecordTooLarge as error:  # the tenant's object, refused unread: its run's condition says which
            storage_error, storage_error_reason = str(error)[:1000], RecordTooLarge.reason
        except Exception as error:  # storage trouble must not stop the state machine: a condition says so
            storage_error = f"{storage.uri}: {type(error).__name__}: {error}"[:500]
    scheduling = observe_scheduling(ctx, run.namespace, pods, cluster)
    memory = ctx.runs.of(run.uid)
    return Observation(
        now=now,
        generation=body["metadata"]["generation"],
        cluster=cluster,
        job=job,
        dashboard_error=dashboard_error,
        progress=progress,
        checkpoints=checkpoints,
        latest_checkpoint_fingerprint=latest_fingerprint,
        expected_fingerprint=config.resume_fingerprint(),
        storage_read=active,
        storage_error=storage_error,
        storage_error_reason=storage_error_reason,
        pod_image_ids=tuple(i for pod in pods for i in pod["imageIds"]) if active else (),
        pod_nodes={pod["name"]: pod["node"] for pod in pods if pod.get("node")},
        pod_problems=scheduling.problems,
        unschedulable=scheduling.waiting,
        scale_up=scheduling.scale_up,
        oom_kills=tuple(
            OomKill(dt.datetime.fromisoformat(finished), message)
            for pod in pods
            for finished, message in pod.get("oomKills", [])
            if finished
        ),
        requested_image=ctx.requested_image(spec),
        submission_prefix=submission.submission_prefix(run),
        action_error=memory.action_error,
        workload=workload,
        disruption=ctx.disruption_since(run.namespace, cluster_name, status.attempt_time),
        mlflow_run=mlflow_run,
        cluster_name=cluster_name,
        run_uri=storage.uri,
        package_sha256=ctx.package_sha256,
        archived_driver_log=memory.archived_driver_log,
        created=created_at(body),
        forensics_answered=answered,
        forensics_answers=answers,
        instance_hour_price=goodput.hour_price(
            ctx.settings.instance_hour_prices,
            spec.cluster.instance_type,
            worker_capacity_types(pods, indexes),
        ),
    )


def worker_capacity_types(pods: list[dict[str, Any]], indexes: Indexes) -> list[str]:
    """spot or on-demand for each placed worker pod, from its node's labels (the operator's node index)."""
    labels = {node["metadata"]["name"]: node["metadata"]["labels"] for node in Indexes.all(indexes.nodes)}
    return [
        goodput.capacity_type(labels.get(pod["node"], {}))
        for pod in pods
        if not pod["head"] and pod.get("node")
    ]


def created_at(body: Mapping[str, Any]) -> dt.datetime | None:
    """The run's creationTimestamp (goodput counts from it); None where the body has none."""
    created = body["metadata"].get("creationTimestamp")
    return dt.datetime.fromisoformat(created) if created else None


def forensics_pending(status: api.FSDPTrainingRunStatus) -> bool:
    found = status.forensics
    return found is not None and found.attempt == status.attempt and found.concluded_at is None


def observe_forensics(
    storage: RunStorage, spec: api.FSDPTrainingRunSpec, status: api.FSDPTrainingRunStatus, now: dt.datetime
) -> tuple[int, tuple[RankStacks, ...] | None]:
    """How many ranks answered the forensics request, and their answers once all have or the wait is over
    (each answer read once, within its cap, not at every pass of the wait)."""
    found = status.forensics
    assert found is not None
    keys = storage.answered_ranks(found.attempt)
    waited = (now - found.requested_at).total_seconds() >= spec.recovery.forensics_seconds
    if not waited and len(keys) < (found.world_size or 1):
        return len(keys), None
    return len(keys), tuple(storage.rank_stacks(keys))


@dataclass(frozen=True)
class Scheduling:
    problems: tuple[PodProblem, ...]  # pods that cannot start, or that no node can be added for
    waiting: tuple[str, ...]  # pods waiting for a node, with the scheduler's (and an autoscaler's) message
    scale_up: str | None  # an autoscaler adding a node for one of them, in its words


def observe_scheduling(
    ctx: Context, namespace: str, pods: list[dict[str, Any]], cluster: ClusterObservation | None
) -> Scheduling:
    """Why the Ray pods cannot start or wait. A pod no node can take is told apart by what an autoscaler
    says in its events: adding a node (cluster-autoscaler's TriggeredScaleUp, Karpenter's Nominated) is
    waited for, up to the provisioning timeout, the head's too; unable to (NotTriggerScaleUp) is a problem,
    which fails the run after podErrorTimeoutSeconds; without an autoscaler, workers wait (a node group may
    be resized by hand) and a head is a problem."""
    waiting_pods = [pod["name"] for pod in pods if pod.get("unschedulable")]
    verdicts = autoscaler_verdicts(ctx, namespace, waiting_pods) if waiting_pods else {}
    problems, waiting, scale_up = [], [], None
    for pod in pods:
        verdict = verdicts.get(pod["name"])
        adding = verdict is not None and verdict[0] in AUTOSCALER_ADDING
        for reason, message in pod["problems"]:
            if reason == "HeadUnschedulable" and adding:
                continue
            # Workers exit while their head is down (no GCS) and loop until it is back: not a fault of theirs.
            if reason == "CrashLoopBackOff" and not pod.get("head") and not (cluster and cluster.ready):
                continue
            problems.append(PodProblem(reason, message))
        if not pod.get("unschedulable"):
            continue
        if verdict is not None and verdict[0] in AUTOSCALER_REFUSED:
            if not pod.get("head"):  # the head's HeadUnschedulable is already a problem
                problems.append(PodProblem(verdict[0], f"{pod['unschedulable']}; {verdict[0]}: {verdict[1]}"))
        elif adding or not pod.get("head"):
            waiting.append(
                pod["unschedulable"] + (f"; {verdict[0]}: {verdict[1]}" if verdict and adding else "")
            )
            if adding and verdict is not None and scale_up is None:
                scale_up = f"{verdict[0]}: {verdict[1]}"
    return Scheduling(tuple(problems), tuple(waiting), scale_up)


def autoscaler_verdicts(ctx: Context, namespace: str, pods: list[str]) -> dict[str, tuple[str, str]]:
    """Pod name -> (reason, message) of the newest autoscaler event about it, for at most
    AUTOSCALER_PODS_READ pods a pass (one bounded LIST each). A read that fails is left out: the pod waits."""
    verdicts = {}
    for pod in pods[:AUTOSCALER_PODS_READ]:
        try:
            events = ctx.kube.pod_events(namespace, pod)
        except Exception as error:
            log.warning("%s: could not read the events of pod %s: %s", namespace, pod, error)
            continue
        said = [e for e in events if e.get("reason") in (*AUTOSCALER_ADDING, *AUTOSCALER_REFUSED)]
        newest = max(said, key=_event_time, default=None)
        if newest is not None:
            verdicts[pod] = (str(newest["reason"]), str(newest.get("message") or "")[:500])
    return verdicts


def _event_time(event: dict[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event["metadata"].get("creationTimestamp")
        or ""
    )


def observe_raycluster(
    ctx: Context,
    run: builder.RunRef,
    spec: api.FSDPTrainingRunSpec,
    status: api.FSDPTrainingRunStatus,
    indexes: Indexes,
) -> ClusterObservation | None:
    raycluster = indexes.raycluster(run.namespace, builder.ray_cluster_name(run.name))
    if raycluster is None:
        return None
    owners = raycluster["metadata"].get("ownerReferences", [])
    if not any(o.get("uid") == run.uid for o in owners):
        raise kopf.PermanentError(
            f"RayCluster {raycluster['metadata']['name']} exists and is not owned by this run; "
            "rename the run or delete that RayCluster"
        )
    # Compared with what it was built from: pinning the digest after the first pull is not a change.
    built_with = (raycluster["metadata"].get("annotations") or {}).get(builder.ANNOTATION_IMAGE)
    desired = (
        ctx.raycluster(run, spec, built_with, status.zone)
        if built_with
        else ctx.desired_raycluster(run, spec, status)
    )
    return observe_cluster(raycluster, builder.cluster_drift(desired, raycluster))


def observe_kueue_workload(ctx: Context, run: builder.RunRef, indexes: Indexes) -> WorkloadObservation | None:
    raycluster = indexes.raycluster(run.namespace, builder.ray_cluster_name(run.name))
    if raycluster is None:
        return None
    try:
        found = ctx.kube.workloads(run.namespace, raycluster["metadata"]["uid"])
    except Exception as error:  # Kueue's answer only refines the message; the RayCluster's suspend decides
        log.warning("%s/%s: could not read Kueue's Workload: %s", run.namespace, run.name, error)
        return None
    newest = max(found, key=lambda w: w["metadata"].get("creationTimestamp", ""), default=None)
    return observe_workload(newest) if newest is not None else None
