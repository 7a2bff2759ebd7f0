"""bench/gpu_fsdp.py's one run on the GPU machine, without a GPU: its time budget counts from the process's
start and a cut run ends within it (during the imports, in a part that stops at the alarm, or in one that
ignores it); the compiled loops come before the checkpoint saves; the disk check counts the state the
trainer saves for the shape; every part is written out as it ends. The parts themselves are stand-ins here,
except in the first test, which runs the script."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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
    """The watchdog's os._exit in a test: records when (on `clock`) and with what it was called, and what the
    summary file held then (what a real run leaves)."""

    def __init__(self, output: Path | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.output, self.clock = output, clock
        self.called = threading.Event()
        self.status: int | None = None
        self.at = 0.0
        self.left: dict[str, Any] = {}

    def __call__(self, status: int) -> None:
        self.status, self.at = status, self.clock()
        if self.output is not None:
            self.left = json.loads(self.output.read_text())
        self.called.set()


# Stands in for torch in the script's process: reports what the script set up before importing it, then
# never returns, as an import on a busy host may take longer than the whole budget.
HUNG_TORCH = """
import json, os, sys, time
script = sys.modules["__main__"]
seen = {"deadline": script.WATCHDOG.deadline, "started": script.PROCESS_STARTED}
print(json.dumps({**seen, "first_line": float(os.environ["FIRST_LINE"])}), flush=True)
time.sleep(3600)
"""


def test_the_budget_counts_from_the_process_start_imports_included(tmp_path: Path) -> None:
    """Told by the order of events, not by seconds: the deadline is the budget after a process start that
    precedes the interpreter's first line (monotonic time is one clock for every process), and the
    watchdog, armed before torch is imported, ends the process during an import that never returns."""
    (tmp_path / "stub" / "torch").mkdir(parents=True)
    (tmp_path / "stub" / "torch" / "__init__.py").write_text(HUNG_TORCH)
    script = str(BENCH / "gpu_fsdp.py")
    argv = [script, "--tiny", "--time-budget", "3.5", "--output", str(tmp_path / "gpu_fsdp.json")]
    code = (
        "import os, runpy, sys, time; os.environ['FIRST_LINE'] = repr(time.monotonic()); "
        f"sys.argv = {argv!r}; runpy.run_path({script!r}, run_name='__main__')"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "stub"), os.environ.get("PYTHONPATH")])),
    }
    before = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == gpu_fsdp.HARD_STOP_EXIT, run.stderr[-2000:]
    assert "the time budget is spent" in run.stderr
    assert not (tmp_path / "gpu_fsdp.json").exists(), "ended in the imports, before any part"
    seen = json.loads(run.stdout.splitlines()[0])
    assert seen["deadline"] == seen["started"] + 3.5
    tick = 1 / os.sysconf("SC_CLK_TCK")  # the kernel records a process's start in whole clock ticks
    assert before - tick <= seen["started"] <= seen["first_line"], seen


def test_a_process_descheduled_between_two_clock_reads_still_dates_its_start_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The boot clock leads the monotonic one by whatever the machine spent suspended (5 s here); the first
    read of the pair is 0.4 s late, as on a loaded machine, and must not move the start."""
    tick = os.sysconf("SC_CLK_TCK")
    clock = {"now": 1000.0}
    delays = iter([0.4] + [0.0] * 20)

    def monotonic() -> float:
        clock["now"] += 1e-6
        return clock["now"]

    def boot_clock(_: int) -> float:
        clock["now"] += next(delays)
        return clock["now"] + 5.0

    started_ticks = int(1004.5 * tick)  # at monotonic 999.5
    stat = "1 (python3) " + " ".join(["S"] + ["0"] * 18 + [str(started_ticks)] + ["0"] * 30)
    monkeypatch.setattr(gpu_fsdp.time, "monotonic", monotonic)
    monkeypatch.setattr(gpu_fsdp.time, "clock_gettime", boot_clock)
    monkeypatch.setattr(gpu_fsdp.Path, "read_text", lambda _: stat)
    assert gpu_fsdp.monotonic_at_process_start() == pytest.approx(999.5, abs=1e-3)


def test_a_part_running_at_the_alarm_is_stopped_and_recorded_before_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The alarm 15 s before the deadline (the most it leaves): room for main's preflight and last summary on
    # a loaded machine, where 6 s was once not enough.
    args = arguments(tmp_path, time_budget=150.0, compile="off")

    def slow_saves() -> dict[str, Any]:
        time.sleep(60)
        return {}

    def slow_parts(args: argparse.Namespace, summary: gpu_fsdp.Summary, *rest: Any) -> None:
        summary.run(summary.fields, "checkpoint_saves", slow_saves)

    monkeypatch.setattr(gpu_fsdp, "run_all", slow_parts)
    exits = ExitRecorder()
    gpu_fsdp.main(args, gpu_fsdp.Watchdog(time.monotonic() + 25.0, exit=exits))
    # By the order of events: the watchdog, which calls `exits` at the deadline, had not when main returned.
    assert not exits.called.is_set(), "the alarm comes before the deadline, with a margin to clean up"
    summary = json.loads(args.output.read_text())
    assert summary["checkpoint_saves"]["not_run"] == "stopped: the time budget was spent while it ran"
    assert summary["ended"] == "the time budget: the part then running was stopped"
    assert summary["loops"]["eager"]["ours"]["not_run"] == gpu_fsdp.NOT_REACHED
    assert exits.called.wait(40)  # the process would have ended by now; the watchdog stays armed to the end


