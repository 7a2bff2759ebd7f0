"""Runs queued by the real Kueue (tests/kueue.py) with real Ray jobs: Kueue admits, the run says why it waits,
and a preemption is a pause that costs no restart.

Kueue's ClusterQueue holds 8 GPUs on one flavor (the fake g6 nodes of us-west-2a), so one demo run (2
workers x 4 GPUs) fits at a time. Runs without a queue name keep the operator's own preflight: every other
e2e test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fsdp_operator import tenancy
from tests.support.demo import BUCKET, RUN_TIMEOUT, demo_run, run_record, wait_for_step
from tests.support.kube import grant, kubectl, kubectl_json
from tests.support.kueue import KueueProcess, kueue_fixture, unique  # noqa: F401 (the fixture)
from tests.support.operator_process import OperatorProcess
from tests.support.reliability import Recorder
from tests.support.runs import conditions_of, run_of, wait_for_phase
from tests.support.waiting import wait_until

ZONE = "us-west-2a"


@dataclass(frozen=True)
class Queue:
    local_queue: str
    cluster_queue: str
    gpu_flavor: str


@pytest.fixture
def queue(kueue: KueueProcess, namespace: str) -> Iterator[Queue]:
    """A ClusterQueue with 8 GPUs of us-west-2a and a LocalQueue for the test's namespace."""
    gpus, system, cluster_queue = unique("g6-2a"), unique("system"), unique("gpus")
    kueue.gpu_flavor(gpus, zone=ZONE)
    kueue.system_flavor(system)
    kueue.cluster_queue(cluster_queue, gpus=8, gpu_flavor=gpus, system_flavor=system)
    local = kueue.local_queue(namespace, "team-gpus", cluster_queue)["metadata"]["name"]
    kueue.wait_queue_active(cluster_queue)
    yield Queue(local, cluster_queue, gpus)


def admitted(run: dict[str, Any]) -> dict[str, Any]:
    return conditions_of(run).get("Admitted", {})


def printed_phase(namespace: str, name: str) -> str:
    """The PHASE printer column of `kubectl get`, as a user reads it (the CRD's additionalPrinterColumns)."""
    table = kubectl("get", "fsdptrainingrun", name, "-n", namespace).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert header[:2] == ["NAME", "PHASE"] and row[0] == name, table
    return row[1]


def test_second_run_waits_queued_with_kueues_reason_then_runs_after_the_first(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, queue: Queue
) -> None:
    first = demo_run(namespace, **{"cluster.queueName": queue.local_queue})
    wait_for_phase(namespace, first, "Running", timeout=RUN_TIMEOUT)
    second = demo_run(namespace, **{"cluster.queueName": queue.local_queue, "training.maxSteps": 20})

    def queued_for_quota() -> dict[str, Any] | None:
        run = run_of(namespace, second)
        waiting = admitted(run).get("status") == "False" and admitted(run).get("reason") == "Pending"
        return run if run.get("status", {}).get("phase") == "Queued" and waiting else None

    held = wait_until(f"run {second} to be Queued for quota", queued_for_quota, timeout=60)
    assert "insufficient unused quota for nvidia.com/gpu" in admitted(held)["message"], admitted(held)
    assert "insufficient unused quota" in held["status"]["message"]
    assert run_of(namespace, first)["status"]["phase"] in ("Running", "Succeeded")
    assert printed_phase(namespace, second) == "Queued"

    wait_for_phase(namespace, first, "Succeeded", timeout=RUN_TIMEOUT)
    done = wait_for_phase(namespace, second, "Succeeded", timeout=RUN_TIMEOUT)
    status = done["status"]
    assert admitted(done)["status"] == "True"
    assert status["queue"]["clusterQueue"] == queue.cluster_queue
    assert f"gpu-workers:{queue.gpu_flavor}" in status["queue"]["flavors"]  # the worker group's pod set
    assert status["zone"] == ZONE  # from the flavor Kueue chose, not from a preflight
    assert status["restarts"]["count"] == 0 and status["attempt"] == 1
    assert conditions_of(done)["Preflight"]["reason"] == "DelegatedToKueue"


def test_preempted_run_is_queued_keeps_its_checkpoints_spends_no_restart_and_resumes(
    namespace: str,
    lifecycle_operator: OperatorProcess,
    s3: Any,
    queue: Queue,
    kueue: KueueProcess,
    reliability: Recorder,
) -> None:
    low, high = unique("low"), unique("high")
    kueue.priority_class(low, 100)
    kueue.priority_class(high, 1000)
    grant(namespace, tenancy.WORKLOAD_PRIORITY_CLASSES, f"{low},{high}")
    victim = demo_run(
        namespace,
        **{
            "cluster.queueName": queue.local_queue,
            "cluster.workloadPriorityClass": low,
            "training.maxSteps": 40,
        },
    )
    before = wait_for_step(namespace, victim, 10)["status"]["checkpoints"]["latest"]["step"]
    urgent = demo_run(
        namespace,
        **{
            "cluster.queueName": queue.local_queue,
            "cluster.workloadPriorityClass": high,
            "training.maxSteps": 20,
        },
    )

    def preempted() -> dict[str, Any] | None:
        run = run_of(namespace, victim)
        status = run.get("status", {})
        return run if status.get("phase") == "Queued" and status["restarts"].get("preemptions") else None

    paused = wait_until(f"run {victim} to be preempted back to Queued", preempted, timeout=60)
    status = paused["status"]
    assert status["restarts"]["count"] == 0 and status["restarts"]["preemptions"] == 1
    [entry] = status["restarts"]["history"]
    assert entry["reason"] == "Preempted" and entry["resumedFromStep"] >= before, entry
    assert "Preempted" in entry["message"]
    assert admitted(paused)["reason"] == "Preempted"
    events = kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={victim}"
    )
    assert "Preempted" in {e["reason"] for e in events["items"]}

    assert wait_for_phase(namespace, urgent, "Succeeded", timeout=RUN_TIMEOUT)["status"]["attempt"] == 1
    done = wait_for_phase(namespace, victim, "Succeeded", timeout=2 * RUN_TIMEOUT)
    status = done["status"]
    assert status["attempt"] == 2 and status["restarts"]["count"] == 0 and status["progress"]["step"] == 40
    progress = json.loads(
        s3.get_object(Bucket=BUCKET, Key=f"runs/{namespace}/{victim}/progress.json")["Body"].read()
    )
    assert progress["resumedFromStep"] >= entry["resumedFromStep"]
    assert [r.reason for r in run_record(s3, namespace, victim).restarts] == ["Preempted"]
    reliability.record(
        "Kueue preempts a running run for one of higher priority",
        "the run is Queued with its checkpoints, spends no restart, and resumes when admitted again",
        f"{status['restarts']['count']} restarts, {status['restarts']['preemptions']} preemption, "
        f"resumed from step {entry['resumedFromStep']}, finished at step {status['progress']['step']}",
    )
