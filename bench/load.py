"""Load: N FSDPTrainingRuns created at once beside N KubeRay RayJobs of the same shape, on the same apiserver
and fake nodes, in one run; then a soak with the N runs training.

- Fake capacity is added for both (clones of the local cluster's g6.12xlarge and system nodes, removed at the
  end); every run and RayJob is one head (1 CPU) and one worker (1 GPU, 8 CPUs), in ten namespaces per
  kind.
- Every Ray dashboard is a stand-in (bench/ray_standin.py) that speaks Ray's job API and writes progress
  and checkpoints to S3 as the trainer does: one local Ray head cannot host 1,000 drivers on two cores. The
  operator runs with its defaults otherwise (observe every 15 s, one process, watching the ten namespaces).
- Both kinds' jobs run on it, so that both controllers poll as they would: the RayJobs are submitted by
  KubeRay itself (submissionMode HTTPMode) and polled every 3 s as KubeRay does, through the stand-in as
  KubeRay's HTTP proxy (KubeRay asks `http://<head Service>.<namespace>.svc.cluster.local:8265`, which no
  resolver here answers: the bench restarts the local cluster's KubeRay with HTTP_PROXY for its length, then
  as it was).
- The runs progress as real ones do (PROFILES): most are quiet (a 5 s step, a record every 50 s, no checkpoint
  in the soak), a tenth checkpoint every minute, a few fail once and a few hang once. Each checkpoint,
  failure and hang the stand-in makes is timed against the moment the run's status showed it (a watch), and
  compared with the bound the operator documents (cadence.py).
- Figures: from each object's create to its RayCluster created and ready (KubeRay's `state: ready`, the same
  event for both kinds), p50 and p99 per kind and their ratio; the runs' create to Running; apiserver requests
  by user agent from the apiserver's audit log (it has the user agent; apiserver_request_total does not), per
  run while they start and per running run per minute in the soak; the operator's peak RSS and CPU seconds;
  in the soak, its RSS slope and its event loop's task count (fsdp_operator_asyncio_tasks); KubeRay's operator
  process (the peer, reconciling the RayJobs and every RayCluster of both kinds) measured the same way, in the
  same run, so that RSS and CPU are ratios too; the operator's admission CPU (fsdp_operator_admission_cpu_
  seconds_total) and where its start-phase requests go, by verb and resource; the dashboard requests of each
  side per running object per minute in the soak (the stand-in counts them).

    python bench/load.py [--runs 1000] [--soak-minutes 10]      (make bench-load; part of make bench)

Prints one JSON document (also to --output) and the table it writes into docs/benchmarks.md ("load"
section).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from tests.support.apiserver_audit import KOPF_USER_AGENT, OPERATOR_USER_AGENT, AuditLog
from tests.support.kube import apply_crd, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import example
from tests.support.net import free_port
from tests.support.operator_process import OperatorProcess
from tests.support.process_usage import cpu_seconds, memory_kib
from tests.support.processes import stop_process
from tests.support.waiting import wait_until

from doc_section import publish
from fsdp_operator import api, builder, cadence

REPO = Path(__file__).resolve().parents[1]

BUCKET = "fsdp-load"
CORPUS = "data/stdlib-docstrings.jsonl"
TEAMS = 10
BENCH_LABEL = "fsdp.training.dev/load-bench"
KUBERAY_USER_AGENT = "kuberay-operator"
IMAGE = "public.ecr.aws/deep-learning-containers/ray:2.58.0"
SHAPE = {
    "cluster.workers": 1,
    "cluster.gpusPerWorker": 1,
    "cluster.efaPerWorker": 0,
    "cluster.head.cpu": "1",
    "cluster.head.memory": "4Gi",
    "cluster.cpu": "8",  # four workers to a g6.12xlarge, one per GPU
    "cluster.memory": "32Gi",
    "cluster.ephemeralStorage": "100Gi",  # a quarter of the node's 500Gi (the default 200Gi fits only two)
    "network.efa": "disabled",
    # 1,000 runs and 1,000 RayJobs take longer than the default 900 s to start on two cores; a run past it has
    # its cluster deleted and queued again (as it should), which the bench would count as the operator's load.
    "recovery.provisioningTimeoutSeconds": 3600,
    "training.maxSteps": 1_000_000,  # trains through the soak; deleted at the end
    "training.logEvery": 10,
    "checkpoint.everySteps": 100,
    "data.source": f"s3://{BUCKET}/{CORPUS}",
    "checkpoint.storagePath": f"s3://{BUCKET}/runs",
}
OBSERVE_SECONDS = 15  # the operator's default observe interval
# KubeRay's reconcile workers per controller for the bench (its default is 1, a flag and a Helm value): one
# worker for 2,000 RayClusters and 1,000 RayJobs started 0.7 pods a second here, both kinds' clusters waiting.
KUBERAY_WORKERS = 8
HANG_TIMEOUT_SECONDS = 120  # the hanging runs'
# How runs progress in the soak: (step seconds, spec changes, fault) by profile; the stand-in takes the step
# time and the fault from the run's env (LOAD_BENCH_STEP_SECONDS, LOAD_BENCH_FAULT).
PROFILES: dict[str, tuple[float, dict[str, Any]]] = {
    "quiet": (5.0, {"training.logEvery": 10, "checkpoint.everySteps": 1000}),
    "checkpointing": (1.0, {"training.logEvery": 10, "checkpoint.everySteps": 60}),
    "failing": (2.0, {"training.logEvery": 10, "checkpoint.everySteps": 100}),
    "hanging": (2.0, {"training.logEvery": 10, "checkpoint.everySteps": 100,
                      "recovery.hangTimeoutSeconds": HANG_TIMEOUT_SECONDS}),
}  # fmt: skip
# The documented bounds (cadence.py): a quiet run's checkpoint or failure is seen within MAX_STRETCH observe
# intervals; a hang is declared at most hangTimeoutSeconds / HANG_SHARE (one interval at least) after it is
# due.
SEEN_WITHIN_SECONDS = cadence.MAX_STRETCH * OBSERVE_SECONDS
HANG_LATE_AT_MOST_SECONDS = max(OBSERVE_SECONDS, HANG_TIMEOUT_SECONDS / cadence.HANG_SHARE)


def events_of(
    custom: k8s.CustomObjectsApi, group: str, version: str, plural: str, stop: threading.Event
) -> Iterator[dict[str, Any]]:
    """Every watch event of a kind, in all namespaces, until `stop`. A watch that ends or fails (under the
    bench's load the apiserver answers 504 "Too large resource version" when its watch cache lags the version
    a watch resumes from) starts again from a fresh list, so a watcher never dies mid-bench."""
    while not stop.is_set():
        try:
            for event in k8s_watch.Watch().stream(
                custom.list_cluster_custom_object, group, version, plural, timeout_seconds=30
            ):
                yield event
                if stop.is_set():
                    return
        except (k8s.ApiException, urllib3.exceptions.HTTPError) as error:
            print(f"watch of {plural} restarted: {error}".splitlines()[0], file=sys.stderr)
            stop.wait(1)


class Timeline:
    """When each object was created and when its RayCluster appeared and became ready (monotonic seconds),
    keyed by (kind, namespace, name) of the object that owns the RayCluster."""

    def __init__(self) -> None:
        self.created: dict[tuple[str, str, str], float] = {}
        self.cluster_added: dict[tuple[str, str, str], float] = {}
        self.cluster_ready: dict[tuple[str, str, str], float] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def watch_clusters(self, api_client: k8s.ApiClient) -> None:
        custom = k8s.CustomObjectsApi(api_client)
        for event in events_of(custom, "ray.io", "v1", "rayclusters", self.stop):
            now, cluster = time.monotonic(), event["object"]
            owners = cluster["metadata"].get("ownerReferences") or []
            if not owners:
                continue
            key = (owners[0]["kind"], cluster["metadata"]["namespace"], owners[0]["name"])
            with self.lock:
                self.cluster_added.setdefault(key, now)
                if (cluster.get("status") or {}).get("state") == "ready":
                    self.cluster_ready.setdefault(key, now)

    def latencies(self, kind: str, until: dict[tuple[str, str, str], float]) -> list[float]:
        return [until[key] - at for key, at in self.created.items() if key[0] == kind and key in until]


class RunWatch:
    """What each run's status showed, and when (wall clock, as the stand-in's events): each checkpoint step
    it first named as the latest, and the first time it showed its attempt ended (a restart counted,
    Restarting, Failed, or forensics asked of a hung attempt)."""

    def __init__(self, namespaces: list[str]) -> None:
        self.namespaces = set(namespaces)
        self.checkpoints: dict[tuple[str, str], list[tuple[int, datetime]]] = {}
        self.interrupted: dict[tuple[str, str], datetime] = {}
        self.stop = threading.Event()

    def watch(self, api_client: k8s.ApiClient) -> None:
        custom = k8s.CustomObjectsApi(api_client)
        for event in events_of(custom, "fsdp.training.dev", "v1alpha1", "fsdptrainingruns", self.stop):
            self.saw(event["object"], datetime.now(UTC))

    def saw(self, run: dict[str, Any], at: datetime) -> None:
        key = (run["metadata"]["namespace"], run["metadata"]["name"])
        if key[0] not in self.namespaces:
            return
        status = run.get("status") or {}
        latest = ((status.get("checkpoints") or {}).get("latest") or {}).get("step")
        seen = self.checkpoints.setdefault(key, [])
        if latest is not None and (not seen or latest > seen[-1][0]):
            seen.append((latest, at))
        ended = (
            (status.get("restarts") or {}).get("count", 0) > 0
            or status.get("phase") in ("Restarting", "Failed")
            or status.get("forensics") is not None
        )
        if ended:
            self.interrupted.setdefault(key, at)


def seen_lags(events: list[dict[str, Any]], watch: RunWatch, until: datetime) -> dict[str, Any]:
    """For each checkpoint, failure and hang the stand-in made: seconds until the run's status showed it (a
    hang: from when it was due, its last record plus the hang timeout), against the documented bound. An event
    whose bound ends after `until` is left out (not yet due to be seen); one never seen within it counts."""
    bounds = {"checkpoint": SEEN_WITHIN_SECONDS, "failed": SEEN_WITHIN_SECONDS,
              "hung": HANG_LATE_AT_MOST_SECONDS}  # fmt: skip
    lags: dict[str, list[float]] = {kind: [] for kind in bounds}
    unseen: Counter[str] = Counter()
    for event in events:
        kind, at = event["event"], datetime.fromisoformat(event["at"])
        if kind == "hung":
            at += timedelta(seconds=HANG_TIMEOUT_SECONDS)
        if at + timedelta(seconds=bounds[kind]) > until:
            continue
        key = tuple(event["run"].rsplit("/", 2)[-2:])
        if kind == "checkpoint":
            shown = [when for step, when in watch.checkpoints.get(key, []) if step >= event["step"]]
            seen = shown[0] if shown else None
        else:
            seen = watch.interrupted.get(key)
        if seen is None:
            unseen[kind] += 1
        else:
            lags[kind].append(max(0.0, (seen - at).total_seconds()))
    return {kind: lag_summary(lags[kind], unseen[kind], bound) for kind, bound in bounds.items()}


def lag_summary(lags: list[float], unseen: int, bound: float) -> dict[str, Any]:
    figures: dict[str, Any] = {"events": len(lags) + unseen, "unseen": unseen, "bound_s": bound,
                               "within_bound": sum(lag <= bound for lag in lags)}  # fmt: skip
    if lags:
        figures.update(p50=round(percentile(lags, 0.5), 1), p99=round(percentile(lags, 0.99), 1),
                       max=round(max(lags), 1))  # fmt: skip
    return figures


def dashboard_requests(standin_url: str) -> Counter[str]:
    with urllib.request.urlopen(f"{standin_url}/bench/requests", timeout=30) as answer:
        return Counter(json.load(answer))


def per_side(counts: Counter[str]) -> dict[str, int]:
    return {side: sum(n for key, n in counts.items() if key.startswith(f"{side} ")) for side in
            ("operator", "kuberay")}  # fmt: skip


class ProfiledOperator(OperatorProcess):
    """The operator under `memray run --aggregate` (memray from MEMRAY_PATH, e.g. a `pip install --target`
    folder: it is not in the project's environment)."""

    output: Path = Path("memray-load.bin")

    def start(self) -> OperatorProcess:
        env = {
            **os.environ,
            "FSDP_OPERATOR_LEADER_ELECTION": "false",
            "FSDP_OPERATOR_HEALTH_PORT": "0",
            **self.env,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / "operator"), str(REPO / "trainer"), os.environ.get("MEMRAY_PATH", "")]
            ),
            "FSDP_OPERATOR_WATCH_NAMESPACES": self.namespace,
        }
        self.output.unlink(missing_ok=True)
        command = [sys.executable, "-m", "memray", "run", "--aggregate", "-o", str(self.output), "-m",
                   "fsdp_operator"]  # fmt: skip
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        return self


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": round(percentile(values, 0.5), 2),
        "p99": round(percentile(values, 0.99), 2),
    }


