"""GitOps with the real Argo CD (v2.14, core mode, tests/argocd.py): runs committed to a git repository served
on loopback are synced by Applications, and their health comes from our Lua check in argocd-cm.

Three Applications at once, each of one run: one that trains and succeeds (Progressing, then Healthy), one
that fails with a permanent error (Degraded), one committed with spec.suspend true (Suspended). Argo CD must
see no drift while the operator writes the runs' status (Synced at every observation after the first
sync), and deleting an Application must prune its run, after which the operator removes the RayCluster.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.argocd import (
    NAMESPACE,
    ArgoCD,
    application_of,
    delete_applications,
    resource_health,
    sync_and_health,
)
from tests.support.demo import BUCKET, RUN_TIMEOUT, demo_manifest
from tests.support.demo import SMALL as SMALL_SHAPE
from tests.support.kube import kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.operator_process import OperatorProcess
from tests.support.runs import rayclusters, run_of
from tests.support.waiting import wait_until

SMALL = {**SMALL_SHAPE, "training.maxSteps": 20}  # the three runs fit the fake nodes together
KIND = "FSDPTrainingRun"
# The health each run's Application must end in.
EXPECTED = {"succeeds": "Healthy", "fails": "Degraded", "suspended": "Suspended"}


@pytest.fixture
def argocd(local_cluster: LocalCluster, lifecycle_operator: OperatorProcess) -> Iterator[ArgoCD]:
    """Argo CD for one test (after the operator, so stopped before it): its Applications are deleted while the
    operator still runs, then its processes are stopped by pid; their logs are printed."""
    # A short path: the repo server's askpass socket lives here (108-byte limit on unix socket paths).
    workdir = Path(tempfile.mkdtemp(prefix="argocd-"))
    instance = ArgoCD(workdir=workdir, kubeconfig=local_cluster.kubeconfig)
    try:
        yield instance.start()
    finally:
        try:
            delete_applications(instance.applications)
        finally:
            instance.stop()
            print(instance.logs())
            shutil.rmtree(workdir, ignore_errors=True)


def test_argo_cd_syncs_runs_and_reports_progressing_healthy_degraded_and_suspended(
    namespace: str, s3: Any, argocd: ArgoCD
) -> None:
    suffix = uuid.uuid4().hex[:5]
    runs = {
        "succeeds": demo_manifest(f"gitops-ok-{suffix}", cleanupPolicy="KeepCluster", **SMALL),
        "fails": demo_manifest(
            f"gitops-bad-{suffix}", **{**SMALL, "data.source": f"s3://{BUCKET}/data/no-such-file.jsonl"}
        ),
        "suspended": demo_manifest(f"gitops-held-{suffix}", suspend=True, **SMALL),
    }
    for key, manifest in runs.items():
        argocd.git.write(f"{key}/run.json", manifest)
    argocd.git.commit("three runs")
    apps = {key: f"{namespace}-{key}" for key in runs}
    for key, app in apps.items():
        # The succeeding run is applied client-side (Argo CD's default), the others server-side.
        argocd.add_application(app, key, namespace, server_side_apply=key != "succeeds")

    # Observe all three Applications together until each has reached its final health.
    history: dict[str, list[tuple[str | None, str | None, str | None]]] = {key: [] for key in runs}
    messages: list[
        str
    ] = []  # the succeeding run's health messages, as the operator's status writes changed it

    def observe() -> bool:
        found = {
            a["metadata"]["name"]: a
            for a in kubectl_json("get", "applications.argoproj.io", "-n", NAMESPACE)["items"]
        }
        for key, app in apps.items():
            sync, health = sync_and_health(found.get(app, {}))
            res = resource_health(found.get(app, {}), KIND, runs[key]["metadata"]["name"])
            seen = (sync, health, (res or {}).get("status"))
            if not history[key] or history[key][-1] != seen:
                history[key].append(seen)
            message = (res or {}).get("message")
            if key == "succeeds" and message and (not messages or messages[-1] != message):
                messages.append(message)
        return all(history[key][-1][1:] == (EXPECTED[key], EXPECTED[key]) for key in runs)

    started = time.monotonic()
    try:
        wait_until("the three Applications to reach their final health", observe, timeout=RUN_TIMEOUT)
    finally:
        print(f"Application (sync, health, run's health) changes after {time.monotonic() - started:.0f}s:")
        for key, seen in history.items():
            print(f"  {apps[key]}: {seen}")
        print(f"  {apps['succeeds']} run's health messages: {messages}")

    # Argo CD applied what git holds, and the operator acted on it.
    ok = run_of(namespace, runs["succeeds"]["metadata"]["name"])
    assert ok["status"]["phase"] == "Succeeded" and ok["status"]["progress"]["step"] == 20
    assert ok["metadata"]["labels"]["app.kubernetes.io/instance"] == apps["succeeds"]
    for key, phase in (("fails", "Failed"), ("suspended", "Suspended")):
        name = runs[key]["metadata"]["name"]
        run = kubectl_json("get", "fsdptrainingrun", name, "-n", namespace, "--show-managed-fields")
        assert run["status"]["phase"] == phase
        applied = {(f["manager"], f["operation"]) for f in run["metadata"]["managedFields"]}
        assert ("argocd-controller", "Apply") in applied, applied  # server-side, as asked

    # Health as the run went: Progressing while it trained, then Healthy; the message is the check's.
    healths = [health for _, health, _ in history["succeeds"]]
    assert "Progressing" in healths[:-1] and healths[-1] == "Healthy", healths
    # The operator rewrote the status several times while Argo CD watched (each write a new message).
    assert len(messages) >= 3 and messages[-1].startswith("Succeeded"), messages

    def run_health_message(key: str) -> str:
        app = application_of(apps[key])
        assert app is not None, f"Application {apps[key]} is gone"
        return str((resource_health(app, KIND, runs[key]["metadata"]["name"]) or {}).get("message", ""))

    assert run_health_message("succeeds").startswith("Succeeded"), run_health_message("succeeds")
    assert "no-such-file.jsonl" in run_health_message("fails"), run_health_message("fails")

    # No drift: once synced, every Application stayed Synced while the operator wrote status.
    for key, seen in history.items():
        syncs = [sync for sync, _, _ in seen]
        assert "Synced" in syncs, (apps[key], seen)
        after = syncs[syncs.index("Synced") :]
        assert set(after) == {"Synced"}, (apps[key], seen)
    # Between observations too: with self-heal on, any drift would have made Argo CD sync again.
    for app in apps.values():
        current = application_of(app)
        assert current is not None and current["status"]["sync"]["revision"] == argocd.git.head()
        syncs_done = current["status"].get("history", [])
        assert [h["revision"] for h in syncs_done] == [argocd.git.head()], (app, syncs_done)

    # Deleting an Application prunes its run (Argo CD's resources finalizer); the operator, finishing the
    # run's deletion, removes the RayCluster it kept.
    [kept] = [c for c in rayclusters(namespace) if c["metadata"]["name"] == ok["status"]["rayClusterName"]]
    kubectl("delete", "applications.argoproj.io", apps["succeeds"], "-n", NAMESPACE, "--wait=false")
    name = ok["metadata"]["name"]

    def pruned() -> bool:
        run = kubectl("get", "fsdptrainingrun", name, "-n", namespace, "--ignore-not-found", "-o", "name")
        return application_of(apps["succeeds"]) is None and not run.stdout.strip()

    wait_until(f"Application {apps['succeeds']} and run {name} to be deleted", pruned, timeout=120)
    wait_until(
        f"RayCluster {kept['metadata']['name']} to be deleted",
        lambda: kept["metadata"]["name"] not in [c["metadata"]["name"] for c in rayclusters(namespace)],
        timeout=60,
    )
    # The other Applications are untouched by it.
    for key in ("fails", "suspended"):
        assert run_of(namespace, runs[key]["metadata"]["name"])["metadata"].get("deletionTimestamp") is None
