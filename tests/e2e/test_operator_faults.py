"""The operator SIGKILLed at each side-effect boundary (a fault point set by the test), then restarted: no
duplicate Ray job or RayCluster, every attempt counted once."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.demo import RUN_TIMEOUT, SMALL, demo_manifest, lifecycle_env
from tests.harness import LocalCluster, OperatorProcess, apply, kubectl, rayclusters, wait_for_phase
from tests.reliability import Recorder


def killed_at(proc: OperatorProcess, point: str) -> None:
    assert proc.process is not None
    code = proc.process.wait(timeout=RUN_TIMEOUT)
    assert code == -signal.SIGKILL, f"the operator exited with {code}, not at fault point {point}"
    assert f"fault point {point.split(':')[0]}" in proc.log.read_text()


@pytest.mark.parametrize(
    ("point", "trainer_fault", "attempts"),
    [
        ("after-submit:1", False, 1),  # the job is in Ray, the status does not say it runs yet
        ("after-submit:2", True, 2),  # the same during a restart
    ],
    ids=["after-submit", "after-resubmit-during-a-restart"],
)
def test_operator_killed_after_a_submission_submits_nothing_twice(
    namespace: str,
    crd_installed: None,
    local_cluster: LocalCluster,
    s3: Any,
    tmp_path: Path,
    point: str,
    trainer_fault: bool,
    attempts: int,
    reliability: Recorder,
) -> None:
    name = f"fault-{uuid.uuid4().hex[:6]}"
    changes: dict[str, Any] = {**SMALL, "recovery.inJobMaxFailures": 0}
    if trainer_fault:  # the rank dies at step 25 of attempt 1, so attempt 2 is submitted by a restart
        changes["runtimeEnv"] = {"env": {"FSDP_TRAINER_FAULT": f"rank=0,step=25,marker={tmp_path / 'died'}"}}
    env = lifecycle_env(local_cluster)
    log = tmp_path / "operator.log"
    proc = OperatorProcess(namespace, {**env, "FSDP_OPERATOR_FAULT_POINT": point}, log).start()
    try:
        apply(namespace, demo_manifest(name, **changes))
        killed_at(proc, point)
        proc = OperatorProcess(namespace, env, log).start()
        run = wait_for_phase(namespace, name, "Succeeded", timeout=2 * RUN_TIMEOUT)
        status = run["status"]
        assert status["attempt"] == attempts and status["restarts"]["count"] == attempts - 1
        jobs = local_cluster.ray_jobs().list_jobs()
        ours = sorted(j.submission_id for j in jobs if (j.metadata or {}).get("run") == name)
        assert ours == [f"{status['jobSubmissionId'][:-2]}-{n}" for n in range(1, attempts + 1)], ours
        assert len(rayclusters(namespace)) <= 1  # deleted at the end (DeleteCluster), never two
        when = "during a restart" if trainer_fault else "before the status says it runs"
        reliability.record(
            f"The operator SIGKILLed right after submitting a job, {when}; started again",
            "the job is adopted, never submitted twice; one RayCluster",
            f"{len(ours)} Ray job(s) for {attempts} attempt(s)",
        )
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{log.read_text()[-6000:]}")
