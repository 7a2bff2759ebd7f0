"""Stopping what a test started, by pid."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def stop_process(process: subprocess.Popen[Any] | None) -> None:
    """SIGTERM by pid, SIGKILL when it has not exited 30 s later."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def stop_process_group(process: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM to the process group a process started with start_new_session leads (a `ray start --block`
    and its servers, say), SIGKILL to the group when the leader has not exited `timeout` s later."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)
