"""A hang after the first step ends within the step timeout (issue 47 item 1), not the setup's 30 minutes:
with rank 0 hung at step 3 (its process alive, out of any collective), rank 1, waiting for it in a
collective, fails within distributed.STEP_TIMEOUT (3 s here) and exits, so the attempt ends and can be
retried. Two CPU processes, gloo, a tiny Qwen2."""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path

import torch.multiprocessing as multiprocessing

from fsdp_trainer import distributed
from fsdp_trainer.contract import TrainerConfig
from tests.support.net import free_port
from tests.support.trainer_runs import as_rank_of_two, config, train

STEP_TIMEOUT = dt.timedelta(seconds=3)


def rank_with_hang(rank: int, port: int, trainer_json: str, marker: str) -> None:
    as_rank_of_two(rank, port)
    os.environ["FSDP_TRAINER_FAULT"] = f"rank=0,step=3,marker={marker},action=hang"
    distributed.STEP_TIMEOUT = STEP_TIMEOUT  # this process's: the test's seconds, not minutes
    train(TrainerConfig.model_validate_json(trainer_json), "job-1")


def test_a_rank_waiting_for_a_hung_one_fails_within_the_step_timeout(tmp_path: Path) -> None:
    trainer = config(tmp_path, max_steps=10)
    marker = tmp_path / "hung"
    context = multiprocessing.get_context("spawn")
    port = free_port()
    hung, waiting = (
        context.Process(target=rank_with_hang, args=(r, port, trainer.model_dump_json(), str(marker)))
        for r in (0, 1)
    )
    hung.start()
    waiting.start()
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert time.monotonic() < deadline, "timed out after 300 s waiting for rank 0 to hang at step 3"
            time.sleep(0.5)
        hung_at = time.monotonic()
        waiting.join(timeout=60)
        waited = time.monotonic() - hung_at
        assert waiting.exitcode is not None, "rank 1 still waits 60 s after rank 0 hung"
        assert waiting.exitcode != 0 and hung.is_alive()
        assert waited < 60, waited
    finally:
        for process in (hung, waiting):
            process.kill()
            process.join(timeout=30)
