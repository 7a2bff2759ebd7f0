"""Actions: the side effects a pass decided, carried out after its status write recorded the intent (keep the
ended job's driver log, stop the job, delete or create the RayCluster with the guards of its dashboard, submit
the attempt), and the run's record in S3. An action that fails is remembered in the run's memory and becomes
an observation of the next pass, which decides what to do about it."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import Any, cast

import kopf

from fsdp_operator import api, builder, conditions, fabric, metrics, submission, tenancy
from fsdp_operator.context import Context
from fsdp_operator.kube import Indexes
from fsdp_operator.reconcile import Decision, DriverLog
from fsdp_trainer.contract import (
    AttemptInfo,
    RunRecord,
    TrainerConfig,
    driver_log_name,
    forensics_request_name,
)

log = logging.getLogger("fsdp_operator")
# A RayCluster this process created is not created again (Secret, NetworkPolicy, RayCluster: three 409s) by
# passes that come before the index shows it, for at most this long.
CREATED_MEMORY_SECONDS = 30.0
# Test hook: SIGKILL this process at a side-effect boundary, e.g. "after-submit" or "after-submit:2".
FAULT_POINT_ENV = "FSDP_OPERATOR_FAULT_POINT"


def act(
    ctx: Context,
    run: builder.RunRef,
    spec: api.FSDPTrainingRunSpec,
    config: TrainerConfig,
    decision: Decision,
) -> None:
    """Carries out the recorded decision; a failure is remembered for the next pass, which decides."""
    cluster_name = builder.ray_cluster_name(run.name)
    memory = ctx.runs.of(run.uid)
    if decision.keep_driver_log is not None:
        keep_driver_log(ctx, run, spec, decision.keep_driver_log)
    try:
        if decision.request_forensics is not None:
            request = decision.request_forensics
            ctx.storage(spec, run).write_text(
                forensics_request_name(request.attempt), request.model_dump_json(by_alias=True)
            )
        if decision.stop_job:
            try:
                ctx.jobs(run.namespace, cluster_name).stop(decision.stop_job)
            except Exception as error:  # a lost or unreachable head has no job left to stop for now
                log.warning(
                    "%s/%s: could not stop job %s: %s", run.namespace, run.name, decision.stop_job, error
                )
        if decision.avoid_node is not None:  # before the cluster goes: its replacement's pods avoid the node
            node = decision.avoid_node
            ctx.kube.patch_node(node.node, fabric.label_patch(node.why, node.labelled_at, run.namespace))
            metrics.NODES_LABELLED.labels(run.namespace).inc()
            log.warning(
                "%s/%s: labelled node %s %s", run.namespace, run.name, node.node, fabric.DEGRADED_LABEL
            )
        if decision.delete_cluster:
            ctx.kube.delete_raycluster(run.namespace, cluster_name, run.uid)
            memory.created = None
        attempt = decision.status.attempt
        created = memory.created
        if decision.create_cluster and not (
            created and created[1] == attempt and time.monotonic() - created[0] < CREATED_MEMORY_SECONDS
        ):
            create_cluster_guards(ctx, run)
            create_efa_claim_template(ctx, run, spec)
            ctx.kube.create_raycluster(ctx.desired_raycluster(run, spec, decision.status))
            memory.created = (time.monotonic(), attempt)
            fault_point("after-create-cluster", attempt)
        if decision.submit_attempt is not None:
            submit(ctx, run, spec, config, decision)
            fault_point("after-submit", decision.submit_attempt)
    except Exception as error:
        message = f"{type(error).__name__}: {error}"[:500]
        memory.action_error = message
        log.warning("%s/%s: action failed, the next pass decides: %s", run.namespace, run.name, message)


def keep_driver_log(ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, job: DriverLog) -> None:
    """The ended job's driver log next to its ranks' logs, before this pass may delete the cluster that has
    it; once per job. A failure is logged and tried again on the next pass while the head is there."""
    memory = ctx.runs.of(run.uid)
    if memory.archived_driver_log == job.submission_id:
        return
    try:
        text = ctx.jobs(run.namespace, builder.ray_cluster_name(run.name)).driver_log(
            job.submission_id, job.node_id
        )
        ctx.storage(spec, run).write_text(driver_log_name(job.attempt), text)
    except Exception as error:
        log.warning(
            "%s/%s: could not keep the driver log of %s: %s",
            run.namespace,
            run.name,
            job.submission_id,
            error,
        )
        return
    memory.archived_driver_log = job.submission_id


def create_cluster_guards(ctx: Context, run: builder.RunRef) -> None:
    """What keeps the run's Ray dashboard (its job API runs code) to the operator: the token Secret its pods
    read, and the NetworkPolicy. Both before the RayCluster, whose pods need the Secret to start."""
    settings = ctx.settings
    token = ctx.ray_token(run.namespace, builder.ray_cluster_name(run.name))
    if settings.ray_token_auth and token:
        ctx.kube.create_if_absent(builder.build_ray_auth_secret(run, token))
    if settings.network_policy:
        put_back = ctx.kube.put_back(ctx.network_policy(run), run.uid)
        if put_back is not None:
            identity = {"name": run.name, "namespace": run.namespace, "uid": run.uid}
            run_body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": identity}
            policy_put_back(run_body, builder.ray_cluster_name(run.name), put_back)


def create_efa_claim_template(ctx: Context, run: builder.RunRef, spec: api.FSDPTrainingRunSpec) -> None:
    """Where nodes expose EFA through DRA, the claim template the workers' pods name, before the cluster."""
    device_class = ctx.settings.efa_device_class
    if device_class is not None and builder.uses_efa(spec):
        ctx.kube.create_if_absent(builder.build_efa_claim_template(spec, run, device_class))


