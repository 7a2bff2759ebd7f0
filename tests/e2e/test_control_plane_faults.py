"""The control plane fails under a running operator, which must go on in the same process, act on every
change, and create nothing twice:

- its connection to the apiserver goes silent: every watch and request black-holed behind a loopback proxy
  (accepted, never answered, never closed: a dead NAT entry or peer) while runs are created, changed and
  deleted directly; it must notice its dead watches by itself (renewed every watch_timeout_seconds);
- kube-apiserver or etcd is killed (SIGKILL) for 30 s and started again as it was. While the apiserver is
  down, etcd is compacted to its latest revision: the apiserver comes back with an empty watch cache above a
  compacted history, so every watch resumed from before is refused (410 Gone) and the operator must list
  again. Runs in every phase meanwhile: one waits for capacity (Pending), one's head pod fits no node
  (Provisioning), and a real Ray job either trains (Running, under the apiserver kill) or has just died and
  waits out its restart backoff (Restarting, under the etcd kill).

The runs changed during the faults wait for capacity (more GPUs than the fake nodes have): no Ray job is
needed to see the operator act on them.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from fsdp_operator.builder import LABEL_RUN
from tests.support.control_plane import ControlPlaneComponent, restart_exited_control_plane
from tests.support.demo import RUN_TIMEOUT, SMALL, demo_run, lifecycle_env
from tests.support.kube import apply, kubectl
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import example
from tests.support.netproxy import BlackHoleProxy
from tests.support.operator_process import OperatorProcess
from tests.support.reliability import Recorder
from tests.support.runs import rayclusters, set_suspend, wait_for_phase
from tests.support.waiting import wait_until

WATCH_SECONDS = 10  # the operator's watch_timeout_seconds here (60 by default)
OUTAGE_SECONDS = 15  # longer than a watch lasts: the renewals made during the outage are swallowed too
PENDING = {"cluster.workers": 5, "preflight.recheckSeconds": 5}  # more GPUs than the fake nodes have
# Its head pod selects a node that does not exist yet (as one an autoscaler would add): Provisioning until
# deleted (not failed after the default 300 s of a head no node takes, which a loaded machine's 300-step run
# outlasted). A head larger than every node preflight refuses before its RayCluster exists.
PROVISIONING = {
    **SMALL,
    "cluster.head.nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
    "recovery.podErrorTimeoutSeconds": 3600,
}
RESTART_BACKOFF_SECONDS = 40  # longer than it takes to kill etcd once the run is seen Restarting


def run_named(name: str) -> dict[str, Any]:
    manifest = example("aws-sample", **PENDING)
    manifest["metadata"]["name"] = name
    return manifest


def kubeconfig_through(proxy: BlackHoleProxy, kubeconfig: str, path: Path) -> Path:
    config = yaml.safe_load(Path(kubeconfig).read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"  # the apiserver's cert names the IP
    path.write_text(yaml.safe_dump(config))
    return path


def phase(namespace: str, name: str) -> str | None:
    found = kubectl(
        "get", "fsdptrainingrun", name, "-n", namespace, "-o", "jsonpath={.status.phase}", check=False
    )
    return found.stdout if found.returncode == 0 else None


def seconds_until_phases(
    namespace: str, expected: dict[str, str | None], since: float, timeout: float
) -> dict[str, float]:
    """Seconds from `since` until each run showed its expected phase (None: the run is gone)."""
    handled: dict[str, float] = {}

    def all_handled() -> bool:
        for name, wanted in expected.items():
            if name not in handled and phase(namespace, name) == wanted:
                handled[name] = time.monotonic() - since
        return len(handled) == len(expected)

    wait_until(f"the operator to act on {sorted(expected)}", all_handled, timeout=timeout)
    return handled


def test_changes_made_while_the_operators_watches_were_black_holed_are_all_handled(
    namespace: str, crd_installed: None, local_cluster: LocalCluster, tmp_path: Path, reliability: Recorder
) -> None:
    server = urlparse(
        yaml.safe_load(Path(local_cluster.kubeconfig).read_text())["clusters"][0]["cluster"]["server"]
    )
    assert server.hostname and server.port
    with BlackHoleProxy(server.hostname, server.port) as proxy:
        env = {
            "KUBECONFIG": str(kubeconfig_through(proxy, local_cluster.kubeconfig, tmp_path / "kubeconfig")),
            "FSDP_OPERATOR_WATCH_TIMEOUT_SECONDS": str(WATCH_SECONDS),
        }
        proc = OperatorProcess(namespace, env, tmp_path / "operator.log").start()
        try:
            for name in ("changed", "deleted"):
                apply(namespace, run_named(name))
            for name in ("changed", "deleted"):
                wait_for_phase(namespace, name, "Pending", timeout=60)

            proxy.black_hole()
            apply(namespace, run_named("created"))
            set_suspend(namespace, "changed", True)
            kubectl("delete", "fsdptrainingrun", "deleted", "-n", namespace, "--wait=false")
            time.sleep(OUTAGE_SECONDS)
            assert phase(namespace, "created") == "" and phase(namespace, "changed") == "Pending"
            proxy.pass_through()
            recovered = time.monotonic()

            expected = {"created": "Pending", "changed": "Suspended", "deleted": None}
            handled = seconds_until_phases(namespace, expected, recovered, timeout=4 * WATCH_SECONDS + 30)
            assert proc.process is not None and proc.process.poll() is None, "the operator exited"
            assert rayclusters(namespace) == [], "no run had capacity: nothing may have been created"
        finally:
            kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
            proc.stop()
            print(f"--- operator log ---\n{proc.log.read_text()[-4000:]}")
    first, last = min(handled.values()), max(handled.values())
    reliability.record(
        f"Every connection of the operator to the apiserver black-holed for {OUTAGE_SECONDS} s (no FIN, no "
        "RST) while a run is created, one suspended and one deleted",
        f"the same process renews its dead watches (watch timeout {WATCH_SECONDS} s here, 60 s by default) "
        "and acts on all three; no RayCluster created for them (none has capacity)",
        f"first change handled {first:.0f} s after the traffic passed again, all three after {last:.0f} s",
    )


KILLED_SECONDS = 30


def apiserver_ready() -> bool:
    return kubectl("get", "--raw", "/readyz", check=False).returncode == 0


def runs_path(namespace: str) -> str:
    return f"/apis/fsdp.training.dev/v1alpha1/namespaces/{namespace}/fsdptrainingruns"


def runs_resource_version(namespace: str) -> str:
    listed = json.loads(kubectl("get", "--raw", runs_path(namespace)).stdout)
    return str(listed["metadata"]["resourceVersion"])


def watch_from(namespace: str, resource_version: str) -> str:
    """What a watch of the namespace's runs from that resourceVersion gets in its first second."""
    query = f"?watch=1&resourceVersion={resource_version}&timeoutSeconds=1"
    return kubectl("get", "--raw", runs_path(namespace) + query).stdout


