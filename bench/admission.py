"""Admission CPU, side by side: the operator's admission passes of a wave of runs replayed through
`Admission.admit`, admission's one entry point, of this checkout and of an earlier commit (by default 5646f42,
where admission became an object of its own), on the same runs, nodes and pass order. Each side runs in a
process of its own with its revision's packages (`git archive`), so neither reaches into the other's
internals.

The wave is bench/load.py's: N runs of one 1-GPU worker created at once on 100 g6.12xlarge nodes (400
slots) in two zones. Passes come in creation order, shuffled within windows of 20 (kopf works on several
events at once), and an admitted run's status (Provisioning, its zone) reaches the index 30 passes later
(admission remembers what it admitted, as in the operator), with its worker pod bound to a node of its zone
(each binding changes the view admission placed the queue on); then every run still waiting gets one timer
pass.

    python bench/admission.py [--runs 200] [--base 5646f42]

Prints JSON: CPU seconds of each side, the ratio, and the admitted runs (which must be the same).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TYPE = "g6.12xlarge"
SPEC: dict[str, Any] = {
    "model": {"source": "Qwen/Qwen2.5-1.5B"},
    "checkpoint": {"storagePath": "s3://bucket/runs"},
    "cluster": {"instanceType": TYPE, "workers": 1, "gpusPerWorker": 1, "efaPerWorker": 0},
    "network": {"efa": "disabled"},
}
WINDOW, LAG = 20, 30


def node(i: int) -> dict[str, Any]:
    from fsdp_operator import builder, preflight

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


def replay(runs: int, seed: int) -> tuple[float, list[str]]:
    """CPU seconds of every admission pass of the wave through this process's admission (the revision on its
    PYTHONPATH), and the admitted runs."""
    from fsdp_operator import api, builder
    from fsdp_operator.admission import Admission
    from fsdp_operator.kube import Indexes

    admit = Admission(watch_namespaces=[], kube=None, ec2=lambda: None).admit
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
    nodes = [node(i) for i in range(100)]
    pods: dict[tuple[str, str], list[dict[str, Any]]] = {}
    indexes = Indexes(runs=index, rayclusters={}, ray_pods={}, nodes={None: nodes}, accelerator_pods=pods)
    slots = {n["metadata"]["name"]: 4 for n in nodes}

    def came_back(key: tuple[str, str], zone: str | None) -> None:
        """The admitted run's status write reached the index, and the scheduler bound its worker."""
        bodies[key]["status"] = {"phase": "Provisioning", "zone": zone}
        names = [n["metadata"]["name"] for n in nodes if n["metadata"]["labels"][builder.LABEL_ZONE] == zone]
        at = next(name for name in names if slots[name])
        slots[at] -= 1
        labels = {"ray.io/node-type": "worker", builder.LABEL_RAY_CLUSTER: builder.ray_cluster_name(key[1])}
        pods[(key[0], f"{key[1]}-worker")] = [
            {"metadata": {"namespace": key[0], "name": f"{key[1]}-worker", "labels": labels},
             "spec": {"nodeName": at, "containers": [{"resources": {"requests": {builder.GPU: "1"}}}]}}
        ]  # fmt: skip

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
            came_back(done, zone)
        one_pass(key)
    for _, done, zone in arriving:
        came_back(done, zone)
    n = len(passes)
    for key in order:  # the timer, once for every run still waiting
        one_pass(key)
    return cpu, sorted(admitted)


def packages_of(revision: str, into: Path) -> Path:
    """The revision's operator and trainer packages, unpacked under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "operator", "trainer"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def replay_in(tree: Path, runs: int, seed: int) -> tuple[float, list[str]]:
    """`replay` in a process whose fsdp_operator is the one in `tree`."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'operator'}:{tree / 'trainer'}"}
    done = subprocess.run(
        [sys.executable, __file__, "--replay", "--runs", str(runs), "--seed", str(seed)],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    found = json.loads(done.stdout)
    return found["cpu"], found["admitted"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--base", default="5646f42", help="the earlier commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)  # one side, in a child
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay:
        cpu, admitted = replay(args.runs, args.seed)
        print(json.dumps({"cpu": cpu, "admitted": admitted}))
        return
    with tempfile.TemporaryDirectory() as scratch:
        base = packages_of(args.base, Path(scratch))
        rounds = []
        for seed in range(args.rounds):  # alternating, so that neither side always runs on a warmer machine
            base_cpu, base_admitted = replay_in(base, args.runs, seed)
            ours_cpu, ours_admitted = replay_in(REPO, args.runs, seed)
            assert ours_admitted == base_admitted, "both sides must admit the same runs"
            ratio = round(ours_cpu / base_cpu, 4)
            rounds.append({"base_cpu_s": round(base_cpu, 3), "ours_cpu_s": round(ours_cpu, 3),
                           "ratio": ratio, "admitted": len(ours_admitted)})  # fmt: skip
    print(json.dumps({"runs": args.runs, "base": args.base, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
