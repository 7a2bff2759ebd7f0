"""The real Kueue for the tests that need it, started on demand (never by cluster-up), out of cluster.

The manager (bin/kueue, built by hack/build-tools.sh from sigs.k8s.io/kueue) runs against the local cluster
on loopback with leader election off and only the ray.io/raycluster integration. Out of cluster nothing
registers Kueue's webhook configurations with the apiserver, so its defaulting webhook never runs: a
RayCluster must be created with `spec.suspend: true` by its creator (Kueue then unsuspends it on admission).

With internal cert management off, Kueue 0.17 reads TLS certificates from fixed paths whatever its
configuration says: /etc/kueue/metrics/certs (metrics server, read at start even when metrics are off) and
/visibility (the visibility API, kueue's pending-workloads server). Its webhook server (always started: the
webhooks are registered in code) reads them from `webhook.certDir`. The harness makes one self-signed
certificate for 127.0.0.1 and runs the manager in a mount namespace of its own, chrooted into an overlay of
/ whose upper layer holds those files, so nothing is written outside a temp dir.

Use: a test requests the `kueue` fixture (`from tests.kueue import kueue_fixture`; each module that imports
it gets a session instance of its own, so several modules should share it through a conftest), creates its
queues with the helpers below and labels its RayClusters with `kueue.x-k8s.io/queue-name` (and
`kueue.x-k8s.io/priority-class`).
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fsdp_operator import api, builder
from tests.support.kube import kubectl, kubectl_json, wait_established
from tests.support.local_cluster import LocalCluster
from tests.support.net import free_port
from tests.support.paths import REPO
from tests.support.processes import stop_process
from tests.support.tls import self_signed_cert
from tests.support.waiting import wait_until

KUEUE_BIN = REPO / "bin" / "kueue"
KUEUE_CRDS = REPO / "bin" / "kueue-crds"
API = "kueue.x-k8s.io/v1beta2"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
LABEL_PRIORITY = "kueue.x-k8s.io/priority-class"
GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
# Every resource a run's RayCluster requests (operator/fsdp_operator/builder.py): a ClusterQueue must cover
# each one, or Kueue never admits the workload.
RESOURCES = ("cpu", "memory", GPU, EFA)
PLURALS = {  # kubectl's names of the cluster-scoped kinds the helpers create
    "ResourceFlavor": "resourceflavors.kueue.x-k8s.io",
    "ClusterQueue": "clusterqueues.kueue.x-k8s.io",
    "WorkloadPriorityClass": "workloadpriorityclasses.kueue.x-k8s.io",
}
# The fake nodes of hack/cluster/nodes.sh.
LABEL_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
LABEL_ZONE = "topology.kubernetes.io/zone"
GPU_INSTANCE_TYPE = "g6.12xlarge"  # 4 GPUs, 1 EFA, 48 CPU, 192 GiB; two nodes per zone
SYSTEM_INSTANCE_TYPE = "m6i.2xlarge"  # the CPU node the Ray heads go to

# Run inside `unshare --mount`: an overlay of / whose upper layer (on a tmpfs of this namespace only) holds
# the certificates Kueue reads from fixed paths, then exec the manager chrooted into it.
_LAUNCH = r"""
set -eu
workdir=$1; shift
mnt=$workdir/ns
mount -t tmpfs -o size=16m tmpfs "$mnt"
mkdir -p "$mnt/upper/etc/kueue/metrics/certs" "$mnt/upper/visibility" "$mnt/work" "$mnt/root"
for dir in "$mnt/upper/etc/kueue/metrics/certs" "$mnt/upper/visibility"; do
  cp "$workdir/certs/tls.crt" "$workdir/certs/tls.key" "$dir/"
done
mount -t overlay overlay -o "lowerdir=/,upperdir=$mnt/upper,workdir=$mnt/work" "$mnt/root"
for fs in proc sys dev; do mount --rbind "/$fs" "$mnt/root/$fs"; done
exec chroot "$mnt/root" "$@"
"""


def install_crds() -> None:
    """Kueue's CRDs (server-side: they exceed the client-side annotation limit); waits until served."""
    # bin/kueue-crds is a link: with the slash kubectl reads the directory behind it.
    kubectl("apply", "--server-side", "--force-conflicts", "-f", f"{KUEUE_CRDS}/")
    names = [
        f"crd/{p.name.removeprefix('kueue.x-k8s.io_').removesuffix('.yaml')}.kueue.x-k8s.io"
        for p in sorted(KUEUE_CRDS.glob("*.yaml"))
    ]
    wait_established(*names)


