"""The per-worker loop in one CPU process (gloo, a tiny Qwen2, synthetic tokens, local storage): what it tells
the operator while it sets up, and that it never resumes from checkpoints of another configuration."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import pytest

from fsdp_trainer.contract import ProgressRecord
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.loop import collector_skips_setup
from tests.support.trainer_runs import config, history, manifests, train


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    storage = tmp_path_factory.mktemp("storage")
    train(config(storage), "job-1")
    return storage, storage / "team-a" / "tiny"


def test_setup_names_each_stage_before_the_first_step(first_run: tuple[Path, Path]) -> None:
    _, run = first_run
    (records,) = history(run)
    starting = [record for record in records if record.phase == "starting"]
    stages = [stage for stage, _ in itertools.groupby(record.stage for record in starting)]
    assert stages == [
        "initializing",
        "downloading-model",
        "loading-data",
        "probing-transport",
        "downloading-model",
    ], "a new run has no checkpoint to load"
    assert records.index(starting[-1]) < min(i for i, r in enumerate(records) if r.step > 0)
    assert all(record.stage is None for record in records if record.phase != "starting")
    assert {record.submission_id for record in records} == {"job-1"}
    final = ProgressRecord.model_validate_json((run / "progress.json").read_text())
    assert (final.phase, final.step, final.submission_id) == ("finished", 4, "job-1")


def test_checkpoints_carry_the_runs_resume_fingerprint(first_run: tuple[Path, Path]) -> None:
    storage, run = first_run
    written = manifests(run)
    assert [manifest.step for manifest in written] == [2, 4]
    assert {manifest.fingerprint for manifest in written} == {config(storage).resume_fingerprint()}


def test_the_same_configuration_resumes_under_the_namespaced_prefix(first_run: tuple[Path, Path]) -> None:
    storage, run = first_run
    train(config(storage, max_steps=6), "job-2")
    resumed = history(run)[-1]
    stages = [record.stage for record in resumed if record.phase == "starting"]
    assert stages[-1] == "loading-checkpoint", "the last setup stage of a resumed run"
    assert resumed[-1].phase == "finished" and resumed[-1].resumed_from_step == 4
    assert min(record.step for record in resumed if record.phase == "training" and record.loss) == 5


def test_another_configuration_under_the_same_prefix_is_refused(first_run: tuple[Path, Path]) -> None:
    storage, run = first_run
    other = config(storage, seed=4, max_steps=8)  # another data order: the old position would be wrong
    newest_before = manifests(run)[-1]
    with pytest.raises(ConfigError) as refused:
        train(other, "job-3")
    message = str(refused.value)
    assert "another configuration" in message
    assert newest_before.fingerprint is not None and newest_before.fingerprint in message
    assert other.resume_fingerprint() in message
    failed = ProgressRecord.model_validate_json((run / "progress.json").read_text())
    assert (failed.phase, failed.error_kind, failed.submission_id) == ("failed", "config", "job-3")
    assert failed.resumed_from_step is None and failed.step == 0, "nothing was loaded"
    assert manifests(run)[-1] == newest_before, "and nothing was trained or saved"


def test_full_collections_in_the_loop_skip_the_setups_objects(first_run: tuple[Path, Path]) -> None:
    """A full collection walks every tracked object with the GIL held (~0.2 s after a real setup), stalling
    every rank at the next collective: inside the loop it walks only what the loop made, and a finished loop
    (the first_run fixture's) has handed the setup's objects back to the collector."""
    assert gc.get_freeze_count() == 0
    made_in_setup = [[] for _ in range(10_000)]
    with collector_skips_setup():
        made_in_loop = [[] for _ in range(10)]
        walked = {id(tracked) for tracked in gc.get_objects()}
        assert not walked & {id(made) for made in made_in_setup}
        assert {id(made) for made in made_in_loop} <= walked
    assert gc.get_freeze_count() == 0
