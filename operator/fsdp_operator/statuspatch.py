"""The one status writer's diff: a JSON merge patch (RFC 7386) from the stored status to the new one, and when
a diff of a run's figures alone waits for a later pass."""

from __future__ import annotations

from typing import Any

from fsdp_operator.reconcile.running import says_training

# A run's figures alone (a training run's status.progress and the message that says its step, any run's
# goodput) are written at most every `figures_every` seconds: two observe intervals (30 s at the default
# 15 s), so that a steadily training run costs the apiserver two status writes a minute instead of four;
# longer once the operator's runs would write more than FIGURE_WRITES_PER_SECOND between them (every 500 s
# at 1,000 runs), so that the apiserver the whole cluster shares carries a bounded rate of figures whatever
# the number of runs (client-go gives a controller 5 requests a second by default: the figures take at most
# two). The step `kubectl get` shows, and the per-run metrics read from the status, lag by as much at most
# (the trainer's own tracking, MLflow where a run names it, has every step). Anything else in the status (a
# phase, a condition, a checkpoint, a restart) is written at once, with them.
FIGURES_EVERY_INTERVALS = 2
FIGURE_WRITES_PER_SECOND = 2.0
FIGURES = frozenset({"progress", "goodput"})


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The smallest merge patch that turns `old` into `new`: changed leaves, removed keys as null at any depth
    (so the previous attempt's loss does not survive beside step 0), lists replaced whole. Empty when
    nothing changed, so nothing is sent."""
    patch: dict[str, Any] = {key: None for key in old.keys() - new.keys()}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            nested = merge_patch(before, value)
            if nested:
                patch[key] = nested
        elif value != before:
            patch[key] = value
    return patch


def figures_every(interval: float, runs: int) -> float:
    """Seconds between two writes of one run's figures, with `runs` unfinished runs writing theirs."""
    return max(FIGURES_EVERY_INTERVALS * interval, runs / FIGURE_WRITES_PER_SECOND)


def figures_wait(
    patch: dict[str, Any], acts: bool, old: dict[str, Any], since_written: float | None, every: float
) -> bool:
    """Whether `patch` waits for a later pass: it changes only figures (a training run's progress, goodput
    and the message that says its step and loss, when the stored status already shows a training step, so
    nothing that counts from the first step depends on it; any other run's goodput alone, refreshed while it
    waits or provisions), the pass
    does nothing else (`acts`: actions or Events, whose intent must be written first), and the figures were
    written less than `every` seconds ago (`since_written`; None: not by this process)."""
    progress = old.get("progress") or {}
    training = (
        old.get("phase") == "Running" and progress.get("step") is not None and not progress.get("stage")
    )
    # A training run's message says its step and loss: with them, it is one of the figures.
    message_is_a_figure = says_training(old.get("message"), old.get("attempt")) and says_training(
        patch.get("message"), old.get("attempt")
    )
    if training:
        figures = patch.keys() <= FIGURES | ({"message"} if message_is_a_figure else set())
    else:
        figures = patch.keys() == {"goodput"}
    recent = since_written is not None and since_written < every
    return bool(patch) and figures and not acts and recent