@dataclass
class KueueProcess:
    """The Kueue manager out of cluster, started in a session of its own and stopped by pid."""

    kubeconfig: str
    workdir: Path
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    webhook_port: int = field(default_factory=free_port)
    visibility_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    created: list[tuple[str, str]] = field(default_factory=list)  # cluster-scoped (kind, name) to delete

    @property
    def log(self) -> Path:
        return self.workdir / "kueue.log"

    def configuration(self) -> dict[str, Any]:
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}"},
            "webhook": {
                "host": "127.0.0.1",
                "port": self.webhook_port,
                "certDir": str(self.workdir / "certs"),
            },
            "visibilityServer": {"bindAddress": "127.0.0.1", "bindPort": self.visibility_port},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            # waitForPodsReady absent: off.
            "integrations": {"frameworks": ["ray.io/raycluster"]},
            # Ray pods request local disk (ephemeral-storage), which the ClusterQueue has no quota for:
            # without this Kueue admits no workload ("resource ephemeral-storage unavailable").
            "resources": {"excludeResourcePrefixes": ["ephemeral-storage"]},
        }

    def start(self) -> KueueProcess:
        (self.workdir / "ns").mkdir(parents=True, exist_ok=True)
        self_signed_cert(self.workdir / "certs", "kueue-local")
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump(self.configuration()))
        unshare = ["unshare", "--mount", "--propagation", "private"]
        if os.geteuid() != 0:  # an unprivileged user gets the mount namespace inside a user namespace
            unshare[1:1] = ["--user", "--map-root-user"]
        command = [
            *unshare,
            "bash",
            "-c",
            _LAUNCH,
            "kueue-launch",
            str(self.workdir),
            str(KUEUE_BIN),
            f"--config={config}",
            f"--kubeconfig={self.kubeconfig}",
            f"--visibility-server-port={self.visibility_port}",
        ]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            wait_until(
                f"Kueue's readiness probe on 127.0.0.1:{self.health_port} (log {self.log})",
                lambda: self._exited() or self._ready(),
                timeout=180,
            )
            if self._exited():
                raise AssertionError(f"Kueue exited with code {self.process.returncode} at start")
        except AssertionError as failure:
            self.stop()
            raise AssertionError(f"{failure}\n--- Kueue log ---\n{self.log_tail()}") from None
        return self

    def _exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def log_tail(self, chars: int = 8000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def stop(self) -> None:
        stop_process(self.process)  # the manager is the launcher's pid: it execs

    def visibility(self, path: str) -> Any:
        """GET on Kueue's visibility API (visibility.kueue.x-k8s.io/v1beta2) straight on its loopback port,
        as the kubeconfig's user (the server authenticates and authorizes through the apiserver). Path is
        e.g. `namespaces/NS/localqueues/LQ/pendingworkloads` or `clusterqueues/CQ/pendingworkloads`."""
        user = yaml.safe_load(Path(self.kubeconfig).read_text())["users"][0]["user"]
        context = ssl.create_default_context(cafile=str(self.workdir / "certs" / "tls.crt"))
        context.load_cert_chain(user["client-certificate"], user["client-key"])
        url = f"https://127.0.0.1:{self.visibility_port}/apis/visibility.kueue.x-k8s.io/v1beta2/{path}"
        with urllib.request.urlopen(url, context=context, timeout=10) as answer:
            return json.load(answer)

    # --- objects -------------------------------------------------------------------------------------

    def _create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        kubectl("create", "-f", "-", input=json.dumps(manifest))
        if "namespace" not in manifest["metadata"]:
            self.created.append((PLURALS[manifest["kind"]], manifest["metadata"]["name"]))
        return manifest

    def resource_flavor(self, name: str, node_labels: dict[str, str]) -> dict[str, Any]:
        return self._create(
            {
                "apiVersion": API,
                "kind": "ResourceFlavor",
                "metadata": {"name": name},
                "spec": {"nodeLabels": node_labels},
            }
        )

    def gpu_flavor(self, name: str, zone: str | None = None) -> dict[str, Any]:
        """The fake g6.12xlarge GPU nodes (in one zone when given): Kueue puts these labels into the
        nodeSelector of the pods it admits on this flavor."""
        labels = {LABEL_INSTANCE_TYPE: GPU_INSTANCE_TYPE}
        if zone:
            labels[LABEL_ZONE] = zone
        return self.resource_flavor(name, labels)

    def system_flavor(self, name: str) -> dict[str, Any]:
        """The CPU system node, for the Ray head: the head's pod template keeps it off the GPU instance type
        (node affinity NotIn), which Kueue honours when it picks a flavor for the head's pod set."""
        return self.resource_flavor(name, {LABEL_INSTANCE_TYPE: SYSTEM_INSTANCE_TYPE})

    def cluster_queue(
        self,
        name: str,
        *,
        gpus: int,
        gpu_flavor: str,
        system_flavor: str,
        efa: int = 4,
        gpu_cpu: str = "192",
        gpu_memory: str = "768Gi",
        system_cpu: str = "8",
        system_memory: str = "32Gi",
    ) -> dict[str, Any]:
        """A ClusterQueue for every namespace covering cpu, memory, GPUs and EFA, with `gpus` GPUs of quota
        on the GPU flavor (tried first) and the system node's CPU and memory for heads; a workload may
        preempt lower-priority ones of the same queue."""

        def flavor(flavor_name: str, cpu: str, memory: str, gpu: int, efa_count: int) -> dict[str, Any]:
            quotas = {"cpu": cpu, "memory": memory, GPU: str(gpu), EFA: str(efa_count)}
            return {
                "name": flavor_name,
                "resources": [{"name": r, "nominalQuota": quotas[r]} for r in RESOURCES],
            }

        return self._create(
            {
                "apiVersion": API,
                "kind": "ClusterQueue",
                "metadata": {"name": name},
                "spec": {
                    "namespaceSelector": {},
                    "queueingStrategy": "BestEffortFIFO",
                    "preemption": {"withinClusterQueue": "LowerPriority"},
                    "resourceGroups": [
                        {
                            "coveredResources": list(RESOURCES),
                            "flavors": [
                                flavor(gpu_flavor, gpu_cpu, gpu_memory, gpus, efa),
                                flavor(system_flavor, system_cpu, system_memory, 0, 0),
                            ],
                        }
                    ],
                },
            }
        )

    def local_queue(self, namespace: str, name: str, cluster_queue: str) -> dict[str, Any]:
        return self._create(
            {
                "apiVersion": API,
                "kind": "LocalQueue",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"clusterQueue": cluster_queue},
            }
        )

    def priority_class(self, name: str, value: int) -> dict[str, Any]:
        return self._create(
            {
                "apiVersion": API,
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": name},
                "value": value,
                "description": f"test priority {value}",
            }
        )

    def wait_queue_active(self, cluster_queue: str, timeout: float = 60) -> None:
        def active() -> bool:
            found = kubectl_json("get", f"clusterqueues.v1beta2.kueue.x-k8s.io/{cluster_queue}")
            return any(
                c["type"] == "Active" and c["status"] == "True"
                for c in found.get("status", {}).get("conditions", [])
            )

        wait_until(f"ClusterQueue {cluster_queue} to be Active", active, timeout=timeout)

    def delete_created(self) -> None:
        """Deletes the cluster-scoped objects made through this harness (while Kueue runs, so that its
        finalizers are released), newest first."""
        for kind, name in reversed(self.created):
            kubectl("delete", kind, name, "--ignore-not-found", "--wait=false")
        stuck = []
        for kind, name in reversed(self.created):
            if kubectl("wait", "--for=delete", f"{kind}/{name}", "--timeout=60s", check=False).returncode:
                stuck.append(f"{kind}/{name}")
                # Never leave a Terminating object behind on a shared cluster.
                release = '{"metadata":{"finalizers":null}}'
                kubectl("patch", kind, name, "--type=merge", "-p", release, check=False)
        self.created.clear()
        assert not stuck, f"Kueue did not release {stuck} within 60 s (finalizers removed by hand)"


