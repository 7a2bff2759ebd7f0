"""Helpers for tests that use the local cluster started by hack/cluster-up.sh."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parents[1]
# Which local cluster this process uses (hack/lib.sh, FSDP_CLUSTER_INSTANCE): pytest-xdist's worker gwN uses
# instance N, so that two workers never share a control plane, a Ray head or an S3 server.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
INSTANCE = int(_WORKER[2:] if _WORKER else os.environ.get("FSDP_CLUSTER_INSTANCE", "0"))


def cluster_settings(*names: str) -> list[str]:
    """hack/lib.sh's values of these settings for this process's local cluster (arrays space-separated)."""
    return subprocess.run(
        [REPO / "hack" / "settings.sh", *names],
        env={**os.environ, "FSDP_CLUSTER_INSTANCE": str(INSTANCE)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()


STATE = Path(cluster_settings("STATE")[0])
T = TypeVar("T")


@dataclass(frozen=True)
class LocalCluster:
    """Endpoints of the running local cluster, read from the env file cluster-up writes."""

    env: dict[str, str]

    @classmethod
    def from_env_file(cls, path: Path = STATE / "env") -> LocalCluster:
        env = {}
        for line in path.read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
        return cls(env)

    @property
    def kubeconfig(self) -> str:
        return self.env["KUBECONFIG"]

    @property
    def s3_endpoint(self) -> str:
        return self.env["AWS_ENDPOINT_URL"]

    @property
    def ray_dashboard_url(self) -> str:
        return self.env["RAY_DASHBOARD_URL"]

    @property
    def ray_token_header(self) -> dict[str, str]:
        """What the local Ray head (token auth, as every run's cluster) asks of a caller."""
        return {"X-Ray-Authorization": f"Bearer {self.env['FSDP_LOCAL_RAY_TOKEN']}"}

    def ray_jobs(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.ray_dashboard_url, headers=self.ray_token_header)


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs the repo's kubectl against the local cluster (KUBECONFIG comes from the session fixture); with
    check, a failure says what kubectl printed."""
    done = subprocess.run([str(REPO / "bin" / "kubectl"), *args], input=input, text=True, capture_output=True)
    if check and done.returncode != 0:
        output = (done.stderr.strip() or done.stdout.strip())[-2000:]
        raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}: {output}")
    return done


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json").stdout)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 1.0) -> T:
    """Polls probe until it returns something truthy; fails naming what was awaited and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


def apply_crd() -> None:
    """Installs the generated FSDPTrainingRun CRD and waits until the apiserver serves it."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    wait_established("crd/fsdptrainingruns.fsdp.training.dev")


# The platform's S3 grant of the tests' operators: the examples' buckets (the demo's, and the one of the AWS
# sample, named by runs that only wait for capacity) and the e2e tier's.
TEST_S3_PREFIXES = "s3://fsdp-demo/,s3://my-training-bucket/,s3://fsdp-e2e/"


@dataclass
class OperatorProcess:
    """The operator running as `python -m fsdp_operator` against the local cluster, stopped by pid."""

    namespace: str
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = {
            **os.environ,
            # One operator per test: no election to wait for after a kill (tests of it turn it on), and no
            # probe server whose port other test sessions on this machine could hold.
            "FSDP_OPERATOR_LEADER_ELECTION": "false",
            "FSDP_OPERATOR_HEALTH_PORT": "0",
            "FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS": "2",
            "FSDP_OPERATOR_S3_PREFIXES": TEST_S3_PREFIXES,
            **self.env,
            "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'trainer'}",
            "FSDP_OPERATOR_WATCH_NAMESPACES": self.namespace,
        }
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fsdp_operator"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        return self

    def kill(self) -> None:
        """SIGKILL: the operator gets no chance to finish what it was doing."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen[Any] | None) -> None:
    """SIGTERM by pid, SIGKILL when it has not exited 30 s later."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def stop_process_group(process: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM to the process group a process started with start_new_session leads (a `ray start --block`
    and its servers, say), SIGKILL to the group when the leader has not exited `timeout` s later."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)


def answers(url: str, headers: dict[str, str] | None = None) -> bool:
    """Whether an HTTP server answers at url with a success."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5):
            return True
    except OSError:
        return False


# The toleration of the real node's taint: the platform grants it to the suite's namespaces (tenancy.py), as a
# platform grants a team the tolerations of its node pool.
REAL_NODE_TOLERATION = {"key": "fsdp.training.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}


def grant(namespace: str, annotation: str, value: str) -> None:
    """What the platform grants runs in a namespace, as the namespace annotation the operator reads."""
    kubectl("annotate", "namespace", namespace, "--overwrite", f"{annotation}={value}")


def delete_namespace(name: str) -> None:
    """Deletes a test's namespace once its operator is stopped: releases the runs' finalizers and waits for
    the pods only, so that the next test finds the fake GPUs free; the namespace may finish deleting later.
    The RayClusters go first (KubeRay would replace their pods) and the pods are deleted at once: left to the
    namespace controller, they took 5 s per test."""
    runs = kubectl("get", "fsdptrainingruns", "-n", name, "-o", "name", check=False).stdout.split()
    for run in runs:
        kubectl("patch", run, "-n", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    kubectl("delete", "rayclusters", "--all", "-n", name, "--wait=false", check=False)
    kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false", check=False)
    kubectl("delete", "namespace", name, "--wait=false")
    wait_until(
        f"the pods of namespace {name} to be gone",
        lambda: not kubectl("get", "pods", "-n", name, "-o", "name", check=False).stdout.strip(),
        timeout=90,
    )


DELETE = object()  # as a value in `with_changes`: remove the field


def with_changes(spec: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """A copy of `spec` with dotted-path changes ({"cluster.workers": 3}) applied."""
    changed = copy.deepcopy(spec)
    for dotted, value in changes.items():
        target = changed
        *parents, leaf = dotted.split(".")
        for key in parents:
            target = target.setdefault(key, {})
        if value is DELETE:
            target.pop(leaf)
        else:
            target[leaf] = value
    return changed


def example(name: str, **spec_changes: Any) -> dict[str, Any]:
    """A manifest from examples/, with changes to its spec."""
    manifest: dict[str, Any] = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
    manifest["spec"] = with_changes(manifest["spec"], spec_changes)
    return manifest


def apply(namespace: str, manifest: dict[str, Any]) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))


@functools.cache
def _custom_objects(kubeconfig: str) -> Any:
    """An in-process client for what the tests poll every second (a run, a namespace's RayClusters): each
    `kubectl get` is a Go process start, about 0.1 CPU-s, and two workers polling spent minutes of the
    suite's two cores on them. Keyed by the kubeconfig's content: a restarted cluster has new certificates."""
    from kubernetes import client, config

    return client.CustomObjectsApi(config.new_client_from_config_dict(yaml.safe_load(kubeconfig)))


def _get_custom(what: str, call: Callable[[Any], Any]) -> Any:
    from kubernetes.client.exceptions import ApiException

    try:
        return call(_custom_objects(Path(os.environ["KUBECONFIG"]).read_text()))
    except ApiException as error:
        raise AssertionError(f"GET {what}: {error.status} {error.reason}: {error.body}") from None


def run_of(namespace: str, name: str) -> dict[str, Any]:
    from fsdp_operator.api import GROUP, PLURAL, VERSION

    found: dict[str, Any] = _get_custom(
        f"fsdptrainingrun {namespace}/{name}",
        lambda api: api.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _request_timeout=30
        ),
    )
    return found


def conditions_of(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in run.get("status", {}).get("conditions", [])}


def run_summary(run: dict[str, Any]) -> str:
    """Where a run stands, in one line: its phase, step, attempt and every condition's reason and message."""
    status = run.get("status", {})
    step = (status.get("progress") or {}).get("step")
    conditions = "; ".join(
        f"{c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}"
        for c in status.get("conditions", [])
    )
    return f"phase {status.get('phase')}, step {step}, attempt {status.get('attempt')}; {conditions}"


def wait_for_phase(namespace: str, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        nonlocal last
        last = run_of(namespace, name)
        return last if last.get("status", {}).get("phase") == phase else None

    try:
        return wait_until(f"run {name} to reach phase {phase}", reached, timeout=timeout)
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}; the run was at {run_summary(last)}") from None


def set_suspend(namespace: str, name: str, suspend: bool) -> None:
    patch = json.dumps({"spec": {"suspend": suspend}})
    kubectl("patch", "fsdptrainingrun", name, "-n", namespace, "--type=merge", "-p", patch)


def rayclusters(namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = _get_custom(
        f"rayclusters in {namespace}",
        lambda api: api.list_namespaced_custom_object(
            "ray.io", "v1", namespace, "rayclusters", _request_timeout=30
        ),
    )["items"]
    return items


def drift(namespace: str, manifest: dict[str, Any], field_manager: str | None) -> str:
    """What `kubectl diff` shows for re-applying the manifest the way it was applied (server-side with the
    field manager, or client-side with None): empty when the live run is as the manifest says, which is what a
    GitOps tool compares before it syncs. kubectl diff reads the live run, then dry-runs the apply: a status
    write by the operator in between shows as a changed resourceVersion and status. A drift persists, so a
    diff is taken up to three times and any empty one means in sync."""
    side = ["--server-side", f"--field-manager={field_manager}"] if field_manager else []
    for attempt in range(3):
        if attempt:
            time.sleep(1)
        diff = kubectl("diff", *side, "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False)
        assert diff.returncode in (0, 1), f"kubectl diff failed: {diff.stderr}"
        if not diff.stdout:
            break
    return diff.stdout


def fields_others_own(namespace: str, manifest: dict[str, Any], applier: str) -> list[str]:
    """The fields the manifest sets (spec, its labels, its annotations) that a manager other than the
    applier also owns, as `manager: field`: a controller writing them flips a GitOps app to OutOfSync."""
    name = manifest["metadata"]["name"]
    live = kubectl_json("get", "fsdptrainingrun", name, "-n", namespace, "--show-managed-fields")
    taken = []
    for entry in live["metadata"]["managedFields"]:
        if entry["manager"] == applier:
            continue
        fields = entry.get("fieldsV1", {})
        if "f:spec" in fields:
            taken.append(f"{entry['manager']}: spec")
        meta = fields.get("f:metadata", {})
        for kind in ("labels", "annotations"):
            for key in manifest["metadata"].get(kind, {}):
                if f"f:{key}" in meta.get(f"f:{kind}", {}):
                    taken.append(f"{entry['manager']}: metadata.{kind}.{key}")
    return taken


GITOPS_APPLIER = "gitops"  # the field manager of a GitOps tool (Argo CD's ServerSideApply, Flux)


def gitops_sync(namespace: str, manifest: dict[str, Any]) -> None:
    """Applies a manifest as a GitOps tool syncs it: server-side, as its own field manager."""
    kubectl(
        "apply",
        "--server-side",
        f"--field-manager={GITOPS_APPLIER}",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(manifest),
    )


def assert_in_sync(namespace: str, manifest: dict[str, Any]) -> None:
    """The live run is as the synced manifest says, and no one but the GitOps tool owns what it sets."""
    found = drift(namespace, manifest, GITOPS_APPLIER)
    assert found == "", f"the live run differs from the synced manifest:\n{found}"
    taken = fields_others_own(namespace, manifest, GITOPS_APPLIER)
    assert taken == [], f"fields the manifest sets are owned by others too: {taken}"


@dataclass(frozen=True)
class ControlPlaneComponent:
    """One process of the local control plane as kwokctl runs it (binary, arguments, working directory, pid
    and log files), to kill with SIGKILL and start again exactly as it was."""

    name: str
    command: list[str]
    work_dir: Path

    @classmethod
    def all_of_local_cluster(cls) -> list[ControlPlaneComponent]:
        [cluster] = (STATE / "kwok" / "clusters").iterdir()
        documents = yaml.safe_load_all((cluster / "kwok.yaml").read_text())
        return [
            cls(c["name"], [c["binary"], *c.get("args", [])], Path(c["workDir"]))
            for doc in documents
            for c in (doc or {}).get("components", [])
        ]

    @classmethod
    def of_local_cluster(cls, name: str) -> ControlPlaneComponent:
        [found] = [c for c in cls.all_of_local_cluster() if c.name == name]
        return found

    def running(self) -> bool:
        return Path(f"/proc/{int(self.pid_file.read_text())}").exists()

    @property
    def pid_file(self) -> Path:
        return self.work_dir / "pids" / f"{self.name}.pid"

    def kill(self) -> None:
        os.kill(int(self.pid_file.read_text()), 9)
        wait_until(f"{self.name} to die", lambda: not self.running(), timeout=30)

    def start(self) -> None:
        """Starts it again, detached, with its pid where kwokctl (and cluster-down) look for it."""
        with (self.work_dir / "logs" / f"{self.name}.log").open("ab") as log:
            process = subprocess.Popen(
                self.command, cwd=self.work_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid_file.write_text(str(process.pid))


def restart_exited_control_plane() -> list[str]:
    """Starts again every control-plane process that has exited, as its supervisor (systemd, a kubelet) would:
    kube-controller-manager and kube-scheduler exit when an apiserver outage costs them their leader lease."""
    exited = [c for c in ControlPlaneComponent.all_of_local_cluster() if not c.running()]
    for component in exited:
        component.start()
    return [c.name for c in exited]


def wait_established(*crds: str) -> None:
    """`kubectl wait --for condition=established`, again while a just-created CRD has no conditions yet
    (kubectl then exits at once with "accessor error: <nil>" instead of waiting)."""
    wait_until(
        f"{', '.join(crds)} to be established",
        lambda: (
            kubectl(
                "wait", "--for", "condition=established", "--timeout", "10s", *crds, check=False
            ).returncode
            == 0
        ),
        timeout=60,
    )


def tiny_qwen2(**sizes: Any) -> dict[str, Any]:
    """A Qwen2 config (model.fromConfig) small enough to train in seconds on a CPU; `sizes` override."""
    return {
        "model_type": "qwen2",
        "vocab_size": 320,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
        **sizes,
    }


@dataclass(frozen=True)
class MlflowServer:
    url: str
    bucket: str

    def get(self, endpoint: str, **query: str) -> dict[str, Any]:
        url = f"{self.url}/api/2.0/{endpoint}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
        return result

    def post(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/api/2.0/{endpoint}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
        return result

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        found = self.get("mlflow/experiments/get-by-name", experiment_name=experiment)["experiment"]
        runs: list[dict[str, Any]] = self.post(
            "mlflow/runs/search", {"experiment_ids": [found["experiment_id"]]}
        ).get("runs", [])
        return runs

    def logged_steps(self, experiment: str, metric: str) -> list[int]:
        """The steps of the metric in the experiment's runs, so far (none while it has no run)."""
        try:
            runs = self.runs(experiment)
        except urllib.error.HTTPError:  # no experiment yet
            return []
        return [m["step"] for r in runs for m in self.history(r["info"]["run_id"], metric)]

    def history(self, run_id: str, metric: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get(
            "mlflow/metrics/get-history", run_id=run_id, metric_key=metric, max_results="25000"
        ).get("metrics", [])
        return found


MLFLOW_VENV = Path(cluster_settings("MLFLOW_VENV")[0])  # hack/venv.sh installs the MLflow server there
# The DLC's Python (3.13, torch): where the trainer runs, for tests that start it in a process of their own.
DLC_PYTHON = Path(cluster_settings("DLC_VENV")[0]) / "bin" / "python"


@contextlib.contextmanager
def mlflow_server(home: Path, artifacts: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A real MLflow tracking server on a free loopback port (SQLite in `home`, artifacts served by the
    server from `artifacts`: a directory or s3:// prefix), in a process group of its own, stopped by its pid
    at the end; yields its URL."""
    mlflow = MLFLOW_VENV / "bin" / "mlflow"
    assert mlflow.exists(), f"{mlflow} missing: hack/venv.sh installs the MLflow server's venv"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "mlflow-server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
             "--artifacts-destination", artifacts, "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            # No job runner (GenAI jobs: seven worker processes a tracking server needs none of).
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}, cwd=home,
            stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(f"the MLflow server at {url}", lambda: answers(f"{url}/health"), timeout=180)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        print(f"--- MLflow server log ({log}) ---\n{log.read_text()[-3000:]}")
