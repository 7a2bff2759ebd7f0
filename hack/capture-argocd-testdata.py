"""Captures the Argo CD health check's testdata from real runs of the e2e and cluster tests.

Watches every FSDPTrainingRun on the local cluster while the tests below run, then keeps, for each case the
health check must handle, the first object seen in that state, as the apiserver returned it (less
managedFields, uid, resourceVersion and the last-applied annotation). Two states need hardware the local
cluster does not have (NCCL falling back to TCP sockets on EFA nodes; pods of one run reporting different
image digests); they are made by the operator's own reconcile function from a captured Running object, and
their files say so. Run it on a running local cluster (`make cluster-up`):

    ~/.cache/fsdp-operator/venv/bin/python hack/capture-argocd-testdata.py
    # or recapture some cases only, from the tests that reach them:
    ... hack/capture-argocd-testdata.py --cases queued-for-quota,failed-data-error tests/e2e/test_kueue.py ...
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer"), str(REPO)]

from tests.support.kube import apply_crd  # noqa: E402
from tests.support.local_cluster import LocalCluster  # noqa: E402

from fsdp_operator import api  # noqa: E402
from fsdp_operator.jobs import JobObservation  # noqa: E402
from fsdp_operator.reconcile import ClusterObservation, Observation, reconcile  # noqa: E402
from fsdp_trainer.contract import ProgressRecord, TransportReport  # noqa: E402

TESTDATA = REPO / "argocd/resource_customizations/fsdp.training.dev/FSDPTrainingRun/testdata"
TESTS = [
    "tests/e2e/test_lifecycle.py",
    "tests/e2e/test_shared_cluster.py::test_one_name_in_two_namespaces_keeps_two_prefixes_and_a_reused_prefix_is_refused",
    "tests/e2e/test_shared_cluster.py::test_two_runs_that_need_the_same_zone_run_one_after_the_other",
    "tests/cluster/test_operator.py::test_example_run_reaches_cluster_ready_on_gpu_nodes_in_one_zone",
    "tests/cluster/test_operator.py::test_run_asking_for_more_gpus_than_exist_gets_preflight_false_and_no_cluster",
    "tests/cluster/test_operator.py::test_three_workers_fit_only_across_zones_and_fail_by_policy",
    "tests/cluster/test_operator.py::test_an_image_that_never_pulls_fails_the_run_with_the_kubelets_reason",
    "tests/e2e/test_kueue.py",
]

Run = dict[str, Any]


def status(run: Run) -> dict[str, Any]:
    return run.get("status") or {}


def phase(run: Run) -> str | None:
    return status(run).get("phase")


def condition(run: Run, type_: str) -> dict[str, Any]:
    return next((c for c in status(run).get("conditions", []) if c["type"] == type_), {})


def failed_with(*reasons: str) -> Callable[[Run], bool]:
    return lambda run: phase(run) == "Failed" and condition(run, "Failed").get("reason") in reasons


def lagging(run: Run) -> bool:
    observed = status(run).get("observedGeneration")
    return phase(run) is not None and observed is not None and observed < run["metadata"]["generation"]


def training(run: Run) -> bool:
    s = status(run)
    return (
        phase(run) == "Running"
        and bool(s.get("progress", {}).get("step"))
        and bool(s.get("checkpoints", {}).get("latest"))
    )


def last_restart_allowed(run: Run) -> bool:
    count = status(run).get("restarts", {}).get("count", 0)
    return training(run) and count > 0 and count >= run["spec"]["recovery"]["maxRestarts"]


# case name -> the state it shows; the first object seen in that state is kept.
CASES: dict[str, Callable[[Run], bool]] = {
    "new": lambda run: not status(run),
    "generation-not-observed": lagging,
    "pending-insufficient-capacity": lambda run: (
        phase(run) == "Pending"
        and condition(run, "Preflight").get("status") == "False"
        and condition(run, "Preflight").get("reason") != "WaitingForEarlierRun"
    ),
    "provisioning": lambda run: (
        phase(run) == "Provisioning" and condition(run, "PodsHealthy").get("status") != "False"
    ),
    "provisioning-image-pull-error": lambda run: (
        phase(run) == "Provisioning" and condition(run, "PodsHealthy").get("status") == "False"
    ),
    "cluster-ready": lambda run: phase(run) == "ClusterReady" and not lagging(run),
    "running-setup": lambda run: (
        phase(run) == "Running" and bool(status(run).get("progress", {}).get("stage"))
    ),
    "running": lambda run: training(run) and status(run).get("restarts", {}).get("count", 0) == 0,
    "restarting": lambda run: phase(run) == "Restarting",
    "running-last-restart": last_restart_allowed,
    "suspended": lambda run: phase(run) == "Suspended" and not lagging(run),
    "succeeded": lambda run: phase(run) == "Succeeded" and not lagging(run),
    "queued-for-quota": lambda run: (
        phase(run) == "Queued" and condition(run, "Admitted").get("reason") == "Pending"
    ),
    "queued-after-preemption": lambda run: (
        phase(run) == "Queued" and condition(run, "Admitted").get("reason") == "Preempted"
    ),
    "failed-data-error": failed_with("DataError"),
    "failed-restarts-exhausted": failed_with("RestartsExhausted"),
    "failed-preflight": lambda run: (
        phase(run) == "Failed" and condition(run, "Preflight").get("status") == "False"
    ),
    "failed-image-pull": failed_with("ErrImagePull", "ImagePullBackOff"),
    "failed-checkpoint-mismatch": failed_with("CheckpointMismatch"),
}


def clean(run: Run) -> Run:
    run = json.loads(json.dumps(run))
    meta = run["metadata"]
    for key in ("managedFields", "uid", "resourceVersion"):
        meta.pop(key, None)
    annotations = meta.get("annotations", {})
    annotations.pop("kubectl.kubernetes.io/last-applied-configuration", None)
    if not annotations:
        meta.pop("annotations", None)
    return run


def watched_objects(stream: str) -> list[Run]:
    decoder, objects, at = json.JSONDecoder(), [], 0
    while at < len(stream):
        while at < len(stream) and stream[at].isspace():
            at += 1
        if at < len(stream):
            obj, at = decoder.raw_decode(stream, at)
            objects.append(obj)
    return objects


def made_by_reconcile(running: Run, observe: Callable[[Observation], Observation]) -> Run:
    """The status the operator writes for `running` after one pass over a changed observation."""
    spec = api.FSDPTrainingRunSpec.model_validate(running["spec"])
    current = api.FSDPTrainingRunStatus.model_validate(status(running))
    progress = current.progress
    record = ProgressRecord(
        run_name=running["metadata"]["name"],
        phase="training",
        step=progress.step or 0,
        max_steps=progress.max_steps,
        loss=progress.loss,
        updated_at=progress.updated_at or dt.datetime.now(dt.UTC),
    )
    now = (progress.updated_at or dt.datetime.now(dt.UTC)) + dt.timedelta(seconds=5)
    base = Observation(
        now=now,
        generation=running["metadata"]["generation"],
        cluster=ClusterObservation(ready=True, message=""),
        job=JobObservation(current.job_submission_id or "", "RUNNING"),
        progress=record,
        checkpoints=tuple(reversed(current.checkpoints.recent)),
        pod_image_ids=(current.image.digest,) if current.image.digest else (),
    )
    decision = reconcile(spec, current, observe(base))
    made = json.loads(json.dumps(running))
    made["status"] = decision.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    return made


def socket_fallback(obs: Observation) -> Observation:
    assert obs.progress is not None
    evidence = ["NCCL INFO NET/Socket : Using [0]eth0:10.0.1.17<0>", "NCCL INFO Using network Socket"]
    transport = TransportReport(observed="socket", evidence=evidence)
    return dataclasses.replace(obs, progress=obs.progress.model_copy(update={"transport": transport}))


def pods_disagree(obs: Observation) -> Observation:
    other = "public.ecr.aws/deep-learning-containers/ray@sha256:" + "0" * 64
    return dataclasses.replace(obs, pod_image_ids=(*obs.pod_image_ids, other))


# Cases made from the captured running object: case -> (change to the observation, what it is).
MADE: dict[str, tuple[Callable[[Observation], Observation], str]] = {
    "transport-socket-fallback": (socket_fallback, "a progress record whose NCCL transport is TCP sockets"),
    "pods-disagree": (pods_disagree, "a second pod image digest"),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", help="comma-separated cases to write (default: all)")
    parser.add_argument("tests", nargs="*", default=TESTS, help="pytest node ids (default: the list above)")
    args = parser.parse_args()
    wanted = set(args.cases.split(",")) if args.cases else set(CASES) | set(MADE)
    unknown = wanted - set(CASES) - set(MADE)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    cluster = LocalCluster.from_env_file()
    os.environ.update(cluster.env)
    env = dict(os.environ)
    apply_crd()  # the watch below ends at once when the CRD is missing
    kubectl = str(REPO / "bin" / "kubectl")
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as stream:
        watch = subprocess.Popen(
            [kubectl, "get", "fsdptrainingruns", "-A", "--watch", "-o", "json"], stdout=stream, env=env
        )
        try:
            time.sleep(2)
            if watch.poll() is not None:
                raise SystemExit(f"kubectl's watch of the runs ended (exit {watch.returncode})")
            pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args.tests]
            tests = subprocess.run(pytest, env=env)
        finally:
            watch.terminate()
            watch.wait(timeout=10)
        stream.seek(0)
        objects = watched_objects(stream.read())
    if tests.returncode != 0:
        print("some tests failed; the states they reached are still kept", file=sys.stderr)
    found: dict[str, tuple[Run, str]] = {}
    for run in objects:
        for case, shows in CASES.items():
            if case not in found and shows(run):
                found[case] = (clean(run), "captured from a real run of the tests listed in the script")
    if "running" in found:
        base = found["running"][0]
        why = "made by the operator's reconcile() from the captured running.yaml with {} (impossible on CPU)"
        for case, (change, what) in MADE.items():
            found[case] = (made_by_reconcile(base, change), why.format(what))
    found = {case: kept for case, kept in found.items() if case in wanted}
    TESTDATA.mkdir(parents=True, exist_ok=True)
    for case, (run, origin) in sorted(found.items()):
        header = f"# {origin}; hack/capture-argocd-testdata.py, {dt.date.today().isoformat()}\n"
        (TESTDATA / f"{case}.yaml").write_text(header + yaml.safe_dump(run, sort_keys=False))
    missing = sorted(wanted - set(found))
    print(f"{len(objects)} objects watched; wrote {len(found)} cases to {TESTDATA}")
    if missing:
        print("no object showed: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
