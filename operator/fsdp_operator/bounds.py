"""Text a tenant's trainer wrote, as the operator keeps it in status (pure)."""

from __future__ import annotations

import re

TRUNCATED = "...[truncated]"
# C0 and C1 controls (ESC starts a terminal escape, \x9b is one by itself) and bidirectional overrides.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def bounded_text(text: str, limit: int) -> str:
    """Control characters replaced, at most `limit` characters, a cut one ending in TRUNCATED."""
    text = CONTROL_CHARACTERS.sub("?", text)
    return text if len(text) <= limit else text[: limit - len(TRUNCATED)] + TRUNCATED


def inert(text: str) -> str:
    """One line a terminal prints as it is (`kubectl get`, `describe`): whitespace controls as spaces, other
    controls as '?'."""
    return CONTROL_CHARACTERS.sub(lambda found: " " if found.group() in "\t\n\r" else "?", text)
