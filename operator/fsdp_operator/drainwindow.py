"""The drain window a run's worker pods get: how long a worker's node may take going away once Ray announces
it, long enough for the trainer's checkpoint at the notice (trainer/fsdp_trainer/preemption.py), short enough
that Ray Train, which waits the window out before it restarts the attempt, loses no more than it must.

It is Ray's RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S in the worker pods (`ray start --block` drains its node that
long on SIGTERM) and their terminationGracePeriodSeconds a little beyond it (the kubelet's SIGKILL comes after
Ray has stopped). Derived, when a RayCluster is created, from the slowest save of the run's recent checkpoints
(their manifests' saveSeconds): the notice's poll, twice that save, and a margin for the rest of the step the
notice arrives in. Before any save was measured, the save is estimated from the size of a worker's checkpoint
shards (localdisk.py); Kubernetes' and Ray's 30 s where the model's size is unknown.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fsdp_operator import api
from fsdp_trainer.contract import CheckpointRef

DEFAULT_SECONDS = 30  # Ray's and Kubernetes' own default: no save measured, the model's size unknown
# Until a save is measured, a worker's checkpoint shards are taken to reach storage at this rate (2 Gbit/s:
# one process's upload, well under what a GPU instance's network carries).
ASSUMED_SAVE_BYTES_PER_SECOND = 250 * 10**6
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


def estimated_save_seconds(spec: api.FSDPTrainingRunSpec) -> float | None:
    """A save's seconds before any was measured: a worker's checkpoint shards at the assumed rate."""
    disk = spec.worker_disk()
    return None if disk.parameters is None else disk.checkpoint_shards / ASSUMED_SAVE_BYTES_PER_SECOND


def window(checkpoints: Iterable[CheckpointRef], estimate: float | None) -> int:
    """Seconds of drain for a new RayCluster, from the slowest save measured so far, else the estimate, else
    the default."""
    saves = [c.save_seconds for c in checkpoints if c.save_seconds is not None]
    save = max(saves) if saves else estimate
    if save is None:
        return DEFAULT_SECONDS
    needed = NOTICE_POLL_SECONDS + SAVE_FACTOR * save + MARGIN_SECONDS
    return min(max(math.ceil(needed), MIN_SECONDS), MAX_SECONDS)


def grace_period(drain_seconds: int) -> int:
    """The worker pods' terminationGracePeriodSeconds for a drain window."""
    return drain_seconds + RAY_STOP_SECONDS
