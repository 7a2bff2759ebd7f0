"""training.globalBatchSize (issue 34 item 2): the global batch is part of the recipe, gradient accumulation
is derived from it at each world size, and a resume at another world size keeps tokens per step, the schedule
and the data position. The loop runs on CPU (gloo, a tiny Qwen2): two processes, then one."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as multiprocessing
from pydantic import ValidationError

from fsdp_trainer import checkpoint, data
from fsdp_trainer.contract import MANIFEST_FILE, CheckpointManifest, TrainerConfig, TrainingSpec
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.storage import Location
from tests.support.net import free_port
from tests.support.trainer_runs import as_rank_of_two, config, history, losses, manifests, train


def with_training(trainer: TrainerConfig, **update: Any) -> TrainerConfig:
    return trainer.model_copy(update={"training": trainer.training.model_copy(update=update)})


def test_accumulation_is_derived_from_the_global_batch_at_each_world_size() -> None:
    training = TrainingSpec.model_validate(
        {"globalBatchSize": 16, "microBatchSize": 2, "gradAccumulation": 3}
    )
    assert [training.accumulation_for(world) for world in (1, 2, 4, 8)] == [8, 4, 2, 1]
    unset = TrainingSpec.model_validate({"microBatchSize": 2, "gradAccumulation": 3})
    assert unset.global_batch_size is None
    assert unset.accumulation_for(4) == 3, "unset, today's fields give the batch as before"
    assert unset.accumulation_for(1, checkpoint_global_batch=24) == 12, "a resume keeps the checkpoint's"


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused_naming_both() -> None:
    training = TrainingSpec.model_validate({"globalBatchSize": 12, "microBatchSize": 2})
    with pytest.raises(ValueError) as refused:
        training.accumulation_for(4)
    message = str(refused.value)
    assert "training.globalBatchSize 12" in message
    assert "world size 4" in message and "training.microBatchSize 2" in message
    with pytest.raises(ValidationError):
        TrainingSpec.model_validate({"globalBatchSize": 0})


def test_the_loop_refuses_an_indivisible_global_batch_as_a_config_error(tmp_path: Path) -> None:
    trainer = with_training(config(tmp_path, max_steps=1), global_batch_size=3)  # microBatchSize 2
    with pytest.raises(
        ConfigError, match=r"training.globalBatchSize 3 .*world size 1 x training.microBatchSize 2"
    ):
        train(trainer, "job-1")


def train_on_rank(rank: int, port: int, trainer_json: str) -> None:
    as_rank_of_two(rank, port)
    train(TrainerConfig.model_validate_json(trainer_json), "job-1")


@pytest.mark.parametrize("recipe", [8, None], ids=["global-batch-set", "unset-keeps-the-checkpoints"])
def test_a_resume_at_another_world_size_keeps_the_global_batch_samples_and_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: int | None
) -> None:
    # World size 2, microBatchSize 2: 8 sequences a step, 2 micro-steps (derived, or gradAccumulation 2).
    trainer = with_training(
        config(tmp_path, max_steps=4),
        grad_accumulation=2,
        **({} if recipe is None else {"global_batch_size": recipe}),
    )
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=train_on_rank, args=(r, port, trainer.model_dump_json())) for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=600)
    assert [process.exitcode for process in ranks] == [0, 0]
    run = tmp_path / "team-a" / "tiny"
    uninterrupted = losses(history(run)[0])
    assert sorted(uninterrupted) == [1, 2, 3, 4]

    # The same run, interrupted after its step-2 checkpoint, resumes on one process.
    [last] = [m for m in manifests(run) if m.step == 4]
    shutil.rmtree(next(run.glob("checkpoint_00000004_*")))
    consumed: dict[int, list[int]] = {}
    real_indices = data.BatchLayout.micro_batch_indices

    def recorded(layout: data.BatchLayout, position: int, micro_step: int, rank: int) -> list[int]:
        indices = real_indices(layout, position, micro_step, rank)
        consumed.setdefault(position, []).extend(indices)
        return indices

    monkeypatch.setattr(data.BatchLayout, "micro_batch_indices", recorded)
    train(trainer, "job-2")

    resumed_records = history(run)[1]
    resumed = losses(resumed_records)
    assert sorted(resumed) == [3, 4]
    # Steps 3 and 4 read global samples 16..23 and 24..31, as the two ranks did: 4 micro-steps of 2, not 1.
    assert {position: sorted(indices) for position, indices in consumed.items()} == {
        16: list(range(16, 24)),
        24: list(range(24, 32)),
    }
    [again] = [m for m in manifests(run) if m.step == 4]
    assert again.world_size == 1 and again.tokens_seen == last.tokens_seen == 4 * 8 * 16
    # The same samples and the same global mean: only the order of the fp32 sums differs (an all-reduce of
    # two ranks' gradients against four micro-steps accumulated on one), rounding at about 1e-7 relative per
    # operation; 1e-4 relative is well above that and far below what another batch or LR gives (over 1e-2).
    # Measured: equal within 1e-15 relative on CPU (gloo, fp32) at both steps.
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-4), step

    # The checkpoint's manifest records its batch: a later resume at the world size it was written at keeps 8
    # a step, where this world size's own fields give 1 x 2 x 2 = 4.
    assert again.global_batch_size == 8 and last.global_batch_size == 8
    assert checkpoint.GLOBAL_BATCH_FILE not in again.files, "no file of its own any more"
    train(with_training(trainer, max_steps=5), "job-3")
    [fifth] = [m for m in manifests(run) if m.step == 5]
    assert fifth.world_size == 1 and fifth.tokens_seen == 5 * 8 * 16


def forget_global_batch(checkpoint_dir: Path, **manifest_update: Any) -> None:
    """Makes a checkpoint look written before checkpoints recorded their global batch."""
    path = checkpoint_dir / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest.pop("globalBatchSize", None)
    if manifest["files"].pop(checkpoint.GLOBAL_BATCH_FILE, None) is not None:
        (checkpoint_dir / checkpoint.GLOBAL_BATCH_FILE).unlink()
    manifest.update(manifest_update)
    path.write_text(json.dumps(manifest))


def recorded_in_a_file(checkpoint_dir: Path, global_batch: int) -> None:
    """Makes a checkpoint look written while the global batch had a file of its own beside the shards."""
    forget_global_batch(checkpoint_dir)
    batch_file = checkpoint_dir / checkpoint.GLOBAL_BATCH_FILE
    batch_file.write_text(json.dumps({"globalBatchSize": global_batch}))
    path = checkpoint_dir / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["files"][checkpoint.GLOBAL_BATCH_FILE] = batch_file.stat().st_size
    path.write_text(json.dumps(manifest))


def test_the_global_batch_is_read_from_the_manifest_or_an_older_checkpoints_file(tmp_path: Path) -> None:
    """Sequence length 16; this attempt's fields give 2 a step; the checkpoints were trained with 4."""
    directory = tmp_path / "checkpoint_00000003_a"
    directory.mkdir()
    manifest = CheckpointManifest(
        run_name="r",
        step=3,
        tokens_seen=3 * 4 * 16,
        world_size=2,
        created_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        files={},
        global_batch_size=4,
    )
    (directory / MANIFEST_FILE).write_text(manifest.to_json())
    location = Location.parse(str(directory))
    assert checkpoint.resumed_global_batch(location, 16, unrecorded=2) == 4
    assert json.loads((directory / MANIFEST_FILE).read_text())["globalBatchSize"] == 4
    recorded_in_a_file(directory, 4)  # written between the two: global_batch.json, listed in the manifest
    assert checkpoint.resumed_global_batch(location, 16, unrecorded=2) == 4
    forget_global_batch(directory)
    with pytest.raises(ConfigError, match="does not record its global batch"):
        checkpoint.resumed_global_batch(location, 16, unrecorded=2)
    assert checkpoint.resumed_global_batch(location, 16, unrecorded=4) == 4, "its tokens show 4 a step"


