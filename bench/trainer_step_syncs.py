"""The step-time change of issue 47 item 5 on CPU, side by side in one run: the trainer's loop of this
checkout against the same loop of the trainer before it (by default c77397f^, before the non-finite guard
left the host), on the same tiny Qwen2, configuration, synthetic data and 2 gloo ranks under torchrun
(`python -m fsdp_trainer --launcher direct`); and this checkout's non-finite guard on against off.

Three arms, each a torchrun of its own, every round, in alternating order (forward, then backward) so that
the host's other load falls on all of them alike; each ratio is taken within a round, then the median over
the rounds is reported with its range:
  - before:    the base revision's trainer (`git archive` into a temporary directory, on PYTHONPATH);
  - now:       this checkout's trainer;
  - guard off: this checkout's trainer with the guard taken out in the ranks' process (optim.non_finite
               returns a constant 0, optim.apply_update is a plain optimizer.step(), no found_inf): no
               configuration switches it off. The step's loss is still all-reduced (it is the logged loss).
Step time: the progress records' mean step time of each logEvery window, the first window (lazy
initialisation) left out. The guard's own time: every rank times its calls of the guard's functions
(before: optim.all_finite; now: optim.global_loss, optim.non_finite) and of AdamW.step (with found_inf in
`now`, without in `guard off`), each call with perf_counter: on the CPU every op is done when its call
returns, so a call's time is its cost (a collective's includes waiting for the other rank). The forward and
backward passes (optim.accumulate_gradients) and the norm (optim.clip_gradients) are timed too, to tell where
a difference between the revisions lies.

    python bench/trainer_step_syncs.py [--rounds 5] [--base c77397f^] [--steps 50] [--output f] [--no-doc]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.net import free_port

import trainer_cpu  # its model and run: a step of tens of milliseconds on 2 cores, a run of ~15 s
from doc_section import publish

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SECTION = "trainer-step-syncs"
ARMS = ("before", "now", "guard off")
LOG_EVERY = trainer_cpu.LOG_EVERY  # the run logs (and the ranks time) every so many steps
# The functions whose calls are timed in the ranks, where the revision has them: the guard's, then the step's
# forward and backward passes and its gradient norm.
TIMED_FUNCTIONS = ("all_finite", "global_loss", "non_finite", "accumulate_gradients", "clip_gradients")
OPTIMIZER_STEP = "AdamW.step"


def trainer_config(run_name: str, storage: Path, steps: int) -> dict[str, Any]:
    """bench/trainer_cpu.py's run, without its bandwidth probe: only steps are timed here."""
    return {**trainer_cpu.trainer_config(run_name, str(storage), steps), "network": {"bandwidthProbeMb": 0}}


# The ranks' side: runs under torchrun with the arm's trainer on PYTHONPATH; uses only what every revision has
# (fsdp_trainer.optim's module attributes, fsdp_trainer.__main__.main).


