"""Checkpoints: DCP shards of model + optimizer, with scheduler, data position and step, per-rank RNG files,
and our manifest, which is written last and makes a checkpoint usable.

Saving (CheckpointSaver): the state is staged into host memory while the next step's forward and backward run;
writing the DCP shards (in place on a local path; for S3 locally, then uploaded into `<run prefix>/<name>/`),
and the manifest follow in the background. Rank 0 writes the
manifest only once every rank's files are in storage at their sizes; a crash anywhere before that leaves a
checkpoint without a manifest, which resumption never picks. Checkpoints are not reported to Ray Train:
resumption scans storage, and `prune` keeps the newest `keep` complete ones and the newest with a finite loss.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import math
import os
import pickle
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse, async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

from fsdp_trainer.contract import MANIFEST_FILE, CheckpointManifest, Versions, checkpoint_is_complete
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.storage import Location

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint_"
# Where checkpoints written before CheckpointManifest.global_batch_size recorded their global batch: a file
# rank 0 wrote beside the shards. Read on resume only; new checkpoints record it in the manifest.
GLOBAL_BATCH_FILE = "global_batch.json"
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
        self.tied = tied_names(model)
        # A model with frozen weights (an adapter's run) saves and loads the trainable ones only: the
        # frozen ones are the pretrained model's, read from model.source by every attempt.
        frozen = any(not p.requires_grad for p in model.parameters())
        self.options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self.options)
        for alias in self.tied:  # a tied weight is saved once, under its first name (the optimizer's)
            model_state.pop(alias, None)
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
        model_state = dict(state_dict["model"])
        for alias, name in self.tied.items():  # loaded into the one parameter both names hold
            if name in model_state:
                model_state.setdefault(alias, model_state[name])
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=state_dict["optimizer"],
            options=self.options,
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


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each later name of a parameter the model holds under several (a tied output head: Qwen2.5-1.5B's
    lm_head.weight is model.embed_tokens.weight, 0.93 GB in fp32), mapped to its first name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


# ----------------------------------------------------------------------------------------------------------
# RNG: per rank, outside DCP, because a different world size has different ranks


def rank_seed(seed: int, rank: int) -> int:
    """A rank's own seed from the run's: ranks draw different streams (dropout masks), the same in every run
    with this seed."""
    return seed * 100_003 + rank


def seed_generators(value: int) -> None:
    """Seeds the generators training draws from: torch's (the CPU's and every CUDA device's) and Python's.
    numpy's global generator is not seeded: the trainer draws only from generators seeded where they are
    made (np.random.default_rng([seed, ...]))."""
    torch.manual_seed(value)
    random.seed(value)


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
        seed_generators(reseed)
        return False
    _set_rng(torch.load(path, weights_only=True))
    return True


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


def resumed_global_batch(location: Location, sequence_length: int, unrecorded: int) -> int:
    """The global batch a complete checkpoint was trained with, as its manifest records it (or, written
    before manifests did, its GLOBAL_BATCH_FILE). One written before checkpoints recorded it at all is
    resumed with `unrecorded` (the batch this attempt's fields give) only when its tokens seen show that
    every one of its steps had that batch; otherwise its last batch cannot be known (an average over a
    resize is no batch), and a ConfigError asks for training.globalBatchSize rather than changing tokens per
    step silently."""
    manifest = CheckpointManifest.model_validate_json(location.child(MANIFEST_FILE).read_text())
    if manifest.global_batch_size is not None:
        return manifest.global_batch_size
    if GLOBAL_BATCH_FILE in manifest.files:
        return int(json.loads(location.child(GLOBAL_BATCH_FILE).read_text())["globalBatchSize"])
    if manifest.tokens_seen == manifest.step * sequence_length * unrecorded:
        return unrecorded
    average = manifest.tokens_seen / max(manifest.step * sequence_length, 1)
    raise ConfigError(
        f"checkpoint {location.uri} does not record its global batch (written before checkpoints did) and "
        f"its tokens seen ({manifest.tokens_seen} over {manifest.step} steps of sequenceLength "
        f"{sequence_length}: {average:g} sequences a step on average, written at world size "
        f"{manifest.world_size}) do not match this attempt's {unrecorded} (world size x microBatchSize x "
        "gradAccumulation); set training.globalBatchSize to the batch the run trained with"
    )


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
    """Keeps the newest `keep` complete checkpoints, and the newest complete one whose manifest records a
    finite loss however old, and deletes the rest, plus incomplete leftovers older than the newest complete
    one. Rank 0 runs it after each save's manifest, under Ray too (checkpoints are not reported to Ray Train).

    A loss that was not finite is stored as null, like a loss not yet measured; either way the checkpoint
    does not count as known good, so a run whose newer checkpoints went bad keeps one to go back to."""
    candidates = run_checkpoints(run)
    complete = complete_oldest_first(candidates)
    if not complete:
        return
    kept = {c.location.uri for c in complete[-keep:]}
    known_good = [c for c in complete if c.manifest is not None and _finite(c.manifest.loss)]
    if known_good:
        kept.add(known_good[-1].location.uri)
    newest = complete[-1].location.name
    doomed = [
        c for c in candidates if c.location.uri not in kept and (c.complete or c.location.name < newest)
    ]
    for candidate in doomed:
        log.info("deleting checkpoint %s (keep %d)", candidate.location.uri, keep)
        candidate.location.delete_dir()


def _finite(loss: float | None) -> bool:
    return loss is not None and math.isfinite(loss)


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
    """One finished save: rank 0's manifest (None on other ranks), how long `wait` blocked, and when (by
    time.perf_counter) the checkpoint became complete."""

    manifest: CheckpointManifest | None
    blocked_seconds: float
    completed_at: float


# Free disk a checkpoint must leave behind on the disk it is written to: the rest of the machine (logs, the
# compile cache, the next save's temporary files) keeps working while it is written.
DISK_RESERVE_BYTES = 2 << 30
Writer = Literal["thread", "process"]
# The writer bench/trainer_checkpoint.py measured to cost training less (docs/benchmarks.md).
DEFAULT_WRITER: Writer = "thread"


StateDict = dict[str, Any]


class ComputeFence(Protocol):
    def synchronize(self) -> None:
        """Returns once the device has done the work queued before the fence."""
        ...


def compute_fence(device: torch.device) -> ComputeFence | None:
    """A fence after the work queued so far on `device`'s current stream (the optimizer step), or None where
    that work is done by the time the call that queued it returns (the CPU)."""
    if device.type != "cuda":
        return None
    fence = torch.cuda.Event()  # type: ignore[no-untyped-call]
    fence.record(torch.cuda.current_stream(device))
    return fence


class StepOrderedStager(DefaultStager):
    """DefaultStager whose copy starts only when the device has finished the work queued before the save.

    DefaultStager copies on a CUDA stream of its own, which does not wait for the compute stream: the
    optimizer step's kernels may still be writing the weights and moments it copies, and a step-N checkpoint
    would hold a half-updated state. The staging thread waits on a fence recorded at `stage`; training does
    not wait."""

    def __init__(self, options: StagingOptions, device: torch.device) -> None:
        super().__init__(options)
        self.device = device

    def stage(self, state_dict: StateDict, **kwargs: Any) -> StateDict | Future[StateDict]:
        return super().stage(state_dict, fence=compute_fence(self.device), **kwargs)

    def _stage(self, state_dict: StateDict, fence: ComputeFence | None = None, **kwargs: Any) -> StateDict:
        if fence is not None:
            fence.synchronize()
        return super()._stage(state_dict, **kwargs)


class CheckpointSaver:
    """Saves checkpoints as torchtitan's async_with_pinned_mem mode does: training waits only while the state
    is staged into host memory, and that staging overlaps the next step's forward and backward.

    `start` hands the state dict to DCP's DefaultStager, which copies it into host memory in a thread of its
    own (on CUDA: pinned buffers, reused between saves, filled by non-blocking copies on a side stream, once
    the optimizer step queued before the save is done: StepOrderedStager) and returns at once;
    `wait_for_staging`, called before the next optimizer step changes the weights, waits for the copy. The
    staged shards are then written by DCP from `writer`: a thread of this process, or a process of its own
    (dcp.async_save's PROCESS checkpointer: the staged tensors in shared memory, the writing off this
    process's GIL); bench/trainer_checkpoint.py measures both. A local storage path is written in place,
    synced; for S3 the shards go to a local temporary directory first and this rank uploads them. Every rank's
    file list is then gathered, which also tells rank 0 that every rank's files are in storage; rank 0 checks
    storage holds every file at its size, writes the manifest last, prunes, and tells the other ranks. A crash
    before the manifest leaves a checkpoint that resumption never picks.

    The background collectives run on a gloo group of their own, so they never interleave with training's.
    At most one save is in flight: `start` and `wait` first finish the previous one. Before each save the
    disk it is written to must hold this node's shards with DISK_RESERVE_BYTES to spare, or the save is
    refused (OSError) before anything is written.
    """

    def __init__(
        self,
        run: Location,
        identity: SaveIdentity,
        rank: int,
        keep: int,
        device: torch.device,
        writer: Writer = DEFAULT_WRITER,
        ranks_per_node: int = 1,
    ) -> None:
        self.run, self.identity, self.rank, self.keep = run, identity, rank, keep
        self.writer, self.ranks_per_node = writer, ranks_per_node
        self.group = dist.new_group(backend="gloo")  # a collective: every rank builds it at the same point
        on_cuda = device.type == "cuda"
        self.stager = StepOrderedStager(
            StagingOptions(
                use_pinned_memory=on_cuda,
                use_shared_memory=writer == "process",  # the writer process maps the staged tensors
                use_async_staging=True,
                use_non_blocking_copy=on_cuda,
            ),
            device,
        )
        self._staging: Future[Any] | None = None
        self._pending: _BackgroundSave | None = None

    def start(
        self, app_state: AppState, name: str, loss: float | None, global_batch: int | None = None
    ) -> float:
        """Begins a save of the current state and returns the seconds that took (including waiting for the
        previous save). The state is staged in the background: call
        `wait_for_staging` before anything changes the weights or the optimizer state. `global_batch`, the
        sequences per optimizer step, is recorded in the manifest for a resume when given."""
        started = time.perf_counter()
        self.wait()
        location = self.run.child(name)
        write_dir = location.path if self.run.is_local else tempfile.mkdtemp(prefix="fsdp-checkpoint-")
        state = {"app": app_state.state_dict()}
        require_disk(write_dir, staged_bytes(state) * self.ranks_per_node + DISK_RESERVE_BYTES)
        os.makedirs(write_dir, exist_ok=True)
        save_rng(write_dir, self.rank)
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
            global_batch_size=global_batch,
        )
        # Synced in place: a local checkpoint is the durable copy. Unsynced for S3: the local files are a
        # staging copy the upload reads back at once, and the checkpoint is durable once storage holds it.
        storage_writer = FileSystemWriter(write_dir, sync_files=self.run.is_local)
        written: Callable[[], object]
        if self.writer == "process":
            response = async_save(
                state,
                storage_writer=storage_writer,
                process_group=self.group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
            if not isinstance(response, AsyncSaveResponse):  # only without asynchronous staging
                raise TypeError(f"async_save returned {type(response).__name__}, not AsyncSaveResponse")
            self._staging, written = response.staging_completion, response.upload_completion.result
        else:
            staging = self.stager.stage(state)
            if not isinstance(staging, Future):  # only without asynchronous staging
                raise TypeError(f"the stager returned {type(staging).__name__}, not a Future")
            self._staging = staging

            def written() -> object:
                return dcp_save(staging.result(), storage_writer=storage_writer, process_group=self.group)

        self._pending = _BackgroundSave(lambda: self._complete(written, write_dir, location, manifest))
        return time.perf_counter() - started

    def wait_for_staging(self) -> float:
        """Waits until the save in flight has its copy of the state (the weights may change after this);
        returns the seconds waited. Raises what staging raised."""
        staging, self._staging = self._staging, None
        if staging is None:
            return 0.0
        started = time.perf_counter()
        staging.result()
        return time.perf_counter() - started

    @property
    def writing(self) -> bool:
        """Whether a save is in flight on this rank (staging, writing, uploading or finalising)."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> SaveResult | None:
        """Finishes the save in flight (if any): when it returns, on any rank, the checkpoint is complete
        (manifest written). Raises what the save raised."""
        started = time.perf_counter()
        self.wait_for_staging()
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        manifest = pending.result()
        return SaveResult(manifest, time.perf_counter() - started, pending.finished_at)

    def close(self) -> None:
        self.stager.close()

    def _complete(
        self,
        written: Callable[[], object],
        write_dir: str,
        location: Location,
        manifest: CheckpointManifest,
    ) -> CheckpointManifest | None:
        try:
            failure: str | None = None
            local_files: dict[str, int] = {}
            try:
                started = time.perf_counter()
                written()
                wrote = time.perf_counter()
                local_files = {e.name: e.stat().st_size for e in os.scandir(write_dir) if e.is_file()}
                if not self.run.is_local:
                    location.upload_from(write_dir)
                log.info(
                    "checkpoint step %d, rank %d: written by the %s writer in %.2f s (%d bytes in %s)%s",
                    manifest.step,
                    self.rank,
                    self.writer,
                    wrote - started,
                    sum(local_files.values()),
                    write_dir,
                    "" if self.run.is_local else f", uploaded in {time.perf_counter() - wrote:.2f} s",
                )
            except Exception as error:  # every rank must still reach the gather below, or the others hang
                failure = f"rank {self.rank}: {type(error).__name__}: {error}"
            gathered: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, (local_files, failure), group=self.group)
        finally:
            if not self.run.is_local:
                shutil.rmtree(write_dir, ignore_errors=True)
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
        saved = (dt.datetime.now(dt.UTC) - manifest.created_at).total_seconds()  # created_at: save begun
        manifest = manifest.model_copy(update={"files": all_files, "save_seconds": round(saved, 3)})
        location.child(MANIFEST_FILE).write_text(manifest.to_json())
        size = sum(all_files.values())
        log.info("checkpoint step %d complete at %s (%d bytes)", manifest.step, location.uri, size)
        try:
            prune(self.run, self.keep)
        except OSError as error:  # the checkpoint is complete; old ones go at the next save's pruning
            log.warning("pruning %s after step %d failed: %s", self.run.uri, manifest.step, error)
        return manifest


