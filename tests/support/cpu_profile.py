"""Where the suite's CPU goes, test by test: a pytest plugin, and the report over its files.

Wall time on a loaded 2-core machine says little about a test's cost: a test that waits is cheap, one whose
processes compete is not. For each test (its setup, call and teardown) this records the CPU-seconds of three
things, each counted once and whatever else runs on the machine:
- the test's own processes: the pytest worker and every process under it (operators, kubectl, the Ray jobs'
  drivers it starts), waited children included;
- its local cluster's daemons: the processes whose command line names the instance's state directory (the
  control plane, KubeRay, the real node's kubelet and containerd) or that descend from its pid files (the Ray
  head, moto), less those inside the real node's pods;
- the real node's pods: the kubelet's cgroup, by the kernel's own accounting (cpuacct, or cpu.stat on
  cgroup v2).

Use: `FSDP_CPU_PROFILE=DIR make test` (or pytest with it set) writes DIR/instance-<N>.tsv (the local
cluster instance of each pytest worker);
`python -m tests.support.cpu_profile DIR` prints the files ranked by CPU, each with its tests' wall time.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from collections import defaultdict
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import INSTANCE, cluster_settings, state_dir

PROFILE_DIR_VARIABLE = "FSDP_CPU_PROFILE"
_TICKS = os.sysconf("SC_CLK_TCK")
COLUMNS = ("test", "wall_s", "tests_cpu_s", "cluster_cpu_s", "pods_cpu_s")


@dataclass(frozen=True)
class _Process:
    parent: int
    command: str
    cpu_s: float  # its own and its waited children's
    in_pods: bool


def _processes() -> dict[int, _Process]:
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat_file:
                fields = stat_file.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                command = cmdline.read(4096).replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry.name}/cgroup") as cgroups:
                in_pods = "/fsdp-node-" in cgroups.read()
        except OSError:  # it ended while we looked
            continue
        # utime, stime, cutime, cstime (proc(5)): fields 14-17, here 11-14 after the command's ")".
        cpu = sum(int(value) for value in fields[11:15]) / _TICKS
        found[int(entry.name)] = _Process(int(fields[1]), command, cpu, in_pods)
    return found


def _descendants(processes: dict[int, _Process], roots: Iterable[int]) -> set[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for pid, process in processes.items():
        children[process.parent].append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in processes and pid not in found:
            found.add(pid)
            todo.extend(children[pid])
    return found


class _Sampler:
    def __init__(self) -> None:
        self.state = state_dir()
        self.node_cgroup = self._node_cgroup()

    def _node_cgroup(self) -> tuple[Path, float] | None:
        """The kubelet's cgroup root and the unit of its CPU counter (in seconds)."""
        name = cluster_settings("NODE_CGROUP")[0]
        v2 = Path("/sys/fs/cgroup") / name / "cpu.stat"
        v1 = Path("/sys/fs/cgroup/cpuacct") / name / "cpuacct.usage"
        if v1.parent.is_dir():
            return v1, 1e-9
        if v2.parent.is_dir():
            return v2, 1e-6
        return None

    def _pods_cpu(self) -> float:
        if self.node_cgroup is None:
            self.node_cgroup = self._node_cgroup()  # the real node may start after the first test
            if self.node_cgroup is None:
                return 0.0
        counter, unit = self.node_cgroup
        try:
            text = counter.read_text()
        except OSError:  # the node stopped
            return 0.0
        if counter.name == "cpu.stat":
            text = next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec"))
        return int(text) * unit

    def sample(self) -> tuple[float, float, float]:
        processes = _processes()
        tests = _descendants(processes, [os.getpid()])
        pid_files = [int(path.read_text()) for path in (self.state / "pids").glob("*.pid") if path.is_file()]
        # With its slash: instance 0's state directory is a prefix of instance 1's.
        named = [pid for pid, process in processes.items() if f"{self.state}/" in process.command]
        cluster = _descendants(processes, pid_files + named) - tests

        def cpu(pids: set[int]) -> float:
            return sum(processes[pid].cpu_s for pid in pids if not processes[pid].in_pods)

        return cpu(tests), cpu(cluster), self._pods_cpu()


class CpuProfile:
    """The plugin: one row per test in <dir>/instance-<N>.tsv."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # The instance, not the worker: make test's two tiers run side by side, each with its own gw0.
        self.out = (directory / f"instance-{INSTANCE}.tsv").open("a", newline="")
        self.writer = csv.writer(self.out, delimiter="\t")
        if self.out.tell() == 0:
            self.writer.writerow(COLUMNS)
        self.sampler: _Sampler | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None]:
        if self.sampler is None:
            self.sampler = _Sampler()
        started, before = time.monotonic(), self.sampler.sample()
        yield
        after = self.sampler.sample()
        deltas = [max(0.0, end - start) for start, end in zip(before, after, strict=True)]
        wall = time.monotonic() - started
        self.writer.writerow([item.nodeid, f"{wall:.1f}", *(f"{delta:.1f}" for delta in deltas)])
        self.out.flush()


def pytest_configure(config: pytest.Config) -> None:
    if directory := os.environ.get(PROFILE_DIR_VARIABLE):
        config.pluginmanager.register(CpuProfile(Path(directory)), "fsdp-cpu-profile")


def report(directory: Path) -> str:
    """The files ranked by CPU-seconds, with the share each column takes and the tests' wall time."""
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0] * 5)
    for table in sorted(directory.glob("*.tsv")):
        with table.open() as rows:
            for row in csv.DictReader(rows, delimiter="\t"):
                totals = by_file[row["test"].split("::")[0]]
                totals[0] += 1
                for index, column in enumerate(COLUMNS[1:], start=1):
                    totals[index] += float(row[column])
    all_cpu = sum(sum(totals[2:]) for totals in by_file.values())
    lines = [
        f"{'CPU-s':>8} {'share':>6} {'tests':>7} {'cluster':>8} {'pods':>7} {'wall-s':>7} {'n':>4} file",
    ]
    for file, (count, wall, tests, cluster, pods) in sorted(by_file.items(), key=lambda kv: -sum(kv[1][2:])):
        cpu = tests + cluster + pods
        share = cpu / all_cpu
        lines.append(
            f"{cpu:8.0f} {share:6.1%} {tests:7.0f} {cluster:8.0f} {pods:7.0f} {wall:7.0f} {count:4.0f} {file}"
        )
    lines.append(f"{all_cpu:8.0f} in all ({all_cpu / 60:.1f} CPU-minutes)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