def restore_network_policy(
    ctx: Context, policy: Mapping[str, Any], event_type: str | None, indexes: Indexes
) -> None:
    """The NetworkPolicy of a run whose RayCluster runs keeps its dashboard (its job API runs code) to the
    operator and its pods off the instance metadata service: deleted, edited, or taken from the run (its
    owner reference removed), it is put back at once, with a Warning. Not when the run or its cluster is going
    (the garbage collector deleting it with them)."""
    meta = policy["metadata"]
    found = next(
        (
            run
            for run in indexes.all(indexes.runs)
            if run["metadata"]["namespace"] == meta["namespace"]
            and builder.ray_cluster_name(run["metadata"]["name"]) == meta["name"]
        ),
        None,
    )
    if found is None or found["metadata"].get("deletionTimestamp"):
        return
    cluster = indexes.raycluster(meta["namespace"], meta["name"])
    if cluster is None or cluster["metadata"].get("deletionTimestamp"):
        return
    run_meta = found["metadata"]
    ref = builder.RunRef(name=run_meta["name"], namespace=run_meta["namespace"], uid=run_meta["uid"])
    if event_type == "DELETED":
        ctx.kube.create_if_absent(ctx.network_policy(ref))
        policy_put_back(found, meta["name"], "it was deleted while the RayCluster runs")
        return
    put_back = ctx.kube.put_back(ctx.network_policy(ref), ref.uid, policy)
    if put_back is not None:
        policy_put_back(found, meta["name"], put_back)


def policy_put_back(run: Mapping[str, Any], name: str, why: str) -> None:
    message = f"NetworkPolicy {name}: {why}; put back as the run needs it"
    kopf.event(kopf.Body(cast(Any, run)), type="Warning", reason="NetworkPolicyRestored", message=message)
    log.warning("%s/%s: %s", run["metadata"]["namespace"], run["metadata"]["name"], message)


def fault_point(name: str, attempt: int) -> None:
    """Dies as SIGKILL would at the named boundary when the test hook asks for it (unset in production)."""
    wanted = os.environ.get(FAULT_POINT_ENV, "")
    if wanted in (name, f"{name}:{attempt}"):
        log.warning("fault point %s (attempt %s): killing the operator", name, attempt)
        os.kill(os.getpid(), signal.SIGKILL)


