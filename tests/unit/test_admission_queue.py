"""Admission placed once per view (preflight.Queue) decides exactly as each run's own `admit` pass does, and
the operator's passes share one placement while the view holds."""

from __future__ import annotations

import random
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


def test_a_wave_of_runs_is_placed_once_not_once_per_run() -> None:
    """Forty runs created at once on room for twenty, every pass in the worst order (latest first), with the
    status of each admitted run coming back in between: the first twenty are admitted, and the queue is
    placed a handful of times instead of forty."""
    ctx = Context(
        settings=Settings(max_active_runs_per_namespace=0),
        kube=cast(Any, None),
        s3=None,
        ec2=cast(Any, None),
        package_sha256="x",
    )
    nodes = {
        None: [
            preflight.node_facts(cluster_node(f"n{i}", ["us-west-2a", "us-west-2b"][i % 2])) for i in range(5)
        ]
    }
    runs = {
        ("team", f"r{i:02d}"): [
            {
                "metadata": {
                    "namespace": "team",
                    "name": f"r{i:02d}",
                    "uid": f"uid-{i}",
                    "generation": 1,
                    "creationTimestamp": "2026-12-01T00:00:00Z",
                },
                "spec": SPEC,
                "status": {"phase": "Pending"},
            }
        ]
        for i in range(40)
    }
    indexes = Indexes(runs=runs, rayclusters={}, ray_pods={}, nodes=nodes, accelerator_pods={})
    admitted = []
    for key in sorted(runs, reverse=True):
        body = runs[key][0]
        ref = builder.RunRef(name=key[1], namespace="team", uid=body["metadata"]["uid"])
        run_spec = api.FSDPTrainingRunSpec.model_validate(SPEC)
        result = ctx.admission.admit(ref, run_spec, body["metadata"]["creationTimestamp"], indexes)
        if result.ok:
            admitted.append(key[1])
            body["status"] = {"phase": "Provisioning", "zone": result.zone}  # its status write came back
    assert sorted(admitted) == [f"r{i:02d}" for i in range(20)]
    assert ctx.admission.queue_placements <= 2, ctx.admission.queue_placements
