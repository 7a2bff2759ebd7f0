"""Observation: everything a pass reads about a run, reduced to `reconcile.Observation`. It only reads: the
watched objects from kopf's indexes, the job from the run's Ray dashboard, progress and checkpoints from S3
(each call bounded by a timeout); a read that fails is an observation too."""

from __future__ import annotations

import datetime as dt
import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from fsdp_operator import api, builder, fabric, goodput, instancetypes, quantity, submission
from fsdp_operator.context import Context
from fsdp_operator.kube import Indexes
from fsdp_operator.kueue import WorkloadObservation, observe_workload
from fsdp_operator.reconcile import (
    ClusterObservation,
    Observation,
    OomKill,
    PodProblem,
    PodsProgress,
    job_to_observe,
    needs_workload,
    observe_cluster,
    ready_for_a_job,
)
from fsdp_operator.records import RecordTooLarge, RunStorage
from fsdp_operator.runmemory import Pull, PullsRead
from fsdp_trainer.contract import CheckpointRef, ProgressRecord, RankStacks, SlowFabricPolicy, TrainerConfig

log = logging.getLogger("fsdp_operator")
AUTOSCALER_MESSAGE_CHARS = 600  # of an autoscaler's event message, kept in a run's status
AUTOSCALER_EVENT_REASONS = ("TriggeredScaleUp", "NotTriggerScaleUp", "Nominated", "FailedScheduling")
# Karpenter's refusal shares its reason with the scheduler's; its message says whose it is.
KARPENTER_REFUSAL = "Failed to schedule pod"
# Refusals that pass by themselves: a node group at its maximum or in backoff after a failed scale-up (EC2
# out of that type for now: p5 capacity shortages every day), a NodePool at its limits. Anything else an
# autoscaler refuses (no group or pool can make a node the pod fits on) stays refused.
PASSING_REFUSALS = (
    "max node group size reached",
    "in backoff after failed scale-up",
    "exceed limits for nodepool",
)


class Verdict(enum.Enum):
    """What an autoscaler's newest word about a waiting pod means for the run."""

    ADDING = "adding"  # a node is being added for it: wait, up to provisioningTimeoutSeconds
    DELAYED = "delayed"  # none can be added now but may be later: wait, up to provisioningTimeoutSeconds
    REFUSED = "refused"  # none of its node groups can take the pod: a problem


