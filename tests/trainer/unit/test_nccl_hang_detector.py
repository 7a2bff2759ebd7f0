"""Ray Train's NCCL hang detector (NCCL RAS), issue 47 item 1: the driver turns it on in observe mode where
the image's Ray has it (Ray >= 2.60; the DLC's 2.58 has not, and the run says so), and what it stored of a
confirmed hang reaches the operator in rank 0's answer to a forensics request. NCCL RAS needs GPUs: the
files here are in the form Ray 2.60.0 stores them (ray/train/v2/_internal/callbacks/nccl_ras.py:918-941,
998-1016)."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import pytest
import ray
import ray.train.v2._internal.callbacks as ray_callbacks

from fsdp_trainer import driver, hangdetector
from fsdp_trainer.contract import (
    ForensicsRequest,
    RankStacks,
    TrainerConfig,
    forensics_request_name,
    rank_stacks_name,
)
from fsdp_trainer.forensics import ForensicsWatch
from fsdp_trainer.storage import Location

DETECTOR_VARIABLES = (hangdetector.ENABLE_ENV, hangdetector.ACTION_ENV, hangdetector.CONFIRM_ENV)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DETECTOR_VARIABLES:  # unset, and unset again afterwards whatever the driver set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture
def ray_with_detector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed Ray with the detector's module where Ray 2.60 has it (a stand-in file: the lock pins Ray
    2.58, which has none)."""
    stand_in = tmp_path / "ray-2.60-callbacks"
    stand_in.mkdir()
    (stand_in / "nccl_ras.py").write_text('"""Stands in for Ray 2.60\'s NCCLRASCallback module."""\n')
    monkeypatch.setattr(ray_callbacks, "__path__", [*ray_callbacks.__path__, str(stand_in)])


def gpu_config(tmp_path: Path) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "runName": "tiny",
            "namespace": "team-a",
            "model": {"source": "m"},
            "checkpoint": {"storagePath": str(tmp_path)},
            "gpusPerWorker": 4,
        }
    )


def test_the_dlcs_ray_has_no_detector_and_the_driver_sets_nothing_but_says_so(tmp_path: Path) -> None:
    assert ray.__version__ == "2.58.0", "the DLC's Ray (hack/dlc/requirements.lock)"
    assert hangdetector.enable(gpu=True) == "unavailable in Ray 2.58.0"
    env = driver.worker_environment(gpu_config(tmp_path))
    assert not set(DETECTOR_VARIABLES) & set(env), env


@pytest.mark.usefixtures("ray_with_detector")
def test_where_ray_has_it_gpu_runs_observe_and_the_runs_own_setting_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert hangdetector.enable(gpu=False) == "off", "no NCCL on CPU workers"
    assert hangdetector.ENABLE_ENV not in os.environ

    assert hangdetector.enable(gpu=True) == "observe"
    env = driver.worker_environment(gpu_config(tmp_path))
    assert env[hangdetector.ENABLE_ENV] == "1" and env[hangdetector.ACTION_ENV] == "observe"
    assert float(env[hangdetector.CONFIRM_ENV]) < 300, "confirmed before the 5-minute collective timeout"

    monkeypatch.setenv(hangdetector.ACTION_ENV, "fail")  # the run's runtimeEnv chose it
    monkeypatch.delenv(hangdetector.ENABLE_ENV)
    assert hangdetector.enable(gpu=True) == "fail"
    assert driver.worker_environment(gpu_config(tmp_path))[hangdetector.ACTION_ENV] == "fail"


