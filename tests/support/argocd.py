"""The real Argo CD (v2.14, core mode) on the local cluster, for the GitOps e2e test.

Core mode is Argo CD without its API server or UI: the application controller and the repo server, with
redis as their cache. All three run here as processes on loopback, each in a session of its own and stopped
by pid, against the local cluster's kubeconfig; plaintext gRPC between controller and repo server. The repo
server fetches from a git repository served by `git daemon` on loopback (git://127.0.0.1:PORT/runs).
Argo CD is built by hack/build-tools.sh (bin/argocd, one binary for every component, chosen by
ARGOCD_BINARY_NAME) and redis-server and git come from hack/packages.sh (`make tools`).

Installed in the cluster: Argo CD's Application and AppProject CRDs (from the argo-cd module's
manifests/crds), namespace argocd, the default AppProject, and argocd-cm carrying the FSDPTrainingRun health
check from argocd/resource_customizations (with the settings maps and secret a core install has).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.kube import kubectl, wait_established
from tests.support.net import free_port
from tests.support.paths import REPO
from tests.support.processes import stop_process_group
from tests.support.waiting import wait_until

NAMESPACE = "argocd"
ARGOCD = REPO / "bin" / "argocd"
HEALTH_LUA = (
    REPO / "argocd" / "resource_customizations" / "fsdp.training.dev" / "FSDPTrainingRun" / "health.lua"
)
HEALTH_KEY = "resource.customizations.health.fsdp.training.dev_FSDPTrainingRun"
APP_FINALIZER = "resources-finalizer.argocd.argoproj.io"
PART_OF = {"app.kubernetes.io/part-of": "argocd"}  # Argo CD's settings informers select on this label


def crd_dir() -> Path:
    """manifests/crds of the argo-cd module version that bin/argocd was built from (hack/go/argocd)."""
    listed = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", "github.com/argoproj/argo-cd/v2"],
        cwd=REPO / "hack" / "go" / "argocd",
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(listed.stdout.strip()) / "manifests" / "crds"


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return int(answer.status) == 200
    except OSError:
        return False


@dataclass
class GitRepo:
    """A git repository served read-only by `git daemon` on loopback, as git://127.0.0.1:PORT/runs."""

    root: Path  # the daemon's base path; the repository is root/runs

    @property
    def path(self) -> Path:
        return self.root / "runs"

    def git(self, *args: str) -> str:
        env = {
            **os.environ,
            "GIT_AUTHOR_NAME": "e2e",
            "GIT_AUTHOR_EMAIL": "e2e@localhost",
            "GIT_COMMITTER_NAME": "e2e",
            "GIT_COMMITTER_EMAIL": "e2e@localhost",
        }
        done = subprocess.run(
            ["git", "-C", str(self.path), *args], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout

    def init(self) -> None:
        self.path.mkdir(parents=True)
        self.git("init", "--quiet", "--initial-branch", "main")
        (self.path / "README").write_text("runs applied by Argo CD in the e2e test\n")
        self.commit("initial commit")

    def write(self, relative: str, manifest: dict[str, Any]) -> None:
        target = self.path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(manifest, indent=2) + "\n")

    def commit(self, message: str) -> str:
        self.git("add", "--all")
        self.git("commit", "--quiet", "--allow-empty", "-m", message)
        return self.head()

    def head(self) -> str:
        return self.git("rev-parse", "HEAD").strip()


