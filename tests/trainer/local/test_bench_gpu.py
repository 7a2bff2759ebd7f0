"""bench/gpu_fsdp.py's one run on the GPU machine, without a GPU: its time budget counts from the process's
start and a cut run ends within it (during the imports, in a part that stops at the alarm, or in one that
ignores it); the compiled loops come before the checkpoint saves; the disk check counts the state the
trainer saves for the shape; every part is written out as it ends. The parts themselves are stand-ins here,
except in the first test, which runs the script."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_trainer import checkpoint
from tests.support.paths import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_fsdp

BENCH = Path(gpu_fsdp.__file__).parent


def arguments(tmp_path: Path, **overrides: Any) -> argparse.Namespace:
    settings = {
        "tiny": True,
        "compile": "both",
        "sequence_length": 64,
        "micro_batch_size": 2,
        "warmup_steps": 1,
        "steps": 3,
        "time_budget": 450.0,
        "checkpoint_dir": tmp_path,
        "disk_bound_gb": 40.0,
        "output": tmp_path / "gpu_fsdp.json",
    }
    return argparse.Namespace(**{**settings, **overrides})


class ExitRecorder:
    """The watchdog's os._exit in a test: records when and with what it was called, and what the summary
    file held then (what a real run leaves)."""

    def __init__(self, output: Path | None = None) -> None:
        self.output = output
        self.called = threading.Event()
        self.status: int | None = None
        self.at = 0.0
        self.left: dict[str, Any] = {}

    def __call__(self, status: int) -> None:
        self.status, self.at = status, time.monotonic()
        if self.output is not None:
            self.left = json.loads(self.output.read_text())
        self.called.set()


def test_the_budget_counts_from_the_process_start_imports_included(tmp_path: Path) -> None:
    """The process sleeps 3 s before the script starts, and the budget is 3.5 s: a budget counted from the
    end of the imports (torch, transformers, the trainer: seconds on any host) would let it run far longer."""
    script = str(BENCH / "gpu_fsdp.py")
    argv = [script, "--tiny", "--time-budget", "3.5", "--output", str(tmp_path / "gpu_fsdp.json")]
    code = (
        "import runpy, sys, time; time.sleep(3); "
        f"sys.argv = {argv!r}; runpy.run_path({script!r}, run_name='__main__')"
    )
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    assert run.returncode == gpu_fsdp.HARD_STOP_EXIT, run.stderr[-2000:]
    assert "the time budget is spent" in run.stderr
    # Up to 2 s over for this process's own wait on a busy host: a budget counted after the imports overruns
    # by the imports' time (tens of seconds here).
    assert 3.4 < took < 3.5 + 2.0, f"{took:.1f} s for a budget of 3.5 s"


def test_a_part_running_at_the_alarm_is_stopped_and_recorded_before_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = arguments(tmp_path, time_budget=60.0, compile="off")  # the alarm 6 s before the deadline

    def slow_saves() -> dict[str, Any]:
        time.sleep(60)
        return {}

    def slow_parts(args: argparse.Namespace, summary: gpu_fsdp.Summary, *rest: Any) -> None:
        summary.run(summary.fields, "checkpoint_saves", slow_saves)

    monkeypatch.setattr(gpu_fsdp, "run_all", slow_parts)
    exits = ExitRecorder()
    deadline = time.monotonic() + 12.0
    gpu_fsdp.main(args, gpu_fsdp.Watchdog(deadline, exit=exits))
    assert time.monotonic() < deadline, "the alarm comes before the deadline, with a margin to clean up"
    summary = json.loads(args.output.read_text())
    assert summary["checkpoint_saves"]["not_run"] == "stopped: the time budget was spent while it ran"
    assert summary["ended"] == "the time budget: the part then running was stopped"
    assert summary["loops"]["eager"]["ours"]["not_run"] == gpu_fsdp.NOT_REACHED
    assert exits.called.wait(20)  # the process would have ended by now; the watchdog stays armed to the end


def test_a_part_that_ignores_the_alarm_is_ended_at_the_deadline_with_the_summary_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = arguments(tmp_path, time_budget=20.0, compile="off")
    exits = ExitRecorder(args.output)

    def stuck(args: argparse.Namespace, summary: gpu_fsdp.Summary, *rest: Any) -> None:
        summary.fields["checkpoint_saves"] = {"finished": False, "not_run": "in progress"}
        while not exits.called.is_set():  # a wait the alarm cannot end, until the process is ended
            with contextlib.suppress(gpu_fsdp.BudgetSpent):
                exits.called.wait(0.05)

    monkeypatch.setattr(gpu_fsdp, "run_all", stuck)
    deadline = time.monotonic() + 6.0
    gpu_fsdp.main(args, gpu_fsdp.Watchdog(deadline, exit=exits))
    assert exits.status == gpu_fsdp.HARD_STOP_EXIT
    assert deadline <= exits.at < deadline + 1.0
    assert exits.left["ended"] == "the time budget: the watchdog ended the process"
    assert exits.left["checkpoint_saves"]["not_run"] == "in progress"


def test_the_compiled_loops_run_first_and_the_checkpoint_saves_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []

    def loop(name: str) -> Any:
        def run(args: argparse.Namespace, compile_blocks: bool, *rest: Any) -> dict[str, Any]:
            ran.append(f"{name} {'compiled' if compile_blocks else 'eager'}")
            return {"tokens_per_second": [1.0, 2.0, 3.0]}

        return run

    def saves(*args: Any) -> dict[str, Any]:
        ran.append("checkpoint_saves")
        return {}

    monkeypatch.setattr(gpu_fsdp, "our_loop", loop("ours"))
    monkeypatch.setattr(gpu_fsdp, "baseline_a", loop("baseline_a"))
    monkeypatch.setattr(gpu_fsdp, "checkpoint_saves", saves)
    args = arguments(tmp_path)
    gpu_fsdp.main(args, gpu_fsdp.Watchdog(time.monotonic() + 300, exit=ExitRecorder()))
    assert ran == [
        "ours compiled",
        "baseline_a compiled",
        "ours eager",
        "baseline_a eager",
        "checkpoint_saves",
    ]
    summary = json.loads(args.output.read_text())
    assert list(summary["loops"]) == ["compiled", "eager"]
    for loop_summary in summary["loops"].values():
        assert set(loop_summary) == {"ours", "baseline_a", "ours_over_baseline_a_p50"}, "no baseline B"


def test_the_disk_check_counts_the_state_the_trainer_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2.5-1.5B: fp32 weights and AdamW's two moments, 12 bytes a parameter (18.52 GB), the tied
    embedding's second name (0.93 GB) where the trainer saves it under both, and DCP's records. The figure
    comes from checkpoint.AppState's own state dict: a tensor it gained would be counted."""
    parameters, tied_embedding = 1_543_714_304, 151936 * 1536 * 4
    per_checkpoint = gpu_fsdp.checkpoint_bytes(gpu_fsdp.QWEN25_15B)
    assert 12 * parameters < per_checkpoint < 12 * parameters + tied_embedding + 10e6

    tiny = gpu_fsdp.checkpoint_bytes(gpu_fsdp.TINY)
    saved = checkpoint.AppState.state_dict

    def with_one_more_tensor(self: checkpoint.AppState) -> dict[str, Any]:
        return {**saved(self), "more": torch.empty(1000, device="meta")}

    monkeypatch.setattr(checkpoint.AppState, "state_dict", with_one_more_tensor)
    assert gpu_fsdp.checkpoint_bytes(gpu_fsdp.TINY) == tiny + 4000 + gpu_fsdp.DCP_BYTES_PER_TENSOR


