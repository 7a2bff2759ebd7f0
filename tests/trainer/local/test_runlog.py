"""Each rank's log in S3: streamed while the rank runs, complete at its end or failure, capped, and free of
Secret values."""

from __future__ import annotations

import logging
import re
import sys
import uuid
import warnings

import pytest

from fsdp_trainer import runlog
from fsdp_trainer.contract import AttemptInfo, TrainerConfig, rank_log_name
from fsdp_trainer.errors import DataError
from fsdp_trainer.launch import LoopInput
from fsdp_trainer.loop import train_loop
from fsdp_trainer.storage import Location
from tests.support.clock import Clock
from tests.support.trainer_runs import TINY_QWEN2, config
from tests.support.waiting import wait_until

TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 [A-Z]+ ")


def test_a_failed_rank_leaves_its_whole_log_in_s3_without_the_secret(
    s3_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("TEAM_TOKEN", secret)
    for stream in ("stdout", "stderr"):  # the loop redacts them for the rest of the process: not pytest's
        monkeypatch.setattr(sys, stream, getattr(sys, stream))
    base = config(s3_storage)
    # A source that names the secret (a presigned URL, say) makes the failure's message carry it.
    trainer = TrainerConfig.model_validate(
        {
            **base.model_dump(),
            "data": {"source": f"{s3_storage}/missing/{secret}.jsonl", "evalFraction": 0},
            "model": {"fromConfig": {**TINY_QWEN2, "vocab_size": 272}, "tokenizer": "byte-level"},
            "secret_env_names": ["TEAM_TOKEN"],
        }
    )
    with pytest.raises(DataError):
        train_loop(
            LoopInput(trainer=trainer, submission_id="job-3", attempt=AttemptInfo(attempt=3)).model_dump(
                mode="json"
            )
        )

    text = Location.parse(trainer.run_uri()).child(rank_log_name(3, 0)).read_text()
    assert secret not in text
    assert "[TEAM_TOKEN redacted]" in text  # the failure is there, with the value replaced
    assert "rank 0 failed" in text and "Traceback" in text
    first_line = text.splitlines()[0]
    assert TIMESTAMPED.match(first_line), first_line


def test_lines_and_warnings_reach_storage_within_the_interval_and_all_at_the_end(s3_storage: str) -> None:
    """On the store's clock, which only the test moves: the first line goes out at once, the next ones once
    the interval has passed since, and whatever is left when the log is closed."""
    run = Location.parse(f"{s3_storage}/team-a/stream")
    clock = Clock()
    handler = runlog.RankLog(
        run.child(rank_log_name(1, 2)), runlog.Redactor([]), upload_seconds=0.5, clock=clock
    )
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    target = run.child("logs/attempt-1/rank-2.log")

    def stored() -> str:
        return target.read_text() if target.is_file() else ""

    try:
        logging.getLogger("fsdp_trainer.test").info("step 1/2 | loss 4.2")
        wait_until("the first line in storage", lambda: "step 1/2" in stored(), 10, interval=0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("lr scheduler stepped early", UserWarning, stacklevel=1)
        clock.now += 0.5 - 2**-10  # just before the interval has passed (binary fractions: exact sums)
        looked = clock.read_again(3)
        assert "lr scheduler" not in stored(), "stored again within the interval"
        assert looked, "the store stopped looking at its clock while a line waited"
        clock.now += 2**-10
        wait_until(
            "the warning in storage once the interval passed",
            lambda: "lr scheduler" in stored(),
            10,
            interval=0.05,
        )
        logging.getLogger("fsdp_trainer.test").info("step 2/2 | loss 3.9")
    finally:
        root.removeHandler(handler)
        handler.close()
        logging.captureWarnings(False)
    lines = target.read_text().splitlines()
    [warning] = [line for line in lines if "UserWarning: lr scheduler stepped early" in line]
    assert TIMESTAMPED.match(warning) and " WARNING py.warnings: " in warning
    assert lines[-1].endswith("step 2/2 | loss 3.9")

    # A worker restarted within the attempt continues the file.
    again = runlog.RankLog(target, runlog.Redactor([]), upload_seconds=0.5)
    again.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "after the restart", None, None))
    again.close()
    assert target.read_text().splitlines()[: len(lines)] == lines
    assert target.read_text().endswith("after the restart\n")


def test_a_long_log_keeps_its_start_and_its_end_within_the_cap() -> None:
    capped = runlog.CappedText(head_bytes=100, tail_bytes=200)
    lines = [f"line {i:04d} {'x' * 10}\n" for i in range(1000)]
    for line in lines:
        capped.add(line)
    text = capped.text()
    assert text.startswith(lines[0]) and text.endswith(lines[-1])
    kept = [line for line in text.splitlines(keepends=True) if line.startswith("line ")]
    assert sum(len(line) for line in kept) <= 300
    assert f"{capped.dropped} lines left out" in text and capped.dropped == 1000 - len(kept)


def test_secret_values_are_redacted_from_stdout_and_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    redact = runlog.Redactor(["A_SECRET"], environ={"A_SECRET": "s3cr3t-value", "SHORT": "1"})
    stream = runlog.RedactingStream(sys.stdout, redact)
    stream.write("token=s3cr3t-value in 1 place\n")
    stream.flush()
    assert capfd.readouterr().out == "token=[A_SECRET redacted] in 1 place\n"
