"""Checkpoints: DCP shards of model + optimizer, with scheduler, data position and step, per-rank RNG files,
and our manifest, which is written last and makes a checkpoint usable.

Saving (CheckpointSaver): the state is staged into host memory while training waits; writing the DCP shards,
uploading them into `<run prefix>/<name>/`, and the manifest follow in the background. Rank 0 writes the
manifest only once every rank's files are in storage at their sizes; a crash anywhere before that leaves a
checkpoint without a manifest, which resumption never picks. Checkpoints are not reported to Ray Train:
resumption scans storage, and `prune` keeps the newest `keep` complete ones.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.contract import MANIFEST_FILE, CheckpointManifest, Versions, checkpoint_is_complete
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.storage import Location, node_local_copy

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint_"
RESUME_AUTO = "auto"
RESUME_NEVER = "never"


def checkpoint_name(step: int, attempt_id: str) -> str:
    """Sorts by step; the attempt id keeps a step re-saved after a restart from reusing a directory."""
    return f"{CHECKPOINT_PREFIX}{step:08d}_{attempt_id}"


@dataclass
class TrainState:
    """The loop's own position, saved with the shards (the data position is the batch loader's)."""

    step: int = 0
    tokens_seen: int = 0


class AppState(Stateful):
    """DCP's Stateful pattern: get_state_dict/set_state_dict handle sharded model and optimizer state and
    reshard on load, so a run may resume on a different number of workers. The batch loader's state (data
    position and stream cursors, see data.py) is saved beside the loop's position, in the "train" entry
    where checkpoints have always kept the data position, so older checkpoints of synthetic data load."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        train: TrainState,
        batches: Stateful | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.train = model, optimizer, scheduler, train
        self.batches = batches

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        batches = {} if self.batches is None else self.batches.state_dict()
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "train": {**asdict(self.train), **batches},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores weights, optimizer moments, schedule position and loop position. Hyperparameters come
        from this run's configuration, not the checkpoint: a learning rate or weight decay changed between
        submissions applies from the first resumed step."""
        configured = [
            {key: value for key, value in group.items() if key != "params"}
            for group in self.optimizer.param_groups
        ]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )
        self.scheduler.load_state_dict(state_dict["scheduler"])
        for group, settings in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(settings)
        scheduler = self.scheduler
        scheduler.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        for group, factor in zip(self.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # get_last_lr() reads it
        train = dict(state_dict["train"])
        for name in asdict(self.train):
            setattr(self.train, name, train.pop(name))
        if self.batches is not None:
            self.batches.load_state_dict(train)


# ----------------------------------------------------------------------------------------------------------
# RNG: per rank, outside DCP, because a different world size has different ranks


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def save_rng(directory: str, rank: int) -> None:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    torch.save(state, os.path.join(directory, _rng_file(rank)))


def load_rng(directory: str, rank: int, reseed: int) -> bool:
    """Restores this rank's generators; when the checkpoint has no file for this rank (it was saved on
    fewer workers), seeds them from `reseed` instead and says so."""
    path = os.path.join(directory, _rng_file(rank))
    if not os.path.exists(path):
        torch.manual_seed(reseed)
        random.seed(reseed)
        return False
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


# ----------------------------------------------------------------------------------------------------------
# Choosing the checkpoint to resume from (pure given the listings)


@dataclass(frozen=True)
class Candidate:
    location: Location
    manifest: CheckpointManifest | None
    listing: dict[str, int]

    @property
    def complete(self) -> bool:
        return checkpoint_is_complete(self.manifest, self.listing)


def inspect(location: Location) -> Candidate:
    """A checkpoint directory as storage holds it. A manifest that cannot be read right now (OSError: S3
    unreachable) raises: taken as missing, it would make a complete checkpoint look partial, to be skipped by
    resumption and deleted by pruning. One that is not a valid manifest is broken for good: no manifest."""
    listing = location.list_files()
    manifest = None
    if MANIFEST_FILE in listing:
        text = location.child(MANIFEST_FILE).read_text()
        try:
            manifest = CheckpointManifest.model_validate_json(text)
        except ValidationError as error:
            log.warning("invalid manifest in %s: %s", location.uri, error)
    return Candidate(location, manifest, listing)


def complete_oldest_first(candidates: list[Candidate], submission_id: str | None = None) -> list[Candidate]:
    """The complete checkpoints by step (then time), optionally only those written by one submission."""
    usable = [
        (candidate.manifest.step, candidate.manifest.created_at, index, candidate)
        for index, candidate in enumerate(candidates)
        if candidate.manifest is not None
        and candidate.complete
        and (submission_id is None or candidate.manifest.submission_id == submission_id)
    ]
    return [candidate for *_, candidate in sorted(usable)]


def newest_complete(candidates: list[Candidate], submission_id: str | None = None) -> Candidate | None:
    complete = complete_oldest_first(candidates, submission_id)
    return complete[-1] if complete else None


def run_checkpoints(run: Location) -> list[Candidate]:
    return [inspect(d) for d in run.list_dirs() if d.name.startswith(CHECKPOINT_PREFIX)]


def find_resume_point(
    run: Location, resume: str, submission_id: str, fingerprint: str, data_fingerprint: str | None = None
) -> Candidate | None:
    """Where to start: this run's newest complete checkpoint in storage; with resume=never only checkpoints
    of this submission count (in-job retries); failing those, an explicit resume URI, which must be complete.

    A checkpoint of the run's own prefix is used only when its manifest carries `fingerprint` (the run's
    TrainerConfig.resume_fingerprint()): another model, data or seed under the same prefix is a ConfigError,
    never a silent resume into the wrong run; likewise `data_fingerprint` (when given), because a changed
    corpus or tokenizer under the same URI would make the saved data position point at other samples. An
    explicit URI is the user's deliberate choice and exempt."""
    own_only = submission_id if resume == RESUME_NEVER else None
    candidates = run_checkpoints(run)
    found = newest_complete(candidates, own_only)
    if found is not None:
        require_fingerprint(run, found, fingerprint)
        require_data_fingerprint(run, found, data_fingerprint)
        return found
    if resume in (RESUME_AUTO, RESUME_NEVER):
        return None
    explicit = inspect(Location.parse(resume))
    if not explicit.complete:
        raise ConfigError(
            f"checkpoint.resume {resume} is not a complete checkpoint (no manifest or missing files)"
        )
    return explicit


