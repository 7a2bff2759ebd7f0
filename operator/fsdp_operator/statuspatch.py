"""The one status writer's diff: a JSON merge patch (RFC 7386) from the stored status to the new one."""

from __future__ import annotations

from typing import Any


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