def add_nodes(template: str, prefix: str, count: int, zones: list[str] | None = None) -> list[str]:
    """Clones of one of the local cluster's fake nodes (KWOK makes them Ready), labelled for removal."""
    node = kubectl_json("get", "node", template)
    clones = []
    for i in range(count):
        labels = {
            **node["metadata"]["labels"],
            "kubernetes.io/hostname": f"{prefix}-{i}",
            BENCH_LABEL: "true",
        }
        if zones:
            labels["topology.kubernetes.io/zone"] = zones[i % len(zones)]
        clones.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": f"{prefix}-{i}",
                    "labels": labels,
                    "annotations": node["metadata"]["annotations"],
                },
                "spec": {},
                "status": {k: node["status"][k] for k in ("allocatable", "capacity", "nodeInfo")},
            }
        )
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": clones}))
    return [clone["metadata"]["name"] for clone in clones]


def profile_of(i: int) -> str:
    """84 % quiet, 10 % checkpointing, 4 % failing, 2 % hanging, spread over the runs and namespaces."""
    if i % 50 == 7:
        return "hanging"
    if i % 25 == 3:
        return "failing"
    return "checkpointing" if i % 10 == 5 else "quiet"


def run_manifest(name: str, i: int) -> dict[str, Any]:
    profile = profile_of(i)
    step_seconds, changes = PROFILES[profile]
    env = {"LOAD_BENCH_STEP_SECONDS": str(step_seconds)}
    if profile == "failing":
        env["LOAD_BENCH_FAULT"] = f"fail:{120 + i * 37 % 240}"
    if profile == "hanging":
        env["LOAD_BENCH_FAULT"] = f"hang:{60 + i * 53 % 180}"
    manifest = example("cpu-demo", **{**SHAPE, **changes, "runtimeEnv.env": env})
    manifest["metadata"]["name"] = name
    return manifest


