"""Loopback ports and HTTP probes."""

from __future__ import annotations

import socket
import urllib.request


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answers(url: str, headers: dict[str, str] | None = None) -> bool:
    """Whether an HTTP server answers at url with a success."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5):
            return True
    except OSError:
        return False