def ras_poll(counts: dict[int, int], timestamp: str) -> str:
    """One `ncclras -f json` answer in NCCL 2.28's schema (as in Ray's own test of the detector)."""
    ranks = [
        {
            "rank": rank,
            "host": "10.0.77.184",
            "pid": 8813 + rank,
            "cuda_dev": rank,
            "nvml_dev": rank,
            "status": {
                "init_state": 0,
                "async_error": 0,
                "finalize_called": False,
                "destroy_flag": False,
                "abort_flag": False,
            },
            "collective_counts": {"Broadcast": 0, "AllGather": 9, "AllReduce": count},
        }
        for rank, count in counts.items()
    ]
    communicator = {
        "hash": "0x514e98cf4e44862b",
        "secondary_hash": "0x2cd6d618b4a75a5a:0xe6854f9ece96c663",
        "size": len(ranks),
        "ranks_count": len(ranks),
        "missing_ranks_count": 0,
        "ranks": ranks,
        "missing_ranks": [],
    }
    return json.dumps(
        {
            "nccl_version": "2.28.9",
            "timestamp": timestamp,
            "communicators_count": 1,
            "communicators": [communicator],
            "ras": {"collection_time_sec": 0.0, "timeouts_count": 0},
        },
        indent=2,
    )


@pytest.mark.usefixtures("ray_with_detector")
def test_a_confirmed_hang_is_in_rank_0s_answer_to_the_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(hangdetector.ENABLE_ENV, "1")  # as the driver's worker_environment passes it on
    monkeypatch.setenv(hangdetector.ACTION_ENV, "observe")
    run_dir = tmp_path / "run"
    run = Location.parse(str(run_dir))
    started = time.monotonic()
    watch = ForensicsWatch(run, 2, 0, 2, step=lambda: 7, recent_log=lambda: "", poll_seconds=0.05)
    # The worker group started; the detector then confirms a hang and stores its diagnostics.
    stored = run_dir / "hang_detector" / "nccl_ras"  # <experiment dir>/HANG_DETECTOR_DIRNAME/_NCCL_RAS_TOOL
    stored.mkdir(parents=True)
    # Ray names each poll ncclras_<its timestamp, unsafe characters as '-'>.json: the last is the newest.
    for second, counts in (("41", {0: 1447, 1: 1447}), ("56", {0: 1448, 1: 1447})):
        poll = ras_poll(counts, f"2026-06-19 06:51:{second}")
        (stored / f"ncclras_2026-06-19-06-51-{second}.json").write_text(poll)
    report = "x" * 20_000 + "\nRAS: rank 1 has not entered AllReduce #1448\n"  # NCCL's text, beyond the bound
    (stored / "ncclras_report.txt").write_text(report)
    request = ForensicsRequest(attempt=2, reason="Hang", requested_at="2026-12-06T12:00:00Z")
    run.child(forensics_request_name(2)).write_text(request.model_dump_json(by_alias=True))

    answer = run.child(rank_stacks_name(2, 0))
    while not answer.exists():
        assert time.monotonic() - started < 10, "rank 0 did not answer"
        time.sleep(0.05)
    watch.stop()

    found = RankStacks.model_validate_json(answer.read_text()).nccl_hang_detector
    assert found is not None and found.state == "observe" and found.confirmed
    assert found.uri == f"{run_dir}/hang_detector"
    assert found.finding == (
        "communicator 0x514e98cf4e44862b: AllReduce: rank 1 (10.0.77.184 pid 8814) at 1447, others up to 1448"
    )
    assert found.report.endswith("rank 1 has not entered AllReduce #1448\n")
    assert len(found.report) == hangdetector.REPORT_CHARS, "the tenant's file, read within a bound"


@pytest.mark.usefixtures("ray_with_detector")
def test_an_earlier_hangs_files_are_not_this_worker_groups(tmp_path: Path) -> None:
    stored = tmp_path / "run" / "hang_detector" / "nccl_ras"
    stored.mkdir(parents=True)
    earlier = stored / "ncclras_2026-06-19-06-51-56.json"
    earlier.write_text(ras_poll({0: 1448, 1: 1447}, "2026-06-19 06:51:56"))
    an_hour_ago = time.time() - 3600
    os.utime(earlier, (an_hour_ago, an_hour_ago))
    started = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    found = hangdetector.findings(Location.parse(str(tmp_path / "run")), started)
    assert not found.confirmed and found.finding == ""