@dataclass(frozen=True)
class AutoscalerSaid:
    reason: str
    message: str

    @property
    def karpenter(self) -> bool:
        return self.message.startswith(KARPENTER_REFUSAL)

    @property
    def verdict(self) -> Verdict | None:
        """None for what is not an autoscaler's (the scheduler's own FailedScheduling)."""
        if self.reason in ("TriggeredScaleUp", "Nominated"):
            return Verdict.ADDING
        if self.reason != "NotTriggerScaleUp" and not (self.reason == "FailedScheduling" and self.karpenter):
            return None
        passing = any(words in self.message for words in PASSING_REFUSALS)
        return Verdict.DELAYED if passing else Verdict.REFUSED

    @property
    def short_of_resources(self) -> bool:
        """Karpenter found no instance type with room for the pod (its requests, not its selectors)."""
        return self.karpenter and "enough resources" in self.message

    @property
    def refusal_reason(self) -> str:
        """The condition reason of a refusal: Karpenter's is named for what it means, no NodePool fits."""
        return "NoNodePoolFits" if self.karpenter else self.reason

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


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
    pods = ray_pods(run, indexes) if cluster is not None else []
    if cluster is not None:
        ready_workers = sum(1 for p in pods if not p["head"] and p.get("ready"))
        cluster = ready_for_a_job(cluster, spec, status.phase, ready_workers)
    workload = observe_kueue_workload(ctx, run, indexes) if needs_workload(spec, status, cluster) else None
    active = status.phase in api.ACTIVE_PHASES  # finished, pending or suspended runs have nothing new to read
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
    memory = ctx.runs.of(run.uid)
    job, dashboard_error = None, None
    watched = job_to_observe(status)
    if watched and not spec.suspend:
        if status.phase == api.Phase.RUNNING:  # else the pass acts on the job: Ray is asked
            job = memory.cadence.job_answered_by(
                watched, progress, now, time.monotonic(), ctx.settings.observe_interval_seconds
            )
        if job is None:
            try:
                job = ctx.jobs(run.namespace, cluster_name).observe(watched)
                memory.cadence.job_asked(job, time.monotonic())
            except Exception as error:  # the head may be down, restarting or black-holed; the machine decides
                dashboard_error = f"{type(error).__name__}: {error}"[:500]
    scheduling = observe_scheduling(ctx, run.namespace, pods, cluster, spec)
    # The cluster of the next attempt on its way to ready: the first, or one recreated while Restarting.
    provisioning = cluster is not None and (
        status.phase == api.Phase.PROVISIONING or (status.phase == api.Phase.RESTARTING and not cluster.ready)
    )
    memory.cadence.observed(
        progress,
        time.monotonic(),
        ctx.settings.observe_interval_seconds,
        spec.recovery.hang_timeout_seconds,
        quiet=status.phase == api.Phase.RUNNING
        and progress is not None
        and progress.phase == "training"
        and dashboard_error is None
        and storage_error is None
        and not forensics_pending(status),
    )
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
        fabric_labels=fabric_label_budget(ctx, run, spec, progress, indexes, now),
        pod_problems=scheduling.problems,
        unschedulable=scheduling.waiting,
        scale_up=scheduling.scale_up,
        scale_up_delayed=scheduling.scale_up_delayed,
        pods_progress=observe_pods_progress(ctx, run.namespace, pods, memory.pulls) if provisioning else None,
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
        disruption=ctx.disruptions.since((run.namespace, cluster_name), status.attempt_time),
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


def ray_pods(run: builder.RunRef, indexes: Indexes) -> list[dict[str, Any]]:
    """The run's Ray pods: those its RayCluster owns, by UID. The index finds them by label, and anyone who
    may create pods in the namespace may copy labels onto a pod of their own, on any node."""
    cluster_name = builder.ray_cluster_name(run.name)
    raycluster = indexes.raycluster(run.namespace, cluster_name)
    uid = raycluster["metadata"].get("uid") if raycluster is not None else None
    return [pod for pod in indexes.pods(run.namespace, cluster_name) if uid and pod.get("owner") == uid]


