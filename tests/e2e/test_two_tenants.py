"""Two tenants on one operator, one of them hostile (issue 35): every reach past the hostile namespace's
grants fails only its own run, naming the field, with nothing created for it. The one run it is allowed has
its prefix filled with the largest objects the operator reads there each pass (issue 46). The other team's
run trains and succeeds beside them; the operator neither restarts nor grows past a bound, and that run's
status keeps up with its trainer.

The platform grants each namespace its own S3 prefix (s3-prefixes: s3://fsdp-e2e/tenants/{namespace}/) and
the shared corpus; the hostile namespace gets no other grant.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.doc_section import write_section

from fsdp_operator.builder import ray_cluster_name
from fsdp_operator.cadence import MAX_STRETCH
from fsdp_operator.records import CHECKPOINT_DIR_PREFIX, MAX_RECORD_BYTES
from fsdp_trainer.contract import MANIFEST_FILE, PROGRESS_FILE, RUN_RECORD_FILE
from fsdp_trainer.progress import STORE_INTERVAL_SECONDS
from tests.support.demo import (
    BUCKET,
    CORPUS,
    RUN_TIMEOUT,
    SMALL,
    demo_manifest,
    keys_under,
    lifecycle_env,
)
from tests.support.kube import apply, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.moto_recorder import RecordedRequest, recorded_requests
from tests.support.operator_process import OBSERVE_INTERVAL_SECONDS, OperatorProcess
from tests.support.paths import REPO
from tests.support.process_usage import cpu_seconds, memory_kib, reset_peak
from tests.support.reliability import Recorder
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.status_lag import StatusLag, recorded_steps
from tests.support.waiting import wait_until

# The hostile namespace's one admitted run: its pods never start (KWOK keeps an image named never-pulls in
# ErrImagePull), so it stays Provisioning, an active phase whose every pass reads its storage, without a Ray
# job taking the shared head's CPUs from the run that trains. Its timeouts outlast the test.
HOARD = "hoard"
HOARD_CHANGES: dict[str, Any] = {
    "image": "example.invalid/never-pulls:1",
    "recovery.podErrorTimeoutSeconds": 3600,
    "recovery.provisioningTimeoutSeconds": 3600,
}
MANIFESTS = 100
# What the platform expects one run's pass to read of its manifests at most, whatever its prefix holds: the
# operator's budget (records.MANIFEST_BYTES_PER_PASS), stated here so that a budget lifted fails this test.
MANIFEST_MIB_PER_PASS = 8
# The other team's run trains long enough (its 300 steps ~10 s here) for its status to be watched over several
# observe intervals, with a checkpoint and an evaluation now and then as the demo's.
HONEST_CHANGES: dict[str, Any] = {
    "training.maxSteps": 300,
    "checkpoint.everySteps": 100,
    "data.evalEvery": 100,
}
PEAK_RSS_GROWTH_MIB = 64
# A changed progress record is read at the next pass: at most MAX_STRETCH observe intervals after a quiet
# spell (cadence.py), after the trainer's store, which stores at most every STORE_INTERVAL_SECONDS; and the
# pass's own reads and status write on this loaded 2-core host.
STATUS_LAG_BOUND = STORE_INTERVAL_SECONDS + MAX_STRETCH * OBSERVE_INTERVAL_SECONDS + 5


def own_prefix(namespace: str) -> str:
    return f"s3://{BUCKET}/tenants/{namespace}"


def own_storage(namespace: str) -> dict[str, str]:
    return {"checkpoint.storagePath": own_prefix(namespace)}


def hostile_cases(victim: str, hostile: str) -> dict[str, tuple[dict[str, Any], str]]:
    """Each hostile run's spec changes and the field its refusal must name."""
    theirs = own_prefix(victim)
    return {
        "secret": ({"runtimeEnv.secretEnv": {"HF_TOKEN": {"name": "hf", "key": "token"}}},
                   "spec.runtimeEnv.secretEnv.HF_TOKEN.name"),
        "mlflow": ({"tracking.mlflow": {"trackingUri": "https://collector.example",
                                        "credentials": {"token": {"name": "hf", "key": "token"}}}},
                   "spec.tracking.mlflow.trackingUri"),
        "account": ({"cluster.serviceAccountName": "admin"}, "spec.cluster.serviceAccountName"),
        "priority": ({"cluster.priorityClassName": "system-cluster-critical"},
                     "spec.cluster.priorityClassName"),
        "tolerate-all": ({"cluster.tolerations": [{"operator": "Exists"}]}, "spec.cluster.tolerations[0]"),
        "write-theirs": ({"checkpoint.storagePath": theirs}, "spec.checkpoint.storagePath"),
        "resume-theirs": ({"checkpoint.resume": f"{theirs}/{victim}/honest/checkpoints/step_10"},
                          "spec.checkpoint.resume"),
        "read-theirs": ({"data.source": f"{theirs}/{victim}/honest/run.json"}, "spec.data.source"),
        "climb-out": ({"data.source": f"{own_prefix(hostile)}/../{victim}/{victim}/honest/run.json"},
                      "spec.data.source"),
    }  # fmt: skip


