"""The one status writer's diff: a JSON merge patch (RFC 7386) from the stored status to the new one, and when
a diff of a training run's figures alone waits for the next pass."""

from __future__ import annotations

from typing import Any

# A training run's figures (status.progress, goodput) are written at most every this many observe intervals
# (30 s at the default 15 s). The step `kubectl get` shows and the metrics read from the status lag by as much
# at most, and a steadily training run costs the apiserver two status writes a minute instead of four.
# Anything else in the status (a phase, a condition, a checkpoint, a restart) is written at once, with them.
FIGURES_EVERY_INTERVALS = 2
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


def figures_wait(
    patch: dict[str, Any], acts: bool, old: dict[str, Any], since_written: float | None, interval: float
) -> bool:
    """Whether `patch` waits for a later pass: it changes only a training run's figures (the stored status
    already shows a training step, so nothing that counts from the first step depends on it), the pass does
    nothing else (`acts`: actions or Events, whose intent must be written first), and the figures were
    written less than FIGURES_EVERY_INTERVALS observe intervals ago (`since_written`; None: not by this
    process)."""
    progress = old.get("progress") or {}
    training = (
        old.get("phase") == "Running" and progress.get("step") is not None and not progress.get("stage")
    )
    recent = since_written is not None and since_written < FIGURES_EVERY_INTERVALS * interval
    return bool(patch) and patch.keys() <= FIGURES and training and not acts and recent