@metrics.SUBMISSION_DURATION.time()
def submit(
    ctx: Context,
    run: builder.RunRef,
    spec: api.FSDPTrainingRunSpec,
    config: TrainerConfig,
    decision: Decision,
) -> None:
    submission_id = decision.status.job_submission_id
    assert submission_id is not None and decision.submit_attempt is not None
    attempt = AttemptInfo(
        attempt=decision.submit_attempt,
        image_digest=decision.status.image.digest,
        trainer_package_sha256=ctx.package_sha256,
    )
    ctx.jobs(run.namespace, builder.ray_cluster_name(run.name)).submit(
        submission_id,
        submission.entrypoint(config, submission_id, attempt),
        submission.runtime_env(spec),
        metadata={"run": run.name, "namespace": run.namespace, "attempt": str(decision.submit_attempt)},
    )


def write_run_record(
    ctx: Context,
    run: builder.RunRef,
    spec: api.FSDPTrainingRunSpec,
    config: TrainerConfig,
    status: api.FSDPTrainingRunStatus,
) -> None:
    """run.json next to the checkpoints: the evidence outlives the custom resource. It keeps every restart
    (the status keeps the last few), carried over from the run.json this run wrote before. Nothing for a run
    refused its namespace's grants: its paths are what was refused, and may be another run's."""
    if status.phase in (None, api.Phase.PENDING) or refused_grants(status):
        return
    storage = ctx.storage(spec, run)
    memory = ctx.runs.of(run.uid)
    previous = memory.written_record
    try:
        if previous is not None:
            restarts = list(previous.restarts)
        else:
            restarts = storage.read_run_restarts(run.uid) or []
        restarts += [r for r in status.restarts.history if r not in restarts]
        record = RunRecord(
            run_name=run.name,
            namespace=run.namespace,
            uid=run.uid,
            image_requested=status.image.requested or ctx.requested_image(spec),
            image_digest=status.image.digest,
            trainer_package_sha256=status.record.package_sha256,
            versions=status.record.versions,
            config=config,
            phase=str(status.phase),
            start_time=status.start_time,
            completion_time=status.completion_time,
            checkpoints=list(reversed(status.checkpoints.recent)),
            restarts=restarts,
            transport=status.transport,
            fabric=status.fabric.report if status.fabric is not None else None,
            logs_uri=status.record.logs_uri,
        )
        if previous == record:
            return  # progress alone changed: run.json holds no progress, so it stays as written
        storage.write_run_record(record)
        memory.written_record = record
    except Exception as error:  # the bucket may not exist yet; the next change tries again
        # Once StorageReadable=False says so (with an Event), repeating it every pass is noise.
        readable = conditions.condition(status.conditions, conditions.STORAGE_READABLE)
        level = logging.DEBUG if readable is not None and readable.status == "False" else logging.WARNING
        log.log(level, "%s/%s: cannot write run.json to %s: %s", run.namespace, run.name, storage.uri, error)


def refused_grants(status: api.FSDPTrainingRunStatus) -> bool:
    failed = conditions.condition(status.conditions, conditions.FAILED)
    return failed is not None and failed.status == "True" and failed.reason == tenancy.NOT_ALLOWED


def delete_run(ctx: Context, body: kopf.Body) -> None:
    """Stops the job and deletes the cluster; checkpoints and run.json stay in S3. Under the run's lock and on
    the status as stored now: a pass in flight finishes first (a job it just submitted is stopped too), and
    every later pass sees the deletion and does nothing, so none can recreate the cluster."""
    meta = body["metadata"]
    cluster_name = builder.ray_cluster_name(meta["name"])
    with ctx.runs.of(meta["uid"]).lock:
        status = (ctx.kube.get_run(meta["namespace"], meta["name"]) or body).get("status") or {}
        ctx.forget(meta["uid"])
        if status.get("phase") in (api.Phase.RUNNING, api.Phase.RESTARTING) and status.get("jobSubmissionId"):
            try:
                ctx.jobs(meta["namespace"], cluster_name).stop(status["jobSubmissionId"])
            except Exception as error:  # a dead head has no job to stop; the cluster goes either way
                log.warning("%s/%s: could not stop job: %s", meta["namespace"], meta["name"], error)
        ctx.kube.delete_raycluster(meta["namespace"], cluster_name, meta["uid"])
    ctx.disruptions.forget((meta["namespace"], cluster_name))
