"""The progress record the operator reads (progress.json next to the checkpoints) and its history.

Rank 0 rewrites progress.json at every logging interval and at start, end and failure. Each record also goes
to the attempt's history, metrics/<attempt>.jsonl, which is flushed at checkpoints and at the end: a crash
loses at most the history since the last checkpoint, which is also the training that will be redone.
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
from collections.abc import Callable
from typing import Any

from fsdp_trainer.contract import METRICS_DIR, PROGRESS_FILE, ProgressRecord, Versions
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


class ProgressWriter:
    """Keeps the current record; each write merges new fields in (evaluation results, transport and the
    resume point stay until replaced) and stores it."""

    def __init__(self, run: Location, attempt_id: str, **fields: Any) -> None:
        self._progress = run.child(PROGRESS_FILE)
        self._history_file = run.child(METRICS_DIR, f"{attempt_id}.jsonl")
        self._fields: dict[str, Any] = fields
        self._history: list[str] = []

    def write(self, **fields: Any) -> ProgressRecord:
        self._fields.update(fields, updated_at=utc_now())
        record = ProgressRecord(**self._fields)
        text = record.to_json()
        self._progress.write_text(text)
        self._history.append(text)
        return record

    def flush_history(self) -> None:
        self._history_file.write_text("".join(line + "\n" for line in self._history))


def read_progress(run: Location) -> ProgressRecord | None:
    location = run.child(PROGRESS_FILE)
    if not location.exists():
        return None
    return ProgressRecord.model_validate_json(location.read_text())