@dataclass
class ArgoCD:
    """redis, the repo server, the application controller and a git daemon, each stopped by its pid."""

    workdir: Path
    kubeconfig: str
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    applications: list[str] = field(default_factory=list)  # created through add_application

    @property
    def repo_url(self) -> str:
        return f"git://127.0.0.1:{self.ports['git']}/runs"

    @property
    def git(self) -> GitRepo:
        return GitRepo(self.workdir / "git")

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Runs argv in a session of its own (pid = process group id, so children stop with it)."""
        with self.log(name).open("ab") as out:
            self.processes[name] = subprocess.Popen(
                argv,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )

    def _wait(self, what: str, probe: Any, timeout: float, name: str) -> None:
        def ready() -> bool:
            process = self.processes[name]
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with {process.returncode} while waiting for {what}")
            return bool(probe())

        wait_until(what, ready, timeout=timeout, interval=0.5)

    def start(self) -> ArgoCD:
        for tool in ("redis-server", "git"):
            if shutil.which(tool) is None:
                raise AssertionError(f"{tool} is not installed: run `make tools` (hack/packages.sh)")
        if not ARGOCD.exists():
            raise AssertionError(f"{ARGOCD} is missing: run `make tools` (hack/build-tools.sh)")
        if not HEALTH_LUA.exists():
            raise AssertionError(f"the FSDPTrainingRun health check {HEALTH_LUA} is missing")
        for directory in ("logs", "tmp", "plugins", "home"):
            (self.workdir / directory).mkdir(parents=True, exist_ok=True)
        self.ports = {
            name: free_port() for name in ("redis", "repo", "repo-metrics", "controller-metrics", "git")
        }
        self.install()

        # The cache: loopback only, no persistence, no password (Argo CD's own manifests run it the same way).
        self._spawn(
            "redis",
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.ports["redis"]), "--save", "",
             "--appendonly", "no", "--protected-mode", "yes", "--dir", str(self.workdir / "tmp")],
        )  # fmt: skip
        self.git.init()
        self._spawn(
            "git-daemon",
            ["git", "daemon", "--listen=127.0.0.1", f"--port={self.ports['git']}", "--export-all",
             "--reuseaddr", "--informative-errors", f"--base-path={self.git.root}", str(self.git.root)],
        )  # fmt: skip
        common = {
            "KUBECONFIG": self.kubeconfig,  # not on the command line: the path names the cluster's state dir
            # The destination https://kubernetes.default.svc ("in-cluster") from KUBECONFIG, as out of cluster
            # Argo CD's own local modes do; else it reads a service account token that is not there.
            "ARGOCD_FAKE_IN_CLUSTER": "true",
            "HOME": str(self.workdir / "home"),
            "TMPDIR": str(self.workdir / "tmp"),  # the repo server's checkouts
            "ARGOCD_GPG_ENABLED": "false",  # else the repo server sets up a GnuPG keyring under /app
            "ARGOCD_ASK_PASS_SOCK": str(self.workdir / "askpass.sock"),  # default /tmp/... is shared
            "ARGOCD_PLUGINSOCKFILEPATH": str(self.workdir / "plugins"),
        }
        self._wait("redis", lambda: _listening(self.ports["redis"]), 30, "redis")
        self._wait("git daemon", lambda: _listening(self.ports["git"]), 30, "git-daemon")
        self._spawn(
            "repo-server",
            [str(ARGOCD), "--address", "127.0.0.1", "--port", str(self.ports["repo"]), "--disable-tls",
             "--metrics-address", "127.0.0.1", "--metrics-port", str(self.ports["repo-metrics"]),
             "--redis", f"127.0.0.1:{self.ports['redis']}", "--loglevel", "info"],
            env={**common, "ARGOCD_BINARY_NAME": "argocd-repo-server"},
        )  # fmt: skip
        # The controller's metrics server (with /healthz) binds 0.0.0.0 in v2.14 (it has no address flag):
        # on a free port, not the default 8082.
        self._spawn(
            "application-controller",
            [str(ARGOCD), "--namespace", NAMESPACE, "--repo-server", f"127.0.0.1:{self.ports['repo']}",
             "--repo-server-plaintext", "--redis", f"127.0.0.1:{self.ports['redis']}",
             "--metrics-port", str(self.ports["controller-metrics"]),
             # Poll git every 10 s (default 180 s); operations and status need no more.
             "--app-resync", "10", "--self-heal-timeout-seconds", "2", "--status-processors", "4",
             "--operation-processors", "4", "--loglevel", "info"],
            env={**common, "ARGOCD_BINARY_NAME": "argocd-application-controller"},
        )  # fmt: skip
        self._wait("the Argo CD repo server", lambda: _listening(self.ports["repo"]), 120, "repo-server")
        self._wait(
            "the Argo CD application controller's /healthz",
            lambda: _healthz(self.ports["controller-metrics"]),
            120,
            "application-controller",
        )
        return self

    def install(self) -> None:
        """CRDs, namespace, the default project and the settings a core install has, with our health check."""
        crds = crd_dir()
        kubectl(
            "apply", "--server-side", "--force-conflicts",
            "-f", str(crds / "application-crd.yaml"), "-f", str(crds / "appproject-crd.yaml"),
        )  # fmt: skip
        wait_established("crd/applications.argoproj.io", "crd/appprojects.argoproj.io")
        kubectl("create", "namespace", NAMESPACE, check=False)
        objects: list[dict[str, Any]] = [
            _config_map("argocd-cm", {HEALTH_KEY: HEALTH_LUA.read_text()}),
            _config_map("argocd-rbac-cm", {}),
            _config_map("argocd-cmd-params-cm", {}),
            _config_map("argocd-gpg-keys-cm", {}),
            _config_map("argocd-ssh-known-hosts-cm", {}),
            _config_map("argocd-tls-certs-cm", {}),
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "argocd-secret", "namespace": NAMESPACE, "labels": PART_OF},
                "type": "Opaque",
            },
            {
                "apiVersion": "argoproj.io/v1alpha1",
                "kind": "AppProject",
                "metadata": {"name": "default", "namespace": NAMESPACE},
                "spec": {
                    "sourceRepos": ["*"],
                    "destinations": [{"server": "*", "namespace": "*"}],
                    "clusterResourceWhitelist": [{"group": "*", "kind": "*"}],
                },
            },
        ]
        kubectl(
            "apply", "--server-side", "--force-conflicts", "--field-manager", "fsdp-e2e", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}),
        )  # fmt: skip

    def add_application(
        self, name: str, path: str, destination_namespace: str, *, server_side_apply: bool = False
    ) -> None:
        """Creates an Application of one directory of the git repository, synced automatically (prune,
        self-heal), with Argo CD's resources finalizer: deleting it deletes what it synced. Argo CD applies
        client-side (its default) or, with server_side_apply, server-side (sync option ServerSideApply)."""
        spec: dict[str, Any] = {
            "project": "default",
            "source": {
                "repoURL": self.repo_url,
                "targetRevision": "main",
                "path": path,
                "directory": {"recurse": False},
            },
            "destination": {"server": "https://kubernetes.default.svc", "namespace": destination_namespace},
            "syncPolicy": {"automated": {"prune": True, "selfHeal": True}},
        }
        if server_side_apply:
            spec["syncPolicy"]["syncOptions"] = ["ServerSideApply=true"]
        application = {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Application",
            "metadata": {"name": name, "namespace": NAMESPACE, "finalizers": [APP_FINALIZER]},
            "spec": spec,
        }
        self.applications.append(name)
        kubectl("apply", "-f", "-", input=json.dumps(application))

    def stop(self) -> None:
        """Stops every process by its process group, the controller first (no action half done after)."""
        for name in ("application-controller", "repo-server", "git-daemon", "redis"):
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                stop_process_group(process, timeout=20)

    def logs(self, lines: int = 60) -> str:
        out = []
        for log in sorted((self.workdir / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- last {len(tail)} lines of {log} ---\n" + "\n".join(tail))
        return "\n".join(out)


def _config_map(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": PART_OF},
        "data": data,
    }


def application_of(name: str) -> dict[str, Any] | None:
    """The Application, or None once it is gone."""
    got = kubectl("get", "applications.argoproj.io", name, "-n", NAMESPACE, "-o", "json", check=False)
    if got.returncode != 0:
        if "NotFound" in got.stderr:
            return None
        raise AssertionError(f"kubectl get application {name}: {got.stderr.strip()}")
    found: dict[str, Any] = json.loads(got.stdout)
    return found


def delete_applications(names: list[str], timeout: float = 60) -> None:
    """Deletes Applications left by a test; drops Argo CD's finalizer of any still there after `timeout`
    (its controller may be stopped), so that nothing in namespace argocd outlives the test."""
    for name in names:
        kubectl("delete", "applications.argoproj.io", name, "-n", NAMESPACE, "--wait=false", check=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(application_of(n) for n in names):
        time.sleep(1)
    for name in names:
        if application_of(name) is not None:
            kubectl(
                "patch", "applications.argoproj.io", name, "-n", NAMESPACE, "--type=merge",
                "-p", '{"metadata":{"finalizers":null}}', check=False,
            )  # fmt: skip


def sync_and_health(app: dict[str, Any]) -> tuple[str | None, str | None]:
    status = app.get("status", {})
    return status.get("sync", {}).get("status"), status.get("health", {}).get("status")


def resource_health(app: dict[str, Any], kind: str, name: str) -> dict[str, Any] | None:
    """The health Argo CD recorded for one of the Application's resources (`.status.resources[]`)."""
    for resource in app.get("status", {}).get("resources", []):
        if resource.get("kind") == kind and resource.get("name") == name:
            found: dict[str, Any] | None = resource.get("health")
            return found
    return None
