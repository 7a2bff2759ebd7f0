"""Checkpoints: DCP shards of model + optimizer, with scheduler, data position and step, per-rank RNG files,
and our manifest, which is written last and makes a checkpoint usable.

Saving: every rank `dcp.save`s into a fresh local directory; the directories are persisted side by side into
`<storage>/<run>/<name>/` (through `ray.train.report` under Ray, so Ray's CheckpointConfig keeps K); once
every rank has persisted, rank 0 checks that storage holds every file at its size and writes the manifest.
A crash anywhere before that leaves a checkpoint without a manifest, which resumption never picks.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from pydantic import ValidationError
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
    """The loop's own position, saved with the shards."""

    step: int = 0
    data_position: int = 0  # global samples consumed (see data.py)
    tokens_seen: int = 0


class AppState(Stateful):
    """DCP's Stateful pattern: get_state_dict/set_state_dict handle sharded model and optimizer state and
    reshard on load, so a run may resume on a different number of workers."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        train: TrainState,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.train = model, optimizer, scheduler, train

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "train": asdict(self.train),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )
        self.scheduler.load_state_dict(state_dict["scheduler"])
        for key, value in state_dict["train"].items():
            setattr(self.train, key, value)


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
    listing = location.list_files()
    manifest = None
    if MANIFEST_FILE in listing:
        try:
            manifest = CheckpointManifest.model_validate_json(location.child(MANIFEST_FILE).read_text())
        except (ValidationError, OSError) as error:
            log.warning("unreadable manifest in %s: %s", location.uri, error)
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
    run: Location, resume: str, submission_id: str, fingerprint: str, latest_reported: Location | None
) -> Candidate | None:
    """Where to start: this run's newest complete checkpoint, from a scan of the run directory plus Ray's
    latest reported one (a job stopped mid-report can leave a newer complete checkpoint that Ray never
    registered, and Ray's latest may be incomplete); with resume=never only checkpoints of this submission
    count (in-job retries); failing those, an explicit resume URI, which must be complete.

    A checkpoint of the run's own prefix is used only when its manifest carries `fingerprint` (the run's
    TrainerConfig.resume_fingerprint()): another model, data or seed under the same prefix is a ConfigError,
    never a silent resume into the wrong run. An explicit URI is the user's deliberate choice and exempt."""
    own_only = submission_id if resume == RESUME_NEVER else None
    candidates = run_checkpoints(run)
    if latest_reported is not None and all(c.location.uri != latest_reported.uri for c in candidates):
        candidates.append(inspect(latest_reported))
    found = newest_complete(candidates, own_only)
    if found is not None:
        require_fingerprint(run, found, fingerprint)
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


class Persist(Protocol):
    """Puts one rank's local checkpoint directory into storage under the given name (a collective)."""

    def __call__(self, local_dir: str, name: str, metrics: dict[str, Any]) -> None: ...


def ray_persist(local_dir: str, name: str, metrics: dict[str, Any]) -> None:
    """Ray Train uploads each rank's directory into the same checkpoint and tracks it (keep K, resume)."""
    import ray.train

    ray.train.report(
        metrics, checkpoint=ray.train.Checkpoint.from_directory(local_dir), checkpoint_dir_name=name
    )


def direct_persist(run: Location) -> Persist:
    """Without Ray (torchrun): every rank copies its files into the checkpoint directory itself."""

    def persist(local_dir: str, name: str, metrics: dict[str, Any]) -> None:
        run.child(name).upload_from(local_dir)

    return persist


@dataclass
class SaveContext:
    run: Location
    run_name: str
    submission_id: str
    fingerprint: str
    rank: int
    world_size: int
    versions: Versions
    gather: Callable[[Any], list[Any]]
    barrier: Callable[[], None]


def save(
    context: SaveContext,
    app_state: AppState,
    name: str,
    loss: float | None,
    persist: Persist,
) -> CheckpointManifest | None:
    """Saves a checkpoint on every rank; rank 0 returns the manifest it wrote."""
    local_dir = tempfile.mkdtemp(prefix="fsdp-checkpoint-")
    try:
        dcp_save({"app": app_state}, checkpoint_id=local_dir)
        save_rng(local_dir, context.rank)
        local_files = {entry.name: entry.stat().st_size for entry in os.scandir(local_dir) if entry.is_file()}
        all_files = {name: size for files in context.gather(local_files) for name, size in files.items()}
        train = app_state.train
        persist(local_dir, name, {"step": train.step, "loss": loss, "tokens_seen": train.tokens_seen})
        context.barrier()  # every rank's files are in storage
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    if context.rank != 0:
        return None
    location = context.run.child(name)
    stored = location.list_files()
    missing = {n: size for n, size in all_files.items() if stored.get(n) != size}
    if missing:
        raise OSError(f"checkpoint {location.uri} is missing or has wrong sizes for {sorted(missing)}")
    manifest = CheckpointManifest(
        run_name=context.run_name,
        step=train.step,
        loss=loss,
        tokens_seen=train.tokens_seen,
        world_size=context.world_size,
        created_at=dt.datetime.now(dt.UTC),
        versions=context.versions,
        files=all_files,
        submission_id=context.submission_id,
        fingerprint=context.fingerprint,
    )
    location.child(MANIFEST_FILE).write_text(manifest.to_json())
    log.info(
        "checkpoint step %d complete at %s (%d bytes)", train.step, location.uri, sum(all_files.values())
    )
    return manifest


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
