"""Admission placed once per view (preflight.Queue) decides exactly as each run's own `admit` pass does, and
the operator's passes share one placement while the view holds."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, cast

from fsdp_operator import api, builder, preflight
from fsdp_operator.context import Context
from fsdp_operator.kube import Indexes
from fsdp_operator.settings import Settings
from tests.support.decision_inputs import spec

TYPE = "g6.12xlarge"


def waiting(name: str, created: str, workers: int, free: tuple[preflight.NodeFree, ...]) -> Any:
    run_spec = spec(cluster={"workers": workers})
    fits = preflight.check_nodes(run_spec, [preflight.NodeFree(n.name, n.zone, 4, 1) for n in free]).ok
    return preflight.Competitor(name, created, TYPE, False, None, workers, fits, spec=run_spec, free=free)


def scenario(rng: random.Random) -> list[preflight.Competitor]:
    free = tuple(
        preflight.NodeFree(f"n{i}", rng.choice(["us-west-2a", "us-west-2b"]), rng.choice([0, 2, 4]), 1)
        for i in range(rng.randint(0, 6))
    )
    runs: list[preflight.Competitor] = [
        waiting(
            f"ns/r{i:02d}", f"2026-12-01T00:00:{rng.randint(0, 5):02d}Z", rng.choice([1, 1, 2, 3, 9]), free
        )
        for i in range(rng.randint(1, 12))
    ]
    for i in range(rng.randint(0, 3)):
        zone = rng.choice(["us-west-2a", "us-west-2b"])
        runs.append(
            preflight.Competitor(f"ns/a{i}", "2026-12-01T00:00:00Z", TYPE, True, zone, rng.randint(0, 2))
        )
    return runs


def test_one_placement_gives_every_run_the_result_of_its_own_pass() -> None:
    rng = random.Random(25)
    for _ in range(300):
        runs = scenario(rng)
        queue = preflight.Queue.place(runs, TYPE)
        for run in runs:
            if run.admitted:
                continue
            assert run.spec is not None
            others = [c for c in runs if c is not run]
            assert queue.results[run.name] == preflight.admit(
                run.spec, run.created, run.name, list(run.free), others
            ), run.name


def test_the_placement_holds_while_the_runs_it_placed_are_admitted_where_it_placed_them() -> None:
    rng = random.Random(7)
    for _ in range(200):
        runs = scenario(rng)
        queue = preflight.Queue.place(runs, TYPE)
        # Each run that it admits, admitted where it said (the order of the passes does not matter).
        view = list(runs)
        for run in rng.sample(view, len(view)):
            if run.admitted or not queue.results[run.name].ok:
                continue
            zone = queue.results[run.name].zone
            view = [c for c in view if c.name != run.name]
            view.append(preflight.Competitor(run.name, run.created, TYPE, True, zone, run.workers_not_placed))
            held = queue.still_holds(view)
            assert held is queue
            fresh = preflight.Queue.place(view, TYPE)
            for other in view:
                if not other.admitted:  # a fresh placement admits the same runs
                    assert fresh.results[other.name].ok == queue.results[other.name].ok, other.name
        # A run created later is placed after them, and decides as a fresh placement would.
        late = waiting("ns/zz", "2026-12-01T00:01:00Z", 1, runs[0].free if not runs[0].admitted else ())
        held = queue.still_holds([*view, late])
        assert (
            held is not None
            and held.results["ns/zz"] == preflight.Queue.place([*view, late], TYPE).results["ns/zz"]
        )


def test_any_other_change_places_the_queue_again() -> None:
    free = tuple(preflight.NodeFree(f"n{i}", "us-west-2a", 4, 1) for i in range(6))  # 6 slots
    runs = [waiting(f"ns/r{i}", "2026-12-01T00:00:00Z", 2, free) for i in range(3)]
    admitted = preflight.Competitor("ns/a", "2026-12-01T00:00:00Z", TYPE, True, "us-west-2a", 2)
    queue = preflight.Queue.place([*runs, admitted], TYPE)
    assert [queue.results[r.name].ok for r in runs] == [True, True, False]
    less_free = tuple(preflight.NodeFree(f"n{i}", "us-west-2a", 2, 1) for i in range(6))
    elsewhere = preflight.Competitor("ns/r0", "2026-12-01T00:00:00Z", TYPE, True, "us-west-2b", 2)
    for changed in (
        [*runs[:2], admitted],  # a waiting run deleted
        [*runs, preflight.Competitor("ns/a", "", TYPE, True, "us-west-2a", 1)],  # a pod of the admitted bound
        [*runs],  # the admitted run finished
        [waiting(r.name, r.created, 2, less_free) for r in runs] + [admitted],  # the free nodes changed
        [waiting("ns/0", "2026-12-01T00:00:00Z", 1, free), *runs, admitted],  # a run placed among them
        [elsewhere, runs[1], runs[2], admitted],  # admitted, but not where this placement put it
    ):
        assert preflight.Queue.place([*runs, admitted], TYPE).still_holds(changed) is None


def cluster_node(name: str, zone: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {builder.LABEL_INSTANCE_TYPE: TYPE, builder.LABEL_ZONE: zone},
        },
        "spec": {},
        "status": {
            "allocatable": {builder.GPU: "4", builder.EFA: "1"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


SPEC: dict[str, Any] = {
    "model": {"source": "Qwen/Qwen2.5-1.5B"},
    "checkpoint": {"storagePath": "s3://bucket/runs"},
    "cluster": {"instanceType": TYPE, "workers": 1, "gpusPerWorker": 1, "efaPerWorker": 0},
    "network": {"efa": "disabled"},
}


ZONES = ["us-west-2a", "us-west-2b"]


def admission(max_active_per_namespace: int = 0) -> Any:
    return Context(
        settings=Settings(max_active_runs_per_namespace=max_active_per_namespace),
        kube=cast(Any, None),
        s3=None,
        ec2=cast(Any, None),
        package_sha256="x",
    ).admission


def wave(count: int, nodes: int, same_time: bool = True) -> Indexes:
    """`count` waiting runs of one 1-GPU worker in namespace "team" (created at once, or a second apart in
    name order), indexed latest first, on `nodes` 4-GPU nodes alternating between two zones."""
    runs = {
        ("team", f"r{i:02d}"): [
            {
                "metadata": {
                    "namespace": "team",
                    "name": f"r{i:02d}",
                    "uid": f"uid-{i}",
                    "generation": 1,
                    "creationTimestamp": f"2026-12-01T00:00:{0 if same_time else i:02d}Z",
                },
                "spec": SPEC,
                "status": {"phase": "Pending"},
            }
        ]
        for i in reversed(range(count))
    }
    facts = [preflight.node_facts(cluster_node(f"n{i}", ZONES[i % 2])) for i in range(nodes)]
    return Indexes(
        runs=runs, rayclusters={}, ray_pods={}, nodes={None: facts}, accelerator_pods={}, active_runs={}
    )


def latest_first(
    decide: Any, indexes: Indexes, admitted: Callable[[str, preflight.PreflightResult], None]
) -> dict[str, preflight.PreflightResult]:
    """Every run's pass, the latest created first (the worst order), each admitted one's `admitted` before
    the next pass: every run's result."""
    results = {}
    for key in sorted(indexes.runs, reverse=True):
        body = indexes.runs[key][0]
        ref = builder.RunRef(name=key[1], namespace="team", uid=body["metadata"]["uid"])
        run_spec = api.FSDPTrainingRunSpec.model_validate(SPEC)
        result = results[key[1]] = decide(ref, run_spec, body["metadata"]["creationTimestamp"], indexes)
        if result.ok:
            body["status"] = {"phase": "Provisioning", "zone": result.zone}  # its status write came back
            admitted(key[1], result)
    return results


