"""The validator: held-out loss and perplexity, over the same targets as the training loss (the learned
tokens), token-weighted over every rank's batches."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from fsdp_trainer import data, distributed, optim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    seconds: float  # the evaluation's wall time, which is not training time


class Validator:
    """Reads the evaluation set once, when built (the first `batches` rounds of every rank's micro-batches,
    the same on every rank), and evaluates the model on this rank's share of it. Without held-out data, or
    with too little for one sequence, it does nothing."""

    def __init__(
        self,
        samples: data.EvalSamples | None,
        batches: int,
        micro_batch_size: int,
        runtime: distributed.Runtime,
    ) -> None:
        self.runtime = runtime
        self.evaluated_at_step: int | None = None
        held_out = None if samples is None else samples.first(batches * micro_batch_size * runtime.world_size)
        if held_out is not None and len(held_out) == 0:
            log.warning("the held-out data holds no full sequence: evaluation disabled")
            held_out = None
        self.held_out = held_out
        self.batches = (
            []
            if held_out is None
            else data.eval_batch_indices(
                len(held_out), batches, micro_batch_size, runtime.rank, runtime.world_size
            )
        )

    def validate(self, lm: torch.nn.Module, step: int) -> EvalResult | None:
        """Every rank must call this together (the forwards are collective); None without held-out data."""
        if self.held_out is None:
            return None
        started = time.perf_counter()
        self.evaluated_at_step = step
        device = self.runtime.device
        held_out = self.held_out
        batches = [data.MicroBatch.from_samples(held_out[indices], device) for indices in self.batches]
        config = getattr(lm, "config", None)
        lm.eval()
        with torch.no_grad():
            # Each batch's summed cross-entropy over the targets of all the ranks' batches: their sum over
            # batches and ranks is the mean over every held-out target.
            targets = optim.all_targets(batches)
            total = torch.zeros((), device=device)
            for batch in batches:
                total += lm(**optim.model_inputs(batch, config), num_items_in_batch=targets).loss.float()
        lm.train()
        loss = float(optim.global_loss(total))
        perplexity = math.exp(min(loss, 80.0))  # capped: an untrained model would overflow
        return EvalResult(loss, perplexity, time.perf_counter() - started)