def require_fingerprint(run: Location, found: Candidate, fingerprint: str) -> None:
    theirs = None if found.manifest is None else found.manifest.fingerprint
    if theirs != fingerprint:
        raise ConfigError(
            f"{run.uri} holds checkpoints of another configuration: the newest complete one, "
            f"{found.location.name}, has resume fingerprint {theirs or 'none (written before fingerprints)'} "
            f"but this run's is {fingerprint} (model, tokenizer, sequence length, data or seed differ); "
            "refusing to load it. Use a new run name or storage path, or delete those checkpoints."
        )


def require_data_fingerprint(run: Location, found: Candidate, data_fingerprint: str | None) -> None:
    theirs = None if found.manifest is None else found.manifest.data_fingerprint
    if data_fingerprint is not None and theirs != data_fingerprint:
        raise ConfigError(
            f"the training data changed since {run.uri}/{found.location.name} was written: its data "
            f"fingerprint is {theirs or 'none'}, the data now gives {data_fingerprint} (a changed corpus or "
            "tokenizer), so its saved position would resume at other samples; refusing to load it. Restore "
            "the data, or use a new run name or storage path."
        )


def prune(run: Location, keep: int) -> None:
    """Keeps the newest `keep` complete checkpoints and deletes the rest, plus incomplete leftovers older
    than the newest complete one; for launches without Ray, whose CheckpointConfig does this otherwise."""
    candidates = run_checkpoints(run)
    complete = complete_oldest_first(candidates)
    if not complete:
        return
    kept = {c.location.uri for c in complete[-keep:]}
    newest = complete[-1].location.name
    doomed = [
        c for c in candidates if c.location.uri not in kept and (c.complete or c.location.name < newest)
    ]
    for candidate in doomed:
        log.info("deleting checkpoint %s (keep %d)", candidate.location.uri, keep)
        candidate.location.delete_dir()


