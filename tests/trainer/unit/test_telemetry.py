"""The metrics processor: records only every logEvery steps (no host sync or collective in between), tokens/s
that time outside training steps (evaluations, checkpoint stalls) does not lower, and records that reach the
progress writer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_trainer import distributed, telemetry
from fsdp_trainer.contract import ProgressRecord
from fsdp_trainer.progress import ProgressWriter
from fsdp_trainer.storage import Location
from fsdp_trainer.telemetry import MetricsProcessor, Throughput
from fsdp_trainer.validate import EvalResult
from tests.support.clock import Clock


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stands in for the all-reduces the processor could make (one rank: the value is the result)."""
    calls: list[str] = []

    def maximum(value: float, device: torch.device) -> float:
        calls.append("max")
        return value

    monkeypatch.setattr(telemetry.distributed, "maximum", maximum)
    return calls


def processor(tmp_path: Path, clock: Clock, log_every: int = 10) -> tuple[MetricsProcessor, ProgressWriter]:
    runtime = distributed.Runtime("single", 0, 1, 0, 1, torch.device("cpu"))
    writer = ProgressWriter(Location.parse(str(tmp_path)), "a", run_name="r", phase="training", max_steps=30)
    metrics = MetricsProcessor(runtime, writer, Throughput(1000, 6e6), log_every, max_steps=30, clock=clock)
    return metrics, writer


def step(metrics: MetricsProcessor, clock: Clock, number: int, seconds: float = 0.5) -> object:
    clock.now += seconds
    return metrics.step_done(number, torch.tensor(2.0), torch.tensor(1.5), 1e-4, number * 1000)


def test_only_logging_steps_sync_and_reduce(tmp_path: Path, collectives: list[str]) -> None:
    clock = Clock(100.0)
    metrics, writer = processor(tmp_path, clock)
    records = [step(metrics, clock, n) for n in range(1, 21)]
    writer.close()
    assert [n for n, record in enumerate(records, start=1) if record is not None] == [10, 20]
    # The loss comes reduced from the step (optim.global_loss): the peak memory is the record's one reduction.
    assert collectives == ["max", "max"], "one all-reduce per record, none in between"


def test_evaluation_and_checkpoint_time_do_not_lower_tokens_per_second(
    tmp_path: Path, collectives: list[str]
) -> None:
    clock = Clock(100.0)
    metrics, writer = processor(tmp_path, clock, log_every=4)
    for n in range(1, 4):
        step(metrics, clock, n)
    clock.now += 30.0  # an evaluation and a checkpoint stall
    metrics.evaluated(EvalResult(loss=3.0, perplexity=20.1, seconds=20.0), 10)
    metrics.checkpoint_staged(blocked_seconds=10.0)
    record = step(metrics, clock, 4)
    writer.close()
    assert record is not None
    assert record.step_time_seconds == pytest.approx(0.5)
    assert record.tokens_per_second == pytest.approx(2000.0)
    assert (record.loss, record.grad_norm, record.tokens_seen) == (2.0, 1.5, 4000)
    assert (record.eval_loss, record.eval_perplexity, record.checkpoint_blocked_seconds) == (3.0, 20.1, 10.0)


def test_a_checkpoint_adds_no_record_of_its_own_so_no_step_is_counted_twice(
    tmp_path: Path, collectives: list[str]
) -> None:
    clock = Clock(100.0)
    metrics, writer = processor(tmp_path, clock, log_every=1)
    step(metrics, clock, 1)
    metrics.checkpoint_staged(blocked_seconds=0.25)  # the save at step 1, staged during step 2
    step(metrics, clock, 2)
    metrics.checkpoint_staged(blocked_seconds=0.5)  # the save at the last step, staged at the end
    metrics.finished(2, None)
    writer.close()
    history = [
        ProgressRecord.model_validate_json(line)
        for line in (tmp_path / "metrics" / "a.jsonl").read_text().splitlines()
    ]
    assert [(r.phase, r.step) for r in history] == [("training", 1), ("training", 2), ("finished", 2)]
    assert [r.checkpoint_blocked_seconds for r in history] == [None, 0.25, 0.5]