def test_a_checkpoint_without_a_recorded_batch_resumes_only_when_its_tokens_show_the_batch(
    tmp_path: Path,
) -> None:
    trainer = config(tmp_path, max_steps=2)  # world size 1, microBatchSize 2: 2 sequences a step
    train(trainer, "job-1")
    run = tmp_path / "team-a" / "tiny"
    [written] = run.glob("checkpoint_00000002_*")
    forget_global_batch(written)
    # 2 steps x 2 sequences x 16 tokens: every step had this attempt's batch, so it resumes with it.
    train(with_training(trainer, max_steps=3), "job-2")
    assert [m.tokens_seen for m in manifests(run) if m.step == 3] == [3 * 2 * 16]

    # Written at world size 2 (4 sequences a step): this attempt's fields would halve tokens per step.
    [third] = run.glob("checkpoint_00000003_*")
    forget_global_batch(third, worldSize=2, tokensSeen=3 * 4 * 16)
    with pytest.raises(ConfigError, match=r"does not record its global batch.*set training.globalBatchSize"):
        train(with_training(trainer, max_steps=4), "job-3")
    train(with_training(trainer, max_steps=4, global_batch_size=4), "job-4")
    # Step 4 takes 4 sequences (the shards' tokens seen were not faked: 3 x 2 x 16 before it).
    assert [m.tokens_seen for m in manifests(run) if m.step == 4] == [3 * 2 * 16 + 4 * 16]