# ----------------------------------------------------------------------------------------------------------
# Saving and loading


@dataclass(frozen=True)
class SaveIdentity:
    """What every manifest of this attempt records besides the step."""

    run_name: str
    submission_id: str
    fingerprint: str
    data_fingerprint: str
    world_size: int
    versions: Versions


@dataclass(frozen=True)
class SaveResult:
    """One finished save: rank 0's manifest (None on other ranks) and how long training was blocked."""

    manifest: CheckpointManifest | None
    blocked_seconds: float


class CheckpointSaver:
    """Saves checkpoints with the training step blocked only while the state is copied off the device.

    `start` stages model, optimizer, scheduler and loop position into host memory (DCP's DefaultStager, pinned
    on CUDA, reused between saves) and returns; a background thread then writes the DCP shards to local disk
    (`dcp.save`), uploads this rank's files, and gathers every rank's file list, which also tells rank 0 that
    every rank's files are in storage. Rank 0 then checks storage holds every file at its size, writes the
    manifest last, prunes, and tells the other ranks. A crash before the manifest leaves a checkpoint that
    resumption never picks (a crash while a save is in flight resumes from the checkpoint before it).

    The background collectives run on a gloo group of their own, so they never interleave with training's.
    At most one save is in flight: `start` and `wait` first finish the previous one.
    """

    def __init__(
        self,
        run: Location,
        identity: SaveIdentity,
        rank: int,
        keep: int,
        device: torch.device,
        asynchronous: bool = True,
    ) -> None:
        self.run, self.identity, self.rank, self.keep = run, identity, rank, keep
        self.asynchronous = asynchronous
        self.group = dist.new_group(backend="gloo")  # a collective: every rank builds it at the same point
        on_cuda = device.type == "cuda"
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=on_cuda,
                use_shared_memory=False,
                use_async_staging=False,  # staging is the part training waits for, by design
                use_non_blocking_copy=False,
            )
        )
        self._pending: _BackgroundSave | None = None

    def start(self, app_state: AppState, name: str, loss: float | None) -> float:
        """Begins a save of the current state; returns the seconds training was blocked (including waiting
        for the previous save, and the whole save when not asynchronous)."""
        started = time.perf_counter()
        self.wait()
        local_dir = tempfile.mkdtemp(prefix="fsdp-checkpoint-")
        save_rng(local_dir, self.rank)
        staged = self.stager.stage({"app": app_state.state_dict()})
        if isinstance(staged, Future):  # only with use_async_staging, which this stager does not use
            staged = staged.result()
        train = app_state.train
        manifest = CheckpointManifest(
            run_name=self.identity.run_name,
            step=train.step,
            loss=loss,
            tokens_seen=train.tokens_seen,
            world_size=self.identity.world_size,
            created_at=dt.datetime.now(dt.UTC),
            versions=self.identity.versions,
            files={},
            submission_id=self.identity.submission_id,
            fingerprint=self.identity.fingerprint,
            data_fingerprint=self.identity.data_fingerprint,
        )
        self._pending = _BackgroundSave(lambda: self._complete(staged, local_dir, name, manifest))
        if not self.asynchronous:
            self.wait()
        return time.perf_counter() - started

    def wait(self) -> SaveResult | None:
        """Finishes the save in flight (if any): when it returns, on any rank, the checkpoint is complete
        (manifest written). Raises what the save raised."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        started = time.perf_counter()
        manifest = pending.result()
        return SaveResult(manifest, time.perf_counter() - started)

    def close(self) -> None:
        self.stager.close()

    def _complete(
        self, staged: dict[str, Any], local_dir: str, name: str, manifest: CheckpointManifest
    ) -> CheckpointManifest | None:
        location = self.run.child(name)
        try:
            failure: str | None = None
            local_files: dict[str, int] = {}
            try:
                started = time.perf_counter()
                # Not synced to disk: the local files are a staging copy the upload reads back at once, and
                # the checkpoint is durable only once storage holds it.
                writer = FileSystemWriter(local_dir, sync_files=False)
                dcp_save(staged, storage_writer=writer, process_group=self.group)
                written = time.perf_counter()
                local_files = {e.name: e.stat().st_size for e in os.scandir(local_dir) if e.is_file()}
                location.upload_from(local_dir)
                log.info(
                    "checkpoint step %d, rank %d: %d bytes written locally in %.2f s, uploaded in %.2f s",
                    manifest.step,
                    self.rank,
                    sum(local_files.values()),
                    written - started,
                    time.perf_counter() - written,
                )
            except Exception as error:  # every rank must still reach the gather below, or the others hang
                failure = f"rank {self.rank}: {type(error).__name__}: {error}"
            gathered: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, (local_files, failure), group=self.group)
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        failures = [failed for _, failed in gathered if failed]
        if failures:
            raise OSError(f"checkpoint {location.uri} failed: {'; '.join(failures)}")
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome[0] = self._finalise(location, manifest, gathered)
            except Exception as error:  # the other ranks wait for the outcome below
                outcome[0] = f"{type(error).__name__}: {error}"
        # Every rank learns that the manifest is written, so wait() anywhere means "complete".
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if isinstance(outcome[0], str):
            raise OSError(f"checkpoint {location.uri} failed: {outcome[0]}")
        return outcome[0] if self.rank == 0 else None

    def _finalise(
        self, location: Location, manifest: CheckpointManifest, gathered: list[Any]
    ) -> CheckpointManifest:
        """Rank 0: every file in storage at its size, then the manifest, then pruning."""
        all_files = {file: size for files, _ in gathered for file, size in files.items()}
        stored = location.list_files()
        missing = {file: size for file, size in all_files.items() if stored.get(file) != size}
        if missing:
            raise OSError(f"missing or wrong sizes in storage for {sorted(missing)}")
        manifest = manifest.model_copy(update={"files": all_files})
        location.child(MANIFEST_FILE).write_text(manifest.to_json())
        size = sum(all_files.values())
        log.info("checkpoint step %d complete at %s (%d bytes)", manifest.step, location.uri, size)
        try:
            prune(self.run, self.keep)
        except OSError as error:  # the checkpoint is complete; old ones go at the next save's pruning
            log.warning("pruning %s after step %d failed: %s", self.run.uri, manifest.step, error)
        return manifest


class _BackgroundSave:
    """A daemon thread and its outcome: a save stuck in a collective with a dead peer must not keep the
    process from exiting (concurrent.futures' workers are joined at exit)."""

    def __init__(self, work: Callable[[], CheckpointManifest | None]) -> None:
        self._work = work
        self._manifest: CheckpointManifest | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-save", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._manifest = self._work()
        except BaseException as error:  # handed to the training thread by result()
            self._error = error

    def result(self) -> CheckpointManifest | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._manifest


def load(
    checkpoint: Location,
    app_state: AppState,
    rank: int,
    local_rank: int,
    reseed: int,
    barrier: Callable[[], None],
) -> bool:
    """Loads a complete checkpoint, resharding onto this world size; returns whether this rank's RNG state
    was in it. The checkpoint is copied to each node once and removed after loading."""
    local_dir = node_local_copy(checkpoint.uri, local_rank, barrier)
    dcp_load({"app": app_state}, checkpoint_id=local_dir)
    restored = load_rng(local_dir, rank, reseed)
    barrier()
    if local_rank == 0:
        shutil.rmtree(local_dir, ignore_errors=True)
    return restored
