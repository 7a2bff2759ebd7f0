"""The progress record as the operator reads it: plain camelCase JSON next to the checkpoints."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from fsdp_trainer.contract import ErrorKind, ProgressRecord, SetupStage, TrainerConfig
from fsdp_trainer.driver import record_failure
from fsdp_trainer.progress import ProgressWriter, read_progress
from fsdp_trainer.storage import Location
from tests.support.clock import Clock
from tests.support.waiting import wait_until


def test_records_merge_and_history_is_flushed_per_attempt(tmp_path: Path) -> None:
    run = Location.parse(str(tmp_path / "run"))
    writer = ProgressWriter(run, "20260101T000000000000", run_name="run", phase="starting", max_steps=10)
    writer.write()
    writer.write(phase="training", step=1, loss=5.5, eval_loss=5.6, eval_perplexity=270.4)
    writer.update(step=2, loss=5.0)
    writer.close()  # stores what is pending
    document = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert document["phase"] == "training" and document["step"] == 2 and document["loss"] == 5.0
    assert document["evalLoss"] == 5.6, "evaluation results stay until the next evaluation"
    assert "updatedAt" in document and "eval_loss" not in document
    assert not (tmp_path / "run" / "metrics").exists(), "history is written at checkpoints, not every step"
    writer.flush_history()
    lines = (tmp_path / "run" / "metrics" / "20260101T000000000000.jsonl").read_text().splitlines()
    assert [json.loads(line)["phase"] for line in lines] == ["starting", "training", "training"]


def stored(run: Path) -> ProgressRecord:
    return ProgressRecord.model_validate_json((run / "progress.json").read_text())


def test_setup_heartbeats_name_the_stage_until_training_starts(tmp_path: Path) -> None:
    """On the store's clock, which only the test moves."""
    clock = Clock()
    writer = ProgressWriter(
        Location.parse(str(tmp_path)), "a", heartbeat_seconds=0.25, clock=clock, run_name="run",
        phase="starting", max_steps=10, submission_id="job-1",
    )  # fmt: skip
    try:
        writer.stage(SetupStage.LOADING_CHECKPOINT)
        first = stored(tmp_path)
        assert (first.phase, first.stage, first.submission_id) == ("starting", "loading-checkpoint", "job-1")
        # A long stage: no update from the trainer, yet the record is re-stored with a fresh time.
        clock.now += 0.25
        beat = wait_until(
            "a heartbeat", lambda: (r := stored(tmp_path)).updated_at > first.updated_at and r, 10
        )
        assert beat.stage == "loading-checkpoint" and beat.phase == "starting"

        writer.write(phase="training", stage=None, step=0)
        training = stored(tmp_path)
        assert training.stage is None
        store = writer._store
        with store.lock:
            clock.now += 10**6  # past any heartbeat
        for _ in range(
            3
        ):  # three looks: with nothing due the thread waits for a change, so the test wakes it
            with store.lock:
                reads = clock.reads
                store.lock.notify_all()
            assert clock.read_again(1, since=reads), "the store never looked at its clock again"
        assert stored(tmp_path).updated_at == training.updated_at, "no heartbeat once training: a hang shows"
    finally:
        writer.close()


class StalledStore:
    """The progress record's place in storage, whose writes hang until released (an S3 PUT that stalls)."""

    def __init__(self, inner: Location) -> None:
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def write_text(self, text: str) -> None:
        self.entered.set()
        self.release.wait(120)
        self.inner.write_text(text)


def test_progress_updates_never_wait_for_storage(tmp_path: Path) -> None:
    """The training loop's updates return while the background thread's store hangs; closing stores the
    newest record once storage answers."""
    writer = ProgressWriter(
        Location.parse(str(tmp_path)), "a", store_interval_seconds=0, run_name="run", phase="training",
        max_steps=10, submission_id="job-1",
    )  # fmt: skip
    stalled = StalledStore(writer._progress)
    try:
        writer.write(step=0)
        writer._progress = stalled  # type: ignore[assignment]
        writer.update(step=1, loss=4.0)
        assert stalled.entered.wait(60), "the background thread never began storing step 1"
        updates = threading.Thread(target=lambda: [writer.update(step=s, loss=5.0 - s) for s in range(2, 6)])
        updates.start()
        updates.join(60)  # a bound for a loaded machine; an update that waits for the store never returns
        assert not updates.is_alive(), "an update waited for the stalled store"
        assert stored(tmp_path).step == 0, "nothing got past the stalled store"
    finally:
        stalled.release.set()
        writer.close()
    assert stored(tmp_path).step == 5, "closing stores the newest record"


def test_a_failure_keeps_the_last_progress_and_says_why(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(
        {"run_name": "run", "model": {"source": "x"}, "checkpoint": {"storage_path": str(tmp_path)}}
    )
    run = Location.parse(config.run_uri())
    writer = ProgressWriter(run, "a", run_name="run", phase="training", max_steps=10, step=7, loss=3.2)
    writer.write()
    writer.close()
    record_failure(config, "DataError: no column 'text'", ErrorKind.DATA, "job-2")
    failed = read_progress(run)
    assert failed is not None
    assert (failed.phase, failed.step, failed.loss, failed.submission_id) == ("failed", 7, 3.2, "job-2")
    assert failed.error == "DataError: no column 'text'" and failed.error_kind == "data"


def test_a_failure_before_any_progress_still_leaves_a_record(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(
        {"run_name": "run", "model": {"source": "x"}, "checkpoint": {"storage_path": str(tmp_path)}}
    )
    record_failure(config, "RayActorError: lost", ErrorKind.RUNTIME)
    failed = read_progress(Location.parse(str(tmp_path / "default" / "run")))
    assert failed is not None and failed.phase == "failed" and failed.step == 0