def rayjob_manifest(name: str, namespace: str, i: int) -> dict[str, Any]:
    """KubeRay's RayJob with the RayCluster the operator builds for the same spec (as control_plane.py),
    submitted by KubeRay itself over HTTP (no submitter pod: KWOK's would run nothing)."""
    spec = api.FSDPTrainingRunSpec.model_validate(run_manifest(name, i)["spec"])
    ref = builder.RunRef(name=name, namespace=namespace, uid=str(uuid.uuid4()))
    cluster = builder.build_raycluster(spec, ref, IMAGE, None)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name},
        "spec": {
            "entrypoint": "python -c 'print(1)'",
            "submissionMode": "HTTPMode",
            "rayClusterSpec": cluster["spec"],
        },
    }


def proc_stat(pid: int) -> dict[str, float]:
    """RSS and peak RSS (MiB) and CPU seconds of a process, from /proc."""
    return {
        "rss_mib": memory_kib(pid) / 1024,
        "peak_rss_mib": memory_kib(pid, "VmHWM") / 1024,
        "cpu_seconds": cpu_seconds(pid),
    }


def metric(metrics_url: str, name: str) -> float | None:
    """One unlabelled sample of the operator's /metrics."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    found = [line for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(found[0].split()[1]) if found else None


def asyncio_tasks(metrics_url: str) -> int | None:
    found = metric(metrics_url, "fsdp_operator_asyncio_tasks")
    return None if found is None else int(found)


def kuberay_pid(state: Path) -> int:
    """The local cluster's KubeRay operator (hack/kuberay.sh starts the binary itself under setsid)."""
    pid = int((state / "pids" / "kuberay.pid").read_text())
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    assert command.endswith(b"ray-operator"), f"pid {pid} is {command!r}, not KubeRay's operator"
    return pid


def agent_of(user_agent: str) -> str:
    return user_agent.split("/")[0].split(" ")[0]


def requests_by_kind(log: AuditLog, since: datetime, until: datetime) -> dict[str, Counter[str]]:
    """Start-phase requests of the operator (kopf and its own client) and of KubeRay, by verb and resource
    ("verb resource[/subresource]"), for the table of where they go."""
    found: dict[str, Counter[str]] = {"operator": Counter(), "kuberay": Counter()}
    for event in log.requests("", since, until):
        agent = agent_of(event.user_agent)
        side = "kuberay" if agent == KUBERAY_USER_AGENT else "operator" if agent in OPERATOR_AGENTS else None
        if side:
            found[side][
                f"{event.verb} {event.resource}" + (f"/{event.subresource}" if event.subresource else "")
            ] += 1
    return found


