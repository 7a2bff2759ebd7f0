"""Ray Train's NCCL hang detector (NCCL RAS), where the Ray in the image has it (Ray >= 2.60; 2.58 has
not): switched on in observe mode for GPU runs, and what it stored of a confirmed hang read back for the
operator's hang forensics.

The detector runs in Ray Train's controller. Every RAY_TRAIN_NCCL_RAS_MIN_POLL_INTERVAL_S (15 s) it runs
NCCL's `ncclras -f json` on a worker; when a communicator's ranks disagree on their collective counts and none
advances for RAY_TRAIN_NCCL_RAS_CONFIRM_DURATION_S, it logs a warning and stores the polls it kept, NCCL's
text report and every rank's stack under `<run>/hang_detector/` (Ray 2.60.0,
ray/train/v2/_internal/callbacks/nccl_ras.py:781-822 handle_confirmed_hangs, 918-941 dump_ras_query_history,
998-1016 upload_diagnostics). The workers need NCCL's `ncclras` client on PATH (NCCL >= 2.28.7); without it
the detector logs once and stops (nccl_ras.py:681-689)."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from fsdp_trainer.contract import HANG_DETECTOR_DIR, NcclHangDetectorReport
from fsdp_trainer.storage import Location

# The module that honours the variables below: Ray 2.60.0's DataParallelTrainer adds its NCCLRASCallback
# when ENABLE_ENV is set (ray/train/v2/api/data_parallel_trainer.py:235-236) and the callback reads the
# others as it is made (nccl_ras.py:586-624), both in the driver's process, at fit().
DETECTOR_MODULE = "ray.train.v2._internal.callbacks.nccl_ras"
ENABLE_ENV = "RAY_TRAIN_ENABLE_NCCL_HANG_DETECTOR"
ACTION_ENV = "RAY_TRAIN_NCCL_RAS_ACTION"
CONFIRM_ENV = "RAY_TRAIN_NCCL_RAS_CONFIRM_DURATION_S"
# Observe, never fail: fail raises NCCLHangError in Ray Train's controller, whose failure policy then ends
# or retries the worker group out of the operator's sight; the operator's hang handling (every rank's stacks,
# then a restart it records) stays the one that decides. Ray's 600 s confirmation would outlast the 5-minute
# collective timeout after the first step (distributed.STEP_TIMEOUT), at which NCCL's watchdog ends the
# processes: 120 s leaves time for its stack capture (30 s at most) while the ranks are still alive.
OBSERVE = {ENABLE_ENV: "1", ACTION_ENV: "observe", CONFIRM_ENV: "120"}
RAS_DIR = "nccl_ras"  # nccl_ras.py:79 _NCCL_RAS_TOOL
TEXT_REPORT = "ncclras_report.txt"  # nccl_ras.py:938
POLL_PREFIX = "ncclras_"  # nccl_ras.py:934: ncclras_<the poll's timestamp>.json
MAX_POLL_BYTES = 4 << 20  # one `ncclras -f json` answer; a larger file is the tenant's and is left unread
REPORT_CHARS = 8000
FINDING_CHARS = 2000


def ray_has_detector() -> bool:
    """The Ray installed here has the detector's module (not a version test: a patched Ray counts too)."""
    try:
        return importlib.util.find_spec(DETECTOR_MODULE) is not None
    except ImportError:  # no ray.train.v2 at all
        return False


def ray_version() -> str:
    try:
        import ray

        return str(ray.__version__)
    except ImportError:
        return "none"


