"""PYTORCH_CUDA_ALLOC_CONF expandable_segments:True for GPU workers, set before CUDA initialises, unless the
run set the variable (issue 34 item 4): the Ray driver's worker environment, and the loop before it starts
the process group (torchrun, a lone process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_trainer import distributed
from fsdp_trainer.driver import worker_environment
from fsdp_trainer.launch import LoopInput
from fsdp_trainer.loop import train_loop
from fsdp_trainer.transport import CUDA_ALLOC_CONF
from tests.support.trainer_runs import config

USERS = "garbage_collection_threshold:0.6"


def test_gpu_workers_get_expandable_segments_unless_the_run_set_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = config(tmp_path).model_copy(update={"gpus_per_worker": 1})
    monkeypatch.delenv(CUDA_ALLOC_CONF, raising=False)
    assert worker_environment(gpu)[CUDA_ALLOC_CONF] == "expandable_segments:True"
    assert CUDA_ALLOC_CONF not in worker_environment(config(tmp_path)), "CPU workers have no CUDA"
    # The job's env_vars carry the user's value to the workers; the worker env must not override it.
    monkeypatch.setenv(CUDA_ALLOC_CONF, USERS)
    assert CUDA_ALLOC_CONF not in worker_environment(gpu)


class Started(Exception):
    pass


@pytest.mark.parametrize("users", [None, USERS])
def test_the_loop_sets_it_before_cuda_initialises_and_keeps_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, users: str | None
) -> None:
    environ = {key: value for key, value in os.environ.items() if key != CUDA_ALLOC_CONF}
    if users is not None:
        environ[CUDA_ALLOC_CONF] = users
    monkeypatch.setattr(os, "environ", environ)  # the NCCL settings the loop adds stay out of this process
    at_start: list[str | None] = []

    def start(use_gpu: bool, cpu_offload: bool = False) -> distributed.Runtime:
        at_start.append(os.environ.get(CUDA_ALLOC_CONF))
        raise Started

    monkeypatch.setattr(distributed, "start", start)
    gpu = config(tmp_path).model_copy(update={"gpus_per_worker": 1})
    with pytest.raises(Started):
        train_loop(LoopInput(trainer=gpu, submission_id="job-1").model_dump(mode="json"))
    assert at_start == [users or "expandable_segments:True"]
