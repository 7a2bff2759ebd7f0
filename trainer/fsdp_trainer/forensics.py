"""Hang forensics, the rank's side: a thread that watches for the operator's request (an object it writes
under the run's prefix when it declares the attempt hung, before it stops anything) and answers with every
thread's stack, where the training thread waits, the last step and the last log lines. A hung rank's
training thread sits in C (a collective, a sleep) with the GIL released, so this thread still runs; its answer
outlives the cluster."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from fsdp_trainer import hangdetector
from fsdp_trainer.contract import (
    NODE_NAME_ENV,
    CollectiveRecord,
    NcclHangDetectorReport,
    RankStacks,
    ThreadStack,
    forensics_request_name,
    rank_stacks_name,
    timeout_dump_name,
)
from fsdp_trainer.storage import Location

# How often each rank looks for a request (under Ray, rank 0 reads storage and the others the GCS); the
# operator waits a minute for every answer (recovery.forensicsSeconds).
POLL_SECONDS = 5.0
# torch's flight recorder: the last collectives of every process group, kept in memory by c10d for every
# backend (read only when the operator asks). Read by the process group as it is created, so it is set in the
# workers' environment (driver.py) and, under other launchers, before the group starts (distributed.py).
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = "2000"
COLLECTIVES_IN_ANSWER = 16
# On a collective timeout NCCL's watchdog writes its recorder to <TIMEOUT_DUMP_DIR>/rank-<rank> and ends the
# process without tearing the communicators down (which can hang): torchtitan's settings. The next attempt's
# ranks on the node upload what they find there (upload_timeout_dumps).
TIMEOUT_DUMP_DIR = Path(tempfile.gettempdir()) / "fsdp-trainer-nccl-dumps"
TIMEOUT_DUMP_SETTINGS = {
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_DUMP_TEMP_FILE": str(TIMEOUT_DUMP_DIR / "rank-"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


def flight_recorder_env() -> dict[str, str]:
    """The flight recorder's size and its dump on a timeout, except what the run's environment sets."""
    wanted = {FLIGHT_RECORDER_ENV: FLIGHT_RECORDER_ENTRIES, **TIMEOUT_DUMP_SETTINGS}
    return {key: value for key, value in wanted.items() if key not in os.environ}


def upload_timeout_dumps(run: Location, dump_dir: Path = TIMEOUT_DUMP_DIR) -> list[str]:
    """Uploads the recorder dumps a timeout left on this node to the run's forensics (timeout_dump_name),
    each by the one rank that claims it (an atomic rename: the node's other ranks skip it); returns their
    names. A dump that cannot be uploaded is put back for the next attempt."""
    uploaded = []
    for path in sorted(dump_dir.glob("rank-*")) if dump_dir.is_dir() else []:
        if CLAIMED in path.name:
            continue
        claimed = path.with_name(f"{path.name}{CLAIMED}{os.getpid()}")
        try:
            path.rename(claimed)
        except OSError:  # another rank took it
            continue
        stamp = dt.datetime.fromtimestamp(claimed.stat().st_mtime, dt.UTC).strftime("%Y%m%dT%H%M%S")
        name = timeout_dump_name(f"{socket.gethostname()}-{path.name}-{stamp}")
        try:
            run.child(name).write_bytes(claimed.read_bytes())
        except OSError as error:
            claimed.rename(path)
            sys.stderr.write(f"hang forensics: {path} not uploaded: {type(error).__name__}: {error}\n")
            continue
        claimed.unlink()
        uploaded.append(name)
    return uploaded


CLAIMED = ".claimed-by-"


class RayRelay:
    """Under Ray Train, one storage read per interval for the whole attempt rather than one per rank: rank 0
    reads the request and raises a flag in the Ray cluster's key-value store (the GCS), which the other ranks
    read instead of storage. A hang leaves every process alive, rank 0's watcher included."""

    def __init__(self, run: Location, attempt: int) -> None:
        self._key = f"fsdp-forensics:{run.uri}:attempt-{attempt}".encode()

    def raise_flag(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self._key, b"1", overwrite=True)

    def flagged(self) -> bool:
        from ray.experimental import internal_kv

        return bool(internal_kv._internal_kv_exists(self._key))


class ForensicsWatch:
    """Answers the operator's forensics request for this rank's attempt, once."""

    def __init__(
        self,
        run: Location,
        attempt: int,
        rank: int,
        world_size: int,
        step: Callable[[], int],
        recent_log: Callable[[], str],
        poll_seconds: float = POLL_SECONDS,
        relay: RayRelay | None = None,
    ) -> None:
        self._run, self._attempt, self._rank, self._world_size = run, attempt, rank, world_size
        self._step, self._recent_log, self._poll_seconds = step, recent_log, poll_seconds
        self._relay = relay  # None: every rank reads storage
        self._started = dt.datetime.now(dt.UTC)  # the worker group's start, near enough
        TIMEOUT_DUMP_DIR.mkdir(parents=True, exist_ok=True)  # NCCL writes its dump there, not creating it
        # The thread that trains: Ray Train V2 runs the loop in a thread of its own, not the main one.
        self._training = threading.get_ident()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="forensics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=30)

    def _watch(self) -> None:
        try:
            for name in upload_timeout_dumps(self._run):
                sys.stderr.write(f"hang forensics: a previous attempt's timeout dump is at {name}\n")
        except Exception as error:  # forensics must never stop training
            sys.stderr.write(f"hang forensics: timeout dumps: {type(error).__name__}: {error}\n")
        request = self._run.child(forensics_request_name(self._attempt))
        while not self._stopped.wait(self._poll_seconds):
            try:
                if not self._asked(request):
                    continue
                stacks = capture(
                    self._rank, self._world_size, self._step(), self._recent_log(), self._training
                )
                if self._rank == 0:  # one storage read for the attempt: the detector is the controller's
                    stacks.nccl_hang_detector = detector_report(self._run, self._started)
                target = self._run.child(rank_stacks_name(self._attempt, self._rank))
                target.write_text(stacks.model_dump_json(by_alias=True))
                return
            except Exception as error:  # forensics must never stop training; the next poll tries again
                sys.stderr.write(f"hang forensics of rank {self._rank}: {type(error).__name__}: {error}\n")

    def _asked(self, request: Location) -> bool:
        if self._relay is None:
            return request.exists()
        if self._rank != 0:
            return self._relay.flagged()
        if not request.exists():
            return False
        self._relay.raise_flag()
        return True


def detector_report(run: Location, since: dt.datetime) -> NcclHangDetectorReport:
    """What Ray Train's NCCL hang detector found since `since`; its state alone when its diagnostics cannot
    be read."""
    try:
        return hangdetector.findings(run, since)
    except Exception as error:  # the stacks are answered all the same
        unreadable = f"its diagnostics are unreadable: {type(error).__name__}: {error}"
        return NcclHangDetectorReport(state=hangdetector.detector_state(), finding=unreadable[:2000])


def capture(rank: int, world_size: int, step: int, recent_log: str, training: int | None) -> RankStacks:
    """Every thread's stack now, and whether the training thread waits in torch.distributed."""
    frames = sys._current_frames()
    names = {thread.ident: thread for thread in threading.enumerate()}
    threads = []
    for ident, frame in frames.items():
        thread = names.get(ident)
        threads.append(
            ThreadStack(
                name=thread.name if thread else f"thread {ident}",
                daemon=bool(thread and thread.daemon),
                stack="".join(traceback.format_stack(frame)),
            )
        )
    training_frame = frames.get(training) if training is not None else None
    top = traceback.extract_stack(training_frame)[-1] if training_frame is not None else None
    collectives = recent_collectives()
    # On NCCL the host does not wait inside torch.distributed: a healthy rank blocks in a read of a device
    # value (.item()) or a copy while its GPU waits in the collective, which only the recorder shows.
    waiting_frame = training_frame is not None and waits_in_distributed(training_frame)
    return RankStacks(
        rank=rank,
        world_size=world_size,
        pod=socket.gethostname(),
        node=os.environ.get(NODE_NAME_ENV),
        step=step,
        in_collective=waiting_frame or any(not record.completed for record in collectives),
        training_thread_top=f"{top.filename}:{top.lineno} in {top.name}" if top else "",
        threads=threads,
        recent_log=recent_log,
        collectives=collectives,
        written_at=dt.datetime.now(dt.UTC),
    )


def recent_collectives(limit: int = COLLECTIVES_IN_ANSWER) -> list[CollectiveRecord]:
    """The last `limit` collectives this process entered in each of torch's flight recorders; none when
    they are off or unreadable (forensics must answer with what it has). NCCL keeps a recorder of its own
    (the generic one never sees NCCL's collectives), whose entries its watchdog marks completed; the
    generic one records gloo's, retired once done. A group with both backends (cpu_offload) has both."""
    records: list[CollectiveRecord] = []
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        try:
            # Not in torch's type stubs: the bindings torch's own flight-recorder tools call.
            from torch._C import _distributed_c10d

            entries = json.loads(getattr(_distributed_c10d, name)(True, False)).get("entries") or []
            recorded = [
                CollectiveRecord(
                    seq=int(entry["collective_seq_id"]),
                    process_group=str((entry.get("process_group") or ["", ""])[-1])[:128],
                    op=str(entry.get("profiling_name", ""))[:128],
                    completed=entry.get("state") == "completed" or bool(entry.get("retired")),
                )
                for entry in entries
                if not entry.get("is_p2p")
            ]
            records.extend(recorded[-limit:])
        except Exception as error:
            sys.stderr.write(f"hang forensics: torch's {name} unreadable: {type(error).__name__}: {error}\n")
    return records


def waits_in_distributed(frame: FrameType) -> bool:
    """Some frame of the stack is torch.distributed's: a collective, a barrier, FSDP's gathers and reduces."""
    current: FrameType | None = frame
    while current is not None:
        if str(current.f_globals.get("__name__", "")).startswith("torch.distributed"):
            return True
        current = current.f_back
    return False
