"""The progress record the operator reads (progress.json next to the checkpoints) and its history.

Rank 0 makes a record at every setup stage, every logging interval, and at the end or failure; a
background thread stores the newest one in progress.json (at most once a second; at once for phase
changes), so storage never delays a training step. Each record also goes to the attempt's history,
metrics/<attempt>.jsonl, which is flushed at checkpoints and at the end: a crash loses at most the history
since the last checkpoint, which is also the training that will be redone.
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from fsdp_trainer.background import BackgroundStore
from fsdp_trainer.contract import METRICS_DIR, PROGRESS_FILE, ProgressRecord, SetupStage, Versions
from fsdp_trainer.storage import Location

log = logging.getLogger(__name__)


def versions() -> Versions:
    """Versions of what is importable here; missing packages (no Ray under torchrun) are left out."""
    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("ray", "torch", "transformers"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    try:
        import torch

        found["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            nccl_version: Callable[[], tuple[int, ...]] = torch.cuda.nccl.version
            found["nccl"] = ".".join(str(part) for part in nccl_version())
    except ImportError:
        pass
    return Versions(**found)


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


HEARTBEAT_SECONDS = 10.0  # the operator needs a sign of life at least every 30 s while the job sets up
STORE_INTERVAL_SECONDS = 1.0  # at most one routine store per second, whatever logEvery: a status, not a log


class ProgressWriter:
    """Rank 0's progress record and its history, stored by a background thread.

    `update` merges new fields into the current record (evaluation results, transport and the resume point
    stay until replaced) and returns at once: storage latency never delays a training step. The thread
    stores the newest record at most every `store_interval_seconds` (the history keeps every one); `write`
    stores at once and waits, for phase changes the operator must see. While the phase is "starting" the
    thread re-stores the record with a fresh updatedAt every `heartbeat_seconds`, so a long setup stage
    (named in `stage`) is not taken for a hang.
    """

    def __init__(
        self,
        run: Location,
        attempt_id: str,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        store_interval_seconds: float = STORE_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,  # the store's, for the interval and heartbeat
        **fields: Any,
    ) -> None:
        self._progress = run.child(PROGRESS_FILE)
        self._history_file = run.child(METRICS_DIR, f"{attempt_id}.jsonl")
        self._heartbeat_seconds = heartbeat_seconds
        self._fields: dict[str, Any] = fields
        self._history: list[str] = []
        self._store = BackgroundStore(
            "progress-writer",
            self._record_text,
            lambda text: self._progress.write_text(text),
            _report_store_failure,
            interval_seconds=store_interval_seconds,
            heartbeat_seconds=self._heartbeat_interval,
            clock=clock,
        )
        self._store.start()

    def update(self, **fields: Any) -> ProgressRecord:
        with self._store.lock:
            self._fields.update(fields, updated_at=utc_now())
            record = ProgressRecord(**self._fields)
            self._history.append(record.to_json())
            self._store.changed()
        return record

    def write(self, **fields: Any) -> ProgressRecord:
        """Updates, then waits until this record is stored; raises what storing it raised."""
        record = self.update(**fields)
        error = self._store.flush()
        if error is not None:
            raise error
        return record

    def stage(self, stage: SetupStage) -> None:
        """Announces a setup stage (phase "starting") and waits until the operator can see it."""
        log.info("setup stage: %s", stage.value)
        self.write(phase="starting", stage=stage)

    def flush_history(self) -> None:
        with self._store.lock:
            lines = list(self._history)
        self._history_file.write_text("".join(line + "\n" for line in lines))

    def close(self) -> None:
        """Stores what is pending (one attempt) and stops the thread."""
        self._store.close()

    def _record_text(self) -> str:
        """What the store writes (it holds the lock)."""
        if not self._store.pending:  # a heartbeat: the same record, a new time
            self._fields["updated_at"] = utc_now()
        return ProgressRecord(**self._fields).to_json()

    def _heartbeat_interval(self) -> float | None:
        return self._heartbeat_seconds if self._fields.get("phase") == "starting" else None


def _report_store_failure(error: Exception) -> None:  # the waiting writer gets the error; retried later
    log.warning("cannot store the progress record: %s", error)


def read_progress(run: Location) -> ProgressRecord | None:
    location = run.child(PROGRESS_FILE)
    if not location.exists():
        return None
    return ProgressRecord.model_validate_json(location.read_text())