def write_table(cases: dict[str, tuple[dict[str, Any], str]], said: dict[str, str], pip: str) -> None:
    """docs/security.md's table of what a hostile tenant tried, written by this test when it passes."""
    lines = [
        f"Written by `{Path(__file__).relative_to(REPO)}` when it passes: each row a run a hostile tenant "
        "applied beside another team's training run on one operator, and what the tenant was told.",
        "",
        "| the hostile run asks for | refused | what its status says |",
        "|---|---|---|",
    ]
    for case, (changes, _) in cases.items():
        asked = json.dumps(changes, sort_keys=True).replace("|", "\\|")
        lines.append(f"| `{asked}` | Failed, NotAllowed, before any RayCluster | {said[case]} |")
    lines.append(f"| `runtimeEnv.env: {{pip_index_url: ...}}` | by the apiserver (CRD rule) | {pip} |")
    write_section("hostile-inputs", "\n".join(lines), REPO / "docs" / "security.md")


def apply_refused_runs(hostile: str, cases: dict[str, tuple[dict[str, Any], str]]) -> str:
    """Applies each case's run; returns the apiserver's refusal of a run whose env steers pip (it never
    reaches the operator)."""
    for case, (changes, _) in cases.items():
        manifest = demo_manifest(case, **SMALL, **own_storage(hostile))
        for key, value in changes.items():  # a whole map replaced, not merged into the example's
            *parents, leaf = key.split(".")
            target = manifest["spec"]
            for parent in parents:
                target = target.setdefault(parent, {})
            target[leaf] = value
        apply(hostile, manifest)
    steering: dict[str, Any] = {"runtimeEnv.env": {"pip_index_url": "https://x"}}
    steering_run = json.dumps(demo_manifest("pip-index", **steering))
    refused = kubectl("apply", "-n", hostile, "-f", "-", check=False, input=steering_run)
    assert refused.returncode != 0 and "spec.runtimeEnv.env" in refused.stderr, refused.stderr
    return refused.stderr.strip().splitlines()[-1]


def refusals(hostile: str, cases: dict[str, tuple[dict[str, Any], str]]) -> dict[str, str]:
    """What each case's run was told: Failed, NotAllowed, naming its field."""
    said: dict[str, str] = {}
    for case, (_, field) in cases.items():
        run = wait_for_phase(hostile, case, "Failed", timeout=60)
        failed = conditions_of(run)["Failed"]
        assert failed["reason"] == "NotAllowed", (case, failed)
        assert failed["message"].startswith(field) or f"; {field}" in failed["message"], (case, failed)
        said[case] = failed["message"]
    return said


def pods_of(namespace: str) -> list[str]:
    return [p["metadata"]["name"] for p in kubectl_json("get", "pods", "-n", namespace)["items"]]


