"""The drain window a run's worker pods get: how long a worker's node may take going away once Ray announces
it, long enough for the trainer's checkpoint at the notice (trainer/fsdp_trainer/preemption.py), short enough
that Ray Train, which waits the window out before it restarts the attempt, loses no more than it must.

It is Ray's RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S in the worker pods (`ray start --block` drains its node that
long on SIGTERM) and their terminationGracePeriodSeconds a little beyond it (the kubelet's SIGKILL comes after
Ray has stopped). Derived, when a RayCluster is created, from the slowest save of the run's recent checkpoints
(their manifests' saveSeconds): the notice's poll, twice that save, and a margin for the rest of the step the
notice arrives in. Kubernetes' and Ray's 30 s until a checkpoint has been measured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fsdp_trainer.contract import CheckpointRef

DEFAULT_SECONDS = 30  # Ray's and Kubernetes' own default, before any save was measured
MIN_SECONDS = 20
# A spot instance is reclaimed two minutes after its notice, and Karpenter drains at once: a window longer
# than that saves nothing there, while kubectl drain and Karpenter's consolidation honour it.
MAX_SECONDS = 300
# How often Ray Train's preemption watcher polls the GCS for a drain (our jobs' setting; Ray's default 5 s).
NOTICE_POLL_SECONDS = 1
POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
SAVE_FACTOR = 2.0  # a save at the drain competes with no training, but storage may be slower than it was
MARGIN_SECONDS = 15  # the rest of the step the notice arrives in, and the ranks' agreement
# After the drain, `ray stop`'s own shutdown before the kubelet kills the container.
RAY_STOP_SECONDS = 15
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


def window(checkpoints: Iterable[CheckpointRef]) -> int:
    """Seconds of drain for a new RayCluster, from the saves measured so far (none: the default)."""
    saves = [c.save_seconds for c in checkpoints if c.save_seconds is not None]
    if not saves:
        return DEFAULT_SECONDS
    needed = NOTICE_POLL_SECONDS + SAVE_FACTOR * max(saves) + MARGIN_SECONDS
    return min(max(math.ceil(needed), MIN_SECONDS), MAX_SECONDS)


def grace_period(drain_seconds: int) -> int:
    """The worker pods' terminationGracePeriodSeconds for a drain window."""
    return drain_seconds + RAY_STOP_SECONDS
