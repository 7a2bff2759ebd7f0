"""Two tenants on one operator, one of them hostile (issue 35): every reach past the hostile namespace's
grants fails only its own run, naming the field, with nothing created for it; the other team's run trains and
succeeds beside it; the operator neither restarts nor grows.

The platform grants each namespace its own S3 prefix (s3-prefixes: s3://fsdp-e2e/tenants/{namespace}/) and
the shared corpus; the hostile namespace gets no other grant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.doc_section import write_section

from tests.support.demo import BUCKET, CORPUS, RUN_TIMEOUT, SMALL, demo_manifest, lifecycle_env
from tests.support.kube import apply, kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.reliability import Recorder
from tests.support.runs import conditions_of, rayclusters, wait_for_phase


def own_prefix(namespace: str) -> str:
    return f"s3://{BUCKET}/tenants/{namespace}"


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


def rss_kib(proc: OperatorProcess) -> int:
    assert proc.process is not None
    status = Path(f"/proc/{proc.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def pods_of(namespace: str) -> list[str]:
    return [p["metadata"]["name"] for p in kubectl_json("get", "pods", "-n", namespace)["items"]]


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
    try:
        apply(
            namespace, demo_manifest("honest", **SMALL, **{"checkpoint.storagePath": own_prefix(namespace)})
        )
        wait_for_phase(namespace, "honest", "Running", timeout=RUN_TIMEOUT)
        rss_before = rss_kib(proc)

        for case, (changes, _) in cases.items():
            manifest = demo_manifest(case, **SMALL, **{"checkpoint.storagePath": own_prefix(hostile)})
            for key, value in changes.items():  # a whole map replaced, not merged into the example's
                *parents, leaf = key.split(".")
                target = manifest["spec"]
                for parent in parents:
                    target = target.setdefault(parent, {})
                target[leaf] = value
            apply(hostile, manifest)
        # What the apiserver refuses never reaches the operator: an env steering pip.
        refused = kubectl(
            "apply", "-n", hostile, "-f", "-", check=False,
            input=json.dumps(demo_manifest("pip-index", **{"runtimeEnv.env": {"pip_index_url": "https://x"}})),
        )  # fmt: skip
        assert refused.returncode != 0 and "spec.runtimeEnv.env" in refused.stderr, refused.stderr
        pip_refusal = refused.stderr.strip().splitlines()[-1]

        said: dict[str, str] = {}
        for case, (_, field) in cases.items():
            run = wait_for_phase(hostile, case, "Failed", timeout=60)
            failed = conditions_of(run)["Failed"]
            assert failed["reason"] == "NotAllowed", (case, failed)
            assert failed["message"].startswith(field) or f"; {field}" in failed["message"], (case, failed)
            said[case] = failed["message"]
        assert not rayclusters(hostile), "a RayCluster was created for a refused run"
        assert not pods_of(hostile), "a pod was created for a refused run"

        status = wait_for_phase(namespace, "honest", "Succeeded", timeout=RUN_TIMEOUT)["status"]
        assert status["restarts"]["count"] == 0, status
        assert status["record"]["uri"].startswith(f"{own_prefix(namespace)}/{namespace}/honest/")
        rss_after = rss_kib(proc)
        assert proc.process is not None and proc.process.poll() is None, "the operator exited"
        assert "Traceback" not in proc.log.read_text()
        # A refusal is a few status writes; the operator's memory is its watches and its runs, not them.
        assert rss_after < rss_before + 32 * 1024, f"RSS {rss_before} KiB -> {rss_after} KiB"
        write_table(cases, said, pip_refusal)
        reliability.record(
            f"A hostile tenant's {len(cases)} runs, each reaching past its namespace's grants (a Secret, "
            "credentials to a foreign host, a service account, a system priority, a toleration of every "
            "taint, the other team's S3 prefix to write, resume or read, a '..' out of its own), and one "
            "steering pip, beside another team's training run on the same operator",
            "each refused run Failed with reason NotAllowed naming its field (pip: refused by the "
            "apiserver), no RayCluster or pod in the hostile namespace; the other run succeeds without a "
            "restart; the operator never exits and its RSS grows by under 32 MiB",
            f"{len(cases)} refused; operator RSS {rss_before // 1024} MiB -> {rss_after // 1024} MiB, "
            "0 operator restarts; the other run: 0 restarts",
        )
    finally:
        for ns in (namespace, hostile):
            kubectl("delete", "fsdptrainingruns", "--all", "-n", ns, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{proc.log.read_text()[-8000:]}")
