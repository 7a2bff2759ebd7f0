"""bench/gpu_fsdp.py's baseline B without a GPU: why it is not run (no CUDA, or torchtitan's import error,
word for word), its figures from torchtitan's per-step log lines, a run cut off at the time budget, and its
part of the summary. Nothing here trains: a script printing torchtitan's lines stands in for its run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_fsdp


def torchtitan_line(step: int, memory_gib: float, tps: float, mfu: float) -> str:
    """A line as torchtitan 0.3's MetricsProcessor.log writes it (colours off), with its logger's prefix."""
    return (
        f"[titan] 2026-09-01 12:00:00,000 - root - INFO - step: {step:2}  loss: {7.5:8.5f}  "
        f"grad_norm: {1.25:7.4f}  memory: {memory_gib:5.2f}GiB({22.05:.2f}%)  tps: {round(tps):,}  "
        f"tflops: {207.5:,.2f}  mfu: {mfu:.2f}%"
    )


LOG = "\n".join(
    [
        "[titan] 2026-09-01 12:00:00,000 - root - INFO - Building qwen3 28x1536",
        torchtitan_line(1, 40.0, 1_000, 1.0),  # warm-up: compilation
        torchtitan_line(2, 31.5, 20_000, 20.0),
        torchtitan_line(3, 31.0, 21_000, 21.0),
        torchtitan_line(4, 32.0, 22_000, 22.0),
    ]
)


def arguments(**overrides: Any) -> argparse.Namespace:
    settings = {
        "sequence_length": 64,
        "micro_batch_size": 2,
        "warmup_steps": 1,
        "steps": 3,
        "time_budget": 450.0,
    }
    return argparse.Namespace(**{**settings, **overrides})


def test_without_a_gpu_baseline_b_is_not_run_and_says_why() -> None:
    assert gpu_fsdp.baseline_b_unavailable(torch.device("cpu")) == (
        "not run: no CUDA device (torchtitan trains on GPUs only)",
        None,
    )


def test_an_import_failure_is_recorded_word_for_word(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "torchtitan").mkdir()  # a torchtitan whose import fails the way a missing dependency does
    (tmp_path / "torchtitan" / "__init__.py").write_text("import spmd_types_missing_here\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    reason, version = gpu_fsdp.baseline_b_unavailable(torch.device("cuda", 0))
    assert reason == "not run: ModuleNotFoundError: No module named 'spmd_types_missing_here'"
    assert version is None


def test_the_measured_steps_come_from_torchtitans_log_lines() -> None:
    parsed = gpu_fsdp.parse_torchtitan_log(LOG, warmup=1)
    assert parsed["tokens_per_second"] == [20_000.0, 21_000.0, 22_000.0]
    assert parsed["torchtitan_mfu_p50"] == pytest.approx(0.21)
    assert parsed["peak_memory_reserved_bytes"] == 32 * 2**30
    with pytest.raises(ValueError, match="no step after the warm-up"):
        gpu_fsdp.parse_torchtitan_log(LOG, warmup=4)


def test_a_run_gives_figures_and_our_ratio_to_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gpu_fsdp, "BASELINE_B_COMMAND", ["-c", f"print({LOG!r})"])
    result = gpu_fsdp.baseline_b(arguments(), gpu_fsdp.TINY, False, 60.0, tmp_path / "b.log")
    ours = {"tokens_per_second_per_gpu": {"p10": 40_000.0, "p50": 42_000.0, "p90": 44_000.0}}
    entry = gpu_fsdp.baseline_b_entry(result, ours, flops=1e9, spec_peak=1e14, matmul_peak=None)
    assert entry["baseline_b"]["tokens_per_second_per_gpu"]["p50"] == 21_000.0
    assert entry["baseline_b"]["mfu_spec_peak"] == pytest.approx(21_000.0 * 1e9 / 1e14)
    assert entry["ours_over_baseline_b_p50"] == pytest.approx(2.0)
    assert entry["baseline_b"]["settings"]["cuda_graphs"] is False, "eager against eager"
    assert (tmp_path / "b.log").read_text().strip() == LOG


def test_a_run_past_the_time_budget_is_stopped_and_recorded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(gpu_fsdp, "BASELINE_B_COMMAND", ["-c", "import time; time.sleep(60)"])
    result = gpu_fsdp.baseline_b(arguments(), gpu_fsdp.TINY, False, 1.0, tmp_path / "b.log")
    assert result == {"not_run": "not run: stopped after 1 s, the time budget left"}
    assert gpu_fsdp.baseline_b_entry(result, {}, 1e9, None, None) == {
        "baseline_b": {"finished": False, **result}
    }
    spent = gpu_fsdp.baseline_b(arguments(time_budget=300.0), gpu_fsdp.TINY, True, -5.0, tmp_path / "c.log")
    assert spent == {"not_run": "not run: the time budget of 300 s was spent"}


def test_a_failed_run_is_recorded_with_the_end_of_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    script = "import sys; print('torch.OutOfMemoryError: CUDA out of memory.'); sys.exit(3)"
    monkeypatch.setattr(gpu_fsdp, "BASELINE_B_COMMAND", ["-c", script])
    result = gpu_fsdp.baseline_b(arguments(), gpu_fsdp.TINY, False, 60.0, tmp_path / "b.log")
    assert result == {"not_run": "failed with exit code 3: torch.OutOfMemoryError: CUDA out of memory."}


def test_a_part_whose_checkpoints_exceed_the_disk_bound_is_not_run(tmp_path: Path) -> None:
    args = arguments(checkpoint_dir=tmp_path, disk_bound_gb=0.001)
    with pytest.raises(gpu_fsdp.NotRun, match=r"not run: 2 checkpoint\(s\) at once need"):
        gpu_fsdp.require_disk_for(args, 2, gpu_fsdp.TINY)


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
        summary.run(loop, "baseline_b", lambda: gpu_fsdp.on_alarm(0, None))
    assert json.loads(output.read_text())["loops"]["eager"]["baseline_b"]["not_run"].startswith("stopped")
