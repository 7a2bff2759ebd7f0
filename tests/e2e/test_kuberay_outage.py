"""The KubeRay operator SIGKILLed for 90 s while one run trains and another provisions: nothing
reconciles RayClusters meanwhile, so the provisioning run's cluster gets no pods and the training run's
cluster status goes stale. Neither run fails or spends a restart; when KubeRay is back the waiting cluster
comes up and its run trains."""

from __future__ import annotations

import subprocess
import time
from datetime import UTC, datetime
from typing import Any

from fsdp_operator.builder import LABEL_RUN
from tests.support.demo import RUN_TIMEOUT, SMALL, demo_run
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.reliability import Recorder, seconds_between
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until

# Longer than kopf's 60 s re-check, so every run is examined again with KubeRay gone.
OUTAGE_SECONDS = 90


def kuberay(action: str) -> None:
    done = subprocess.run([str(REPO / "hack" / "kuberay.sh"), action], capture_output=True, text=True)
    assert done.returncode == 0, f"hack/kuberay.sh {action} failed: {done.stderr[-3000:]}"


def test_kuberay_stopped_for_90s_fails_no_run_and_spends_no_restart(
    namespace: str, lifecycle_operator: OperatorProcess, s3: Any, reliability: Recorder
) -> None:
    # Trains into the outage (20-40 s here, at 20-45 steps/s), then finishes while KubeRay is still down, so
    # that its core is not spent for the whole outage; deleted at the end by the fixture.
    training = demo_run(namespace, **SMALL, **{"training.maxSteps": 800, "checkpoint.everySteps": 200})

    def stepping() -> dict[str, Any] | None:
        status = run_of(namespace, training).get("status", {})
        return status if (status.get("progress", {}).get("step") or 0) >= 2 else None

    wait_until(f"run {training} to train", stepping, timeout=RUN_TIMEOUT)
    kuberay("kill")
    try:
        stopped = time.monotonic()
        provisioning = demo_run(namespace, **SMALL, **{"training.maxSteps": 20})
        steps_before = run_of(namespace, training)["status"]["progress"]["step"]
        phases_seen = set()
        while time.monotonic() - stopped < OUTAGE_SECONDS:
            for name in (training, provisioning):
                status = run_of(namespace, name).get("status", {})
                phases_seen.add((name, status.get("phase")))
                assert status.get("phase") not in ("Failed", "Restarting"), f"{name} in the outage: {status}"
                assert status.get("attempt", 0) <= 1, f"{name} resubmitted in the outage: {status}"
                assert status.get("restarts", {}).get("count", 0) == 0, f"{name} spent a restart: {status}"
            time.sleep(5)
        assert (provisioning, "Provisioning") in phases_seen, phases_seen
        runs_with_clusters = [c["metadata"].get("labels", {}).get(LABEL_RUN) for c in rayclusters(namespace)]
        assert provisioning in runs_with_clusters, f"no RayCluster of {provisioning}: {runs_with_clusters}"
        steps_after = run_of(namespace, training)["status"]["progress"]["step"]
        assert steps_after > steps_before, "the training run's progress stopped with KubeRay"
    finally:
        kuberay("start")
    back = datetime.now(UTC)

    run = wait_for_phase(namespace, provisioning, "Running", timeout=RUN_TIMEOUT)
    ready = conditions_of(run)["ClusterReady"]
    assert ready["status"] == "True"
    wait_for_phase(namespace, provisioning, "Succeeded", timeout=RUN_TIMEOUT)
    for name in (training, provisioning):
        status = run_of(namespace, name)["status"]
        assert status["attempt"] == 1 and status["restarts"]["count"] == 0, f"{name}: {status}"
    assert run_of(namespace, training)["status"]["phase"] in ("Running", "Succeeded")
    reliability.record(
        f"The KubeRay operator SIGKILLed for {OUTAGE_SECONDS} s while one run trains and another provisions",
        "no run fails or spends a restart; the training run trains on (and may finish); the provisioning "
        "run's cluster comes up once KubeRay is back, and it trains to the end",
        f"{steps_after - steps_before} steps trained during the outage; the waiting cluster ready "
        f"{seconds_between(back, ready['lastTransitionTime']):.0f} s after KubeRay was back; 0 restarts",
    )
