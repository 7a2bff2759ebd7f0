"""An idle Ray head's own CPU, Ray's defaults against the suite's quieter settings (tests/support/real_node.py
QUIET_RAY, which the local heads and the real node's Ray pods get), side by side in one run.

Each round starts one head each way, in turns (which goes first alternates), from the DLC's environment (its
Ray, its Python), on loopback ports of its own with its dashboard; waits until its job API answers, lets it
settle, then counts the CPU-seconds of its whole process tree over the window (the kernel's utime + stime of
each process, read from /proc at the window's two ends), and stops it.

    python bench/ray_idle.py [--rounds 3] [--window 60]

Prints JSON: each head's CPU-seconds a minute and the ratio quiet / default per round and in all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.net import answers, free_port
from tests.support.paths import dlc_python
from tests.support.processes import stop_process_group
from tests.support.real_node import QUIET_RAY
from tests.support.waiting import wait_until

TICKS = os.sysconf("SC_CLK_TCK")
SETTLE_SECONDS = 20  # after the job API answers: the dashboard's modules finish starting


def tree(root: int) -> set[int]:
    """root and every process under it."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_seconds(pids: set[int]) -> dict[int, float]:
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[pid] = (int(fields[11]) + int(fields[12])) / TICKS
    return found


def idle_head(env: dict[str, str], window: float) -> float:
    """CPU-seconds a minute of one idle head's processes."""
    session = Path(tempfile.mkdtemp(prefix="ray-idle-", dir="/tmp"))
    dashboard = free_port()
    ray = dlc_python().with_name("ray")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={free_port()}",
         f"--ray-client-server-port={free_port()}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", "--num-cpus=2", "--num-gpus=0", f"--temp-dir={session}",
         "--disable-usage-stats"],
        env={**os.environ, "PATH": f"{ray.parent}:{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0",
             "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{dashboard}/api/version"
        wait_until(f"the Ray head's job API at {url}", lambda: answers(url), timeout=300, interval=1)
        time.sleep(SETTLE_SECONDS)
        before = cpu_seconds(tree(head.pid))
        time.sleep(window)
        after = cpu_seconds(tree(head.pid))
        # A process started in the window counts from zero; one that ended in it is not counted (none should).
        used = sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())
        return used * 60 / window
    finally:
        stop_process_group(head, timeout=60)
        shutil.rmtree(session, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=60.0, help="seconds counted per head")
    args = parser.parse_args()
    rounds = []
    for round_number in range(args.rounds):
        ways = [("default", {}), ("quiet", QUIET_RAY)]
        if round_number % 2:
            ways.reverse()
        figures = {name: idle_head(env, args.window) for name, env in ways}
        rounds.append({**figures, "ratio": figures["quiet"] / figures["default"]})
    default, quiet = (statistics.median(r[name] for r in rounds) for name in ("default", "quiet"))
    print(
        json.dumps(
            {
                "unit": "CPU-seconds a minute of an idle head's processes",
                "quiet_settings": QUIET_RAY,
                "rounds": rounds,
                "median": {"default": default, "quiet": quiet, "ratio": quiet / default},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