def detector_env(gpu: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What turns the detector on in observe mode, less what the run's environment sets itself; nothing on CPU
    (no NCCL) or where Ray lacks the detector."""
    if not gpu or not ray_has_detector():
        return {}
    return {key: value for key, value in OBSERVE.items() if key not in environ}


def enable(gpu: bool) -> str:
    """Sets the detector's variables in this process, the driver's, where Ray Train reads them at fit()
    (except those the run's environment sets); returns the detector's state for the driver's log."""
    os.environ.update(detector_env(gpu))
    return detector_state()


def detector_state(environ: Mapping[str, str] = os.environ) -> str:
    """The detector's state in a process whose environment the driver's settings reached."""
    if not ray_has_detector():
        return f"unavailable in Ray {ray_version()}"
    if environ.get(ENABLE_ENV, "").strip().lower() not in ("1", "true"):  # Ray's env_bool
        return "off"
    return environ.get(ACTION_ENV, "observe").strip().lower()


def findings(
    run: Location, since: dt.datetime, environ: Mapping[str, str] = os.environ
) -> NcclHangDetectorReport:
    """The detector's state, and what it stored of a hang confirmed since `since` (this worker group's start:
    an earlier hang's files stay under the prefix) under the run's prefix, each file read within a bound (the
    run's storage is the tenant's to write)."""
    state = detector_state(environ)
    where = run.child(HANG_DETECTOR_DIR, RAS_DIR)
    selector = pafs.FileSelector(where.path, allow_not_found=True)
    stored = {
        info.base_name: int(info.size)
        for info in where.fs.get_file_info(selector)
        if info.type == pafs.FileType.File and info.mtime is not None and info.mtime >= since
    }
    if not stored:
        return NcclHangDetectorReport(state=state)
    polls = sorted(name for name in stored if name.startswith(POLL_PREFIX) and name.endswith(".json"))
    last = polls[-1] if polls else None
    finding = ""
    if last is not None and stored[last] <= MAX_POLL_BYTES:
        finding = stalled_communicators(where.child(last).read_bytes().decode(errors="replace"))
    report = ""
    if TEXT_REPORT in stored:
        report = tail(where.child(TEXT_REPORT), stored[TEXT_REPORT], REPORT_CHARS)
    return NcclHangDetectorReport(
        state=state,
        confirmed=True,
        uri=run.child(HANG_DETECTOR_DIR).uri,
        finding=finding[:FINDING_CHARS],
        report=report,
    )


def tail(location: Location, size: int, chars: int) -> str:
    """The end of a text file, reading no more than `chars` * 4 bytes (UTF-8's widest character)."""
    length = min(size, chars * 4)
    [data] = location.read_ranges([(size - length, length)]) if length else [b""]
    return data.decode(errors="replace")[-chars:]


def stalled_communicators(ras_json: str) -> str:
    """From one `ncclras -f json` answer (NCCL 2.28-2.30's schema, as Ray parses it: nccl_ras.py:313-373),
    each communicator whose ranks disagree on a collective's count: the ranks behind, and the ranks NCCL RAS
    could not reach. Empty when the answer is not that schema."""
    try:
        data = json.loads(ras_json)
        lines = [line for comm in data["communicators"] if (line := _communicator(comm))]
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""
    return "; ".join(lines)


def _communicator(comm: dict[str, Any]) -> str:
    ranks = comm["ranks"]
    counts: dict[str, dict[int, int]] = {}
    for rank in ranks:
        for op, count in rank["collective_counts"].items():
            counts.setdefault(str(op), {})[int(rank["rank"])] = int(count)
    parts = []
    for op, by_rank in sorted(counts.items()):
        low, high = min(by_rank.values()), max(by_rank.values())
        if low == high:
            continue
        behind = sorted(r for r, count in by_rank.items() if count == low)
        hosts = {int(r["rank"]): f"{r.get('host', '?')} pid {r.get('pid', '?')}" for r in ranks}
        named = ", ".join(f"{r} ({hosts.get(r, '?')})" for r in behind[:8])
        parts.append(f"{op}: rank {named} at {low}, others up to {high}")
    missing = sorted(int(r["rank"]) for r in comm.get("missing_ranks") or [])
    if missing:
        parts.append(f"ranks {', '.join(map(str, missing[:8]))} unreachable by NCCL RAS")
    if not parts:
        return ""
    return f"communicator {str(comm.get('hash', '?'))[:32]}: " + ", ".join(parts)