def workloads(namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl_json("get", "workloads.v1beta2.kueue.x-k8s.io", "-n", namespace)[
        "items"
    ]
    return items


def workload_of(namespace: str, raycluster: str) -> dict[str, Any] | None:
    """The Workload Kueue made for a RayCluster (owned by it), or None."""
    for item in workloads(namespace):
        if any(
            o.get("kind") == "RayCluster" and o.get("name") == raycluster
            for o in item["metadata"].get("ownerReferences", [])
        ):
            return item
    return None


def conditions(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in workload.get("status", {}).get("conditions", [])}


def raycluster(
    name: str,
    *,
    queue: str,
    workers: int,
    gpus_per_worker: int = 4,
    efa_per_worker: int = 1,
    zone: str | None = None,
    priority_class: str | None = None,
    image: str = "rayproject/ray:2.58.0",
) -> dict[str, Any]:
    """A RayCluster as the operator builds it for a queued run (suspended, with the queue and priority
    labels), small enough for the quotas here, without a run to own it (the garbage collector would delete
    it)."""
    spec = api.FSDPTrainingRunSpec.model_validate(
        {
            "model": {"source": "m"},
            "checkpoint": {"storagePath": "s3://b/p"},
            "network": {"efa": "preferred" if efa_per_worker else "disabled"},
            "cluster": {
                "workers": workers,
                "gpusPerWorker": gpus_per_worker,
                "efaPerWorker": efa_per_worker,
                "cpu": "8",
                "memory": "32Gi",
                "head": {"cpu": "1", "memory": "2Gi"},
                "queueName": queue,
                "workloadPriorityClass": priority_class,
            },
        }
    )
    run = builder.RunRef(name=name, namespace="unused", uid=str(uuid.uuid4()))
    manifest = builder.build_raycluster(spec, run, image, zone)
    for key in ("namespace", "ownerReferences"):
        manifest["metadata"].pop(key)
    return manifest


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="session", name="kueue")
def kueue_fixture(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KueueProcess]:
    """Kueue's CRDs installed and its manager running for the rest of the session; its log stays in the
    session's temp dir and its tail is printed when it stops. Objects made through it are deleted first,
    while Kueue still releases their finalizers."""
    install_crds()
    workdir = tmp_path_factory.mktemp("kueue")
    manager = KueueProcess(kubeconfig=local_cluster.kubeconfig, workdir=workdir).start()
    try:
        yield manager
    finally:
        try:
            manager.delete_created()
        finally:
            manager.stop()
            print(f"--- Kueue log ({manager.log}) ---\n{manager.log_tail()}")
            shutil.rmtree(workdir / "certs", ignore_errors=True)