OPERATOR_AGENTS = (KOPF_USER_AGENT.rstrip("/"), OPERATOR_USER_AGENT)


def requests_by_agent(log: AuditLog, since: datetime, until: datetime) -> Counter[str]:
    """Requests in [since, until) by user agent up to its first "/": kopf, fsdp-operator, kuberay-operator."""
    found: Counter[str] = Counter()
    for event in log.requests("", since, until):
        found[agent_of(event.user_agent)] += 1
    return found


def operator_requests(counts: Counter[str]) -> int:
    return sum(n for agent, n in counts.items() if agent in OPERATOR_AGENTS)


def owned_by(name: str, obj: str) -> bool:
    """Whether an object's name is the run's or RayJob's own or one derived from it (its RayCluster, pods,
    Services, Secret, NetworkPolicy, Events: `<name>-...`, `<name>.<hash>`)."""
    return obj == name or obj.startswith((f"{name}-", f"{name}."))


def requests_until(
    log: AuditLog,
    since: datetime,
    until: datetime,
    agents: tuple[str, ...],
    done: dict[tuple[str, str], datetime],
) -> float:
    """Requests per object from its creation until it was done (a run Running, a RayJob's cluster ready):
    each request naming an object (or one derived from it) counts while that object was not done yet; those
    naming none (lists, watches) count for all of them, divided evenly; those naming other objects (KubeRay's
    work on the operator's RayClusters) not at all."""
    by_namespace: dict[str, list[tuple[str, datetime]]] = {}
    for (namespace, name), at in done.items():
        by_namespace.setdefault(namespace, []).append((name, at))
    counted = 0
    for event in log.requests("", since, until):
        if agent_of(event.user_agent) not in agents:
            continue
        if not event.name:
            counted += 1  # a list or watch: shared by all of them
            continue
        owners = [at for name, at in by_namespace.get(event.namespace, []) if owned_by(name, event.name)]
        if owners and event.received < owners[0]:  # named, not of one of them (the other kind's): left out
            counted += 1
    return counted / max(len(done), 1)


def phase_counts(namespaces: list[str]) -> Counter[str]:
    phases: Counter[str] = Counter()
    for namespace in namespaces:
        for run in kubectl_json("get", "fsdptrainingruns", "-n", namespace)["items"]:
            phases[run.get("status", {}).get("phase") or "-"] += 1
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--soak-minutes", type=float, default=10)
    parser.add_argument("--sample-seconds", type=float, default=30)
    parser.add_argument(
        "--start-minutes",
        type=float,
        default=60,
        help="how long the runs and RayJobs may take to start; then the soak measures those that did",
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument(
        "--memray",
        type=Path,
        default=None,
        help="profile the operator with `memray run --aggregate` into this file (memray importable from "
        "MEMRAY_PATH); its RSS and CPU figures are then memray's too, not the operator's",
    )
    parser.add_argument(
        "--namespaced",
        action="store_true",
        help="the operator watches only the runs' namespaces (default: every namespace, the chart's default, "
        "so it sees the RayJobs' clusters and pods too, as on a shared cluster)",
    )
    args = parser.parse_args()
    # A SIGTERM ends the bench through its cleanup (KubeRay restarted as the cluster runs it, nothing left).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    subprocess.run([REPO / "hack" / "cluster-up.sh"], check=True)
    cluster = LocalCluster.from_env_file()
    os.environ.update(cluster.env)
    apply_crd()
    s3 = boto3.client("s3", endpoint_url=cluster.s3_endpoint)
    if BUCKET not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    s3.upload_file(str(REPO / "examples" / "data" / "stdlib-docstrings.jsonl"), BUCKET, CORPUS)

    both = 2 * args.runs
    nodes = add_nodes("gpu-2a-0", "load-gpu", math.ceil(both / 4), ["us-west-2a", "us-west-2b"])
    nodes += add_nodes("system-0", "load-system", math.ceil(both / 8) + 2)  # a head: 1 of its 8 CPUs
    kubectl("wait", "--for", "condition=Ready", "--timeout", "300s", *[f"node/{n}" for n in nodes])
    bench_id = uuid.uuid4().hex[:4]  # an earlier run's namespaces may still be terminating
    run_namespaces = [f"load-{bench_id}-runs-{k}" for k in range(TEAMS)]
    job_namespaces = [f"load-{bench_id}-rayjobs-{k}" for k in range(TEAMS)]
    for namespace in run_namespaces + job_namespaces:
        kubectl("create", "namespace", namespace)

    work = Path(cluster.env["FSDP_LOCAL_CLUSTER_STATE"]) / "logs"
    port_file, events = work / "ray-standin.port", work / "ray-standin-events.jsonl"
    port_file.unlink(missing_ok=True)
    events.unlink(missing_ok=True)
    standin = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "ray_standin.py"), "--port-file", str(port_file),
         "--events", str(events)],
        env={**os.environ, "PYTHONPATH": str(REPO / "trainer")},
        stdout=(work / "ray-standin.log").open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_until("the Ray stand-in's port", lambda: port_file.exists() and port_file.read_text(), timeout=60)
    standin_url = f"http://127.0.0.1:{port_file.read_text()}"
    state = Path(cluster.env["FSDP_LOCAL_CLUSTER_STATE"])
    kuberay_through(standin_url)
    real_node_policies(signal.SIGSTOP, state)
    metrics_port = free_port()
    operator = (ProfiledOperator if args.memray else OperatorProcess)(
        ",".join(run_namespaces) if args.namespaced else "",  # "": every namespace, as the chart installs it
        {
            "FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE": "override",
            "FSDP_OPERATOR_DASHBOARD_URL": standin_url,
            "FSDP_OPERATOR_DASHBOARD_TOKEN": "unused-by-the-stand-in",
            "FSDP_OPERATOR_TRAINER_DEVICE": "cpu",
            "FSDP_OPERATOR_AWS_ENDPOINT_URL": cluster.s3_endpoint,
            "FSDP_OPERATOR_S3_PREFIXES": f"s3://{BUCKET}/",  # granted to every namespace of the bench
            "FSDP_OPERATOR_MAX_ACTIVE_RUNS_PER_NAMESPACE": "0",  # a hundred runs a namespace, all at once
            "FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS": "15",  # the default (tests observe every 2 s)
            "FSDP_OPERATOR_METRICS_PORT": str(metrics_port),
            "MALLOC_ARENA_MAX": "2",  # as the operator's image sets it (Dockerfile.operator)
        },
        work / "load-operator.log",
    )
    if isinstance(operator, ProfiledOperator):
        operator.output = args.memray
    operator.start()
    assert operator.process is not None
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    # The apiserver keeps 150 MB of its audit log; 1,000 runs' start alone may write more. A copy follows it
    # across rotations for the bench's length.
    audit = AuditLog(work / "load-audit.log")
    audit_copy = subprocess.Popen(["tail", "-F", "-n", "0", str(AuditLog.of_local_cluster().path)],
                                  stdout=audit.path.open("wb"), stderr=subprocess.DEVNULL)  # fmt: skip
    timeline, runs_watch = Timeline(), RunWatch(run_namespaces)
    with k8s_config.new_client_from_config(config_file=cluster.kubeconfig) as api_client:
        api_client.user_agent = "fsdp-load-bench"
        for watcher in (timeline.watch_clusters, runs_watch.watch):
            threading.Thread(target=watcher, args=(api_client,), daemon=True).start()
        wait_until("the operator's metrics", lambda: asyncio_tasks(metrics_url), timeout=120)
        time.sleep(5)  # kopf's watches started: its start-up is not counted against it
        try:
            peer = kuberay_pid(state)
            results = measure(args, api_client, timeline, run_namespaces, job_namespaces, operator, audit,
                              metrics_url, peer, standin_url)  # fmt: skip
            results["seen_under_load"] = seen_lags(
                [json.loads(line) for line in events.read_text().splitlines()], runs_watch, datetime.now(UTC)
            )
        finally:
            timeline.stop.set()
            runs_watch.stop.set()
            operator.stop()
            real_node_policies(signal.SIGCONT, state)
            kuberay_through(None)
            stop_process(standin)
            stop_process(audit_copy)
            tear_down(api_client, run_namespaces + job_namespaces)
            kubectl("delete", "nodes", "-l", BENCH_LABEL, "--wait=false", check=False)
    publish("load", results, load_table(results), args.output, not args.no_doc)


