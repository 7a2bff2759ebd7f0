"""One operator, many teams: namespaces, names, reused prefixes, competing runs and a misbehaving Ray head.

Real Ray jobs on the local head (the CPU demo), the real KubeRay and S3; runs share an operator if they can.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fsdp_operator import jobs
from tests.support.demo import (
    BUCKET,
    RUN_TIMEOUT,
    SMALL,
    checkpoint_steps_in_s3,
    demo_manifest,
    lifecycle_env,
    run_record,
)
from tests.support.kube import apply, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.netproxy import BlackHoleProxy
from tests.support.operator_process import OperatorProcess
from tests.support.reliability import Recorder, seconds_between
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until

HANG_BOUND = 60  # the held run's recovery.hangTimeoutSeconds, the least allowed


def operator_for(
    namespaces: list[str], local_cluster: LocalCluster, log: Path, **env: str
) -> OperatorProcess:
    return OperatorProcess(
        namespace=",".join(namespaces),
        env={**lifecycle_env(local_cluster), "FSDP_OPERATOR_LEASE_NAMESPACE": namespaces[0], **env},
        log=log,
    ).start()


def stop(proc: OperatorProcess, namespaces: list[str]) -> None:
    for namespace in namespaces:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
    proc.stop()
    print(f"--- operator log ---\n{proc.log.read_text()[-8000:]}")


def test_one_name_in_two_namespaces_keeps_two_prefixes_and_a_reused_prefix_is_refused(
    namespace: str,
    crd_installed: None,
    second_namespace: str,
    local_cluster: LocalCluster,
    s3: Any,
    tmp_path: Path,
) -> None:
    # 70 characters with dots: no valid Service, label or DNS-1035 name as it is.
    name = "qwen2.5-ft." + "a" * 50 + "-" + uuid.uuid4().hex[:8]
    assert len(name) == 70
    namespaces = [namespace, second_namespace]
    proc = operator_for(namespaces, local_cluster, tmp_path / "operator.log")
    try:
        for ns in namespaces:
            apply(ns, demo_manifest(name, **SMALL))
        runs = [wait_for_phase(ns, name, "Succeeded", timeout=2 * RUN_TIMEOUT) for ns in namespaces]
        for ns, run in zip(namespaces, runs, strict=True):
            status = run["status"]
            child = status["rayClusterName"]
            assert len(child) <= 40 and "." not in child and child[0].isalpha(), child
            assert status["record"]["uri"] == f"s3://{BUCKET}/runs/{ns}/{name}/run.json"
            assert checkpoint_steps_in_s3(s3, ns, name) >= {30, 40}
            assert run_record(s3, ns, name).namespace == ns
        # Each team's run trained its own model: both from step 0, neither resumed from the other.
        for ns in namespaces:
            progress = s3.get_object(Bucket=BUCKET, Key=f"runs/{ns}/{name}/progress.json")["Body"].read()
            assert json.loads(progress).get("resumedFromStep") in (None, 0)

        # Re-created under the same prefix with another configuration: refused before any job, and
        # `kubectl wait` on the terminal condition returns for the failure.
        kubectl("delete", "fsdptrainingrun", name, "-n", namespace, "--timeout=60s")
        apply(namespace, demo_manifest(name, **SMALL, **{"training.seed": 7}))
        waited = kubectl(
            "wait",
            f"fsdptrainingrun/{name}",
            "-n",
            namespace,
            "--for=condition=Finished",
            "--timeout=120s",
            check=False,
        )
        assert waited.returncode == 0, waited.stderr
        run = run_of(namespace, name)
        conditions = conditions_of(run)
        assert conditions["Failed"]["reason"] == "CheckpointMismatch", conditions["Failed"]
        assert "fingerprint" in conditions["Failed"]["message"]
        assert conditions["Succeeded"]["status"] == "False" and run["status"]["attempt"] == 0
        assert checkpoint_steps_in_s3(s3, namespace, name) >= {30, 40}, "the old checkpoints must be kept"
    finally:
        stop(proc, namespaces)


def test_two_runs_that_need_the_same_zone_run_one_after_the_other(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, s3: Any, tmp_path: Path
) -> None:
    # Each run needs both GPU nodes of us-west-2a: admitted together, each would hold one and wait forever.
    shape = {"cluster.zone": "us-west-2a", "preflight.recheckSeconds": 5, "training.maxSteps": 20}
    proc = operator_for([namespace], local_cluster, tmp_path / "operator.log")
    try:
        first, second = f"first-{uuid.uuid4().hex[:6]}", f"second-{uuid.uuid4().hex[:6]}"
        apply(namespace, demo_manifest(first, **shape))
        wait_until(
            f"{first} to be admitted", lambda: run_of(namespace, first).get("status", {}).get("zone"), 60
        )
        apply(namespace, demo_manifest(second, **shape))

        def second_waits() -> dict[str, Any] | None:
            found = conditions_of(run_of(namespace, second)).get("Preflight")
            return found if found and found["status"] == "False" else None

        waiting = wait_until(f"{second} to wait for capacity", second_waits, timeout=60)
        assert waiting["reason"] in ("InsufficientCapacity", "WaitingForEarlierRun"), waiting
        assert run_of(namespace, second)["status"]["phase"] == "Pending"
        assert [c["metadata"]["name"] for c in rayclusters(namespace)] == [
            run_of(namespace, first)["status"]["rayClusterName"]
        ]
        first_done = wait_for_phase(namespace, first, "Succeeded", timeout=RUN_TIMEOUT)
        finished = conditions_of(first_done)["Finished"]
        done = wait_for_phase(namespace, second, "Succeeded", timeout=RUN_TIMEOUT)
        assert done["status"]["zone"] == "us-west-2a" and done["status"]["restarts"]["count"] == 0
        # Admitted once the first run's workers were gone (its reservation ended when it finished), within a
        # few re-checks, not when the operator's memory of admitting the first run expired (120 s).
        admitted = conditions_of(done)["Preflight"]
        waited = seconds_between(finished["lastTransitionTime"], admitted["lastTransitionTime"])
        assert waited < 30, f"{second} was admitted {waited:.0f} s after {first} finished"
    finally:
        stop(proc, [namespace])


def event_after(namespace: str, name: str, reason: str) -> float | None:
    """Seconds from the run's creation to its first Event of that reason (Kubernetes' whole seconds); None
    while it has none."""
    created = run_of(namespace, name)["metadata"]["creationTimestamp"]
    events = kubectl_json("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    times = [e.get("firstTimestamp") or e["eventTime"] for e in events["items"] if e["reason"] == reason]
    return min(seconds_between(created, at) for at in times) if times else None


def handled_after(namespace: str, name: str) -> tuple[float, float]:
    """Seconds from the run's creation to its Ray job's submission, and from the submission to the first
    pass that asked Ray about the job (the JobRunning Event): how soon the operator acted on it."""
    submitted = event_after(namespace, name, "JobSubmitted")
    observed = event_after(namespace, name, "JobRunning")
    assert submitted is not None and observed is not None, f"{name}: no JobSubmitted or JobRunning Event"
    return submitted, observed - submitted


def test_a_black_holed_dashboard_slows_only_its_own_run(
    namespace: str,
    crd_installed: None,
    second_namespace: str,
    local_cluster: LocalCluster,
    s3: Any,
    tmp_path: Path,
    reliability: Recorder,
) -> None:
    dashboard = urlparse(local_cluster.ray_dashboard_url)
    assert dashboard.hostname and dashboard.port
    with BlackHoleProxy(dashboard.hostname, dashboard.port) as proxy:
        urls = json.dumps({second_namespace: proxy.url})
        proc = operator_for(
            [namespace, second_namespace],
            local_cluster,
            tmp_path / "operator.log",
            FSDP_OPERATOR_DASHBOARD_URLS=urls,
        )
        try:
            healthy, held = f"ok-{uuid.uuid4().hex[:6]}", f"held-{uuid.uuid4().hex[:6]}"
            held_changes = {**SMALL, "training.maxSteps": 60, "recovery.hangTimeoutSeconds": HANG_BOUND}
            apply(second_namespace, demo_manifest(held, **held_changes))
            wait_for_phase(second_namespace, held, "Running", timeout=RUN_TIMEOUT)
            wait_until(
                "the held run's first answer from Ray (its JobRunning Event)",
                lambda: event_after(second_namespace, held, "JobRunning") is not None,
                timeout=60,
            )
            held_handled = handled_after(second_namespace, held)
            proxy.black_hole()
            black_holed_at = time.monotonic()

            def unknown() -> dict[str, Any] | None:
                found = conditions_of(run_of(second_namespace, held)).get("JobRunning")
                return found if found and found["status"] == "Unknown" else None

            condition = wait_until("the held run's JobRunning=Unknown", unknown, timeout=90)
            assert condition["reason"] == "DashboardUnreachable", condition
            # Created once the held run's passes are seen hanging on its dashboard (created at once, it was
            # submitted before the first hung read). It is submitted, asked about and finished while every
            # pass of the held run hangs, each as soon as the held run's were before the black hole: not held
            # up by a hung dashboard read (with one handler thread for all runs, the operator first asked Ray
            # about its job 15 s after the submission; the held run's, 2 s).
            apply(namespace, demo_manifest(healthy, **SMALL))
            wait_for_phase(namespace, healthy, "Succeeded", timeout=RUN_TIMEOUT)
            healthy_handled = handled_after(namespace, healthy)
            slack = jobs.REQUEST_TIMEOUT[1] / 2
            assert all(h <= b + slack for h, b in zip(healthy_handled, held_handled, strict=True)), (
                f"{healthy} submitted, then first observed, {healthy_handled} s after, in the black hole; "
                f"{held} {held_handled} s, before it"
            )

            # Longer than the held run's bound: its trainer finishes, then is silent past hangTimeoutSeconds
            # while Ray still cannot be asked how the job ended; that is no hang.
            def silent_past_the_bound() -> dict[str, Any] | None:
                status = run_of(second_namespace, held)["status"]
                assert status["phase"] == "Running" and status["restarts"]["count"] == 0, status
                progress = status.get("progress", {})
                final = progress.get("step") == 60 and progress.get("updatedAt")
                silent = final and seconds_between(final, datetime.now(UTC)) > HANG_BOUND + 15
                return status if silent else None

            wait_until("the held run's last record to be older than its bound", silent_past_the_bound, 300)
            held_for = time.monotonic() - black_holed_at

            proxy.pass_through()

            def recovered() -> dict[str, Any] | None:
                run = run_of(second_namespace, held)
                job = conditions_of(run).get("JobRunning", {})
                finished = run["status"].get("phase") == "Succeeded"
                return run if finished or job.get("status") == "True" else None

            run = wait_until("the held run to be observed again", recovered, timeout=120)
            assert run["status"]["restarts"]["count"] == 0 and run["status"]["attempt"] == 1
            wait_for_phase(second_namespace, held, "Succeeded", timeout=RUN_TIMEOUT)
            reliability.record(
                "One team's Ray dashboard black-holed (connections accepted, never answered) while it "
                "trains, until its trainer has been done for longer than its hangTimeoutSeconds "
                f"({HANG_BOUND} s)",
                "that run shows JobRunning=Unknown and spends no restart; another team's run created then is "
                "submitted and first observed as soon as the held run was before (within half a dashboard "
                "read timeout), trains and finishes meanwhile; the held run is observed again and finishes",
                f"black-holed {held_for:.0f} s; the other run submitted {healthy_handled[0]:.0f} s after its "
                f"creation, first observed {healthy_handled[1]:.0f} s after that (the held run "
                f"{held_handled[0]:.0f} s and {held_handled[1]:.0f} s, before the black hole), finished "
                "meanwhile; the held run: 0 restarts",
            )
        finally:
            stop(proc, [namespace, second_namespace])