def just_under(cap: int, shaped: Callable[[int], dict[str, Any]]) -> bytes:
    """The JSON of shaped(n), for an n that makes it less than `cap` bytes and at most 1% less."""
    n = 1024
    while True:
        body = json.dumps(shaped(n), separators=(",", ":")).encode()
        if cap * 0.99 <= len(body) < cap:
            return body
        n = max(1, n * (cap - 64) // len(body))


def fill_with_the_largest_reads(s3: Any, prefix: str) -> dict[str, int]:
    """What a tenant with its run's prefix writes to cost the operator the most memory per object it reads
    at every pass, each just under the operator's cap for it: MANIFESTS manifests of checkpoints that never
    complete (no DCP metadata beside them) listing ~100k files each, a valid progress record holding a
    ~256 KiB error, and a run.json (read once per run and operator start) of ~75k keys no record has. Returns
    the bytes of each by name. (run.json's cap was 4 MiB and it was validated whole: one of 400k such keys
    grew this operator's peak RSS by 153 MiB, the parse and then a validation error per key.)"""
    now = dt.datetime.now(dt.UTC).isoformat()
    manifest = just_under(
        MAX_RECORD_BYTES[MANIFEST_FILE],
        lambda n: {"runName": HOARD, "step": 1, "tokensSeen": 0, "worldSize": 1, "createdAt": now,
                   "files": {f"{i:05x}": 0 for i in range(n)}},
    )  # fmt: skip
    for i in range(MANIFESTS):
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}checkpoint_{i:06d}/{MANIFEST_FILE}", Body=manifest)
    progress = just_under(
        MAX_RECORD_BYTES[PROGRESS_FILE],
        lambda n: {"runName": HOARD, "phase": "training", "step": 1, "maxSteps": 10, "updatedAt": now,
                   "error": "x" * n},
    )  # fmt: skip
    s3.put_object(Bucket=BUCKET, Key=prefix + PROGRESS_FILE, Body=progress)
    record = just_under(
        MAX_RECORD_BYTES[RUN_RECORD_FILE],
        lambda n: {"uid": "", "restarts": [], **{f"{i:05x}": 0 for i in range(n)}},
    )
    s3.put_object(Bucket=BUCKET, Key=prefix + RUN_RECORD_FILE, Body=record)
    return {MANIFEST_FILE: len(manifest), PROGRESS_FILE: len(progress), RUN_RECORD_FILE: len(record)}


def manifest_reads(requests: list[RecordedRequest], prefix: str) -> tuple[int, int]:
    """(passes, manifests read) of the operator's reads under a run's prefix: a pass lists the checkpoints
    once, then reads the manifests it judges."""
    passes = manifests = 0
    for request in requests:
        url = urllib.parse.unquote(request.url)
        if request.method == "GET" and f"prefix={prefix}{CHECKPOINT_DIR_PREFIX}" in url:
            passes += 1
        elif request.method == "GET" and prefix in url and url.endswith(MANIFEST_FILE):
            manifests += 1
    return passes, manifests


def storage_refused(namespace: str, name: str) -> dict[str, Any] | None:
    said = conditions_of(run_of(namespace, name)).get("StorageReadable")
    return said if said and said["status"] == "False" and said["reason"] == "RecordTooLarge" else None