def tear_down(api_client: k8s.ApiClient, namespaces: list[str]) -> None:
    """The bench's namespaces deleted, with everything in them: the runs' finalizers taken off first (the
    operator is stopped), many at once, since a thousand one by one take minutes."""
    custom = k8s.CustomObjectsApi(api_client)

    def release(namespace: str, name: str) -> None:
        custom.patch_namespaced_custom_object("fsdp.training.dev", "v1alpha1", namespace, "fsdptrainingruns",
                                              name, {"metadata": {"finalizers": None}})  # fmt: skip

    runs = [(namespace, run["metadata"]["name"]) for namespace in namespaces
            for run in custom.list_namespaced_custom_object("fsdp.training.dev", "v1alpha1", namespace,
                                                            "fsdptrainingruns")["items"]]  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: release(*key), runs))
    for namespace in namespaces:
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def kuberay_through(proxy: str | None) -> None:
    """Restart the local cluster's KubeRay with `proxy` as its HTTP proxy and reconciling KUBERAY_WORKERS
    objects at once (None: as the cluster runs it). Its Kubernetes client's requests are HTTPS to loopback,
    which Go never sends through HTTP_PROXY."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "no_proxy")}
    flags = ["--reconcile-concurrency", str(KUBERAY_WORKERS)] if proxy else []
    subprocess.run([REPO / "hack" / "kuberay.sh", "kill"], check=True, env=env)
    subprocess.run([REPO / "hack" / "kuberay.sh", "start", *flags], check=True,
                   env={**env, **({"HTTP_PROXY": proxy} if proxy else {})})  # fmt: skip


def real_node_policies(signal_number: int, state: Path) -> None:
    """SIGSTOP or SIGCONT to the real node's kube-router (its NetworkPolicy controller, and the ipset runs it
    starts). It enforces policies for the real node's pods, none while the bench runs, yet resyncs its sets at
    every change of any pod and policy: at 1,000 runs that took a core of the two."""
    os.killpg(int((state / "node" / "pids" / "kube-router.pid").read_text()), signal_number)


def measure(
    args: argparse.Namespace,
    api_client: k8s.ApiClient,
    timeline: Timeline,
    run_namespaces: list[str],
    job_namespaces: list[str],
    operator: OperatorProcess,
    audit: AuditLog,
    metrics_url: str,
    peer: int,
    standin_url: str,
) -> dict[str, Any]:
    assert operator.process is not None
    pid = operator.process.pid
    custom = k8s.CustomObjectsApi(api_client)

    def create(kind: str, i: int) -> None:
        namespace = (run_namespaces if kind == "FSDPTrainingRun" else job_namespaces)[i % TEAMS]
        name = f"load-{i:04d}"
        if kind == "FSDPTrainingRun":
            custom.create_namespaced_custom_object(
                "fsdp.training.dev", "v1alpha1", namespace, "fsdptrainingruns", run_manifest(name, i)
            )
        else:
            custom.create_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayjobs", rayjob_manifest(name, namespace, i)
            )
        with timeline.lock:
            timeline.created[(kind, namespace, name)] = time.monotonic()

    wall_minus_monotonic = datetime.now(UTC) - timedelta(seconds=time.monotonic())
    before, peer_before = proc_stat(pid), proc_stat(peer)
    admission_before = metric(metrics_url, "fsdp_operator_admission_cpu_seconds_total") or 0.0
    placements_before = metric(metrics_url, "fsdp_operator_admission_queue_placements_total") or 0.0
    started_at = datetime.now(UTC)
    with ThreadPoolExecutor(8) as pool:  # the two kinds interleaved, so that neither goes first
        list(pool.map(lambda task: create(*task), [(k, i) for i in range(args.runs)
                                                   for k in ("FSDPTrainingRun", "RayJob")]))  # fmt: skip
    running_at: dict[tuple[str, str], float] = {}

    def all_running() -> bool:
        for namespace in run_namespaces:
            for run in kubectl_json("get", "fsdptrainingruns", "-n", namespace)["items"]:
                key = (namespace, run["metadata"]["name"])
                if run.get("status", {}).get("phase") == "Running":
                    running_at.setdefault(key, time.monotonic())
        return len(running_at) >= args.runs

    start_bound = time.monotonic() + args.start_minutes * 60
    while not (all_running() and len(timeline.cluster_ready) >= 2 * args.runs):
        if time.monotonic() > start_bound:  # a 2-core machine may not start them all: measure what started
            print(
                f"after {args.start_minutes:g} minutes: {len(running_at)} of {args.runs} runs Running, "
                f"{len(timeline.cluster_ready)} of {2 * args.runs} RayClusters ready; soaking those",
                flush=True,
            )
            break
        time.sleep(5)
    with timeline.lock:
        running, ready_jobs = len(running_at), sum(kind == "RayJob" for kind, *_ in timeline.cluster_ready)

    start_phase_end = datetime.now(UTC)
    after_start, peer_after_start = proc_stat(pid), proc_stat(peer)
    admission = (metric(metrics_url, "fsdp_operator_admission_cpu_seconds_total") or 0.0) - admission_before
    placements = (
        metric(metrics_url, "fsdp_operator_admission_queue_placements_total") or 0
    ) - placements_before
    time.sleep(10)  # the audit log is written when a response completes
    start_requests = requests_by_agent(audit, started_at, start_phase_end)
    start_kinds = requests_by_kind(audit, started_at, start_phase_end)
    with timeline.lock:
        ready_at = dict(timeline.cluster_ready)

    def wall(at: float) -> datetime:
        return wall_minus_monotonic + timedelta(seconds=at)

    until_done = {
        "operator_per_run_until_running": requests_until(
            audit, started_at, start_phase_end, OPERATOR_AGENTS,
            {key: wall(at) for key, at in running_at.items()},
        ),
        "kuberay_per_rayjob_until_its_cluster_ready": requests_until(
            audit, started_at, start_phase_end, (KUBERAY_USER_AGENT,),
            {(ns, name): wall(at) for (kind, ns, name), at in ready_at.items() if kind == "RayJob"},
        ),
    }  # fmt: skip

    samples: list[
        tuple[float, float, int | None, float]
    ] = []  # (seconds into the soak, RSS MiB, tasks, peer's)
    soak_start, soak_at = time.monotonic(), datetime.now(UTC)
    window_requests: list[float] = []
    kuberay_window_requests: list[float] = []
    window_start = soak_at
    dashboard_before = dashboard_requests(standin_url)

    def count_window(window_end: datetime) -> None:
        nonlocal window_start
        minutes = (window_end - window_start).total_seconds() / 60
        counts = requests_by_agent(audit, window_start, window_end)
        window_requests.append(operator_requests(counts) / minutes)
        kuberay_window_requests.append(counts[KUBERAY_USER_AGENT] / minutes)
        window_start = window_end

    while (elapsed := time.monotonic() - soak_start) < args.soak_minutes * 60:
        samples.append(
            (elapsed, proc_stat(pid)["rss_mib"], asyncio_tasks(metrics_url), proc_stat(peer)["rss_mib"])
        )
        if (datetime.now(UTC) - window_start).total_seconds() >= 300:
            count_window(datetime.now(UTC))
        time.sleep(args.sample_seconds)
    if (datetime.now(UTC) - window_start).total_seconds() >= 60:  # the last window, if a minute long
        time.sleep(10)  # the audit log is written when a response completes
        count_window(datetime.now(UTC) - timedelta(seconds=10))
    end, peer_end = proc_stat(pid), proc_stat(peer)
    soak_seconds = time.monotonic() - soak_start
    dashboard = per_side(dashboard_requests(standin_url) - dashboard_before)
    phases = phase_counts(run_namespaces)

    created_ready = {
        kind: {
            "to_raycluster_created_s": summary(timeline.latencies(kind, timeline.cluster_added)),
            "to_raycluster_ready_s": summary(timeline.latencies(kind, timeline.cluster_ready)),
        }
        for kind in ("FSDPTrainingRun", "RayJob")
    }
    to_running = [
        running_at[(ns, name)] - at
        for (kind, ns, name), at in timeline.created.items()
        if kind == "FSDPTrainingRun" and (ns, name) in running_at
    ]
    ours, theirs = created_ready["FSDPTrainingRun"], created_ready["RayJob"]
    slope = (
        statistics.linear_regression([s[0] / 3600 for s in samples], [s[1] for s in samples]).slope
        if len(samples) > 1
        else None
    )
    tasks = [s[2] for s in samples if s[2] is not None]

    def process(
        start: dict[str, float], all_running: dict[str, float], final: dict[str, float]
    ) -> dict[str, float]:
        return {
            "rss_mib_idle": round(start["rss_mib"], 1),
            "rss_mib_all_running": round(all_running["rss_mib"], 1),
            "peak_rss_mib": round(final["peak_rss_mib"], 1),
            "cpu_seconds_to_all_running": round(all_running["cpu_seconds"] - start["cpu_seconds"], 1),
            "cpu_seconds_per_minute_in_soak": round(
                (final["cpu_seconds"] - all_running["cpu_seconds"]) / max(args.soak_minutes, 1e-9), 2
            ),
        }

    ours_process, peer_process = (
        process(before, after_start, end),
        process(peer_before, peer_after_start, peer_end),
    )
    return {
        "runs": args.runs,
        "rayjobs": args.runs,
        "started": {
            "runs_running": running,
            "rayclusters_ready": len(ready_at),
            "bound_minutes": args.start_minutes,
        },
        "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "machine": f"{os.cpu_count()} CPUs",
        "latency": created_ready,
        "ratio_p50_ready": round(
            ours["to_raycluster_ready_s"]["p50"] / theirs["to_raycluster_ready_s"]["p50"], 2
        ),
        "ratio_p99_ready": round(
            ours["to_raycluster_ready_s"]["p99"] / theirs["to_raycluster_ready_s"]["p99"], 2
        ),
        "ratio_p50_created": round(
            ours["to_raycluster_created_s"]["p50"] / theirs["to_raycluster_created_s"]["p50"], 2
        ),
        "ratio_p99_created": round(
            ours["to_raycluster_created_s"]["p99"] / theirs["to_raycluster_created_s"]["p99"], 2
        ),
        "runs_create_to_running_s": summary(to_running),
        "start_phase_requests_by_user_agent": dict(start_requests.most_common(12)),
        "operator_requests_per_run_to_running": round(operator_requests(start_requests) / args.runs, 1),
        "kuberay_requests_per_raycluster_to_ready": round(
            start_requests[KUBERAY_USER_AGENT] / (2 * args.runs), 1
        ),
        "operator_requests_per_running_run_per_minute": [
            round(r / max(running, 1), 2) for r in window_requests
        ],
        "kuberay_requests_per_raycluster_per_minute": [
            round(r / max(len(ready_at), 1), 2) for r in kuberay_window_requests
        ],
        "dashboard_requests_per_running_object_per_minute": {
            side: round(n / max(running if side == "operator" else ready_jobs, 1) / (soak_seconds / 60), 2)
            for side, n in dashboard.items()
        },
        "start_phase_requests_by_kind": {side: dict(c.most_common()) for side, c in start_kinds.items()},
        "requests_until_done": {k: round(v, 1) for k, v in until_done.items()},
        "ratio_requests_until_done": round(
            until_done["operator_per_run_until_running"]
            / max(until_done["kuberay_per_rayjob_until_its_cluster_ready"], 0.1),
            2,
        ),
        "operator": {
            **ours_process,
            "admission_cpu_seconds_to_all_running": round(admission, 2),
            "admission_queue_placements_to_all_running": int(placements),
        },
        "kuberay_operator": peer_process,
        "ratio_rss_all_running": round(
            ours_process["rss_mib_all_running"] / peer_process["rss_mib_all_running"], 2
        ),
        "ratio_peak_rss": round(ours_process["peak_rss_mib"] / peer_process["peak_rss_mib"], 2),
        "ratio_cpu_per_minute_in_soak": round(
            ours_process["cpu_seconds_per_minute_in_soak"]
            / max(peer_process["cpu_seconds_per_minute_in_soak"], 0.01),
            2,
        ),
        "ratio_cpu_to_all_running": round(
            ours_process["cpu_seconds_to_all_running"] / max(peer_process["cpu_seconds_to_all_running"], 0.1),
            2,
        ),
        "ratio_requests_to_start": round(
            operator_requests(start_requests)
            / args.runs
            / max(start_requests[KUBERAY_USER_AGENT] / (2 * args.runs), 0.1),
            2,
        ),
        "soak": {
            "minutes": args.soak_minutes,
            "phases_at_end": dict(phases),
            "rss_mib_first_last": [round(samples[0][1], 1), round(samples[-1][1], 1)] if samples else None,
            "kuberay_rss_mib_first_last": [round(samples[0][3], 1), round(samples[-1][3], 1)]
            if samples
            else None,
            "rss_slope_mib_per_hour": None if slope is None else round(slope, 2),
            "asyncio_tasks_min_max": [min(tasks), max(tasks)] if tasks else None,
        },
    }


def started_note(results: dict[str, Any]) -> list[str]:
    """A sentence where the start phase's bound ended it before everything started."""
    started = results["started"]
    if started["runs_running"] >= results["runs"] and started["rayclusters_ready"] >= 2 * results["rayjobs"]:
        return []
    return [
        f"Not all started within {started['bound_minutes']:g} minutes: {started['runs_running']} of "
        f"{results['runs']} runs Running and {started['rayclusters_ready']} of {2 * results['rayjobs']} "
        "RayClusters ready. Per-run figures in the soak are per run Running and per RayCluster ready."
    ]


