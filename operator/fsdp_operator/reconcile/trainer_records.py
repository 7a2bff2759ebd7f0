"""What the trainer and the run's records say, taken into the status in every phase (never the phase itself):
progress, checkpoints, whether storage is readable, the NCCL transport, the fabric check, a resize, where the
run's records are, and the ended job's driver log to keep.

What the trainer writes (progress.json, mlflow.json: the tenant's code writes them) enters the status
bounded: free text (a version, a transport evidence line) is cut to MAX_TRAINER_TEXT characters ending in
TRUNCATED, evidence beyond MAX_EVIDENCE_LINES lines is counted in a last line; values that are only useful
whole (the exported model's URI, the MLflow run's ids) are refused beyond their bound and left out; counts
are clamped to what the CRD's int64 holds, non-finite numbers are left out.
"""

from __future__ import annotations

import math

from fsdp_operator import api, conditions, fabric
from fsdp_operator.bounds import CONTROL_CHARACTERS, TRUNCATED, bounded_text
from fsdp_operator.builder import uses_efa
from fsdp_operator.jobs import ENDED_JOB_STATUSES
from fsdp_operator.reconcile.decision import DriverLog
from fsdp_operator.reconcile.state import RESIZED, PassState
from fsdp_trainer.contract import (
    LOGS_DIR,
    MAX_URI,
    RUN_RECORD_FILE,
    FabricReport,
    MlflowRunRef,
    ProgressRecord,
    RestartEntry,
    TrainingData,
    Transport,
    TransportReport,
    Versions,
)

RECENT_CHECKPOINTS = 5
MAX_TRAINER_TEXT = 256
MAX_EVIDENCE_LINES = 8
MAX_TRAINER_URI = MAX_URI
MAX_MLFLOW_ID = 256
MAX_COUNT = 2**63 - 1


def absorb_trainer_records(state: PassState) -> None:
    """Progress (with a resize, the transport and the fabric check it reports), checkpoints, and whether
    storage was readable."""
    obs, new = state.obs, state.new
    progress = obs.progress
    if progress is not None:
        stage = progress.stage if progress.phase == "starting" else None
        same_stage = stage is not None and stage == new.progress.stage
        new.progress = api.ProgressStatus(  # rounded: `kubectl get` prints numbers in full
            stage=stage,
            stage_since=(new.progress.stage_since if same_stage else progress.updated_at) if stage else None,
            step=_count(progress.step),
            max_steps=_count(progress.max_steps),
            loss=_round(progress.loss, 4),
            eval_loss=_round(progress.eval_loss, 4),
            eval_perplexity=_round(progress.eval_perplexity, 2),
            tokens_per_second=_round(progress.tokens_per_second, 1),
            mfu=_round(progress.mfu, 4),
            # The size that trains: a restarting group's setup heartbeats are not a resize yet.
            world_size=_count(progress.world_size)
            if progress.phase in ("training", "finished")
            else new.progress.world_size,
            non_finite_steps=_count(progress.non_finite_steps) or None,
            data_rows=_data_rows(progress.training_data) or new.progress.data_rows,
            adapter_bytes=None if progress.adapter_bytes is None else _count(progress.adapter_bytes),
            updated_at=progress.updated_at,
        )
        absorb_resize(state, new.progress.world_size)
        new.record.versions = bounded_versions(progress.versions)
        new.record.exported_model_uri = (
            _whole(progress.exported_model_uri, MAX_TRAINER_URI) or new.record.exported_model_uri
        )
        if progress.transport is not None:
            absorb_transport(state, progress)
        if progress.fabric is not None and progress.submission_id == new.job_submission_id:
            absorb_fabric(state, progress.fabric)
    if obs.checkpoints:
        new.checkpoints.latest = obs.checkpoints[-1]
        new.checkpoints.recent = list(reversed(obs.checkpoints[-RECENT_CHECKPOINTS:]))
    if obs.storage_read:
        absorb_storage(state)


def absorb_resize(state: PassState, world_size: int | None) -> None:
    """An elastic run's attempt that Ray Train resized (a node lost, or back): a history entry with the
    size it ran at until then. Not a restart: nothing is counted against maxRestarts."""
    before, progress = state.old.progress, state.obs.progress
    if (
        progress is None
        or progress.phase != "training"
        or world_size is None
        or before.world_size is None
        or world_size == before.world_size
        or progress.submission_id != state.new.job_submission_id
        or before.updated_at is None
        or state.new.attempt_time is None
        or before.updated_at < state.new.attempt_time  # the size shown was the previous attempt's
    ):
        return
    message = f"Ray Train resized the workers from {before.world_size} to {world_size} training processes"
    entry = RestartEntry(
        time=state.obs.now,
        reason=RESIZED,
        message=message,
        resumed_from_step=progress.resumed_from_step,
        world_size=before.world_size,
    )
    state.new.restarts.history = [*state.new.restarts.history, entry][-api.RESTART_HISTORY_IN_STATUS :]
    state.event(False, RESIZED, message)


