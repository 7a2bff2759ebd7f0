"""The metrics processor: the training loop's metric collectives and their host synchronisations happen
here, once per logging interval (each step's finiteness check, optim.all_finite, is the only other); records
of steps, skipped steps, evaluations, checkpoints and the end of training go to the background progress
writer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsdp_trainer import distributed
from fsdp_trainer.contract import ProgressRecord
from fsdp_trainer.metrics import model_flops_utilisation, peak_flops
from fsdp_trainer.progress import ProgressWriter
from fsdp_trainer.tracking import MlflowTracker
from fsdp_trainer.validate import EvalResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Throughput:
    """What one optimizer step is worth, for tokens/s and MFU."""

    tokens_per_step: int
    flops_per_token: float


class MetricsProcessor:
    """Collects each step's loss and gradient norm as device tensors and turns them into a progress record
    every `log_every` steps (and at the last step). Steps in between cost no host sync and no collective.

    Time spent outside training steps (evaluation, the blocking part of a checkpoint) is `exclude`d, so it
    never lowers the reported tokens/s or MFU. The peak-memory counter is reset after every record, so each
    record shows the peak of its own interval.
    """

    def __init__(
        self,
        runtime: distributed.Runtime,
        progress: ProgressWriter | None,
        throughput: Throughput,
        log_every: int,
        max_steps: int,
        clock: Callable[[], float] = time.perf_counter,
        tracker: MlflowTracker | None = None,
    ) -> None:
        self.runtime, self.progress, self.throughput = runtime, progress, throughput
        self.tracker = tracker
        self.log_every, self.max_steps, self.clock = log_every, max_steps, clock
        self.interval_start = clock()
        self.interval_steps = 0
        self.last_loss: float | None = None
        self.non_finite_steps = 0
        self.checkpoint_blocked_seconds: float | None = None  # of the latest save, once staged
        device = runtime.device
        self.peak_flops = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        _reset_peak_memory(device)

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def step_done(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, learning_rate: float, tokens_seen: int
    ) -> ProgressRecord | None:
        """Counts a finished step; on logging steps, reduces and records it (every rank must call this)."""
        self.interval_steps += 1
        if not self.due(step):
            return None
        device = self.runtime.device
        self.last_loss = float(loss)
        memory = distributed.maximum(_peak_memory(device), device)
        elapsed = self.clock() - self.interval_start
        tokens_per_second = self.throughput.tokens_per_step * self.interval_steps / elapsed
        per_device = tokens_per_second / self.runtime.world_size
        record = None
        if self.progress is not None:
            record = self.progress.update(
                phase="training",
                step=step,
                loss=self.last_loss,
                learning_rate=learning_rate,
                grad_norm=float(grad_norm),
                tokens_per_second=tokens_per_second,
                tokens_per_second_per_device=per_device,
                step_time_seconds=elapsed / self.interval_steps,
                mfu=model_flops_utilisation(per_device, self.throughput.flops_per_token, self.peak_flops),
                peak_memory_bytes=int(memory),
                tokens_seen=tokens_seen,
                checkpoint_blocked_seconds=self.checkpoint_blocked_seconds,
            )
            log.info("%s", summary(record))
            if self.tracker is not None:
                self.tracker.log_metrics(
                    step,
                    {
                        "loss": record.loss,
                        "learning_rate": record.learning_rate,
                        "grad_norm": record.grad_norm,
                        "tokens_per_second": record.tokens_per_second,
                        "tokens_per_second_per_device": record.tokens_per_second_per_device,
                        "step_time_seconds": record.step_time_seconds,
                        "mfu": record.mfu,
                        "tokens_seen": record.tokens_seen,
                    },
                )
        _reset_peak_memory(device)
        self.interval_start, self.interval_steps = self.clock(), 0
        return record

    def step_skipped(self, step: int, loss: torch.Tensor) -> None:
        """A step whose update was skipped for a non-finite loss or gradient norm (every rank calls this;
        the finiteness check has already waited for `loss`)."""
        self.non_finite_steps += 1
        log.warning(
            "step %d: loss or gradient norm not finite (loss %s): update skipped (%d so far)",
            step,
            float(loss),
            self.non_finite_steps,
        )
        if self.progress is not None:
            self.progress.update(non_finite_steps=self.non_finite_steps)

    def exclude(self, seconds: float) -> None:
        """Time inside the interval that was not spent training."""
        self.interval_start += seconds

    def training_started(self) -> None:
        """Ends the setup stages: the operator sees the run training."""
        if self.progress is not None:
            self.progress.write(phase="training", stage=None)

    def evaluated(self, result: EvalResult | None, step: int) -> None:
        if result is None:
            return
        self.exclude(result.seconds)
        if self.progress is not None:
            log.info("eval loss %.4f perplexity %.2f", result.loss, result.perplexity)
            self.progress.update(eval_loss=result.loss, eval_perplexity=result.perplexity)
        if self.tracker is not None:
            self.tracker.log_metrics(step, {"eval_loss": result.loss, "eval_perplexity": result.perplexity})

    def checkpoint_staged(self, blocked_seconds: float) -> None:
        """A save has its copy of the state, having held training up for `blocked_seconds`. The figure goes
        into the next record (a record of its own would repeat the step's); the history so far is stored
        with the checkpoint."""
        self.exclude(blocked_seconds)
        self.checkpoint_blocked_seconds = blocked_seconds
        if self.progress is not None:
            self.progress.flush_history()
        if self.tracker is not None:
            self.tracker.flush()

    def finished(self, step: int, exported_model_uri: str | None) -> None:
        if self.progress is not None:
            self.progress.write(
                phase="finished",
                step=step,
                exported_model_uri=exported_model_uri,
                checkpoint_blocked_seconds=self.checkpoint_blocked_seconds,
            )
            self.progress.flush_history()


def resident_bytes(peak: bool = False) -> int:
    """This process's resident memory now (VmRSS), or its peak since it started (VmHWM). Not getrusage's
    ru_maxrss: Linux carries that across exec, so a rank spawned by a larger process (a raylet, a pytest
    worker) would report its spawner's peak."""
    field = "VmHWM:" if peak else "VmRSS:"
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024  # kB
    raise LookupError(f"{field} is not in /proc/self/status")


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resident_bytes(peak=True))


def _reset_peak_memory(device: torch.device) -> None:
    """CUDA's counter only: off CUDA the peak is the process's since it started."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def summary(record: ProgressRecord) -> str:
    parts = [f"step {record.step}/{record.max_steps}", f"loss {record.loss:.4f}"]
    if record.learning_rate is not None:
        parts.append(f"lr {record.learning_rate:.3g}")
    if record.tokens_per_second is not None:
        parts.append(f"{record.tokens_per_second:,.0f} tok/s")
    if record.mfu is not None:
        parts.append(f"MFU {record.mfu:.1%}")
    return " | ".join(parts)
