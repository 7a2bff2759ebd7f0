"""What the driver asks Ray Train for: a fixed size, or with minWorkers the elastic range, per process."""

from __future__ import annotations

from ray.train import ScalingConfig

from fsdp_trainer.contract import TrainerConfig
from fsdp_trainer.driver import scaling_workers


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
