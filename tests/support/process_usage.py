"""A process's memory and CPU time as the kernel counts them (/proc/PID), for the tests' bounds on the
operator's."""

from __future__ import annotations

import os
from pathlib import Path


def memory_kib(pid: int, field: str = "VmRSS") -> int:
    """VmRSS (resident now) or VmHWM (the peak since start or since reset_peak) in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1])


def reset_peak(pid: int) -> int:
    """Resets VmHWM to the resident size now (Linux's clear_refs 5), so that it measures from here on;
    returns that size in KiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory_kib(pid, "VmHWM")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