def load_table(results: dict[str, Any]) -> str:
    """The markdown of docs/benchmarks.md's load section, from this script's JSON."""
    ours, theirs = results["latency"]["FSDPTrainingRun"], results["latency"]["RayJob"]
    operator, soak, runs = results["operator"], results["soak"], results["runs"]
    requests = results["start_phase_requests_by_user_agent"]
    windows = results["operator_requests_per_running_run_per_minute"]

    def p50_p99(figures: dict[str, Any]) -> str:
        return f"{figures['p50']:.1f} s / {figures['p99']:.1f} s"

    def ratios(figure: str) -> str:
        return " / ".join(f"{ours[figure][p] / theirs[figure][p]:.2f}" for p in ("p50", "p99"))

    running = results["runs_create_to_running_s"]
    peer_windows = results["kuberay_requests_per_raycluster_per_minute"]
    dashboard = results["dashboard_requests_per_running_object_per_minute"]
    seen = results.get("seen_under_load", {})

    def span(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}" if values else "no full window"

    def seen_row(what: str, figures: dict[str, Any]) -> tuple[str, str, str, str, str]:
        lags = (f"{figures['p50']:.1f} / {figures['p99']:.1f} / {figures['max']:.1f} s, "
                if "p50" in figures else "")  # fmt: skip
        return (
            f"under the load: {what}, p50 / p99 / max",
            f"{lags}{figures['within_bound']} of {figures['events']} within the bound"
            + (f", {figures['unseen']} never seen" if figures["unseen"] else ""),
            "", "", f"<= {figures['bound_s']:g} s",
        )  # fmt: skip

    rss, peer_rss = soak["rss_mib_first_last"], soak.get("kuberay_rss_mib_first_last")
    peer = results["kuberay_operator"]
    kinds = results["start_phase_requests_by_kind"]

    def where(side: str, per: int) -> str:
        return ", ".join(f"{kind} {n / per:.1f}" for kind, n in list(kinds[side].items())[:8])

    rows = [
        ("create -> RayCluster created, p50 / p99", p50_p99(ours["to_raycluster_created_s"]),
         p50_p99(theirs["to_raycluster_created_s"]), ratios("to_raycluster_created_s"), ""),
        ("create -> RayCluster ready, p50 / p99", p50_p99(ours["to_raycluster_ready_s"]),
         p50_p99(theirs["to_raycluster_ready_s"]), ratios("to_raycluster_ready_s"),
         "p99 <= 1.0"),
        ("create -> run Running (job submitted), p50 / p99", p50_p99(running), "", "", ""),
        ("apiserver requests while starting",
         f"{results['operator_requests_per_run_to_running']} per run (fsdp-operator "
         f"{requests.get(OPERATOR_USER_AGENT, 0)} + kopf {requests.get('kopf', 0)})",
         f"{results['kuberay_requests_per_raycluster_to_ready']} per RayCluster (kuberay-operator "
         f"{requests.get(KUBERAY_USER_AGENT, 0)} for {2 * runs})",
         f"{results['ratio_requests_to_start']:.2f}", "<= 1.5"),
        ("requests of each run until it is Running / of each RayJob until its RayCluster is ready",
         f"{results['requests_until_done']['operator_per_run_until_running']}",
         f"{results['requests_until_done']['kuberay_per_rayjob_until_its_cluster_ready']}",
         f"{results['ratio_requests_until_done']:.2f}", "<= 1.5"),
        ("where they go, per run / per RayCluster", where("operator", runs), where("kuberay", 2 * runs),
         "", ""),
        (f"apiserver requests per running run / per RayCluster per minute in the soak ({len(windows)} "
         "windows of up to 5 minutes)", span(windows), span(peer_windows),
         f"{max(windows) / max(min(peer_windows), 0.01):.2f} at most" if windows and peer_windows else "",
         "<= 1.5"),
        ("Ray dashboard requests per running run / RayJob per minute in the soak",
         f"{dashboard['operator']:.2f}", f"{dashboard['kuberay']:.2f}",
         f"{dashboard['operator'] / max(dashboard['kuberay'], 0.01):.2f}", ""),
        (f"RSS: idle / {runs} runs / peak",
         f"{operator['rss_mib_idle']:.0f} / {operator['rss_mib_all_running']:.0f} / "
         f"{operator['peak_rss_mib']:.0f} MiB",
         f"{peer['rss_mib_idle']:.0f} / {peer['rss_mib_all_running']:.0f} / {peer['peak_rss_mib']:.0f} MiB",
         f"{results['ratio_rss_all_running']:.2f} at {runs} runs", "<= 1.5"),
        ("CPU: to all Running / per minute in the soak",
         f"{operator['cpu_seconds_to_all_running']:.0f} s / "
         f"{operator['cpu_seconds_per_minute_in_soak']:.1f} s",
         f"{peer['cpu_seconds_to_all_running']:.0f} s / {peer['cpu_seconds_per_minute_in_soak']:.1f} s",
         f"{results['ratio_cpu_to_all_running']:.2f} to all Running / "
         f"{results['ratio_cpu_per_minute_in_soak']:.2f} in the soak", "soak <= 2"),
        ("admission CPU to all Running (queue placements)",
         f"{operator['admission_cpu_seconds_to_all_running']:.2f} s "
         f"({operator['admission_queue_placements_to_all_running']})", "", "", ""),
        (f"soak, {soak['minutes']:g} min, {runs} runs Running: RSS first -> last, slope / asyncio tasks",
         f"{rss[0]:.1f} -> {rss[1]:.1f} MiB, {soak['rss_slope_mib_per_hour']:+.1f} MiB/h / "
         f"{soak['asyncio_tasks_min_max'][0]}-{soak['asyncio_tasks_min_max'][1]}" if rss else "no soak",
         f"{peer_rss[0]:.1f} -> {peer_rss[1]:.1f} MiB" if peer_rss else "", "", "flat"),
        *(seen_row(what, seen[kind]) for kind, what in (
            ("checkpoint", "a complete checkpoint -> the status's latest"),
            ("failed", "a job failed -> the status shows the attempt ended"),
            ("hung", "a hang due (last record + hangTimeoutSeconds) -> declared"),
        ) if kind in seen),
    ]  # fmt: skip
    lines = [
        f"Measured {results['date']} on {results['machine']} (`python bench/load.py --runs {runs} "
        f"--soak-minutes {soak['minutes']:g}`).",
        *started_note(results),
        "",
        "| figure | FSDPTrainingRun (operator) | RayJob (KubeRay) | ratio | target |",
        "|---|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
