"""What the driver asks Ray Train for: a fixed size, or with minWorkers the elastic range, per process; and an
elastic range with a size that could not train (issue 47 item 2) refused before any worker starts."""

from __future__ import annotations

from pathlib import Path

from ray.train import ScalingConfig

from fsdp_trainer.contract import CheckpointSpec, ErrorKind, TrainerConfig
from fsdp_trainer.driver import run_with_ray, scaling_workers
from fsdp_trainer.progress import read_progress
from fsdp_trainer.storage import Location


def config(**fields: object) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {"runName": "r", "model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}, **fields}
    )


def test_a_fixed_run_asks_for_one_process_per_gpu_of_every_worker() -> None:
    assert scaling_workers(config(workers=2, gpusPerWorker=4)) == 8
    assert scaling_workers(config(workers=2, gpusPerWorker=4, minWorkers=2)) == 8
    assert scaling_workers(config(workers=3)) == 3  # CPU workers: one process each


def test_an_elastic_run_asks_ray_train_for_a_range_it_accepts_as_elastic() -> None:
    wanted = scaling_workers(config(workers=4, gpusPerWorker=8, minWorkers=2))
    assert wanted == (16, 32)
    scaling = ScalingConfig(num_workers=wanted, use_gpu=True)  # Ray Train V2's own validation
    assert (scaling.min_workers, scaling.max_workers, scaling.elasticity_enabled) == (16, 32, True)


def test_an_elastic_range_whose_every_size_divides_the_global_batch_is_accepted() -> None:
    # 2 to 4 nodes of 4 GPUs: 8 to 16 processes, each dividing 720720 (the least multiple of 1 to 16)...
    elastic = config(workers=4, gpusPerWorker=4, minWorkers=2, training={"globalBatchSize": 720720})
    assert elastic.unusable_world_sizes() is None
    # ...or a fixed size that divides it.
    assert config(workers=2, gpusPerWorker=4, training={"globalBatchSize": 8}).unusable_world_sizes() is None


def test_sizes_of_the_elastic_range_that_cannot_train_are_named_before_the_run_starts() -> None:
    # 4 to 8 CPU workers and 24 sequences per step: 5 and 7 do not divide it.
    refusal = config(workers=8, minWorkers=4, training={"globalBatchSize": 24}).unusable_world_sizes()
    assert refusal is not None
    assert "4 to 8 processes" in refusal
    assert "5 (training.globalBatchSize 24 is not divisible by 5 x training.microBatchSize 1)" in refusal
    assert "7 (" in refusal and "6 (" not in refusal and "8 (" not in refusal


def test_hybrid_shard_needs_whole_nodes_at_every_size_of_the_range() -> None:
    refusal = config(
        workers=2,
        gpusPerWorker=2,
        minWorkers=1,
        fsdp={"sharding": "HYBRID_SHARD"},
        training={"globalBatchSize": 12},
    ).unusable_world_sizes()
    assert refusal is not None and "3 (HYBRID_SHARD needs whole nodes of 2 processes)" in refusal
    assert "2 (" not in refusal and "4 (" not in refusal


def test_the_driver_fails_such_a_run_as_a_configuration_error_before_starting_workers(tmp_path: Path) -> None:
    trainer = config(workers=8, minWorkers=4, training={"globalBatchSize": 24})
    trainer = trainer.model_copy(update={"checkpoint": CheckpointSpec(storage_path=str(tmp_path))})
    assert run_with_ray(trainer, "job-1") == 1
    record = read_progress(Location.parse(trainer.run_uri()))
    assert record is not None and (record.phase, record.error_kind) == ("failed", ErrorKind.CONFIG)
    assert record.error is not None and record.error.startswith("ConfigError: cluster.minWorkers 4:")
