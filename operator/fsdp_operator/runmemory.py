"""What the operator remembers of each run between its passes: one object per run uid, so that forgetting a
run is one removal. Nothing here is the truth about a run (the status is); it saves requests and carries an
action's failure to the next pass."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsdp_operator.cadence import Cadence
from fsdp_operator.records import RunStorage
from fsdp_trainer.contract import RunRecord

# The versions of a run known stale (the last this many) that a pass is moved past to our last write.
STALE_VERSIONS = 8
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
    """Our last status write of a run, kept until kopf's copy of the run shows it: the run as it came back,
    and the versions known stale by then (those our writes replaced, and those a write was refused on)."""

    stale: tuple[str, ...]
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
    refused: tuple[str, ...] = ()  # versions a status write was refused on (409) since the last write
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
        """The run as our own last status write stored it, when `run` is a version known stale: kopf's copy of
        a run (what a pass starts from) shows a write only once kopf has been through its event, minutes later
        on a busy operator (at 1,000 runs, 1,499 of 2,116 refused writes started from a version older than
        our own last write, 152 s after it at the median), and a pass from it would only be refused and read
        the run again. Once kopf's copy shows the write, or a version after it (another writer's: kopf's copy
        never goes back), the write is forgotten."""
        memory = self._runs.get(run["metadata"]["uid"])
        if memory is None or memory.written is None:
            return run
        if run["metadata"].get("resourceVersion") in memory.written.stale:
            return memory.written.stored
        memory.written = None  # kopf has caught up
        return run

    def refused(self, uid: str, version: str) -> None:
        """A status write from `version` of the run was refused (409): a pass holding it starts from our next
        write instead."""
        memory = self.of(uid)
        memory.refused = (*memory.refused, version)[-STALE_VERSIONS:]

    def wrote(self, uid: str, replaced: str, stored: dict[str, Any]) -> None:
        memory = self.of(uid)
        before = memory.written.stale if memory.written else ()
        memory.written = Written((*before, *memory.refused, replaced)[-STALE_VERSIONS:], stored)
        memory.refused = ()
