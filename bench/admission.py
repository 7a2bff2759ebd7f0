"""Admission CPU, side by side in one process: the operator's admission passes of a wave of runs replayed
through this checkout's admission (`Admission.admit`) and through an earlier commit's handlers (by default
c4ae191, before the queue was placed once per view), on the same runs, nodes and pass order.

The wave is bench/load.py's: N runs of one 1-GPU worker created at once on 100 g6.12xlarge nodes (400
slots) in two zones. Passes come in creation order, shuffled within windows of 20 (kopf works on several
events at once), and an admitted run's status (Provisioning, its zone) reaches the index 30 passes later
(admission remembers what it admitted, as in the operator); then every run still waiting gets one timer pass.

    python bench/admission.py [--runs 200] [--base c4ae191]

Prints JSON: CPU seconds of each side, the ratio, and the admitted runs (which must be the same).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

from fsdp_operator import api, builder, preflight  # noqa: E402
from fsdp_operator.admission import Admission  # noqa: E402
from fsdp_operator.kube import Indexes  # noqa: E402
from fsdp_operator.settings import Settings  # noqa: E402

TYPE = "g6.12xlarge"
SPEC: dict[str, Any] = {
    "model": {"source": "Qwen/Qwen2.5-1.5B"},
    "checkpoint": {"storagePath": "s3://bucket/runs"},
    "cluster": {"instanceType": TYPE, "workers": 1, "gpusPerWorker": 1, "efaPerWorker": 0},
    "network": {"efa": "disabled"},
}
WINDOW, LAG = 20, 30


def handlers_of(revision: str) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:operator/fsdp_operator/handlers.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "handlers_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("handlers_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def node(i: int) -> dict[str, Any]:
    return preflight.node_facts(
        {
            "metadata": {
                "name": f"gpu-{i}",
                "labels": {
                    builder.LABEL_INSTANCE_TYPE: TYPE,
                    builder.LABEL_ZONE: ["us-west-2a", "us-west-2b"][i % 2],
                },
            },
            "spec": {},
            "status": {
                "allocatable": {builder.GPU: "4", builder.EFA: "1"},
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )


Admit = Callable[[builder.RunRef, api.FSDPTrainingRunSpec, str, Any], preflight.PreflightResult]


def base_admission(module: ModuleType) -> tuple[Admit, Callable[..., Any]]:
    """The earlier commit's admission: its handlers' private preflight pass on a context of its own."""
    ctx = module.Context(
        settings=Settings(), kube=cast(Any, None), s3=None, ec2=cast(Any, None), package_sha256="x"
    )
    return functools.partial(module._run_preflight, ctx), module.Indexes


def our_admission() -> tuple[Admit, Callable[..., Any]]:
    return Admission(watch_namespaces=[], kube=None, ec2=lambda: None).admit, Indexes


def replay(side: tuple[Admit, Callable[..., Any]], runs: int, seed: int) -> tuple[float, list[str]]:
    """CPU seconds of every admission pass of the wave through one side's admission, and the admitted runs."""
    admit, make_indexes = side
    bodies = {
        ("team", f"load-{i:03d}"): {
            "metadata": {
                "namespace": "team",
                "name": f"load-{i:03d}",
                "uid": f"uid-{i}",
                "generation": 1,
                "creationTimestamp": f"2026-12-01T00:00:{i // 8:02d}Z",
            },
            "spec": SPEC,
            "status": {"phase": "Pending"},
        }
        for i in range(runs)
    }
    index = {key: [body] for key, body in bodies.items()}
    indexes = make_indexes(
        runs=index,
        rayclusters={},
        ray_pods={},
        nodes={None: [node(i) for i in range(100)]},
        accelerator_pods={},
    )
    rng = random.Random(seed)
    order = list(bodies)
    passes = []
    for start in range(0, len(order), WINDOW):
        window = order[start : start + WINDOW]
        rng.shuffle(window)
        passes += window
    admitted: list[str] = []
    arriving: list[tuple[int, tuple[str, str], str | None]] = []
    cpu = 0.0

    def one_pass(key: tuple[str, str]) -> None:
        nonlocal cpu
        body = bodies[key]
        if body["status"]["phase"] != "Pending" or key[1] in admitted:
            return
        ref = builder.RunRef(name=key[1], namespace=key[0], uid=body["metadata"]["uid"])
        spec = api.FSDPTrainingRunSpec.model_validate(body["spec"])
        start = time.process_time()
        result = admit(ref, spec, body["metadata"]["creationTimestamp"], indexes)
        cpu += time.process_time() - start
        if result.ok:
            admitted.append(key[1])
            arriving.append((n + LAG, key, result.zone))

    for n, key in enumerate(passes):
        while arriving and arriving[0][0] <= n:
            _, done, zone = arriving.pop(0)
            bodies[done]["status"] = {"phase": "Provisioning", "zone": zone}
        one_pass(key)
    for _, done, zone in arriving:
        bodies[done]["status"] = {"phase": "Provisioning", "zone": zone}
    n = len(passes)
    for key in order:  # the timer, once for every run still waiting
        one_pass(key)
    return cpu, sorted(admitted)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--base", default="c4ae191", help="the earlier commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = handlers_of(args.base)
    rounds = []
    for seed in range(args.rounds):  # alternating, so that neither side always runs on a warmer machine
        base_cpu, base_admitted = replay(base_admission(base), args.runs, seed)
        ours_cpu, ours_admitted = replay(our_admission(), args.runs, seed)
        assert ours_admitted == base_admitted, "both sides must admit the same runs"
        rounds.append({"base_cpu_s": round(base_cpu, 3), "ours_cpu_s": round(ours_cpu, 3),
                       "ratio": round(ours_cpu / base_cpu, 4), "admitted": len(ours_admitted)})  # fmt: skip
    print(json.dumps({"runs": args.runs, "base": args.base, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