def fabric_label_budget(
    ctx: Context,
    run: builder.RunRef,
    spec: api.FSDPTrainingRunSpec,
    progress: ProgressRecord | None,
    indexes: Indexes,
    now: dt.datetime,
) -> fabric.LabelBudget | None:
    """What a failed fabric check may still label (the namespace's labels counted from the nodes only when
    the progress record read this pass holds one that may label); None where the platform turned labelling
    off."""
    settings = ctx.settings
    if not settings.fabric_label_nodes:
        return None
    window = settings.fabric_label_window_seconds
    failed_check = progress is not None and progress.fabric is not None and not progress.fabric.passed
    may_label = spec.network.slow_fabric == SlowFabricPolicy.AVOID_NODE and failed_check
    since = now - dt.timedelta(seconds=window)
    labelled = fabric.labelled_by(Indexes.all(indexes.nodes), run.namespace, since) if may_label else 0
    return fabric.LabelBudget(
        settings.fabric_label_max_per_run, settings.fabric_label_max_per_namespace, window, labelled
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


def observe_pods_progress(
    ctx: Context, namespace: str, pods: list[dict[str, Any]], read: PullsRead
) -> PodsProgress:
    """How far the cluster's pods have come, with the image pulls under way (the kubelet's Pulling events,
    read only for pods on a node whose containers are not created yet: one bounded LIST each, at most every
    PULL_READ_EVERY_SECONDS)."""
    pulls: list[tuple[str, str]] = []  # (since, what)
    now = time.monotonic()

    def pull_of(pod: str) -> Pull:
        return pull_under_way(ctx.kube.pod_events(namespace, pod))

    for pod in pods:
        if not pod.get("node") or pod.get("started"):
            continue
        try:
            pull = read.of(pod["name"], now, pull_of)
        except Exception as error:
            log.warning("%s: could not read the events of pod %s: %s", namespace, pod["name"], error)
            continue
        if pull is not None:
            since, image = pull
            pulls.append((since, f"pulling image {image} on node {pod['node']}"))
    pulls.sort()
    return PodsProgress(
        pods=len(pods),
        placed=sum(1 for p in pods if p.get("node")),
        started=sum(1 for p in pods if p.get("started")),
        ready=sum(1 for p in pods if p.get("ready")),
        pulls=tuple(what for _, what in pulls),
        pulling_since=dt.datetime.fromisoformat(pulls[0][0]) if pulls and pulls[0][0] else None,
    )


def pull_under_way(events: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(when it began, the image) of the kubelet's newest Pulling event, unless Pulled or Failed followed."""
    pulling = [
        e for e in sorted(events, key=_event_time) if e.get("reason") in ("Pulling", "Pulled", "Failed")
    ]
    if not pulling or pulling[-1].get("reason") != "Pulling":
        return None
    newest = pulling[-1]
    message = str(newest.get("message") or "")
    image = message.split('"')[1] if message.count('"') >= 2 else message.removeprefix("Pulling image ")
    began = newest.get("firstTimestamp") or newest.get("eventTime") or _event_time(newest)
    return str(began), image[:200]


@dataclass(frozen=True)
class Scheduling:
    problems: tuple[PodProblem, ...]  # pods that cannot start, or that no node can be added for
    waiting: tuple[str, ...]  # pods waiting for a node, with the scheduler's (and an autoscaler's) message
    scale_up: str | None  # an autoscaler adding a node for one of them, or held back for now, in its words
    scale_up_delayed: bool = False  # held back (a group at its maximum, in backoff): none is being added


def observe_scheduling(
    ctx: Context,
    namespace: str,
    pods: list[dict[str, Any]],
    cluster: ClusterObservation | None,
    spec: api.FSDPTrainingRunSpec,
) -> Scheduling:
    """Why the Ray pods cannot start or wait. A pod no node can take is told apart by what an autoscaler
    says in its events: adding a node (cluster-autoscaler's TriggeredScaleUp, Karpenter's Nominated), or held
    back for now (a node group at its maximum or in backoff, a NodePool at its limits) is waited for, up to
    the provisioning timeout, the head's too; unable to (NotTriggerScaleUp, Karpenter's FailedScheduling) is a
    problem: Karpenter's fails the run at once (it has weighed every NodePool), cluster-autoscaler's after
    podErrorTimeoutSeconds; without an autoscaler, workers wait (a node group may be resized by hand) and a
    head is a problem. A worker's crash loop is its own only while its head is up (without GCS workers exit
    and loop until it is back)."""
    head_first = sorted(pods, key=lambda pod: not pod.get("head"))
    waiting_pods = pods_to_ask_about(pods)
    said = autoscaler_said(ctx, namespace, waiting_pods) if waiting_pods else {}
    return scheduling_of(head_first, said, cluster, disk_advice(spec))


def pods_to_ask_about(pods: list[dict[str, Any]]) -> list[str]:
    """Every waiting pod whose events say what an autoscaler does for it, the head first: the pod index lists
    pods in whatever order it was rebuilt (by name after an operator restart: workers before the head)."""
    return [
        pod["name"] for pod in sorted(pods, key=lambda pod: not pod.get("head")) if pod.get("unschedulable")
    ]


def disk_advice(spec: api.FSDPTrainingRunSpec) -> str:
    """What to change when Karpenter finds no node for a worker whose disk request is over what its default
    root volume leaves pods: it sizes a node's disk from the EC2NodeClass, not from the pods."""
    asked = quantity.whole(spec.worker_ephemeral_storage())
    usable = (instancetypes.DEFAULT_ROOT_VOLUME_GIB - instancetypes.ROOT_VOLUME_NOT_FOR_PODS_GIB) * 2**30
    if asked <= usable:
        return ""
    needed = -(-asked // 2**30) + instancetypes.ROOT_VOLUME_NOT_FOR_PODS_GIB
    return (
        f"; each worker requests {spec.worker_ephemeral_storage()} of ephemeral-storage, more than "
        f"Karpenter's default {instancetypes.DEFAULT_ROOT_VOLUME_GIB} GiB root volume leaves pods: give the "
        f"NodePool's EC2NodeClass a root volume of at least {needed} GiB (spec.blockDeviceMappings, "
        "deviceName /dev/xvda, ebs.volumeSize), or lower spec.cluster.ephemeralStorage"
    )


def scheduling_of(
    pods: list[dict[str, Any]],
    said: Mapping[str, AutoscalerSaid],
    cluster: ClusterObservation | None,
    advice: str = "",
) -> Scheduling:
    """observe_scheduling's verdict from the pods (head first) and what autoscalers said of them; advice
    follows a refusal of Karpenter's for want of resources."""
    head_up = any(pod.get("head") and pod.get("ready") for pod in pods) or bool(cluster and cluster.ready)
    problems, waiting, scale_up, delayed = [], [], None, False
    for pod in pods:
        words = said.get(pod["name"])
        verdict = words.verdict if words is not None else None
        waits = verdict in (Verdict.ADDING, Verdict.DELAYED)
        for reason, message in pod["problems"]:
            if reason == "HeadUnschedulable" and (waits or verdict == Verdict.REFUSED):
                continue  # the autoscaler's words say more
            if reason == "CrashLoopBackOff" and not pod.get("head") and not head_up:
                continue
            problems.append(PodProblem(reason, message))
        if not pod.get("unschedulable"):
            continue
        if words is not None and verdict == Verdict.REFUSED:
            problems.append(
                PodProblem(
                    words.refusal_reason,
                    # Karpenter's words say all the scheduler's do, and the requests it could not fit.
                    (f"pod {pod['name']}: {words}" if words.karpenter else f"{pod['unschedulable']}; {words}")
                    + (advice if words.short_of_resources and not pod.get("head") else ""),
                    at_once=words.karpenter,
                )
            )
        elif waits or not pod.get("head"):
            waiting.append(pod["unschedulable"] + (f"; {words}" if words is not None and waits else ""))
            if words is not None and waits and (scale_up is None or (delayed and verdict == Verdict.ADDING)):
                scale_up, delayed = str(words), verdict == Verdict.DELAYED
    return Scheduling(tuple(problems), tuple(waiting), scale_up, delayed)


def autoscaler_said(ctx: Context, namespace: str, pods: list[str]) -> dict[str, AutoscalerSaid]:
    """Pod name -> the newest autoscaler event about it, for every waiting pod of the run (one bounded LIST
    each, the head's first). A read that fails is left out: the pod waits."""
    found = {}
    for pod in pods:
        try:
            events = ctx.kube.pod_events(namespace, pod)
        except Exception as error:
            log.warning("%s: could not read the events of pod %s: %s", namespace, pod, error)
            continue
        newest = newest_autoscaler_word(events)
        if newest is not None:
            found[pod] = newest
    return found


def newest_autoscaler_word(events: list[dict[str, Any]]) -> AutoscalerSaid | None:
    """The newest of the events that are an autoscaler's (the scheduler's FailedScheduling is not)."""
    heard = [
        AutoscalerSaid(str(e["reason"]), ends_kept(str(e.get("message") or ""), AUTOSCALER_MESSAGE_CHARS))
        for e in sorted(events, key=_event_time)
        if e.get("reason") in AUTOSCALER_EVENT_REASONS
    ]
    return next((h for h in reversed(heard) if h.verdict is not None), None)


def ends_kept(text: str, limit: int) -> str:
    """At most limit characters, its middle cut: Karpenter names the NodePool's requirements first and the
    pod's requests (what to lower) last."""
    if len(text) <= limit:
        return text
    head = (limit - 5) * 2 // 5
    return f"{text[:head]} ... {text[len(text) - (limit - 5 - head) :]}"


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
        ctx.raycluster(run, spec, built_with, status)
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
