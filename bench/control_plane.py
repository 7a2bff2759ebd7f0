"""Control-plane benchmark on the local cluster, measured side by side in one run.

- warm `hack/cluster-up.sh` after `hack/cluster-down.sh` (the harness target: under a minute);
- time from `kubectl apply` to a ready RayCluster: our operator (preflight, then RayCluster) against KubeRay's
  own RayJob controller creating the same cluster shape on the same apiserver.

    python bench/control_plane.py [--rounds 3]      (or: make bench)

Prints one JSON document (also to --output) and the table it writes into docs/benchmarks.md ("control-plane"
section). The ratio operator/rayjob is the figure to watch: preflight and the status writes are the operator's
overhead over KubeRay's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.support.kube import apply, apply_crd, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import example
from tests.support.operator_process import OperatorProcess
from tests.support.runs import run_of
from tests.support.waiting import wait_until

from doc_section import publish
from fsdp_operator import api, builder

REPO = Path(__file__).resolve().parents[1]


def seconds(command: list[str]) -> float:
    start = time.monotonic()
    subprocess.run(command, check=True, capture_output=True)
    return time.monotonic() - start


def ready_cluster_of(namespace: str) -> bool:
    clusters = kubectl_json("get", "rayclusters", "-n", namespace)["items"]
    return any((c.get("status") or {}).get("state") == "ready" for c in clusters)


def operator_round(namespace: str) -> float:
    start = time.monotonic()
    apply(namespace, example("aws-sample"))
    wait_until(
        "ClusterReady",
        lambda: (
            run_of(namespace, "qwen25-sample").get("status", {}).get("phase") in ("ClusterReady", "Running")
        ),
        timeout=120,
        interval=0.1,
    )
    return time.monotonic() - start


def rayjob_round(namespace: str) -> float:
    """KubeRay's RayJob with the RayCluster our builder makes for the same spec."""
    spec = api.FSDPTrainingRunSpec.model_validate(example("aws-sample")["spec"])
    run = builder.RunRef(name="bench", namespace=namespace, uid=str(uuid.uuid4()))
    cluster = builder.build_raycluster(spec, run, "public.ecr.aws/deep-learning-containers/ray:2.58.0", None)
    rayjob: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "bench"},
        "spec": {"entrypoint": "python -c 'print(1)'", "rayClusterSpec": cluster["spec"]},
    }
    start = time.monotonic()
    apply(namespace, rayjob)
    wait_until(
        "the RayJob's RayCluster ready", lambda: ready_cluster_of(namespace), timeout=120, interval=0.1
    )
    return time.monotonic() - start


def fresh_namespace() -> str:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    return name


def drop_namespace(name: str) -> None:
    for run in kubectl("get", "fsdptrainingruns", "-n", name, "-o", "name", check=False).stdout.split():
        kubectl(
            "patch", run, "-n", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
        )
    kubectl("delete", "namespace", name, "--wait=true", "--timeout=120s", check=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args()

    subprocess.run([REPO / "hack" / "cluster-down.sh"], check=True, capture_output=True)
    warm_up = seconds([str(REPO / "hack" / "cluster-up.sh")])
    cluster = LocalCluster.from_env_file()
    os.environ.update(cluster.env)
    apply_crd()

    results: dict[str, list[float]] = {"operator": [], "rayjob": []}
    for _ in range(args.rounds):
        namespace = fresh_namespace()
        proc = OperatorProcess(
            namespace,
            env={"FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS": "2"},
            log=Path(cluster.env["FSDP_LOCAL_CLUSTER_STATE"]) / "logs" / "bench-operator.log",
        )
        proc.start()
        time.sleep(3)  # let kopf start watching, so its start-up is not counted against it
        try:
            results["operator"].append(operator_round(namespace))
        finally:
            proc.stop()
            drop_namespace(namespace)
        namespace = fresh_namespace()
        try:
            results["rayjob"].append(rayjob_round(namespace))
        finally:
            drop_namespace(namespace)

    medians = {k: statistics.median(v) for k, v in results.items()}
    measured = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "command": " ".join(["python", "bench/control_plane.py", *sys.argv[1:]]),
        "warm_cluster_up_seconds": round(warm_up, 1),
        "apply_to_ready_raycluster_seconds": {k: [round(x, 2) for x in v] for k, v in results.items()},
        "median_seconds": {k: round(v, 2) for k, v in medians.items()},
        "median_ratio_operator_over_rayjob": round(medians["operator"] / medians["rayjob"], 2),
    }
    publish("control-plane", measured, control_plane_table(measured), args.output, not args.no_doc)


def control_plane_table(results: dict[str, Any]) -> str:
    """The markdown of docs/benchmarks.md's control-plane section, from this script's JSON."""
    rounds, medians = results["apply_to_ready_raycluster_seconds"], results["median_seconds"]
    ours, theirs = medians["operator"], medians["rayjob"]
    return "\n".join(
        [
            f"Measured {results['date']} on {results['cpus']} CPUs (`{results['command']}`), the two kinds "
            "alternating.",
            "",
            "| figure | FSDPTrainingRun (operator) | RayJob (KubeRay) | ratio | target |",
            "|---|---|---|---|---|",
            "| apply -> RayCluster ready, each round | "
            + " | ".join(", ".join(f"{x:.2f}" for x in rounds[k]) + " s" for k in ("operator", "rayjob"))
            + " |  |  |",
            f"| apply -> RayCluster ready, median | {ours:.2f} s | {theirs:.2f} s | "
            f"{results['median_ratio_operator_over_rayjob']:.2f} | <= 1.2 |",
            f"| warm cluster-up | {results['warm_cluster_up_seconds']:.1f} s |  |  |  |",
        ]
    )


if __name__ == "__main__":
    main()