def test_a_part_whose_checkpoints_exceed_the_disk_bound_is_not_run(tmp_path: Path) -> None:
    args = arguments(tmp_path, disk_bound_gb=0.001)
    with pytest.raises(gpu_fsdp.NotRun, match=r"not run: 2 checkpoint\(s\) at once need"):
        gpu_fsdp.require_disk_for(args, 2, gpu_fsdp.checkpoint_bytes(gpu_fsdp.TINY))


def test_every_part_is_written_out_as_it_ends_whatever_becomes_of_it(tmp_path: Path) -> None:
    output = tmp_path / "gpu_fsdp.json"
    summary = gpu_fsdp.Summary({"loops": {"eager": {}}}, [output])
    loop = summary.fields["loops"]["eager"]
    assert summary.run(loop, "ours", lambda: {"tokens": 1})
    assert json.loads(output.read_text())["loops"]["eager"]["ours"] == {"finished": True, "tokens": 1}

    def out_of_memory() -> dict[str, Any]:
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert not summary.run(loop, "baseline_a", out_of_memory)
    written = json.loads(output.read_text())["loops"]["eager"]["baseline_a"]
    assert written["failed"] == "OutOfMemoryError: CUDA out of memory" and not written["finished"]
    with pytest.raises(gpu_fsdp.BudgetSpent):
        summary.run(loop, "ours", lambda: gpu_fsdp.on_alarm(0, None))
    assert json.loads(output.read_text())["loops"]["eager"]["ours"]["not_run"].startswith("stopped")
    assert [path.name for path in tmp_path.iterdir()] == ["gpu_fsdp.json"], "no partial file left"
