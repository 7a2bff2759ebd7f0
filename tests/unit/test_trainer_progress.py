"""The progress record as the operator reads it: plain camelCase JSON next to the checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_trainer.contract import ErrorKind, TrainerConfig
from fsdp_trainer.driver import record_failure
from fsdp_trainer.progress import ProgressWriter, read_progress
from fsdp_trainer.storage import Location


def test_records_merge_and_history_is_flushed_per_attempt(tmp_path: Path) -> None:
    run = Location.parse(str(tmp_path / "run"))
    writer = ProgressWriter(run, "20260101T000000000000", run_name="run", phase="starting", max_steps=10)
    writer.write()
    writer.write(phase="training", step=1, loss=5.5, eval_loss=5.6, eval_perplexity=270.4)
    writer.write(step=2, loss=5.0)
    document = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert document["phase"] == "training" and document["step"] == 2 and document["loss"] == 5.0
    assert document["evalLoss"] == 5.6, "evaluation results stay until the next evaluation"
    assert "updatedAt" in document and "eval_loss" not in document
    assert not (tmp_path / "run" / "metrics").exists(), "history is written at checkpoints, not every step"
    writer.flush_history()
    lines = (tmp_path / "run" / "metrics" / "20260101T000000000000.jsonl").read_text().splitlines()
    assert [json.loads(line)["phase"] for line in lines] == ["starting", "training", "training"]


def test_a_failure_keeps_the_last_progress_and_says_why(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(
        {"run_name": "run", "model": {"source": "x"}, "checkpoint": {"storage_path": str(tmp_path)}}
    )
    run = Location.parse(str(tmp_path / "run"))
    ProgressWriter(run, "a", run_name="run", phase="training", max_steps=10, step=7, loss=3.2).write()
    record_failure(config, "DataError: no column 'text'", ErrorKind.DATA)
    failed = read_progress(run)
    assert failed is not None
    assert (failed.phase, failed.step, failed.loss) == ("failed", 7, 3.2)
    assert failed.error == "DataError: no column 'text'" and failed.error_kind == "data"


def test_a_failure_before_any_progress_still_leaves_a_record(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate(
        {"run_name": "run", "model": {"source": "x"}, "checkpoint": {"storage_path": str(tmp_path)}}
    )
    record_failure(config, "RayActorError: lost", ErrorKind.RUNTIME)
    failed = read_progress(Location.parse(str(tmp_path / "run")))
    assert failed is not None and failed.phase == "failed" and failed.step == 0
