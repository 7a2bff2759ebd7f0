"""Ray's drain notice, taken at a step boundary: a checkpoint at once, then no step the node's loss undoes.

Ray marks a node draining in the GCS with reason PREEMPTION when `ray start --block` gets SIGTERM (a pod
deleted, a node drained by kubectl, Karpenter or the Node Termination Handler; Ray drains for
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S) or the autoscaler drains it. Ray Train v2's PreemptionWatcher polls
the GCS and hands the notice (a `PreemptionInfo`: the draining nodes' ranks and the deadline) to every worker
of the attempt, into the worker's own context.

At each step boundary every rank reads that context (an attribute, no RPC) and the ranks agree in one
all-reduce on a gloo group of their own: a two-integer message, ~0.1 ms, where Ray's public
`ray.train.get_preemption_info()` is a round trip through Ray Train's synchronisation actor for every rank
at every call (measured in docs/operations.md). On a notice the loop saves at that step; `checkpointed`
waits until the save is durable in storage, records the step, and holds every rank without training until
the node goes: a step trained after the checkpoint would be trained again after the resume. Ray Train's
controller keeps the attempt until the deadline (or until every rank has exited), then restarts it from
storage, where the newest checkpoint is this one. If the node outlives the deadline (the drain was
cancelled), training goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_trainer.checkpoint_manager import CheckpointManager
from fsdp_trainer.progress import ProgressWriter

log = logging.getLogger(__name__)

# Ray Train's controller waits this long after a notice without a deadline before it restarts the attempt
# (DEFAULT_PREEMPTION_DEADLINE_S in ray.train.v2._internal.constants); the hold ends with it.
UNKNOWN_DEADLINE_SECONDS = 120.0
HOLD_POLL_SECONDS = 0.5
# Held past the deadline by this much: the controller restarts the attempt once the deadline has passed, and a
# step trained in between would be lost with it.
HOLD_MARGIN_SECONDS = 10.0


@dataclass(frozen=True)
class DrainNotice:
    """A notice every rank agreed on: the epoch second the draining node goes (the latest any rank knows)."""

    deadline: float
    seen_at: float  # time.monotonic() on this rank when the ranks agreed


# What one rank knows: None, or the deadline in epoch milliseconds (0: Ray reported none).
NoticeReader = Callable[[], int | None]


def ray_train_notice_reader() -> NoticeReader | None:
    """Reads the notice Ray Train's PreemptionWatcher gave this worker (its `mark_preempt`) from the worker's
    own context: no RPC, unlike `ray.train.get_preemption_info()`. That context is Ray Train v2's internals:
    where a Ray lacks it (Train v1, a later layout), the run trains on without drain checkpoints, saying so
    (every rank runs the same Ray, so all ranks skip the check alike)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        context = get_train_context().preemption_context
    except (ImportError, AttributeError, RuntimeError) as error:
        log.warning("no drain checkpoints: this Ray Train hands no drain notice to its workers (%s)", error)
        return None

    def read() -> int | None:
        info = context.preemption_info
        if info is None:
            return None
        return info.deadline_ms or 0

    return read


class DrainWatch:
    """Built by every rank at the same point (its gloo group is created collectively)."""

    def __init__(self, read: NoticeReader | None) -> None:
        self._read = read
        self._group = dist.new_group(backend="gloo") if read is not None else None
        self.notice: DrainNotice | None = None
        self._done = False

    @classmethod
    def for_launcher(cls, launcher: str) -> DrainWatch:
        """Under Ray Train, Ray's notices; torchrun and a lone process get none (nothing is checked)."""
        return cls(ray_train_notice_reader() if launcher == "ray" else None)

    def noticed(self) -> bool:
        """Whether a drain was announced to any rank; every rank calls it at every step boundary and all get
        the same answer (one all-reduce). True once per attempt."""
        if self._read is None or self._done:
            return False
        deadline_ms = self._read()
        # [announced, deadline]: MAX gives "any rank" and the latest deadline (0 where none is known).
        agreed = torch.tensor([deadline_ms is not None, deadline_ms or 0], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group)
        if not agreed[0]:
            return False
        self._done = True
        deadline = int(agreed[1]) / 1000 or time.time() + UNKNOWN_DEADLINE_SECONDS
        self.notice = DrainNotice(deadline, time.monotonic())
        log.warning(
            "drain announced: checkpointing at this step, the node goes in %.0f s", deadline - time.time()
        )
        return True

    @property
    def pending(self) -> bool:
        """A notice whose checkpoint was started and not yet completed by `checkpointed`."""
        return self.notice is not None

    def checkpointed(
        self, checkpoints: CheckpointManager, progress: ProgressWriter | None, step: int
    ) -> float:
        """After the loop started the drain checkpoint at `step`: waits until it is durable on every rank,
        records it, and holds until the node goes (Ray Train then ends the attempt) or its deadline passes.
        Returns the seconds training stood still (the metrics exclude them)."""
        notice = self.notice
        if notice is None:
            raise RuntimeError("checkpointed without a drain notice")
        self.notice = None
        checkpoints.wait()
        durable = time.monotonic() - notice.seen_at
        log.warning("drain checkpoint at step %d durable %.2f s after the notice", step, durable)
        if progress is not None:
            progress.write(drain_checkpoint_step=step, drain_checkpoint_seconds=durable)
            progress.flush_history()
        while time.time() < notice.deadline + HOLD_MARGIN_SECONDS:
            time.sleep(HOLD_POLL_SECONDS)
        log.warning("the draining node outlived its deadline: training on")
        return time.monotonic() - notice.seen_at