def timed(name: str, function: Callable[..., Any], timings: dict[str, list[float]]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            timings.setdefault(name, []).append(time.perf_counter() - start)

    return wrapper


def run_rank(arm: str, trainer_json: str, run_name: str, timings_path: Path) -> None:
    import torch

    from fsdp_trainer import optim
    from fsdp_trainer.__main__ import main

    if arm == "guard off":
        optim.non_finite = lambda loss, grad_norm: torch.zeros((), device=loss.device)
        optim.apply_update = lambda optimizer, skip: optimizer.step()
    timings: dict[str, list[float]] = {}
    for name in TIMED_FUNCTIONS:
        if hasattr(optim, name):
            setattr(optim, name, timed(name, getattr(optim, name), timings))
    torch.optim.AdamW.step = timed(OPTIMIZER_STEP, torch.optim.AdamW.step, timings)  # type: ignore[method-assign]
    code = main(["--config", trainer_json, "--submission-id", run_name, "--launcher", "direct"])
    if code != 0:
        raise SystemExit(code)
    rank = os.environ["RANK"]
    timings_path.with_name(f"{timings_path.name}-rank{rank}.json").write_text(json.dumps(timings))


# The orchestrator's side.


def trainer_of(revision: str, into: Path) -> Path:
    """The revision's trainer package, unpacked under `into`; returns the directory to put on PYTHONPATH."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "trainer"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "trainer"


def step_windows(storage: Path, run_name: str) -> list[float]:
    """Mean step time of each logging window after the first, from the run's progress records (read as
    JSON: the two revisions' record models differ)."""
    windows: dict[int, float] = {}
    for path in sorted((storage / "bench" / run_name / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            seconds = record.get("stepTimeSeconds")
            if record.get("phase") == "training" and seconds and record["step"] % LOG_EVERY == 0:
                windows[record["step"]] = seconds
    return [windows[step] for step in sorted(windows)][1:]


def run_arm(arm: str, trainer_path: Path, workdir: Path, run_name: str, steps: int) -> dict[str, Any]:
    storage = workdir / "runs"
    timings = workdir / run_name
    # The arm's trainer, and this checkout's root for tests.support (no trainer package there).
    env = {**os.environ, "PYTHONPATH": f"{trainer_path}:{REPO}", "HF_HUB_OFFLINE": "1"}
    command = [
        str(BIN / "torchrun"), "--nproc-per-node=2", f"--master-port={free_port()}", __file__,
        "--rank-arm", arm, "--rank-config", json.dumps(trainer_config(run_name, storage, steps)),
        "--rank-run", run_name, "--rank-timings", str(timings),
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=workdir)
    if done.returncode != 0:
        raise RuntimeError(f"{arm} ({run_name}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    calls: dict[str, list[float]] = {}
    for rank in (0, 1):
        for name, seconds in json.loads(
            timings.with_name(f"{timings.name}-rank{rank}.json").read_text()
        ).items():
            calls.setdefault(name, []).extend(seconds[LOG_EVERY:])  # the first window's calls: warm-up
    windows = step_windows(storage, run_name)
    return {
        "median_step_seconds": statistics.median(windows),
        "window_step_seconds": windows,
        "median_call_seconds": {name: statistics.median(seconds) for name, seconds in calls.items()},
        "wall_seconds": time.perf_counter() - started,
    }


def ratio_summary(ratios: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def per_round(arm: str) -> list[float]:
        return [r[arm]["median_step_seconds"] for r in rounds]

    def call(arm: str, name: str) -> float:
        return statistics.median(r[arm]["median_call_seconds"].get(name, 0.0) for r in rounds)

    before, now, off = per_round("before"), per_round("now"), per_round("guard off")
    step_now = statistics.median(now)
    # found_inf's cost: the fused step with the flag (now) less the same step without it (guard off).
    found_inf = call("now", OPTIMIZER_STEP) - call("guard off", OPTIMIZER_STEP)
    guard_now = call("now", "non_finite") + found_inf
    return {
        "median_step_seconds": {
            "before": statistics.median(before),
            "now": step_now,
            "guard off": statistics.median(off),
        },
        "now_over_before": ratio_summary([n / b for n, b in zip(now, before, strict=True)]),
        "now_over_guard_off": ratio_summary([n / o for n, o in zip(now, off, strict=True)]),
        "guard_seconds_per_step": {
            "before: all_finite (flag, all-reduce MAX, .item())": call("before", "all_finite"),
            "now: non_finite (flag on the device)": call("now", "non_finite"),
            "now: found_inf in the fused AdamW step (now - guard off)": found_inf,
            "now: global_loss (the loss's all-reduce, shared with the logged loss)": call(
                "now", "global_loss"
            ),
        },
        "guard_share_of_step_now": guard_now / step_now,
        "guard_share_of_step_now_with_loss_all_reduce": (guard_now + call("now", "global_loss")) / step_now,
        "guard_share_of_step_before": call("before", "all_finite") / statistics.median(before),
        "phase_seconds": {
            arm: {
                name: call(arm, name) for name in ("accumulate_gradients", "clip_gradients", OPTIMIZER_STEP)
            }
            for arm in ARMS
        },
    }


def summarise(results: dict[str, Any]) -> str:
    found = results["figures"]
    steps = found["median_step_seconds"]
    loads = [r["load_1min"] for r in results["rounds"]]

    def ratio(name: str) -> str:
        summary = found[name]
        return f"**{summary['median']:.3f}** ({summary['min']:.3f}-{summary['max']:.3f})"

    guard = found["guard_seconds_per_step"]
    phases = found["phase_seconds"]
    rows = [
        ("Median step time, now / before (median of the rounds' ratios, range)",
         f"{steps['now'] * 1e3:.1f} ms / {steps['before'] * 1e3:.1f} ms; {ratio('now_over_before')}"),
        ("Median step time, guard on (now) / guard off",
         f"{steps['now'] * 1e3:.1f} ms / {steps['guard off'] * 1e3:.1f} ms; {ratio('now_over_guard_off')}"),
        *((f"Guard time per step, {name}", f"{seconds * 1e3:.3f} ms") for name, seconds in guard.items()),
        ("The guard's share of a step: now (flag + found_inf) / now with the loss's all-reduce / before",
         f"**{found['guard_share_of_step_now']:.2%}** / "
         f"{found['guard_share_of_step_now_with_loss_all_reduce']:.2%} / "
         f"{found['guard_share_of_step_before']:.2%}"),
        ("Where a step goes, before / now / guard off: forward and backward (accumulate_gradients)",
         " / ".join(f"{phases[arm]['accumulate_gradients'] * 1e3:.1f} ms" for arm in ARMS)),
        ("... the gradient norm and clipping (clip_gradients)",
         " / ".join(f"{phases[arm]['clip_gradients'] * 1e3:.2f} ms" for arm in ARMS)),
        ("... AdamW.step (before: foreach on CPU; now: fused, with found_inf; guard off: fused)",
         " / ".join(f"{phases[arm][OPTIMIZER_STEP] * 1e3:.2f} ms" for arm in ARMS)),
    ]  # fmt: skip
    return "\n".join(
        [
            f"Measured {results['measured_at']} on {results['machine']} (`python bench/trainer_step_syncs.py "
            f"--rounds {results['rounds_asked']} --steps {results['steps']}`): before = {results['base']}, "
            f"now = {results['now']}. {len(results['rounds'])} rounds of the three arms, alternating; "
            f"1-minute load average at each round's start {min(loads):.1f}-{max(loads):.1f} on "
            f"{os.cpu_count()} cores.",
            "",
            "| figure | measured |",
            "|---|---|",
            *(f"| {name} | {value} |" for name, value in rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=50, help="steps per run (default 50: 4 measured windows)"
    )
    parser.add_argument(
        "--base", default="c77397f^", help="the revision before the change (default c77397f^)"
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    for rank_option in ("--rank-arm", "--rank-config", "--rank-run", "--rank-timings"):
        parser.add_argument(rank_option, help=argparse.SUPPRESS)  # one rank of one arm, under torchrun
    args = parser.parse_args()
    if args.rank_arm:
        run_rank(args.rank_arm, args.rank_config, args.rank_run, Path(args.rank_timings))
        return
    now = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    if subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "trainer"]).returncode:
        now += " with uncommitted trainer changes"
    base = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", args.base],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-step-syncs-") as scratch:
        workdir = Path(scratch)
        trainers = {"before": trainer_of(args.base, workdir / "base"), "now": REPO / "trainer"}
        trainers["guard off"] = trainers["now"]
        for number in range(args.rounds):
            order = ARMS if number % 2 == 0 else tuple(reversed(ARMS))
            measured: dict[str, Any] = {"order": list(order), "load_1min": os.getloadavg()[0]}
            for arm in order:
                run_name = f"{arm.replace(' ', '-')}-{number}"
                measured[arm] = run_arm(arm, trainers[arm], workdir, run_name, args.steps)
                print(
                    f"round {number} {arm}: {measured[arm]['median_step_seconds'] * 1e3:.1f} ms", flush=True
                )
            rounds.append(measured)
    results = {
        "measured_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores, gloo, 2 ranks",
        "base": f"{args.base} ({base})",
        "now": now,
        "steps": args.steps,
        "rounds_asked": args.rounds,
        "figures": figures(rounds),
        "rounds": rounds,
    }
    publish(SECTION, results, summarise(results), args.output, not args.no_doc)


if __name__ == "__main__":
    main()
