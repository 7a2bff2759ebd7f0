"""Failure classification and restart backoff (pure).

A failure that will fail again with the same input (invalid config, a trainer that cannot import, out of
memory before the first step) stops the run with its reason instead of burning every restart.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from fsdp_trainer.contract import PERMANENT_ERROR_KINDS, ErrorKind, ProgressRecord

MAX_BACKOFF_SECONDS = 3600

# Driver-log signatures of failures that no restart can fix: (pattern, reason).
PERMANENT_LOG_SIGNATURES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"invalid configuration \(error kind config\)"), "InvalidConfig"),
    # The trainer's first act (fsdp_trainer.access); a pod with no S3 access cannot write its progress record.
    (re.compile(r"storage access refused \(error kind storage-access\)"), "StorageAccessDenied"),
    (re.compile(r"\b(ModuleNotFoundError|ImportError|SyntaxError)\b"), "ImportError"),
    (
        re.compile(r"runtime_env setup failed|Failed to set up runtime environment", re.I),
        "RuntimeEnvSetupFailed",
    ),
]
REASON_BY_KIND = {
    ErrorKind.CONFIG: "InvalidConfig",
    ErrorKind.DATA: "DataError",
    ErrorKind.MODEL: "ModelError",
    ErrorKind.OOM: "OutOfMemory",
    ErrorKind.TRANSPORT: "TransportPolicyViolated",
    ErrorKind.NON_FINITE_LOSS: "NonFiniteLoss",
    ErrorKind.FABRIC: "FabricBelowThreshold",
    ErrorKind.STORAGE_ACCESS: "StorageAccessDenied",
}


@dataclass(frozen=True)
class Failure:
    permanent: bool
    reason: str
    message: str


def classify(
    job_message: str, logs_tail: str, progress: ProgressRecord | None, attempt_started: dt.datetime | None
) -> Failure:
    """Why this attempt failed, from the trainer's own verdict when it wrote one, else the driver's log."""
    current = (
        progress if progress and (attempt_started is None or progress.updated_at >= attempt_started) else None
    )
    if current is not None and current.phase == "failed" and current.error_kind is not None:
        kind = ErrorKind(current.error_kind)
        message = current.error or job_message
        if kind == ErrorKind.OOM and current.step > (current.resumed_from_step or 0):
            # It trained for a while first: memory pressure that a restart may not meet again.
            return Failure(False, "OutOfMemoryAfterProgress", message)
        if kind in PERMANENT_ERROR_KINDS:
            return Failure(True, REASON_BY_KIND[kind], message)
        return Failure(False, "TrainerFailed", message)
    for pattern, reason in PERMANENT_LOG_SIGNATURES:
        match = pattern.search(logs_tail) or pattern.search(job_message)
        if match:
            line = next((ln for ln in logs_tail.splitlines() if pattern.search(ln)), job_message)
            return Failure(True, reason, line.strip()[:500])
    last_line = next(iter(reversed(logs_tail.strip().splitlines())), "")
    return Failure(False, "JobFailed", (job_message or last_line)[:500])


def backoff_seconds(base: int, restarts_so_far: int) -> int:
    return int(min(base * 2**restarts_so_far, MAX_BACKOFF_SECONDS))
