"""Benchmarks write their tables into docs/benchmarks.md between markers of their own, so that no figure
there is typed by hand: `<!-- NAME:begin -->` ... `<!-- NAME:end -->`."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def measured(command: str) -> str:
    """The line a benchmark's table opens with: when, on how many CPUs, by which command."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"Measured {when} on {os.cpu_count()} CPUs (`{command}`)."


def write_section(name: str, text: str, doc: Path = DOC) -> None:
    """Replaces the section's text (appending the markers if the document has none yet)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    current = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin not in current:
        current += f"\n{begin}\n{end}\n"
    replaced = re.sub(rf"{re.escape(begin)}.*?{re.escape(end)}", lambda _: f"{begin}\n{text}\n{end}", current,
                      flags=re.S)  # fmt: skip
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(replaced)


def publish(name: str, results: dict[str, Any], table: str, output: Path | None, write_doc: bool) -> None:
    """Prints the results as JSON and the table; writes the JSON to `output` and the table into section
    `name` of the document."""
    text = json.dumps(results, indent=2)
    print(text)
    if output:
        output.write_text(text + "\n")
    print(table)
    if write_doc:
        write_section(name, table)