def test_a_hostile_tenant_fails_only_its_own_runs_beside_another_teams_run(
    namespace: str,
    crd_installed: None,
    second_namespace: str,
    local_cluster: LocalCluster,
    s3: Any,
    tmp_path: Path,
    reliability: Recorder,
) -> None:
    hostile = second_namespace
    corpus_dir = f"s3://{BUCKET}/{CORPUS.rsplit('/', 1)[0]}/"
    proc = OperatorProcess(
        namespace=f"{namespace},{hostile}",
        env={
            **lifecycle_env(local_cluster),
            "FSDP_OPERATOR_LEASE_NAMESPACE": namespace,
            "FSDP_OPERATOR_S3_PREFIXES": f"s3://{BUCKET}/tenants/{{namespace}}/,{corpus_dir}",
        },
        log=tmp_path / "operator.log",
    ).start()
    cases = hostile_cases(namespace, hostile)
    lag = StatusLag(namespace, "honest")
    hoard_prefix = f"tenants/{hostile}/{hostile}/{HOARD}/"
    try:
        apply(namespace, demo_manifest("honest", **SMALL, **HONEST_CHANGES, **own_storage(namespace)))
        with lag:
            written = fill_with_the_largest_reads(s3, hoard_prefix)
            wait_for_phase(namespace, "honest", "Running", timeout=RUN_TIMEOUT)
            assert proc.process is not None
            rss_before = reset_peak(proc.process.pid)
            cpu_before, exposed = cpu_seconds(proc.process.pid), time.monotonic()
            with recorded_requests(local_cluster.s3_endpoint) as requests_so_far:
                pip_refusal = apply_refused_runs(hostile, cases)
                apply(hostile, demo_manifest(HOARD, **SMALL, **HOARD_CHANGES, **own_storage(hostile)))
                said = refusals(hostile, cases)
                refusal = wait_until(
                    f"StorageReadable=False RecordTooLarge on run {hostile}/{HOARD}",
                    lambda: storage_refused(hostile, HOARD),
                    timeout=90,
                )
                assert "add up to more than the operator reads in a pass" in refusal["message"], refusal
                hoard_cluster = ray_cluster_name(HOARD)  # created before its first pass read the storage
                built = [c["metadata"]["name"] for c in rayclusters(hostile)]
                assert built == [hoard_cluster], f"RayClusters {built}: one was created for a refused run"
                strays = [p for p in pods_of(hostile) if not p.startswith(f"{hoard_cluster}-")]
                assert not strays, f"pods {strays} were created for a refused run"

                status = wait_for_phase(namespace, "honest", "Succeeded", timeout=RUN_TIMEOUT)["status"]
                assert status["restarts"]["count"] == 0, status
                assert status["record"]["uri"].startswith(f"{own_prefix(namespace)}/{namespace}/honest/")
                # Observed all along: still active, its storage still refused at the end.
                hoard = run_of(hostile, HOARD)["status"]
                assert hoard["phase"] == "Provisioning" and storage_refused(hostile, HOARD), hoard
                passes, manifests_read = manifest_reads(requests_so_far(), hoard_prefix)
        cpu_share = (cpu_seconds(proc.process.pid) - cpu_before) / (time.monotonic() - exposed)
        lags = lag.lags(recorded_steps(s3, BUCKET, f"tenants/{namespace}/{namespace}/honest/"))
        peak_after, rss_after = memory_kib(proc.process.pid, "VmHWM"), memory_kib(proc.process.pid)
        assert proc.process.poll() is None, "the operator exited"
        assert "Traceback" not in proc.log.read_text()
        peak_growth = (peak_after - rss_before) / 1024
        read_per_pass = manifests_read * written[MANIFEST_FILE] / max(passes, 1) / (1 << 20)
        print(
            f"hostile prefix: {MANIFESTS} manifests of {written[MANIFEST_FILE]} bytes, {PROGRESS_FILE} of "
            f"{written[PROGRESS_FILE]}, {RUN_RECORD_FILE} of {written[RUN_RECORD_FILE]}; the operator read "
            f"{manifests_read} manifests in {passes} passes of "
            f"the hostile run ({read_per_pass:.1f} MiB a pass); operator RSS "
            f"{rss_before / 1024:.0f} MiB before, peak {peak_after / 1024:.0f} MiB (+{peak_growth:.0f}), "
            f"{rss_after / 1024:.0f} MiB after, {cpu_share:.2f} CPU; the other run's status lag {lags} "
            f"(bound {STATUS_LAG_BOUND:.0f} s)"
        )
        assert passes > 0, f"no pass of run {hostile}/{HOARD} listed its checkpoints"
        assert read_per_pass <= MANIFEST_MIB_PER_PASS, f"the operator read {read_per_pass:.1f} MiB a pass"
        assert peak_growth < PEAK_RSS_GROWTH_MIB, f"peak RSS grew {peak_growth:.0f} MiB"
        assert lags.max < STATUS_LAG_BOUND, f"the other run's status lagged its trainer: {lags}"
        write_table(cases, said, pip_refusal)
        reliability.record(
            f"A hostile tenant's {len(cases)} runs, each reaching past its namespace's grants (a Secret, "
            "credentials to a foreign host, a service account, a system priority, a toleration of every "
            "taint, the other team's S3 prefix to write, resume or read, a '..' out of its own), one "
            "steering pip, and one admitted run whose prefix holds the largest objects the operator reads at "
            f"every pass ({MANIFESTS} manifests and a progress record, each just under its cap), beside "
            "another team's training run on the same operator",
            "each refused run Failed with reason NotAllowed naming its field (pip: refused by the "
            "apiserver), no RayCluster or pod for them; the admitted run's storage RecordTooLarge (its "
            f"manifests over the {MANIFEST_MIB_PER_PASS} MiB a pass reads); the other run succeeds "
            f"without a restart, its status within {STATUS_LAG_BOUND:.0f} s of its trainer's records; the "
            f"operator never exits, its peak RSS grows by under {PEAK_RSS_GROWTH_MIB} MiB",
            f"{len(cases)} refused; operator RSS {rss_before // 1024} MiB, peak +{peak_growth:.0f} MiB, "
            f"{rss_after // 1024} MiB after; the other run: 0 restarts, status lag {lags}",
        )
    finally:
        for ns in (namespace, hostile):
            kubectl("delete", "fsdptrainingruns", "--all", "-n", ns, "--timeout=60s", check=False)
        proc.stop()
        # The local S3 server keeps objects in its memory for the whole suite: ~100 MiB it need not hold.
        hoarded = [{"Key": key} for key in keys_under(s3, hoard_prefix)]
        if hoarded:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": hoarded})
        print(f"--- operator log ---\n{proc.log.read_text()[-8000:]}")