def absorb_storage(state: PassState) -> None:
    error = state.obs.storage_error
    if error is None:
        state.condition(
            conditions.STORAGE_READABLE, True, "Readable", "progress and checkpoints are readable"
        )
        return
    message = f"cannot read progress and checkpoints, so hang detection waits: {error}"
    reason = state.obs.storage_error_reason
    if state.reason_of(conditions.STORAGE_READABLE) != reason or not state.condition_is(
        conditions.STORAGE_READABLE, "False"
    ):
        state.event(True, "StorageUnreadable" if reason == "StorageError" else reason, message)
    state.condition(conditions.STORAGE_READABLE, False, reason, message)


def absorb_transport(state: PassState, progress: ProgressRecord) -> None:
    assert progress.transport is not None
    state.new.transport = bounded_transport(progress.transport)
    fell_back = uses_efa(state.spec) and progress.transport.observed == Transport.SOCKET
    if fell_back:
        fallen = state.new.transport.fallback_pods
        pods = f" (on {', '.join(fallen)})" if fallen else ""
        message = f"NCCL used TCP sockets{pods} although the workers have EFA: " + "; ".join(
            state.new.transport.evidence[:2]
        )
        if not state.condition_is(conditions.TRANSPORT_DEGRADED, "True"):
            state.event(True, "TransportDegraded", message)
        state.condition(conditions.TRANSPORT_DEGRADED, True, "SocketFallback", message)
    else:
        observed = Transport(progress.transport.observed).value
        state.condition(conditions.TRANSPORT_DEGRADED, False, "AsExpected", f"NCCL transport: {observed}")


def absorb_fabric(state: PassState, report: FabricReport) -> None:
    """The attempt's fabric check: its figures in status.fabric and FabricVerified."""
    new = state.new
    avoided = new.fabric.avoided_nodes if new.fabric is not None else []
    new.fabric = api.FabricStatus(
        attempt=new.attempt, report=fabric.bounded_report(report), avoided_nodes=avoided
    )
    ok, reason, message = fabric.verdict(new.fabric.report)
    if not ok and not state.condition_is(conditions.FABRIC_VERIFIED, "False"):
        state.event(True, reason, message)
    state.condition(conditions.FABRIC_VERIFIED, ok, reason, message)


def keep_driver_log(state: PassState) -> None:
    """An ended job's driver log is kept once, under the attempt that ran it (the status as read)."""
    job = state.obs.job
    if (
        job is not None
        and job.status in ENDED_JOB_STATUSES
        and job.driver_node_id
        and job.submission_id != state.obs.archived_driver_log
    ):
        state.decision.keep_driver_log = DriverLog(job.submission_id, job.driver_node_id, state.new.attempt)


def absorb_record(state: PassState) -> None:
    """Where the run's records are, and what a submission of this pass ships."""
    new, obs = state.new, state.obs
    if obs.cluster_name is not None and (state.decision.create_cluster or obs.cluster is not None):
        new.ray_cluster_name = obs.cluster_name
    if obs.run_uri is not None:
        new.record.uri = f"{obs.run_uri}/{RUN_RECORD_FILE}"
        new.record.logs_uri = f"{obs.run_uri}/{LOGS_DIR}"
    if obs.mlflow_run is not None and mlflow_run_is_plausible(state, obs.mlflow_run):
        new.record.mlflow_run = api.MlflowRunStatus.of(obs.mlflow_run)
    if state.decision.submit_attempt is not None and obs.package_sha256 is not None:
        new.record.package_sha256 = obs.package_sha256


def mlflow_run_is_plausible(state: PassState, ref: MlflowRunRef) -> bool:
    """mlflow.json links the status to the tracking server the spec names, with ids of a sane size;
    any other (a tenant's own mlflow.json pointing elsewhere) is left out of the status."""
    mlflow = state.spec.tracking.mlflow
    return (
        mlflow is not None
        and ref.tracking_uri == mlflow.tracking_uri
        and all(_whole(v, MAX_MLFLOW_ID) for v in (ref.experiment_id, ref.run_id))
    )


def _data_rows(data: TrainingData | None) -> api.DataRowsStatus | None:
    if data is None:
        return None
    return api.DataRowsStatus(
        read=_count(data.rows),
        unparsable=_count(data.unparsable),
        truncated=_count(data.truncated),
        dropped=_count(data.dropped),
    )


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def _count(value: int) -> int:
    return min(max(value, 0), MAX_COUNT)


def _whole(value: str | None, limit: int) -> str | None:
    """A value that means something only whole: kept if within `limit` and plain, else refused (None)."""
    if value is None or len(value) > limit or CONTROL_CHARACTERS.search(value):
        return None
    return value


def bounded_versions(versions: Versions) -> Versions:
    fields = versions.model_dump()
    return Versions(**{k: None if v is None else bounded_text(v, 128) for k, v in fields.items()})


def bounded_transport(report: TransportReport) -> TransportReport:
    lines = [bounded_text(line, MAX_TRAINER_TEXT) for line in report.evidence[:MAX_EVIDENCE_LINES]]
    if len(report.evidence) > MAX_EVIDENCE_LINES:
        lines.append(f"{TRUNCATED} {len(report.evidence) - MAX_EVIDENCE_LINES} more lines")
    bandwidth = report.bus_bandwidth_gbps
    return TransportReport(
        observed=report.observed,
        evidence=lines,
        bus_bandwidth_gbps=bandwidth if bandwidth is None or math.isfinite(bandwidth) else None,
        fallback_pods=[bounded_text(pod, 253) for pod in report.fallback_pods[:MAX_EVIDENCE_LINES]],
    )
