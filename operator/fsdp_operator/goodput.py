"""Goodput: where a run's wall time and the GPU-hours it held went, and what they cost.

Pure. Each pass that writes the status (and at least once a minute while the run is not finished) charges
the time since `accountedUntil` to the category the status it read was in: the run was in that state since
the last write. So the categories add up, to the second, to the time from the run's creation to
`accountedUntil` (its completion once finished). Three moves between categories follow the trainer's record:
an attempt's fabric check leaves provisioning for fabric check, a new checkpoint's blocking time leaves
training for checkpoint stall, and a restart moves the steps it will redo (those after the checkpoint it
resumes from) from training to lost to restarts, or to lost to preemptions when a disruption caused it (a
restart first counted and then known as a preemption moves what it cost so far there too).
"""

from __future__ import annotations

import datetime as dt

from fsdp_operator import api, instancetypes
from fsdp_operator.reconcile.state import PREEMPTED
from fsdp_trainer.contract import ProgressRecord

# How old the figures get before a pass refreshes them while nothing else in the status changes (their write
# alone may wait longer: statuspatch.figures_every).
REFRESH_SECONDS = 60


def category(status: api.FSDPTrainingRunStatus) -> str | None:
    """The category the run's time goes to while its status is this one; None once it is finished."""
    phase = status.phase
    if phase in api.FINISHED_PHASES:
        return None
    if phase in (None, api.Phase.PENDING, api.Phase.QUEUED):
        return "queued"
    if phase == api.Phase.SUSPENDED:
        return "idle"
    if phase == api.Phase.RESTARTING:
        return _restart_category(status)
    if phase == api.Phase.RUNNING and _attempt_is_training(status):
        return "training"
    return "provisioning"  # the cluster starting, the job submitted, the trainer setting up


def _restart_category(status: api.FSDPTrainingRunStatus) -> str:
    """Where a restart's time goes: to preemptions when its history entry says a disruption caused it."""
    history = status.restarts.history
    return "lost_to_preemptions" if history and history[-1].reason == PREEMPTED else "lost_to_restarts"


def _attempt_is_training(status: api.FSDPTrainingRunStatus) -> bool:
    """The current attempt's trainer has reported a step (the progress shown is not the last attempt's)."""
    progress = status.progress
    return (
        progress.stage is None
        and progress.step is not None
        and progress.updated_at is not None
        and (status.attempt_time is None or progress.updated_at >= status.attempt_time)
    )


def account(
    spec: api.FSDPTrainingRunSpec,
    old: api.FSDPTrainingRunStatus,
    new: api.FSDPTrainingRunStatus,
    progress: ProgressRecord | None,
    now: dt.datetime,
    created: dt.datetime,
    instance_hour_price: float | None,
) -> api.GoodputStatus:
    """`new`'s goodput: `old`'s with the time since it was accounted charged, when the status changes anyway
    or the figures are REFRESH_SECONDS old; else `old`'s unchanged (no status write for it alone)."""
    kept = old.goodput
    since = kept.accounted_until or created
    charged = category(old)
    changed = new != old  # new still carries old's goodput
    if charged is None or not (changed or (now - since).total_seconds() >= REFRESH_SECONDS):
        return kept
    goodput = kept.model_copy(deep=True)
    elapsed = max(int((now - since).total_seconds()), 0)
    seconds = goodput.seconds
    setattr(seconds, charged, getattr(seconds, charged) + elapsed)
    if old.phase in api.ACTIVE_PHASES:
        goodput.worker_seconds_held += elapsed * spec.cluster.workers
        goodput.gpu_seconds_held += elapsed * spec.cluster.workers * spec.cluster.gpus()
        if instance_hour_price is not None:  # at the price of the capacity held meanwhile
            charged_usd = elapsed * spec.cluster.workers / 3600 * instance_hour_price * _node_share(spec)
            goodput.cost_usd = round((goodput.cost_usd or 0.0) + charged_usd, 6)
    step_time = progress.step_time_seconds if progress is not None else None
    _move_checkpoint_stall(old, new, progress, seconds)
    if new.fabric is not None and (old.fabric is None or old.fabric.attempt != new.fabric.attempt):
        _move(seconds, "provisioning", "fabric_check", round(new.fabric.report.seconds))
    if new.phase == api.Phase.RESTARTING and old.phase != api.Phase.RESTARTING and step_time:
        resumed = new.checkpoints.latest.step if new.checkpoints.latest else 0
        redone = max((old.progress.step or 0) - resumed, 0) if _attempt_is_training(old) else 0
        _move(seconds, "training", _restart_category(new), round(redone * step_time))
    elif _recounted(old, new):  # the same restart, now known as a preemption: what it cost so far moves
        restart = new.restarts.history[-1]
        steps = max((old.progress.step or 0) - (restart.resumed_from_step or 0), 0)
        spent = (now - restart.time).total_seconds() + steps * (step_time or 0.0)
        _move(seconds, "lost_to_restarts", "lost_to_preemptions", round(spent))
    goodput.accounted_until = now
    if progress is not None:
        goodput.tokens = max(progress.tokens_seen, goodput.tokens)
    _derive(new, goodput, step_time, now)
    return goodput