class Clock:
    """The watchdog's clock: moves only when its sleep is called, and then at once by the whole sleep."""

    def __init__(self, before_sleeping: threading.Event) -> None:
        self.now, self.before_sleeping = 1000.0, before_sleeping

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert self.before_sleeping.wait(60), "the part under test never started"
        self.now += seconds


def test_a_part_that_ignores_the_alarm_is_ended_at_the_deadline_with_the_summary_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the watchdog's clock, which the test moves: the watchdog sleeps until the deadline and ends the
    process there, whatever the part does."""
    args = arguments(tmp_path, time_budget=20.0, compile="off")
    in_part = threading.Event()
    clock = Clock(in_part)
    exits = ExitRecorder(args.output, clock)

    def stuck(args: argparse.Namespace, summary: gpu_fsdp.Summary, *rest: Any) -> None:
        summary.fields["checkpoint_saves"] = {"finished": False, "not_run": "in progress"}
        in_part.set()
        give_up = time.monotonic() + 60  # bounded: a watchdog that never ends it fails the asserts below
        while not exits.called.is_set() and time.monotonic() < give_up:  # a wait the alarm cannot end
            with contextlib.suppress(gpu_fsdp.BudgetSpent):
                exits.called.wait(0.05)

    monkeypatch.setattr(gpu_fsdp, "run_all", stuck)
    deadline = clock.now + 60.0
    gpu_fsdp.main(args, gpu_fsdp.Watchdog(deadline, exit=exits, clock=clock, sleep=clock.sleep))
    assert exits.status == gpu_fsdp.HARD_STOP_EXIT
    assert exits.at == deadline
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


def test_our_loops_figures_survive_the_alarm_in_its_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The alarm fires while the last step's checkpoint is saved (on the GPU machine: 18.5 GB, fsynced):
    the steps measured before it are in the summary all the same. Our real loop, tiny, on the CPU."""
    from fsdp_trainer.checkpoint_manager import CheckpointManager

    def alarm_in_the_save(*args: Any, **kwargs: Any) -> None:
        gpu_fsdp.on_alarm(0, None)  # what SIGALRM's handler raises wherever the main thread is

    monkeypatch.setattr(CheckpointManager, "save", alarm_in_the_save)
    args = arguments(tmp_path, compile="off")
    summary = gpu_fsdp.Summary({"loops": {"eager": {}}}, [args.output])
    loop = summary.fields["loops"]["eager"]
    peaks = (1e9, None, None)
    ours = functools.partial(gpu_fsdp.our_loop, args, False, gpu_fsdp.TINY, 1)
    with pytest.raises(gpu_fsdp.BudgetSpent):
        summary.run(loop, "ours", functools.partial(gpu_fsdp.with_figures, ours, peaks))
    written = json.loads(args.output.read_text())["loops"]["eager"]["ours"]
    assert written["not_run"].startswith("stopped") and not written["finished"]
    assert written["measured_steps"] == args.steps, written
    assert written["tokens_per_second_per_gpu"]["p50"] > 0, written


def test_without_a_c_compiler_the_compiled_loops_are_not_run_and_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang to be found
    monkeypatch.delenv("CC", raising=False)
    found = gpu_fsdp.host_preflight(tmp_path)
    assert found["c_compiler"] is None and found["disk_free_bytes"] > 0
    refusal = gpu_fsdp.compile_toolchain_missing(found)
    assert refusal is not None and "need a C compiler (cc, gcc or clang; CC)" in refusal
    args = arguments(tmp_path)
    for loop in (
        functools.partial(gpu_fsdp.our_loop, args, True, gpu_fsdp.TINY, 1),
        functools.partial(gpu_fsdp.baseline_a, args, True),
    ):
        with pytest.raises(gpu_fsdp.NotRun, match="C compiler"):
            loop()


def test_the_allocator_setting_is_in_place_before_anything_starts_cuda() -> None:
    """Set as the script is imported: the matmul peak and the preflight start CUDA before any loop, and CUDA
    reads the setting once, then."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTORCH_CUDA_ALLOC_CONF"}
    code = "import gpu_fsdp, os; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=BENCH, env=environment, capture_output=True, text=True, timeout=300
    )
    assert found.stdout.strip().splitlines()[-1] == "expandable_segments:True", found.stderr[-2000:]
