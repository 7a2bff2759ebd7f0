"""`kubectl trainingrun`: logs followed from S3 as the trainer streams them, the run at a glance, and the
loss curves, against the test S3 server and a kubectl stand-in that answers with a run object."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import Any

import boto3
import pytest

from fsdp_client import logs as run_logs
from fsdp_client import plot
from fsdp_client.storage import RunObjects, storage_prefix
from fsdp_operator import api
from fsdp_trainer import runlog
from fsdp_trainer.contract import MlflowRunRef, ProgressRecord, RunRecord, TrainerConfig, rank_log_name
from fsdp_trainer.storage import Location
from kubectl_trainingrun import cli

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def run_object(storage: str, phase: str = "Running", attempt: int = 2) -> dict[str, Any]:
    run = api.FSDPTrainingRun.model_validate(
        {
            "metadata": {"name": "tiny", "namespace": "team-a"},
            "spec": {"model": {"source": "Qwen/Qwen3-0.6B"}, "checkpoint": {"storagePath": storage}},
            "status": {
                "phase": phase,
                "attempt": attempt,
                "jobSubmissionId": f"tiny-1234abcd-{attempt}",
                "image": {"requested": "dlc:2.58", "digest": "dlc@sha256:" + "a" * 64},
                "progress": {
                    "step": 40,
                    "maxSteps": 100,
                    "loss": 2.5,
                    "evalLoss": 2.75,
                    "tokensPerSecond": 1234.5,
                },
                "transport": {"observed": "gloo"},
                "fabric": {
                    "attempt": 2,
                    "report": {
                        "backend": "gloo",
                        "transport": "gloo",
                        "passed": True,
                        "seconds": 1.25,
                        "message": "bus bandwidth 1.2 GB/s at 64 MiB over 2 pod(s)",
                    },
                    "avoidedNodes": [
                        {"node": "ip-10-0-1-7", "labelledAt": "2026-12-04T18:00:00Z", "why": "slow"}
                    ],
                },
                "checkpoints": {
                    "recent": [{"uri": f"{storage}/team-a/tiny/checkpoint_1", "step": 30, "time": NOW}]
                },
                "restarts": {
                    "count": 1,
                    "history": [
                        {"time": NOW, "reason": "WorkerLost", "message": "pod gone", "resumedFromStep": 30}
                    ],
                },
                "record": {
                    "uri": f"{storage}/team-a/tiny/run.json",
                    "logsUri": f"{storage}/team-a/tiny/logs",
                },
            },
        }
    )
    return run.model_dump(mode="json", by_alias=True, exclude_none=True)


def options(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(argv)


def test_kubectls_options_are_taken_before_or_after_the_command() -> None:
    before = options("-n", "team-a", "--context", "prod", "logs", "tiny", "-f", "--rank", "3")
    after = options("logs", "tiny", "--namespace", "team-a", "--context", "prod", "--attempt", "2")
    for parsed in (before, after):
        assert cli.kubectl_args(parsed) == ["--namespace", "team-a", "--context", "prod"]
    assert (before.follow, before.rank, before.attempt) == (True, 3, None)
    assert (after.follow, after.rank, after.attempt) == (False, 0, 2)


def test_following_prints_every_line_once_while_the_trainer_streams_and_stops_when_the_run_ends(
    s3_storage: str,
) -> None:
    """Counted in the plugin's polls, not in seconds: the trainer stores one line between each two reads
    (the plugin's sleep), each read prints that line and only it, and the read after the run ended is the
    last."""
    run = run_object(s3_storage)
    target = Location.parse(f"{s3_storage}/team-a/tiny").child(rank_log_name(2, 1))
    writer = runlog.RankLog(target, runlog.Redactor([]), upload_seconds=3600)  # stored on flush() only
    printed: list[str] = []
    polls = 0

    def trainer_steps_meanwhile(seconds: float) -> None:
        nonlocal polls
        assert seconds == run_logs.FOLLOW_POLL_SECONDS
        polls += 1
        assert polls <= 20, "still following long after the run ended"
        if polls <= 8:
            writer.emit(
                logging.LogRecord("fsdp_trainer", logging.INFO, __file__, 1, f"step {polls}", None, None)
            )
            writer.flush()
        if polls == 8:
            writer.close()
            run["status"]["phase"] = "Succeeded"

    objects = RunObjects(boto3.client("s3"), storage_prefix(run))
    cli.logs(
        options("logs", "tiny", "-f", "--rank", "1"),
        run,
        objects,
        printed.append,
        lambda: run,
        sleep=trainer_steps_meanwhile,
    )

    # What each read printed: nothing before the first line, then the one line stored since the read before.
    per_read = [[line.rsplit(": ", 1)[-1] for line in text.splitlines()] for text in printed]
    assert per_read == [[], *([f"step {step}"] for step in range(1, 9)), []], printed
    assert polls == 9  # one read after the run ended, for the last lines, and no more


def test_following_a_capped_log_continues_after_the_last_line_printed() -> None:
    printed = "a 1\na 2\na 3\n"
    capped = "a 1\n[... 1 lines left out ...]\na 3\na 4\n"
    assert run_logs.new_output(printed, capped) == "a 4\n"
    assert run_logs.new_output(printed, printed + "a 4\n") == "a 4\n"


def test_describe_shows_the_whole_run_on_one_screen(s3_storage: str) -> None:
    text = cli.describe(run_object(s3_storage))
    assert len(text.splitlines()) <= 40
    for expected in (
        "team-a/tiny",
        "Running",
        "dlc@sha256:" + "a" * 64,
        "step 40/100",
        "loss 2.5000",
        "eval loss 2.7500",
        "1,234 tok/s",
        f"{s3_storage}/team-a/tiny/checkpoint_1",
        "WorkerLost  resumed from step 30  pod gone",
        "Fabric check:  attempt 2 passed in 1.2 s: bus bandwidth 1.2 GB/s at 64 MiB over 2 pod(s)  "
        "(nodes labelled slow: ip-10-0-1-7)",
        f"{s3_storage}/team-a/tiny/run.json",
        f"{s3_storage}/team-a/tiny/logs",
    ):
        assert expected in text, expected
    assert "MLflow" not in text  # tracking off


def test_describe_says_the_data_format_what_became_of_the_rows_and_the_adapters_size(s3_storage: str) -> None:
    run = run_object(s3_storage)
    run["spec"]["data"] = {"source": "s3://d/chats.jsonl", "format": "messages"}
    run["spec"]["fsdp"] = {"adapter": {"rank": 8}}
    run["status"]["progress"].update(
        dataRows={"read": 800, "unparsable": 3, "truncated": 5, "dropped": 2}, adapterBytes=4_194_304
    )
    text = cli.describe(run)
    assert (
        "s3://d/chats.jsonl  format messages, loss on assistant turns, packed; 800 rows read, 3 unparsable, "
        "5 truncated, 2 dropped" in text
    ), text
    assert "LoRA rank 8 alpha 32 on default projections, 4.0 MiB" in text, text


def test_describe_links_the_mlflow_run_once_the_trainer_has_created_it(s3_storage: str) -> None:
    run = run_object(s3_storage)
    run["spec"]["tracking"] = {"mlflow": {"trackingUri": "https://mlflow.example.com/"}}
    assert "MLflow run:    - (not created yet)" in cli.describe(run)
    ref = MlflowRunRef(
        tracking_uri="https://mlflow.example.com/", experiment_id="7", run_id="r1", submission_id="s"
    )
    run["status"]["record"]["mlflowRun"] = api.MlflowRunStatus.of(ref).model_dump(mode="json", by_alias=True)
    assert "MLflow run:    https://mlflow.example.com/#/experiments/7/runs/r1" in cli.describe(run)


def history(steps: range, loss: float, resumed: int | None = None, eval_at: int | None = None) -> str:
    records = []
    for step in steps:
        record = ProgressRecord(
            run_name="tiny",
            phase="training",
            step=step,
            max_steps=20,
            loss=loss - step * 0.1,
            resumed_from_step=resumed,
            eval_loss=loss if eval_at is not None and step >= eval_at else None,
            updated_at=NOW,
        )
        records.append(record.to_json())
    return "\n".join(records) + "\n"


def put_metrics(storage: str) -> None:
    bucket, prefix = storage.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3")
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}/team-a/tiny/metrics/20261201T1000.jsonl",
        Body=history(range(1, 13), 4.0),
    )
    second = history(range(11, 21), 3.5, resumed=10, eval_at=20)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/team-a/tiny/metrics/20261201T1100.jsonl", Body=second)


def kubectl_stand_in(tmp_path: Path, run: dict[str, Any]) -> Path:
    """A `kubectl` that prints the run and records the arguments it was given."""
    (tmp_path / "run.json").write_text(json.dumps(run))
    script = tmp_path / "kubectl"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/args\ncat {tmp_path}/run.json\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "args"


def test_plot_draws_both_curves_of_every_attempt_and_marks_the_restart(
    s3_storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    put_metrics(s3_storage)
    args = kubectl_stand_in(tmp_path, run_object(s3_storage, phase="Succeeded"))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    assert cli.main(["plot", "tiny", "-n", "team-a", "--context", "lab"]) == 0
    assert args.read_text().split()[-4:] == ["--namespace", "team-a", "--context", "lab"]
    drawing = capsys.readouterr().out
    assert plot.LOSS_MARK in drawing and plot.EVAL_MARK in drawing and plot.RESTART_MARK in drawing
    assert "restart (from step 10)" in drawing

    image = tmp_path / "loss.png"
    assert cli.main(["plot", "tiny", "-o", str(image)]) == 0
    width, height, pixels = decode_png(image.read_bytes())
    assert (width, height) == (plot.WIDTH, plot.HEIGHT)
    for colour in (plot.LOSS_COLOUR, plot.EVAL_COLOUR, plot.RESTART_COLOUR):
        assert bytes(colour) in {pixels[i : i + 3] for i in range(0, len(pixels), 3)}, colour


def decode_png(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and RGB pixels of an 8-bit RGB PNG with filter 0 rows (what plot.png writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    chunks, at = {}, 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind = data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[at + 8 + length : at + 12 + length])[0]
        chunks[kind] = body
        at += 12 + length
    rows = zlib.decompress(chunks[b"IDAT"])
    stride = 3 * width + 1
    return width, height, b"".join(rows[y * stride + 1 : (y + 1) * stride] for y in range(height))


def test_describe_and_logs_need_no_more_than_kubectl_and_the_users_s3_access(
    s3_storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    kubectl_stand_in(tmp_path, run_object(s3_storage, phase="Failed", attempt=1))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert cli.main(["describe", "tiny"]) == 0
    assert "Phase:         Failed" in capsys.readouterr().out

    assert cli.main(["logs", "tiny"]) == 1
    assert "no log at" in capsys.readouterr().err
    bucket, prefix = s3_storage.removeprefix("s3://").split("/", 1)
    boto3.client("s3").put_object(
        Bucket=bucket, Key=f"{prefix}/team-a/tiny/logs/attempt-1/driver.log", Body=b"driver says hi\n"
    )
    assert cli.main(["logs", "tiny", "--driver", "-f"]) == 0
    assert capsys.readouterr().out == "driver says hi\n"


def test_following_across_a_restart_prints_the_end_of_one_attempt_then_the_next(s3_storage: str) -> None:
    run = run_object(s3_storage, attempt=1)
    bucket, prefix = s3_storage.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3")

    def put(attempt: int, text: str) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}/team-a/tiny/logs/attempt-{attempt}/rank-0.log", Body=text)

    put(1, "one\n")
    printed: list[str] = []
    polls = 0

    def restart_meanwhile(seconds: float) -> None:
        """Counted in the plugin's polls, not in seconds: between the first two reads attempt 1 stores its
        last words and the run restarts; attempt 2's log is stored only after the next read, and the run
        ends after the one after."""
        nonlocal polls
        polls += 1
        assert polls <= 10, "still following long after the run ended"
        if polls == 1:
            put(1, "one\nlast words\n")
            run["status"]["attempt"] = 2
        elif polls == 3:
            put(2, "resumed\n")
        elif polls == 4:
            run["status"]["phase"] = "Succeeded"

    objects = RunObjects(s3, storage_prefix(run))
    cli.logs(
        options("logs", "tiny", "-f"), run, objects, printed.append, lambda: run, sleep=restart_meanwhile
    )
    # What each read printed: attempt 1's first line; at the restart its last words and the new log's name
    # (attempt 2's log not stored yet: nothing of it, then or at the next read); attempt 2's first line;
    # nothing new, and once more after the run ended, for the last lines, and no more.
    assert printed == [
        "one\n",
        "last words\n",
        "\n[--- logs/attempt-2/rank-0.log ---]\n",
        "resumed\n",
        "",
        "",
    ], printed
    assert polls == 5


def put_record(storage: str, name: str, namespace: str, **config: Any) -> dict[str, Any]:
    """A run's record and its loss history in S3 (as the operator and the trainer write them), and the run."""
    bucket, prefix = storage.removeprefix("s3://").split("/", 1)
    record = RunRecord(
        run_name=name,
        namespace=namespace,
        uid=f"uid-{name}",
        image_requested="dlc:2.58",
        image_digest="dlc@sha256:" + "a" * 64,
        phase="Succeeded",
        start_time=NOW,
        config=TrainerConfig.model_validate(
            {
                "run_name": name,
                "namespace": namespace,
                "model": {"source": "Qwen/Qwen3-0.6B"},
                "checkpoint": {"storage_path": storage},
                **config,
            }
        ),
        final_progress=ProgressRecord(run_name=name, phase="training", step=20, max_steps=20, loss=2.0,
                                      updated_at=NOW),
    )  # fmt: skip
    s3 = boto3.client("s3")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{namespace}/{name}/run.json", Body=record.model_dump_json())
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}/{namespace}/{name}/metrics/20261201T1000.jsonl",
        Body=history(range(1, 21), 4.0),
    )
    run = run_object(storage)
    run["metadata"] |= {"name": name, "namespace": namespace}
    return run