def staged_bytes(state: Any) -> int:
    """The bytes of this rank's tensors in a state dict (a DTensor counts its local shard)."""
    if isinstance(state, DTensor):
        return int(state.to_local().nbytes)
    if isinstance(state, torch.Tensor):
        return int(state.nbytes)
    if isinstance(state, dict):
        return sum(staged_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(staged_bytes(value) for value in state)
    return 0


def require_disk(directory: str, needed: int) -> None:
    """Refuses a write of `needed` bytes below `directory` (which may not exist yet) that the disk cannot
    hold: a checkpoint cut short by a full disk would also starve everything else on the machine."""
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise OSError(
            f"not enough disk for a checkpoint in {directory}: it needs {needed / 1e9:.1f} GB (this node's "
            f"shards and {DISK_RESERVE_BYTES / 1e9:.1f} GB to spare), {free / 1e9:.1f} GB are free"
        )


class _BackgroundSave:
    """A daemon thread and its outcome: a save stuck in a collective with a dead peer must not keep the
    process from exiting (concurrent.futures' workers are joined at exit)."""

    def __init__(self, work: Callable[[], CheckpointManifest | None]) -> None:
        self._work = work
        self._manifest: CheckpointManifest | None = None
        self._error: BaseException | None = None
        self.finished_at = math.nan  # time.perf_counter() when the work ended
        self._thread = threading.Thread(target=self._run, name="checkpoint-save", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._manifest = self._work()
        except BaseException as error:  # handed to the training thread by result()
            self._error = error
        finally:
            self.finished_at = time.perf_counter()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> CheckpointManifest | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._manifest


@dataclass(frozen=True)
class Loaded:
    """What `load` did on this rank: whether the checkpoint had this rank's RNG state, and for one read from
    storage (None when read in place from local disk) the bytes this rank read and in how many reads."""

    rng_restored: bool
    bytes_read: int | None = None
    reads: int | None = None


def load(checkpoint: Location, app_state: AppState, rank: int, reseed: int) -> Loaded:
    """Loads a complete checkpoint, resharding onto this world size. A local checkpoint is read in place;
    one in S3 is read where it is, each rank reading only the byte ranges its share of the state needs
    (RangeReader) and its own RNG file, never a copy of the whole checkpoint."""
    if checkpoint.is_local:
        dcp_load({"app": app_state}, checkpoint_id=checkpoint.path)
        return Loaded(load_rng(checkpoint.path, rank, reseed))
    started = time.perf_counter()
    reader = RangeReader(checkpoint)
    dcp_load({"app": app_state}, storage_reader=reader)
    rng = checkpoint.child(_rng_file(rank))
    restored = rng.exists()
    if restored:
        data = rng.read_whole()
        reader.bytes_read += len(data)
        reader.reads += 1
        _set_rng(torch.load(io.BytesIO(data), weights_only=True))
    else:
        seed_generators(reseed)
    log.info(
        "rank %d read %d bytes of %s in %d reads (%.2f s)",
        rank,
        reader.bytes_read,
        checkpoint.uri,
        reader.reads,
        time.perf_counter() - started,
    )
    return Loaded(restored, reader.bytes_read, reader.reads)


# Adjacent items of a shard file a rank needs are read as one range of up to this many bytes (an item larger
# than this is one range of its own): fewer requests where a rank reads most of a file, as at the world size
# the checkpoint was written at.
RANGE_LIMIT = 64 << 20


class RangeReader(FileSystemReader):
    """DCP's FileSystemReader for a checkpoint in storage (S3) read where it is: the metadata whole, then of
    the shard files only the items this rank's load plan names, adjacent ones merged into ranges of up to
    RANGE_LIMIT bytes, read through Location.read_ranges (concurrent parts, timeouts, retries).

    What a rank reads is what its share of the state needs: every item that overlaps its shards (at the
    world size the checkpoint was written at, the items its rank wrote), plus the items every rank loads
    whole (scheduler and loop state, unsharded tensors). `bytes_read` counts them, with the metadata."""

    def __init__(self, checkpoint: Location) -> None:
        super().__init__(checkpoint.path)  # a path DCP keeps as the checkpoint id; never opened as a file
        self.location = checkpoint
        self.bytes_read = 0
        self.reads = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        data = self.location.child(".metadata" if rank is None else f"__{rank}.metadata").read_whole()
        self.bytes_read += len(data)
        self.reads += 1
        metadata = pickle.loads(data)
        if not isinstance(metadata, Metadata):
            raise TypeError(f"{self.location.uri}/.metadata holds a {type(metadata).__name__}, not Metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            ranges = merged_ranges([(self.storage_data[item.storage_index], item) for item in items])
            spans = [(start, length) for start, length, _ in ranges]
            for (start, _, members), data in zip(
                ranges, self.location.child(relative_path).read_ranges(spans), strict=True
            ):
                self.bytes_read += len(data)
                self.reads += 1
                view = memoryview(data)
                for info, item in members:
                    at = info.offset - start
                    self._load_item(planner, item, info, view[at : at + info.length])
        done: TorchFuture[None] = TorchFuture()
        done.set_result(None)
        return done

    def _load_item(self, planner: LoadPlanner, item: ReadItem, info: Any, data: memoryview) -> None:
        """What FileSystemReader.read_data does with one item it has read from its file."""
        stream = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), io.BytesIO(data)
        )
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            return
        seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
        tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(f"{item.storage_index}: stored {tensor.size()}, loading into {target.size()}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def merged_ranges(items: list[tuple[Any, ReadItem]]) -> list[tuple[int, int, list[tuple[Any, ReadItem]]]]:
    """(offset, length, items) ranges of one file covering each item's stored bytes (`info`: DCP's
    _StorageInfo, offset and length) once, by offset; an item that starts where the range before it ends
    joins it while the range stays within RANGE_LIMIT bytes. Items that share bytes (a stored chunk two of
    this rank's shards overlap) are read once."""
    ranges: list[tuple[int, int, list[tuple[Any, ReadItem]]]] = []
    for info, item in sorted(items, key=lambda pair: (pair[0].offset, pair[0].length)):
        if ranges:
            start, length, members = ranges[-1]
            end = start + length
            if info.offset >= start and info.offset + info.length <= end:  # already inside the last range
                members.append((info, item))
                continue
            if info.offset == end and length + info.length <= RANGE_LIMIT:
                ranges[-1] = (start, length + info.length, [*members, (info, item)])
                continue
        ranges.append((info.offset, info.length, [(info, item)]))
    return ranges
