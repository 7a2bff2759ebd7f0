"""What the operator remembers of each run between its passes: one object per run uid, so that forgetting a
run is one removal. Nothing here is the truth about a run (the status is); it saves requests and carries an
action's failure to the next pass."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsdp_operator.cadence import Cadence
from fsdp_operator.records import RunStorage
from fsdp_trainer.contract import RunRecord

# Our own status writes are remembered this long (and the last this many versions each replaced), so that a
# pass that waited for the run's lock starts from what the pass before it stored.
WRITTEN_MEMORY_SECONDS = 60.0
WRITTEN_VERSIONS = 8
# Runs with a remembered write beyond which older writes are forgotten (a stored run each).
WRITTEN_KEPT_FREELY = 16
# A pod placed and not started has its Events read again at most this often to say which image it pulls: a
# pull of the DLC image takes minutes, and each read is a LIST the apiserver answers by scanning the
# namespace's Events (read at every pass, they were 5.8 requests per run to start at 1,000 runs).
PULL_READ_EVERY_SECONDS = 30.0

Pull = tuple[str, str] | None  # (when it began, the image) of a pull under way


@dataclass
class PullsRead:
    """The pull each waiting pod of a run was last seen doing, and when that was read (monotonic)."""

    read: dict[str, tuple[float, Pull]] = field(default_factory=dict)

    def of(self, pod: str, now: float, read: Callable[[str], Pull]) -> Pull:
        """`pod`'s pull as read within PULL_READ_EVERY_SECONDS of `now`, else `read(pod)` now (a read that
        fails raises and is not remembered). Pods not asked about for that long are forgotten."""
        seen = self.read.get(pod)
        if seen is not None and now - seen[0] < PULL_READ_EVERY_SECONDS:
            return seen[1]
        pull = read(pod)
        self.read = {p: s for p, s in self.read.items() if now - s[0] < PULL_READ_EVERY_SECONDS}
        self.read[pod] = (now, pull)
        return pull


@dataclass(frozen=True)
class Written:
    """Our last status write of a run: when, the versions our writes replaced, the run as it came back."""

    at: float
    replaced: tuple[str, ...]
    stored: dict[str, Any]


@dataclass
class RunMemory:
    """One run's memory. `lock` keeps its passes (and its deletion) one at a time in this process."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    storage: RunStorage | None = None  # its S3 prefix, with the manifests read there
    written_record: RunRecord | None = None  # run.json as last written
    archived_driver_log: str | None = None  # the last ended job whose driver log is kept in S3
    action_error: str | None = None  # why the last action failed, for the next pass to decide on
    written: Written | None = None
    created: tuple[float, int] | None = None  # when this process created its RayCluster, for which attempt
    cadence: Cadence = field(default_factory=Cadence)  # which timer ticks observe it
    figures_written_at: float | None = None  # when its progress or goodput was last written (monotonic)
    pulls: PullsRead = field(default_factory=PullsRead)  # its waiting pods' image pulls, as last read


class RunMemories:
    """Every run's memory, by uid."""

    def __init__(self) -> None:
        self._runs: dict[str, RunMemory] = {}

    def of(self, uid: str) -> RunMemory:
        found = self._runs.get(uid)
        if found is None:
            found = self._runs[uid] = RunMemory()
        return found

    def forget(self, uid: str) -> None:
        self._runs.pop(uid, None)

    def __contains__(self, uid: object) -> bool:
        return uid in self._runs

    def newest(self, run: Mapping[str, Any]) -> Mapping[str, Any]:
        """The run as our own last status write stored it, when `run` is a version that write replaced: a
        pass queued behind another (the per-run lock) holds the body of its event, which that pass's write
        made stale, and would only conflict and read the run again."""
        memory = self._runs.get(run["metadata"]["uid"])
        written = memory.written if memory is not None else None
        if written is None or run["metadata"].get("resourceVersion") not in written.replaced:
            return run
        return written.stored

    def wrote(self, uid: str, replaced: str, stored: dict[str, Any]) -> None:
        now = time.monotonic()
        memory = self.of(uid)
        before = memory.written.replaced if memory.written else ()
        memory.written = Written(now, (*before, replaced)[-WRITTEN_VERSIONS:], stored)
        # Copied first: the event loop's timer ticks add runs meanwhile (see Indexes.all).
        remembered = [m for m in list(self._runs.values()) if m.written is not None]
        if len(remembered) > WRITTEN_KEPT_FREELY:
            for other in remembered:
                if other.written is not None and now - other.written.at > WRITTEN_MEMORY_SECONDS:
                    other.written = None