def test_diff_shows_exactly_what_differs_between_two_runs_of_two_namespaces(
    s3_storage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"training": {"learning_rate": 1e-4}, "data": {"source": f"{s3_storage}/data/a.jsonl"}}
    changed = {"training": {"learning_rate": 3e-4}, "data": {"source": f"{s3_storage}/data/b.jsonl"}}
    runs = [
        put_record(s3_storage, "first", "team-a", **base),
        put_record(s3_storage, "second", "team-b", **changed),
    ]
    for run in runs:
        (tmp_path / f"{run['metadata']['name']}.json").write_text(json.dumps(run))
    script = tmp_path / "kubectl"  # prints the run named in its arguments
    script.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ -f {tmp_path}/$a.json ] && cat {tmp_path}/$a.json; done; exit 0\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    assert cli.main(["diff", "first", "second", "-n", "team-a", "--other-namespace", "team-b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["FIELD", "team-a/first", "team-b/second"]
    assert [line.split()[0] for line in lines[1:]] == ["config.training.learning_rate", "config.data.source"]
    assert lines[1].split()[1:] == ["0.0001", "0.0003"]

    assert cli.main(["diff", "first", "first", "-n", "team-a"]) == 0
    assert capsys.readouterr().out == "no differences\n"
    assert cli.main(["diff", "first", "first", "-n", "team-a", "--all"]) == 0
    everything = capsys.readouterr().out
    assert (
        "image_digest" in everything
        and "loss at step 20" in everything
        and "config.run_name" not in everything
    )
