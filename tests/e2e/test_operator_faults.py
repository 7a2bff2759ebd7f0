"""The operator SIGKILLed at a side-effect boundary (a fault point set by the test), then restarted: no
duplicate Ray job or RayCluster, every attempt counted once."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdp_operator.actions import FAULT_POINT_ENV
from tests.support.demo import RUN_TIMEOUT, SMALL, demo_manifest, lifecycle_env
from tests.support.kube import apply, kubectl
from tests.support.local_cluster import LocalCluster
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.reliability import Recorder
from tests.support.runs import rayclusters, wait_for_phase
from tests.support.waiting import wait_until


@contextlib.contextmanager
def rayclusters_created(namespace: str) -> Iterator[set[str]]:
    """The UIDs of every RayCluster that exists in the namespace while the block runs, from a watch: one
    created and deleted between two looks is seen too. Complete once the block has ended."""
    seen: set[str] = set()
    watch = subprocess.Popen(
        [
            *(REPO / "bin" / "kubectl", "get", "rayclusters.ray.io", "-n", namespace, "--watch"),
            *("-o", 'jsonpath={.metadata.uid}{"\\n"}'),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert watch.stdout is not None
    out = watch.stdout
    reader = threading.Thread(target=lambda: seen.update(line.strip() for line in out if line.strip()))
    reader.start()
    try:
        yield seen
    finally:
        watch.terminate()
        watch.wait(timeout=30)
        reader.join(timeout=30)


def killed_at(proc: OperatorProcess, point: str, attempt: int) -> None:
    assert proc.process is not None
    code = proc.process.wait(timeout=RUN_TIMEOUT)
    assert code == -signal.SIGKILL, f"the operator exited with {code}, not at fault point {point}"
    assert f"fault point {point} (attempt {attempt})" in proc.log.read_text()


def test_operator_killed_after_each_submission_submits_nothing_twice(
    namespace: str,
    crd_installed: None,
    local_cluster: LocalCluster,
    s3: Any,
    tmp_path: Path,
    reliability: Recorder,
) -> None:
    """One run, two kills: right after attempt 1's submission (the job is in Ray, the status does not say it
    runs yet), and right after attempt 2's, submitted by a restart (rank 0 dies at step 25 of attempt 1). Each
    operator started after a kill adopts the job it finds; the run ends with one Ray job per attempt."""
    name = f"fault-{uuid.uuid4().hex[:6]}"
    changes: dict[str, Any] = {
        **SMALL,
        "recovery.inJobMaxFailures": 0,
        "runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": f"rank=0,step=25,marker={tmp_path / 'died'}"}},
    }
    env = lifecycle_env(local_cluster)
    log = tmp_path / "operator.log"
    proc = OperatorProcess(namespace, {**env, FAULT_POINT_ENV: "after-submit:1"}, log).start()
    try:
        with rayclusters_created(namespace) as created:
            apply(namespace, demo_manifest(name, **changes))
            killed_at(proc, "after-submit", 1)
            proc = OperatorProcess(namespace, {**env, FAULT_POINT_ENV: "after-submit:2"}, log).start()
            killed_at(proc, "after-submit", 2)
            proc = OperatorProcess(namespace, env, log).start()
            run = wait_for_phase(namespace, name, "Succeeded", timeout=RUN_TIMEOUT)
            status = run["status"]
            assert status["attempt"] == 2 and status["restarts"]["count"] == 1, status
            jobs = local_cluster.ray_jobs().list_jobs()
            ours = sorted(j.submission_id for j in jobs if (j.metadata or {}).get("run") == name)
            assert ours == [f"{status['jobSubmissionId'][:-2]}-{n}" for n in (1, 2)], ours
            # cleanupPolicy DeleteCluster: the run's one cluster goes once it has succeeded.
            wait_until("the run's RayCluster to be deleted", lambda: rayclusters(namespace) == [], 120)
        assert len(created) == 1, f"RayClusters created for one run: {sorted(created)}"
        reliability.record(
            "The operator SIGKILLed right after submitting a job, before the status says it runs; started "
            "again, and SIGKILLed again right after the resubmission of a restart",
            "each job is adopted, never submitted twice; one RayCluster",
            f"{len(ours)} Ray jobs for 2 attempts, {len(created)} RayCluster",
        )
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{log.read_text()[-6000:]}")
