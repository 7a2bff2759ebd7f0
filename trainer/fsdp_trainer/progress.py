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
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

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
        **fields: Any,
    ) -> None:
        self._progress = run.child(PROGRESS_FILE)
        self._history_file = run.child(METRICS_DIR, f"{attempt_id}.jsonl")
        self._heartbeat_seconds = heartbeat_seconds
        self._store_interval_seconds = store_interval_seconds
        self._fields: dict[str, Any] = fields
        self._history: list[str] = []
        self._lock = threading.Condition()
        self._version = 0  # of the newest record
        self._stored_version = 0
        self._urgent_version = 0  # the version a `write` waits for
        self._last_attempt = -math.inf  # monotonic time of the last store attempt
        self._failures = 0
        self._last_error: Exception | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._store_forever, name="progress-writer", daemon=True)
        self._thread.start()

    def update(self, **fields: Any) -> ProgressRecord:
        with self._lock:
            self._fields.update(fields, updated_at=utc_now())
            record = ProgressRecord(**self._fields)
            self._history.append(record.to_json())
            self._version += 1
            self._lock.notify_all()
        return record

    def write(self, **fields: Any) -> ProgressRecord:
        """Updates, then waits until this record is stored; raises what storing it raised."""
        record = self.update(**fields)
        with self._lock:
            target, failures = self._version, self._failures
            self._urgent_version = target
            self._lock.notify_all()
            self._lock.wait_for(lambda: self._stored_version >= target or self._failures > failures)
            if self._stored_version < target and self._last_error is not None:
                raise self._last_error
        return record

    def stage(self, stage: SetupStage) -> None:
        """Announces a setup stage (phase "starting") and waits until the operator can see it."""
        log.info("setup stage: %s", stage.value)
        self.write(phase="starting", stage=stage)

    def flush_history(self) -> None:
        with self._lock:
            lines = list(self._history)
        self._history_file.write_text("".join(line + "\n" for line in lines))

    def close(self) -> None:
        """Stores what is pending (one attempt) and stops the thread."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._thread.join()

    def _store_forever(self) -> None:
        closing_attempts = 0
        while True:
            with self._lock:
                self._lock.wait_for(self._store_due, timeout=self._next_timeout())
                if self._closed and (self._version == self._stored_version or closing_attempts > 0):
                    return
                if not self._store_due():
                    continue
                closing_attempts += self._closed
                if self._version == self._stored_version:  # a heartbeat: the same record, a new time
                    self._fields["updated_at"] = utc_now()
                text = ProgressRecord(**self._fields).to_json()
                version = self._version
                self._last_attempt = time.monotonic()
            try:
                self._progress.write_text(text)
                error = None
            except Exception as store_error:  # given to the waiting writer, retried later
                log.warning("cannot store the progress record: %s", store_error)
                error = store_error
            with self._lock:
                if error is None:
                    self._stored_version = max(self._stored_version, version)
                else:
                    self._failures += 1
                    self._last_error = error
                    self._urgent_version = self._stored_version  # the waiter has its answer: no busy retry
                self._lock.notify_all()

    def _store_due(self) -> bool:
        """Called with the lock held."""
        if self._closed:
            return True
        since = time.monotonic() - self._last_attempt
        if self._version > self._stored_version:
            return self._urgent_version > self._stored_version or since >= self._store_interval_seconds
        return self._fields.get("phase") == "starting" and since >= self._heartbeat_seconds

    def _next_timeout(self) -> float | None:
        """Seconds until a store may become due without a notification (called with the lock held)."""
        since = time.monotonic() - self._last_attempt
        waits = []
        if self._version > self._stored_version:
            waits.append(self._store_interval_seconds - since)
        if self._fields.get("phase") == "starting":
            waits.append(self._heartbeat_seconds - since)
        return max(0.0, min(waits)) if waits else None


def read_progress(run: Location) -> ProgressRecord | None:
    location = run.child(PROGRESS_FILE)
    if not location.exists():
        return None
    return ProgressRecord.model_validate_json(location.read_text())