def _recounted(old: api.FSDPTrainingRunStatus, new: api.FSDPTrainingRunStatus) -> bool:
    """A restart counted by `old` that `new` records as a preemption (reconcile's recount_as_preemption)."""
    return (
        old.phase == new.phase == api.Phase.RESTARTING
        and _restart_category(old) == "lost_to_restarts"
        and _restart_category(new) == "lost_to_preemptions"
    )


def _move(seconds: api.GoodputSeconds, source: str, target: str, amount: int) -> None:
    moved = min(max(amount, 0), getattr(seconds, source))
    setattr(seconds, source, getattr(seconds, source) - moved)
    setattr(seconds, target, getattr(seconds, target) + moved)


def _move_checkpoint_stall(
    old: api.FSDPTrainingRunStatus,
    new: api.FSDPTrainingRunStatus,
    progress: ProgressRecord | None,
    seconds: api.GoodputSeconds,
) -> None:
    """A checkpoint newer than the last one seen held training up for the trainer's blocked seconds."""
    before = old.checkpoints.latest.step if old.checkpoints.latest else None
    latest = new.checkpoints.latest
    if latest is None or latest.step == before or progress is None or not progress.checkpoint_blocked_seconds:
        return
    _move(seconds, "training", "checkpoint_stall", round(progress.checkpoint_blocked_seconds))


def _derive(
    new: api.FSDPTrainingRunStatus, goodput: api.GoodputStatus, step_time: float | None, now: dt.datetime
) -> None:
    seconds = goodput.seconds
    held = (
        seconds.provisioning
        + seconds.fabric_check
        + seconds.training
        + seconds.checkpoint_stall
        + seconds.lost_to_restarts
        + seconds.lost_to_preemptions
    )
    goodput.fraction = round(seconds.training / held, 4) if held else None
    goodput.gpu_hours_held = round(goodput.gpu_seconds_held / 3600, 3)
    step, max_steps = new.progress.step, new.progress.max_steps
    goodput.progress_percent = round(100 * step / max_steps, 1) if step is not None and max_steps else None
    finished = new.phase in api.FINISHED_PHASES
    goodput.eta = (
        now + dt.timedelta(seconds=round((max_steps - step) * step_time))
        if not finished and step_time and step is not None and max_steps and new.phase == api.Phase.RUNNING
        else None
    )
    cost = goodput.cost_usd
    goodput.cost_per_million_tokens_usd = (
        round(cost / goodput.tokens * 1e6, 4) if cost is not None and goodput.tokens else None
    )


def _node_share(spec: api.FSDPTrainingRunSpec) -> float:
    """A worker pays for the part of its node's GPUs it takes (a whole node by default)."""
    gpus_of_type = instancetypes.of(spec.cluster.instance_type).gpus
    return spec.cluster.gpus() / gpus_of_type if gpus_of_type else 1.0


# Where EKS managed node groups and Karpenter say whether a node is spot capacity.
CAPACITY_TYPE_LABELS = ("eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type")


def capacity_type(labels: dict[str, str]) -> str:
    """spot or on-demand, from the node's labels (on-demand when none says)."""
    said = next((labels[key] for key in CAPACITY_TYPE_LABELS if key in labels), "")
    return "spot" if said.lower() == "spot" else "on-demand"


def hour_price(prices: dict[str, float], instance_type: str, capacity_types: list[str]) -> float | None:
    """USD per instance-hour of the run's workers: each worker's node at `<type>:spot` or
    `<type>:on-demand` where the platform priced them apart, else `<type>`; their mean. None where a worker's
    price is unknown (no cost is better than a wrong one)."""
    each = [prices.get(f"{instance_type}:{kind}", prices.get(instance_type)) for kind in capacity_types]
    if not each:  # no worker placed yet: the type's own (or on-demand) price
        each = [prices.get(f"{instance_type}:on-demand", prices.get(instance_type))]
    known = [price for price in each if price is not None]
    return sum(known) / len(known) if known and len(known) == len(each) else None