def compact_etcd() -> int:
    """Compacts the local cluster's etcd to its current revision (physically), through its gRPC gateway."""
    etcd = ControlPlaneComponent.of_local_cluster("etcd")
    [urls] = [arg.split("=", 1)[1] for arg in etcd.command if arg.startswith("--listen-client-urls=")]
    endpoint = urls.split(",")[0]

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{endpoint}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            found: dict[str, Any] = json.load(answer)
            return found

    revision = int(post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
    post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
    return revision


def clusters_by_run(namespace: str) -> dict[str, list[str]]:
    """The UIDs of the namespace's RayClusters, by the run each belongs to (its label); one being deleted is
    marked so (its replacement comes under the same name once it is gone)."""
    found: dict[str, list[str]] = {}
    for cluster in rayclusters(namespace):
        meta = cluster["metadata"]
        run = meta.get("labels", {}).get(LABEL_RUN, "")
        found.setdefault(run, []).append(
            meta["uid"] + (" (deleting)" if meta.get("deletionTimestamp") else "")
        )
    return found


def progress_step(namespace: str, name: str) -> int:
    found = kubectl("get", "fsdptrainingrun", name, "-n", namespace, "-o", "jsonpath={.status.progress.step}")
    return int(found.stdout or 0)


@pytest.mark.parametrize("component", ["kube-apiserver", "etcd"])
def test_the_operator_carries_on_when_the_apiserver_or_etcd_is_killed_for_30s(
    component: str, namespace: str, crd_installed: None, local_cluster: LocalCluster, s3: Any,
    tmp_path: Path, reliability: Recorder,
) -> None:  # fmt: skip
    killed = ControlPlaneComponent.of_local_cluster(component)
    proc = OperatorProcess(namespace, lifecycle_env(local_cluster), tmp_path / "operator.log").start()
    restarts = 1 if component == "etcd" else 0
    dies = {
        "recovery.inJobMaxFailures": 0,
        "recovery.backoffSeconds": RESTART_BACKOFF_SECONDS,
        "runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": f"rank=0,step=3,marker={tmp_path / 'died'}"}},
    }
    try:
        apply(namespace, run_named("before"))
        provisioning = demo_run(namespace, **PROVISIONING)
        # 300 steps: still training when the apiserver's kill comes a moment after its first step. Under the
        # etcd kill it is Restarting (its first attempt dies at step 3): the demo's 40 steps are enough.
        training = demo_run(namespace, **SMALL, **(dies if restarts else {"training.maxSteps": 300}))
        wait_for_phase(namespace, "before", "Pending", timeout=60)
        wait_for_phase(namespace, provisioning, "Provisioning", timeout=60)
        if restarts:
            wait_for_phase(namespace, training, "Restarting", timeout=RUN_TIMEOUT)
        else:
            wait_until(f"{training} to train", lambda: progress_step(namespace, training) >= 1, RUN_TIMEOUT)
        step_at_kill = progress_step(namespace, training)
        phases_at_kill = {name: phase(namespace, name) for name in ("before", provisioning, training)}
        expected = {"before": "Pending", provisioning: "Provisioning"}
        expected[training] = "Restarting" if restarts else "Running"
        assert phases_at_kill == expected, f"not in the phases to kill {component} in: {phases_at_kill}"
        clusters_at_kill = wait_until(
            f"the RayClusters of {provisioning} and {training}",
            lambda: (found := clusters_by_run(namespace)).keys() == {provisioning, training} and found,
            60,
        )
        listed_at = runs_resource_version(namespace)  # no older than any position of the operator's watches
        kubectl("create", "configmap", "written-after-the-list", "-n", namespace)
        killed.kill()
        if component == "kube-apiserver":  # etcd forgets the history the operator's watches would resume from
            compacted = compact_etcd()
        time.sleep(KILLED_SECONDS)
        started = time.monotonic()
        restarted = restart_exited_control_plane()  # it, and what lost its leader lease meanwhile
        assert component in restarted, restarted
        wait_until(
            f"the apiserver to be ready after {component} came back",
            apiserver_ready,
            120,
        )
        ready = time.monotonic() - started
        if component == "kube-apiserver":  # its watch cache starts afresh, above a compacted history
            refusal = watch_from(namespace, listed_at)
            assert '"code":410' in refusal, f"a watch from {listed_at} was not refused: {refusal[:500]}"
        changed = time.monotonic()
        apply(namespace, run_named("after"))
        set_suspend(namespace, "before", True)
        handled = seconds_until_phases(namespace, {"after": "Pending", "before": "Suspended"}, changed, 90)
        assert proc.process is not None and proc.process.poll() is None, "the operator exited"
        # The clusters at the kill, each still the same object (none deleted and created again), and no more.
        clusters = clusters_by_run(namespace)
        assert clusters == clusters_at_kill, (
            f"RayClusters, by run: {clusters}, at the kill: {clusters_at_kill}"
        )
        status = wait_for_phase(namespace, training, "Succeeded", timeout=RUN_TIMEOUT)["status"]
        assert status["attempt"] == 1 + restarts and status["restarts"]["count"] == restarts, status
        assert phase(namespace, provisioning) == "Provisioning"
        # Still the same object at the end: a deletion begun after the check above would not show there.
        at_end = clusters_by_run(namespace).get(provisioning)
        assert at_end == clusters_at_kill[provisioning], (
            f"{provisioning}'s RayClusters: {at_end}, at the kill: {clusters_at_kill[provisioning]}"
        )
    finally:
        restart_exited_control_plane()  # whatever failed above: the next tests need a whole control plane
        wait_until("the apiserver to be ready", apiserver_ready, 120)
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{proc.log.read_text()[-4000:]}")
    compaction = (
        f", etcd compacted to revision {compacted} meanwhile: every watch resumed from before is refused "
        "with 410 Gone"
        if component == "kube-apiserver"
        else ""
    )
    reliability.record(
        f"{component} SIGKILLed for {KILLED_SECONDS} s under a running operator, then started again"
        f"{compaction}",
        "the same operator process acts on a run created and a run suspended right after; nothing created "
        "twice; a run Pending, one Provisioning and one Running or Restarting at the kill carry on; the "
        "training run finishes with no restart spent by the fault",
        f"apiserver ready {ready:.0f} s after the restart; both changes handled within "
        f"{max(handled.values()):.0f} s; the training run was {phases_at_kill[training]} at step "
        f"{step_at_kill} at the kill, finished with {restarts} restart{'s' if restarts != 1 else ''} "
        f"({'its own injected death' if restarts else 'none'})",
    )
