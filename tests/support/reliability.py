"""The reliability table, docs/reliability.md, made by the suite: every fault test records the fault it
injected, the behaviour it asserts and the figure it measured. A run of `make test` in which every such test
ran and passed rewrites its environment's section of the table (the operator's Python and the DLC's run their
own tests), with the date, the machine and the versions; no number in it is typed by hand."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import sys
from dataclasses import astuple, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
from bench.doc_section import write_section

from tests.support.paths import REPO

INTRO = """# Reliability

Written by `make test` (tests/reliability.py) from its last whole passing run, one section per Python
environment it runs tests in: one row per injected fault, each a test that asserts the expected behaviour and
measured the figure. Real components throughout: the local cluster's kube-apiserver, KubeRay, Ray heads (on
the host, or in the real node's pods), the S3 server and real Ray jobs of the CPU demo (40-80 steps, a
checkpoint every 10).
"""
ROWS = pytest.StashKey[dict[str, "Row"]]()
ORDER = pytest.StashKey[list[str]]()  # every fault test collected, in collection order


@dataclass(frozen=True)
class Row:
    fault: str
    expected: str
    measured: str


class Recorder:
    """What one test records: one row, written when the test has passed."""

    def __init__(self, rows: dict[str, Row], test: str) -> None:
        self._rows, self._test = rows, test

    def record(self, fault: str, expected: str, measured: str) -> None:
        self._rows[self._test] = Row(fault, expected, measured)


def fault_tests(items: list[pytest.Item]) -> list[str]:
    return [item.nodeid for item in items if "reliability" in getattr(item, "fixturenames", ())]


def to_wire(rows: dict[str, Row], order: list[str]) -> dict[str, Any]:
    """Rows and order as plain data, the only kind pytest-xdist passes from a worker to its controller."""
    return {"rows": {test: list(astuple(row)) for test, row in rows.items()}, "order": order}


def from_wire(wire: dict[str, Any]) -> tuple[dict[str, Row], list[str]]:
    return {test: Row(*cells) for test, cells in wire["rows"].items()}, list(wire["order"])


def write_table(rows: dict[str, Row], order: list[str], path: Path) -> None:
    """Rewrites this Python environment's section of the table, keeping the other environments' sections."""
    lines = [
        f"## Python {platform.python_version()}",
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {os.cpu_count()} CPUs, {_memory_gib()} GiB, {platform.machine()}",
        f"- Versions: {_versions()}",
        "",
        "| fault | expected | measured | test |",
        "|---|---|---|---|",
    ]
    for test in order:
        cells = [*(_cell(text) for text in astuple(rows[test])), f"`{test.split('::')[-1]}`"]
        lines.append(f"| {' | '.join(cells)} |")
    if not path.exists() or not path.read_text().startswith(INTRO):
        path.write_text(INTRO)
    environment = f"python{sys.version_info.major}.{sys.version_info.minor}"
    write_section(f"reliability-{environment}", "\n".join(lines), path)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _memory_gib() -> int:
    with open("/proc/meminfo") as meminfo:
        kib = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
    return round(kib / 1024 / 1024)


def _versions() -> str:
    pinned = (REPO / "hack" / "build-tools.sh").read_text()

    def tool(name: str) -> str:
        found = re.search(rf"^{name}_VERSION=(\S+)", pinned, re.M)
        return found.group(1) if found else "?"

    def package(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:  # kopf is the operator's, not in the DLC's environment
            return f"no {name}"

    packages = ", ".join(package(name) for name in ("ray", "torch", "kopf"))
    return f"Kubernetes {tool('K8S')}, KubeRay {tool('KUBERAY')}, Kueue {tool('KUEUE')}, {packages}"


def seconds_between(start: Path | dt.datetime | str, end: Path | dt.datetime | str) -> float:
    """Seconds from one moment to another: a file's modification (a fault's marker), a datetime, or an
    RFC 3339 time from a status. Status times have whole seconds, so under a second reads as 0, never less."""
    return max((_moment(end) - _moment(start)).total_seconds(), 0.0)


def _moment(at: Path | dt.datetime | str) -> dt.datetime:
    if isinstance(at, Path):
        return dt.datetime.fromtimestamp(at.stat().st_mtime, dt.UTC)
    if isinstance(at, str):
        return dt.datetime.fromisoformat(at)
    return at
