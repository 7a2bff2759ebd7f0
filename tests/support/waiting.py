"""Bounded waits that fail saying what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 1.0) -> T:
    """Polls probe until it returns something truthy; fails naming what was awaited and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)
