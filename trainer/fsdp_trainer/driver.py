"""The Ray driver: a TorchTrainer over the per-worker loop, and the record of how the run ended."""

from __future__ import annotations

import logging
import os
from typing import Any

from fsdp_trainer import hangdetector
from fsdp_trainer.contract import PROGRESS_FILE, AttemptInfo, ErrorKind, ProgressRecord, TrainerConfig
from fsdp_trainer.errors import DataError, classify
from fsdp_trainer.forensics import flight_recorder_env
from fsdp_trainer.launch import LoopInput
from fsdp_trainer.progress import read_progress, utc_now
from fsdp_trainer.shards import source_shards
from fsdp_trainer.storage import Location
from fsdp_trainer.transport import allocator_env, worker_env

log = logging.getLogger(__name__)

FORWARDED_ENV_PREFIX = "FSDP_TRAINER_"  # trainer settings and test hooks reach the workers
MAX_ERROR_CHARS = 2000


def ray_train_worker(config: dict[str, Any]) -> None:
    """Ray Train's per-worker function, which Ray pickles by reference: the training loop is imported on
    the worker, so the job's driver process never imports transformers (about 5 CPU-seconds and 180 MB at
    each attempt's start); only the workers that train do."""
    from fsdp_trainer.loop import train_loop

    train_loop(config)


def worker_environment(config: TrainerConfig) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key.startswith(FORWARDED_ENV_PREFIX)}
    env.update(flight_recorder_env())
    # The hang detector's settings (run_with_ray's, or the run's own): rank 0 reports them with its forensics.
    env.update({key: os.environ[key] for key in hangdetector.OBSERVE if key in os.environ})
    if config.gpus_per_worker > 0:
        env.update(worker_env(config.network, config.run_name))
        env.update(allocator_env())  # these env_vars override the job's, so only where the job has none
    return env


def run_with_ray(config: TrainerConfig, submission_id: str, attempt: AttemptInfo | None = None) -> int:
    """Trains to the end (Ray Train restarts the workers up to maxFailures times, resuming from the latest
    checkpoint); returns the process exit code."""
    unusable = config.unusable_world_sizes()
    if unusable is not None:  # refused before any worker starts, not at the resize that reaches such a size
        record_failure(config, f"ConfigError: {unusable}"[:MAX_ERROR_CHARS], ErrorKind.CONFIG, submission_id)
        log.error("training failed (%s): %s", ErrorKind.CONFIG, unusable)
        return 1
    try:
        check_data(config)
    except DataError as error:
        record_failure(config, f"DataError: {error}"[:MAX_ERROR_CHARS], ErrorKind.DATA, submission_id)
        log.error("training failed (%s): %s", ErrorKind.DATA, error)
        return 1
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    from fsdp_trainer.distributed import process_group_backend  # torch: imported once Ray is needed too

    if not ray.is_initialized():
        ray.init()  # RAY_ADDRESS (set inside a Ray job) or a local Ray
    gpu = config.gpus_per_worker > 0
    log.info("Ray Train's NCCL hang detector: %s", hangdetector.enable(gpu))
    scaling = ScalingConfig(
        # mypy resolves Ray's V1 ScalingConfig; Train V2's takes a (min, max) range.
        num_workers=scaling_workers(config),  # type: ignore[arg-type]
        use_gpu=gpu,
        resources_per_worker=None if gpu else {"CPU": config.cpus_per_worker},
    )
    # mypy resolves Ray's V1 RunConfig; Train V2 (the default since Ray 2.5x) has worker_runtime_env.
    run_config = RunConfig(  # type: ignore[call-arg]
        name=config.run_name,
        storage_path=config.run_uri().removesuffix(f"/{config.run_name}"),  # Ray appends name
        failure_config=FailureConfig(max_failures=config.max_failures),
        # No checkpoint_config: the workers save, upload and prune checkpoints themselves, in the background
        # (checkpoint.CheckpointSaver), and resumption scans storage; nothing is reported to Ray.
        worker_runtime_env={"env_vars": worker_environment(config)},
    )
    trainer = TorchTrainer(
        ray_train_worker,
        train_loop_config=LoopInput(
            trainer=config, submission_id=submission_id, attempt=attempt or AttemptInfo()
        ).model_dump(mode="json"),
        scaling_config=scaling,
        run_config=run_config,
        torch_config=TorchConfig(
            backend=process_group_backend(gpu, config.fsdp.cpu_offload),
        ),
    )
    try:
        trainer.fit()
    except TrainingFailedError as error:
        kind, cause = root_cause(error)
        message = f"{type(cause).__name__}: {cause}"[:MAX_ERROR_CHARS]
        record_failure(config, message, kind, submission_id)
        log.error("training failed (%s): %s", kind, error)
        return 1
    return 0


def scaling_workers(config: TrainerConfig) -> int | tuple[int, int]:
    """Ray Train's num_workers: one worker per GPU (each worker process drives one device), or per CPU
    worker. With min_workers, Ray Train's elastic range: it starts on what the cluster has between the two
    and resizes the group (resuming from the latest checkpoint) when nodes go or come back."""
    sizes = config.world_sizes()
    return sizes.start if len(sizes) == 1 else (sizes.start, sizes[-1])


def check_data(config: TrainerConfig) -> None:
    """A URI data source (and evalSource) listed and split as every worker will, before any starts: a wrong
    URI, an empty source or a missing text field fails the attempt in seconds, not after the workers have
    started and loaded the model (minutes on GPU nodes). A local path is left to the workers: it is read
    where they run, which may be a volume the driver's machine lacks (and "synthetic" is neither)."""
    if all("://" in source for source in (config.data.source, config.data.eval_source) if source):
        source_shards(config.data, config.training.sequence_length, config.training.seed)


def root_cause(error: BaseException) -> tuple[ErrorKind, BaseException]:
    """The error that explains the failure: a worker's permanent error when any worker hit one (the others
    then fail with collective errors), else the first worker's (or the controller's) error."""
    worker_failures: dict[int, Any] = getattr(error, "worker_failures", None) or {}
    causes = [worker_failures[rank] for rank in sorted(worker_failures)]
    causes.append(getattr(error, "controller_failure", None))
    classified = [(classify(cause), cause) for cause in causes if isinstance(cause, BaseException)]
    if not classified:
        return classify(error), error
    return next(((kind, cause) for kind, cause in classified if kind != ErrorKind.RUNTIME), classified[0])


def record_failure(
    config: TrainerConfig, message: str, kind: ErrorKind, submission_id: str | None = None
) -> None:
    """phase=failed on the latest progress record (keeping its step and metrics) for the operator, marked
    as written by this submission."""
    run = Location.parse(config.run_uri())
    try:
        previous = read_progress(run)
    except (OSError, ValueError) as read_error:
        log.warning("progress record unreadable (%s): writing a fresh one", read_error)
        previous = None
    fields: dict[str, Any] = (
        previous.model_dump()
        if previous is not None
        else {
            "run_name": config.run_name,
            "max_steps": config.training.max_steps,
            "world_size": config.workers * max(1, config.gpus_per_worker),
        }
    )
    fields.update(
        phase="failed", error=message, error_kind=kind, submission_id=submission_id, updated_at=utc_now()
    )
    run.child(PROGRESS_FILE).write_text(ProgressRecord(**fields).to_json())
