"""Builds stdlib-docstrings.jsonl: a small real English corpus from the docstrings of CPython's standard
library (PSF License), read with `ast` from the interpreter's own sources, so nothing is downloaded.

    python examples/data/make_corpus.py   # rewrites examples/data/stdlib-docstrings.jsonl

One document per module, class or function docstring of at least MIN_CHARS characters, in path order,
until MAX_BYTES. The committed file was built with CPython 3.11.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

MIN_CHARS = 300
MAX_BYTES = 1_500_000
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "ensurepip",
    "turtledemo",
}
OUTPUT = Path(__file__).with_name("stdlib-docstrings.jsonl")


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef))]
    found = (ast.get_docstring(node, clean=True) for node in nodes)
    return [text for text in found if text and len(text) >= MIN_CHARS]


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    size = 0
    python = sys.version.split()[0]
    with OUTPUT.open("w", encoding="utf-8") as out:
        for path in sorted(stdlib.rglob("*.py")):
            relative = path.relative_to(stdlib)
            if SKIP_DIRS.intersection(relative.parts[:-1]):
                continue
            for text in docstrings(path):
                if text in seen:
                    continue
                line = json.dumps({"text": text, "source": f"cpython/Lib/{relative.as_posix()}"}) + "\n"
                if size + len(line.encode()) > MAX_BYTES:
                    print(f"{OUTPUT.name}: {len(seen)} documents, {size} bytes (Python {python})")
                    return
                seen.add(text)
                size += len(line.encode())
                out.write(line)
    print(f"{OUTPUT.name}: {len(seen)} documents, {size} bytes (Python {python})")


if __name__ == "__main__":
    main()