def admitted_runs(results: dict[str, preflight.PreflightResult]) -> list[str]:
    return sorted(name for name, result in results.items() if result.ok)


def test_a_wave_of_runs_is_placed_once_not_once_per_run() -> None:
    """Forty runs created at once on room for twenty, with the status of each admitted run coming back in
    between: the first twenty are admitted, and the queue is placed a handful of times instead of forty."""
    admit = admission()
    results = latest_first(admit.admit, wave(40, nodes=5), lambda name, result: None)
    assert admitted_runs(results) == [f"r{i:02d}" for i in range(20)]
    assert admit.queue_placements <= 2, admit.queue_placements


def worker_pod(run: str, node: str) -> dict[str, Any]:
    """A run's worker pod bound to `node`: one GPU, as builder.py asks."""
    labels = {"ray.io/node-type": "worker", builder.LABEL_RAY_CLUSTER: builder.ray_cluster_name(run)}
    return {
        "metadata": {"namespace": "team", "name": f"{run}-worker", "labels": labels},
        "spec": {"nodeName": node, "containers": [{"resources": {"requests": {builder.GPU: "1"}}}]},
        "status": {"phase": "Pending"},
    }


def test_one_placement_admits_every_run_it_places_though_their_workers_change_the_view() -> None:
    """Forty-eight runs on room for forty, each admitted run's worker bound to a node before the next pass:
    every worker pod bound changes the view, so a queue placed for one run's pass at a time was placed once
    per run (at 1,000 runs, 1,052 placements of half a CPU-second each, one after another). One placement
    admits the forty first-created runs at once, each one's pass takes its decision, and no zone is given
    more runs than its nodes hold."""
    admit = admission()
    indexes = wave(48, nodes=10, same_time=False)
    slots = {f"n{i}": 4 for i in range(10)}

    def bind_its_worker(run: str, result: preflight.PreflightResult) -> None:
        node = next(n for n, free in slots.items() if free and ZONES[int(n[1:]) % 2] == result.zone)
        slots[node] -= 1  # the scheduler binds it in its zone: a node with room there must exist
        indexes.accelerator_pods[("team", f"{run}-worker")] = [worker_pod(run, node)]

    results = latest_first(admit.admit, indexes, bind_its_worker)
    assert admitted_runs(results) == [f"r{i:02d}" for i in range(40)]
    assert admit.queue_placements == 1, admit.queue_placements


def test_a_placement_admits_no_run_past_its_namespaces_limit() -> None:
    """Room for all five runs of a namespace limited to two active: the placement made for the latest run's
    pass admits it and the earliest, and every other pass is told its namespace is at its limit."""
    admit = admission(max_active_per_namespace=2)
    results = latest_first(admit.admit, wave(5, nodes=2, same_time=False), lambda name, result: None)
    assert admitted_runs(results) == ["r00", "r04"]
    assert {results[name].reason for name in ("r01", "r02", "r03")} == {preflight.NAMESPACE_RUN_LIMIT}
