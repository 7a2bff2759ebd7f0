"""A cold Go build of one of the local cluster's components (hack/build-tools.sh), with the compiler writing
DWARF that the linker's -w then drops, against the compiler told not to write it (-gcflags=all=-dwarf=false),
side by side in one run.

Each build starts from an empty build cache (GOCACHE in a temporary directory, removed after), so it compiles
every package as a fresh machine does; the module cache is the machine's (the download is the same either way
and not what the flag changes). The variants alternate within each round, which goes first alternating too.
CPU is the go command's whole tree (the compiler and linker processes), from getrusage of its children.

    python bench/go_build.py [--module etcd] [--package go.etcd.io/etcd/server/v3] [--rounds 2]

Prints JSON and a table (written into docs/benchmarks.md's go-build section with --write-doc).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from doc_section import measured, publish

REPO = Path(__file__).resolve().parents[1]
LDFLAGS = "-s -w"
VARIANTS = {
    "dwarf written, dropped at link": [],
    "-gcflags=all=-dwarf=false": ["-gcflags=all=-dwarf=false"],
}


def cold_build(module: Path, package: str, extra: list[str]) -> tuple[float, float]:
    """(CPU-s, wall s) of one `go build` of package from an empty build cache."""
    with tempfile.TemporaryDirectory(prefix="go-build-bench-") as scratch:
        env = {**os.environ, "GOCACHE": f"{scratch}/cache"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        subprocess.run(
            ["go", "build", "-trimpath", *extra, "-ldflags", LDFLAGS, "-o", f"{scratch}/out", package],
            cwd=module, env=env, check=True, timeout=3600,
        )  # fmt: skip
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="etcd", help="the wrapper module under hack/go")
    parser.add_argument("--package", default="go.etcd.io/etcd/server/v3")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args()
    if shutil.which("go") is None:
        raise SystemExit("go is not on PATH (make tools installs it)")
    module = REPO / "hack" / "go" / args.module
    # Both variants start from the same module cache.
    subprocess.run(["go", "mod", "download"], cwd=module, check=True, timeout=1800)

    names = list(VARIANTS)
    rounds: list[dict[str, dict[str, float]]] = []
    for number in range(args.rounds):
        order = names if number % 2 == 0 else names[::-1]
        now = {}
        for name in order:
            cpu, wall = cold_build(module, args.package, VARIANTS[name])
            now[name] = {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1)}
        now[names[1]]["cpu_ratio"] = round(now[names[1]]["cpu_s"] / now[names[0]]["cpu_s"], 3)
        rounds.append(now)

    ratios = [r[names[1]]["cpu_ratio"] for r in rounds]
    flags = f"--module {args.module} --package {args.package} --rounds {args.rounds}"
    command = f"python bench/go_build.py {flags}"
    lines = [
        measured(command),
        "",
        "| variant | CPU-s, median | wall s, median | CPU ratio (range) |",
        "|---|---|---|---|",
    ]
    for name in names:
        cpu = statistics.median(r[name]["cpu_s"] for r in rounds)
        wall = statistics.median(r[name]["wall_s"] for r in rounds)
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        ratio = "1.00" if name == names[0] else spread
        lines.append(f"| {name} | {cpu:.0f} | {wall:.0f} | {ratio} |")
    results = {"command": command, "rounds": rounds, "cpu_ratio_median": statistics.median(ratios)}
    publish("go-build", results, "\n".join(lines), args.output, args.write_doc)


if __name__ == "__main__":
    main()
