"""`kubectl drain` of the node under a run's workers, on real pods (issue 49): the node cordoned, the worker
pods evicted through the Eviction API, the replacement node there a moment later (as Karpenter launches one
before it drains). The trainer checkpoints at Ray's drain notice, the run resumes from exactly that step on
the new worker pods, no step is trained twice (read from the metric history the trainer wrote, not from the
operator's record), and no restart is spent: the run allows none (recovery.maxRestarts 0), so a restart
counted would have failed it.

In a file of its own: a test worker of its own runs it beside tests/e2e/test_real_pods.py.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from fsdp_client.storage import RunObjects, metric_histories
from fsdp_operator.drainwindow import DRAIN_ENV
from fsdp_trainer.contract import ProgressRecord
from tests.support.demo import BUCKET
from tests.support.kube import kubectl, kubectl_json
from tests.support.operator_process import OperatorProcess
from tests.support.real_node import RUN_TIMEOUT, RealNode, real_pods_run
from tests.support.reliability import Recorder, seconds_between
from tests.support.runs import run_of
from tests.support.waiting import wait_until

EVERY = 20  # periodic checkpoints: the drain's must land between two of them


def progress(namespace: str, run: str) -> dict[str, Any]:
    return dict(run_of(namespace, run).get("status", {}).get("progress") or {})


def trained(history: list[ProgressRecord]) -> set[int]:
    return {r.step for r in history if r.phase == "training" and r.loss is not None and r.step > 0}


@pytest.mark.timeout(1500)
def test_a_drained_worker_node_costs_no_step_and_no_restart(
    namespace: str, proxied_operator: OperatorProcess, real_node: RealNode, s3: Any, reliability: Recorder
) -> None:
    manifest = real_pods_run(
        namespace,
        **{
            "training.maxSteps": 5000,  # more than the test waits for: it ends once training resumed
            "checkpoint.everySteps": EVERY,
            "recovery.maxRestarts": 0,
        },
    )
    run = manifest["metadata"]["name"]
    try:
        wait_until(
            "the run two steps past its first checkpoint",
            lambda: int(progress(namespace, run).get("step") or 0) >= EVERY + 2,
            timeout=RUN_TIMEOUT,
        )
        drained_at = dt.datetime.now(dt.UTC)
        # Cordons the node, evicts the run's worker pods (their DisruptionTarget says so) and waits until they
        # are gone: Ray drains each pod's node for the window the run's status recorded.
        kubectl(
            "drain",
            real_node.name,
            "--pod-selector",
            f"fsdp.training.dev/run={run},ray.io/node-type=worker",
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=300s",  # kubectl's own bound on the evictions
        )
        kubectl("uncordon", real_node.name)  # the replacement node
        objects = RunObjects(s3, f"s3://{BUCKET}/runs/{namespace}/{run}")

        def resumed() -> list[list[ProgressRecord]] | None:
            histories = metric_histories(objects)
            drains = {r.drain_checkpoint_step for h in histories for r in h} - {None}
            if not drains:
                return None
            [step] = drains
            after = [h for h in histories if any(r.resumed_from_step == step for r in h)]
            return histories if after and max(trained(after[-1]), default=0) >= step + 3 else None

        histories = wait_until("training three steps past the drain checkpoint", resumed, timeout=900)
    finally:
        kubectl("uncordon", real_node.name)
    status = run_of(namespace, run)["status"]
    assert status["phase"] == "Running", (status["phase"], status.get("message"))
    assert status["restarts"]["count"] == 0, status["restarts"]

    [drain_step] = {r.drain_checkpoint_step for h in histories for r in h} - {None}
    drained = next(h for h in histories if any(r.drain_checkpoint_step == drain_step for r in h))
    again = next(h for h in histories if any(r.resumed_from_step == drain_step for r in h))
    # The history holds the steps logged (every training.logEvery): none after the drain checkpoint's on the
    # drained attempt, none up to it on the resumed one.
    assert max(trained(drained)) <= drain_step, (
        f"steps trained after the drain checkpoint at {drain_step}: "
        f"{sorted(s for s in trained(drained) if s > drain_step)}"
    )
    assert min(trained(again)) > drain_step, f"the resumed attempt trained {sorted(trained(again))[:5]}..."
    steps = [s for h in histories for s in trained(h)]
    assert len(steps) == len(set(steps)), (
        f"steps trained twice: {sorted({s for s in steps if steps.count(s) > 1})}"
    )
    # Recorded when the cluster was created (before any save was measured: the default), and what its
    # worker pods were given.
    window = status.get("drainSeconds")
    workers = kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"fsdp.training.dev/run={run},ray.io/node-type=worker"
    )["items"]
    given = {
        e.get("value") for p in workers for e in p["spec"]["containers"][0]["env"] if e["name"] == DRAIN_ENV
    }
    assert window is not None and given == {str(window)}, (window, given)
    first_again = min(r.updated_at for r in again if r.phase == "training" and r.step > drain_step)
    took = seconds_between(drained_at, first_again)
    durable = next(r for r in drained if r.drain_checkpoint_step == drain_step)
    print(f"drain checkpoint at step {drain_step}; training again {took:.0f} s after the drain began")
    reliability.record(
        "kubectl drain of the node under a run's two worker pods mid-run (maxRestarts 0), the replacement "
        "node there at once",
        "a checkpoint at Ray's drain notice, training resumed from exactly that step on the new pods, no "
        "step trained twice, no restart spent",
        f"drain checkpoint at step {drain_step} durable {durable.drain_checkpoint_seconds:.1f} s after the "
        f"notice's step boundary; training again {took:.0f} s after the drain began (window {window} s)",
    )
