"""Where the Ray entrypoint's step time goes on CPU: per-thread CPU, run-queue wait and context switches of
the ranks' processes over their training window, the Ray Train entrypoint against the same loop under
torchrun (`--launcher direct`), alternating, on bench/trainer_cpu.py's Ray head, S3 and model.

Threads are grouped as the training thread (the one busy more than a fifth of the window: Ray Train runs the
train function in a second thread, torchrun in the main one), gloo's threads, and every other thread of the
rank's process (under Ray: the core worker's I/O, gRPC pollers, its signal check). From
/proc/<pid>/task/<tid>/schedstat (CPU time, time runnable but waiting for a core, timeslices), sampled every
0.5 s; the window runs from the second logging step to the one before the last.

    python bench/trainer_threads.py [--rounds 3] [--steps 180]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import trainer_cpu

Sample = dict[tuple[str, str], tuple[str, float, float, int]]  # (pid, tid) -> (name, cpu s, wait s, slices)


def rank_threads() -> Sample:
    sample: Sample = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = trainer_cpu.command_line(pid)
            if not command.startswith("ray::RayTrainWorker") and not (
                "--launcher direct" in command and "torchrun" not in command
            ):
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                cpu, wait, slices = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
                sample[(pid, tid)] = (name, cpu / 1e9, wait / 1e9, slices)
        except OSError:
            continue  # exited meanwhile
    return sample


class Sampler:
    def __init__(self) -> None:
        self.samples: list[tuple[float, Sample]] = []
        self.stopped = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.stopped.wait(0.5):
            self.samples.append((time.time(), rank_threads()))

    def window(self, start: float, end: float) -> dict[str, list[float]]:
        """Per kind of thread: cores used, cores' worth of waiting for a core, switches per second."""
        (began, first), (ended, last) = (
            min((s for s in self.samples if s[0] >= start), key=lambda s: s[0]),
            max((s for s in self.samples if s[0] <= end), key=lambda s: s[0]),
        )
        seconds = ended - began
        kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for key, (name, cpu, wait, slices) in last.items():
            if key not in first:
                continue
            used = cpu - first[key][1]
            kind = "training" if used > 0.2 * seconds else "gloo" if "gloo" in name else "other"
            totals = kinds[kind]
            totals[0] += used / seconds
            totals[1] += (wait - first[key][2]) / seconds
            totals[2] += (slices - first[key][3]) / seconds
        return kinds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=180)
    args = parser.parse_args()
    sampler = Sampler()
    services = trainer_cpu.Services(Path(tempfile.mkdtemp(prefix="bench-threads-")))
    try:
        for round_number in range(args.rounds):
            for without_ray in (False, True):
                name = f"{'direct' if without_ray else 'ours'}-{round_number}"
                _, records = trainer_cpu.run_ours(services, name, args.steps, without_ray)
                logged = [r for r in records if r.phase == "training" and r.step_time_seconds]
                kinds = sampler.window(logged[1].updated_at.timestamp(), logged[-2].updated_at.timestamp())
                step = statistics.median(r.step_time_seconds or 0.0 for r in logged[1:])
                print(
                    f"{name:9s} step {step * 1e3:5.1f} ms  "
                    + "  ".join(
                        f"{kind}: {used:.3f} cores, waiting {wait:.3f}, {switches:.0f} switches/s"
                        for kind, (used, wait, switches) in sorted(kinds.items())
                    ),
                    flush=True,
                )
    finally:
        sampler.stopped.set()
        services.stop()


if __name__ == "__main__":
    main()
