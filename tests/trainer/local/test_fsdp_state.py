"""FSDP2 and checkpoint state in one CPU process (a one-rank gloo group): the root keeps its parameters after
forward, an asynchronous checkpoint holds the state of its own step while training goes on, a failed save is
never resumable (both on local disk and in S3), a resumed run takes its hyperparameters from its own
configuration, and the batch loader's position and stream cursors come back from a checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_trainer import checkpoint, data, optim, parallelize
from fsdp_trainer.contract import DataSpec, FsdpSpec, TrainingSpec, Versions
from fsdp_trainer.storage import Location
from tests.support.corpus import CountingTokenizer, mixed_corpus
from tests.support.tiny_model import tiny_lm

FINGERPRINT = "0123456789abcdef"


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_app(spec: TrainingSpec, batches: data.BatchLoader | None = None) -> checkpoint.AppState:
    model = tiny_lm(vocab_size=64)
    mesh = parallelize.build_mesh(parallelize.MeshShape(replicate=1, shard=1), "cpu")
    parallelize.parallelize(model, FsdpSpec(), mesh, torch.float32)
    optimizer = optim.build_optimizer(model, spec)
    scheduler = optim.build_scheduler(optimizer, spec)
    return checkpoint.AppState(model, optimizer, scheduler, checkpoint.TrainState(), batches)


def train_step(app: checkpoint.AppState, saving: checkpoint.CheckpointSaver | None = None) -> None:
    """One step; a save in flight stages the state while forward and backward run, as in the loop."""
    batch = torch.randint(0, 64, (2, 16))
    app.model(input_ids=batch, labels=batch).loss.backward()
    if saving is not None:
        saving.wait_for_staging()
    app.optimizer.step()
    app.scheduler.step()
    app.optimizer.zero_grad()
    app.train.step += 1


def weights(app: checkpoint.AppState) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in app.model.named_parameters()}


def saver(run: Location, writer: checkpoint.Writer = "thread") -> checkpoint.CheckpointSaver:
    identity = checkpoint.SaveIdentity("run", "job-1", FINGERPRINT, "data-0", 1, Versions())
    return checkpoint.CheckpointSaver(run, identity, 0, 3, torch.device("cpu"), writer=writer)


@pytest.fixture(params=["local disk", "S3"])
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """The run's storage: a local directory, or a prefix in a real S3 server (boto3's upload path)."""
    if request.param == "S3":
        s3_location: Location = request.getfixturevalue("s3_run")
        return s3_location
    return Location.parse(str(tmp_path))


def test_the_root_keeps_its_parameters_after_forward_and_the_blocks_reshard() -> None:
    app = sharded_app(TrainingSpec())
    train_step(app)  # the first forward runs FSDP's lazy initialisation, which settles the root
    root_group = app.model._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    block = app.model.model.layers[0]  # type: ignore[union-attr,index]
    block_group = block._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    assert root_group.post_forward_mesh_info is None, "the root would all-gather embeddings again in backward"
    assert block_group.post_forward_mesh_info is not None, "FULL_SHARD blocks free their parameters"


def test_an_async_checkpoint_holds_its_steps_state_while_training_goes_on(run: Location) -> None:
    app = sharded_app(TrainingSpec(learning_rate=1e-2))
    train_step(app)
    at_save = weights(app)
    checkpoints = saver(run)
    began = time.monotonic()
    checkpoints.start(app, checkpoint.checkpoint_name(1, "a"), loss=4.0)
    for _ in range(3):  # the save is in flight: these steps change the weights it is writing
        train_step(app, checkpoints)
    result = checkpoints.wait()
    waited = time.monotonic() - began
    checkpoints.close()
    assert result is not None and result.manifest is not None
    assert (result.manifest.step, result.manifest.fingerprint) == (1, FINGERPRINT)
    # The manifest says how long the save took to be complete, which the operator sizes its drains by.
    assert result.manifest.save_seconds is not None and 0 < result.manifest.save_seconds <= waited + 0.01
    assert not all(torch.equal(at_save[name], now) for name, now in weights(app).items())

    found = checkpoint.find_resume_point(run, "auto", "job-2", FINGERPRINT)
    assert found is not None
    restored = sharded_app(TrainingSpec(learning_rate=1e-2))
    checkpoint.load(found.location, restored, 0, reseed=0)
    assert restored.train.step == 1
    for name, tensor in weights(restored).items():
        torch.testing.assert_close(tensor, at_save[name], rtol=0, atol=0)


class QueuedDeviceWork:
    """Stands in for a GPU's compute stream on the CPU: work queued on it (the optimizer step's kernels) is
    done when a fence recorded after it is synchronized, or when the device gets to it (`run_late`)."""

    def __init__(self) -> None:
        self.queued: list[Callable[[], None]] = []

    def fence(self, device: torch.device) -> QueuedDeviceWork:
        return self

    def synchronize(self) -> None:
        self.run_late()

    def run_late(self) -> None:
        while self.queued:
            self.queued.pop(0)()


def test_a_checkpoint_stages_the_weights_after_the_optimizer_step_still_queued_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = QueuedDeviceWork()
    monkeypatch.setattr(checkpoint, "compute_fence", device.fence)
    app = sharded_app(TrainingSpec())
    train_step(app)

    def optimizer_step() -> None:
        with torch.no_grad():
            for parameter in app.model.parameters():
                parameter.add_(1.0)

    device.queued.append(optimizer_step)  # launched, not yet done: the save is started right after it
    run = Location.parse(str(tmp_path))
    checkpoints = saver(run)
    checkpoints.start(app, checkpoint.checkpoint_name(1, "a"), loss=4.0)
    checkpoints.wait_for_staging()
    device.run_late()  # without the fence the device finishes the step only now, after the copy
    checkpoints.wait()
    checkpoints.close()
    found = checkpoint.find_resume_point(run, "auto", "job-2", FINGERPRINT)
    assert found is not None
    restored = sharded_app(TrainingSpec())
    checkpoint.load(found.location, restored, 0, reseed=0)
    for name, tensor in weights(restored).items():
        torch.testing.assert_close(tensor, weights(app)[name], rtol=0, atol=0)


def test_a_save_that_fails_midway_leaves_nothing_resumable(
    run: Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = sharded_app(TrainingSpec())
    train_step(app)
    real_upload, real_save = Location.upload_from, checkpoint.dcp_save

    def upload_then_lose_the_connection(self: Location, local_dir: str) -> None:
        real_upload(self, local_dir)  # every shard arrives, yet the save does not finish
        raise OSError("connection reset")

    def write_then_lose_the_disk(*args: Any, **kwargs: Any) -> Any:
        real_save(*args, **kwargs)  # a local save is written in place: the failure comes after it
        raise OSError("connection reset")

    if run.is_local:
        monkeypatch.setattr(checkpoint, "dcp_save", write_then_lose_the_disk)
    else:
        monkeypatch.setattr(Location, "upload_from", upload_then_lose_the_connection)
    checkpoints = saver(run)
    checkpoints.start(app, checkpoint.checkpoint_name(1, "a"), loss=4.0)
    with pytest.raises(OSError, match="connection reset"):
        checkpoints.wait()
    checkpoints.close()
    assert [".metadata" in saved.listing for saved in checkpoint.run_checkpoints(run)] == [True], "shards"
    assert checkpoint.find_resume_point(run, "auto", "job-2", FINGERPRINT) is None


def test_a_local_checkpoint_is_written_in_place_with_no_upload_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_copies(self: Location, local_dir: str) -> None:
        raise AssertionError(f"{local_dir} copied to {self.uri}: the disk would hold the checkpoint twice")

    monkeypatch.setattr(Location, "upload_from", no_copies)
    monkeypatch.setattr(checkpoint.tempfile, "mkdtemp", lambda **_: pytest.fail("a staging directory"))
    app = sharded_app(TrainingSpec())
    train_step(app)
    checkpoints = saver(Location.parse(str(tmp_path)))
    checkpoints.start(app, checkpoint.checkpoint_name(1, "a"), loss=4.0)
    result = checkpoints.wait()
    checkpoints.close()
    assert result is not None and result.manifest is not None
    written = tmp_path / checkpoint.checkpoint_name(1, "a")
    assert {".metadata", "rng_rank00000.pt", "fsdp_manifest.json"} <= {p.name for p in written.iterdir()}
    assert checkpoint.find_resume_point(Location.parse(str(tmp_path)), "auto", "job-2", FINGERPRINT)


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = sharded_app(TrainingSpec())
    train_step(app)
    shards = checkpoint.staged_bytes({"app": app.state_dict()})
    assert shards > 4 * sum(p.numel() for p in app.model.parameters()), "weights and both AdamW moments"
    free = shards + checkpoint.DISK_RESERVE_BYTES - 1
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: shutil_usage(free))
    checkpoints = saver(Location.parse(str(tmp_path)))
    with pytest.raises(OSError, match="not enough disk for a checkpoint"):
        checkpoints.start(app, checkpoint.checkpoint_name(1, "a"), loss=4.0)
    checkpoints.close()
    assert list(tmp_path.iterdir()) == []


def shutil_usage(free: int) -> Any:
    return type("Usage", (), {"total": free, "used": 0, "free": free})()


def test_the_writer_process_saves_what_training_had_at_the_step(tmp_path: Path) -> None:
    app = sharded_app(TrainingSpec(learning_rate=1e-2))
    train_step(app)
    at_save = weights(app)
    run = Location.parse(str(tmp_path))
    checkpoints = saver(run, writer="process")
    checkpoints.start(app, checkpoint.checkpoint_name(1, "a"), loss=4.0)
    train_step(app, checkpoints)
    result = checkpoints.wait()
    checkpoints.close()
    assert result is not None and result.manifest is not None
    found = checkpoint.find_resume_point(run, "auto", "job-2", FINGERPRINT)
    assert found is not None
    restored = sharded_app(TrainingSpec(learning_rate=1e-2))
    checkpoint.load(found.location, restored, 0, reseed=0)
    for name, tensor in weights(restored).items():
        torch.testing.assert_close(tensor, at_save[name], rtol=0, atol=0)


def test_a_resumed_run_uses_its_own_learning_rate_and_weight_decay(tmp_path: Path) -> None:
    first = TrainingSpec(learning_rate=1e-3, weight_decay=0.0, max_steps=10, warmup_steps=0)
    app = sharded_app(first)
    train_step(app)
    train_step(app)
    checkpoints = saver(Location.parse(str(tmp_path)))
    checkpoints.start(app, checkpoint.checkpoint_name(2, "a"), loss=4.0)
    checkpoints.wait()
    checkpoints.close()

    changed = first.model_copy(update={"learning_rate": 5e-3, "weight_decay": 0.1})
    resumed = sharded_app(changed)
    found = checkpoint.find_resume_point(Location.parse(str(tmp_path)), "auto", "job-2", FINGERPRINT)
    assert found is not None
    checkpoint.load(found.location, resumed, 0, reseed=0)
    expected = 5e-3 * optim.lr_factor(2, changed)
    assert resumed.scheduler.get_last_lr() == pytest.approx([expected, expected])
    assert [group["lr"] for group in resumed.optimizer.param_groups] == pytest.approx([expected, expected])
    assert [group["weight_decay"] for group in resumed.optimizer.param_groups] == [0.1, 0.0]
    assert resumed.optimizer.state, "the AdamW moments were restored"


def test_a_checkpoint_restores_the_data_position_and_every_streams_cursor(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    texts = mixed_corpus(tmp_path / "corpus")
    layout = data.BatchLayout(world_size=1, micro_batch_size=2, grad_accumulation=2)

    def loader(tokenizer: CountingTokenizer) -> data.BatchLoader:
        spec = DataSpec(source=str(tmp_path / "corpus"), eval_fraction=0)
        datasets = data.build_datasets(spec, tokenizer, 320, 16, seed=1, streams=2)
        return data.BatchLoader(datasets.train, layout, 0, torch.device("cpu"))

    app = sharded_app(TrainingSpec(), loader(CountingTokenizer()))
    assert app.batches is not None
    for _ in range(200):  # a few hundred samples into each stream, well past its first shards
        list(app.batches.next_step())
    checkpoints = saver(Location.parse(str(tmp_path / "run")))
    checkpoints.start(app, checkpoint.checkpoint_name(200, "a"), loss=4.0)
    checkpoints.wait()
    checkpoints.close()
    uninterrupted = [torch.cat([batch.input_ids for batch in app.batches.next_step()]) for _ in range(20)]

    tokenizer = CountingTokenizer()
    restored = sharded_app(TrainingSpec(), loader(tokenizer))
    found = checkpoint.find_resume_point(Location.parse(str(tmp_path / "run")), "auto", "job-2", FINGERPRINT)
    assert found is not None and restored.batches is not None
    checkpoint.load(found.location, restored, 0, reseed=0)
    assert restored.batches.position == 200 * layout.samples_per_step
    continued = [torch.cat([batch.input_ids for batch in restored.batches.next_step()]) for _ in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(continued, uninterrupted, strict=True))
    tokenised = set(tokenizer.documents) & set(texts)
    assert len(tokenised) < 0.2 * len(texts), "the streams continue where they were, not from their start"
