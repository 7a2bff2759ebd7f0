"""What a tenant with one namespace tries after its run is admitted, and through the paths and names it writes
(issue 46): edits that would need a grant while the run is active, a grant withdrawn before the cluster is
rebuilt, a refused run's paths, and names that libraries read differently. Each is refused naming the field,
and nothing ungranted is built or written. docs/security.md's table of them is written here when they pass."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from bench.doc_section import write_section

from fsdp_operator import tenancy
from fsdp_operator.context import POLICY_SECONDS
from tests.support.kube import apply, grant, kubectl, kubectl_json
from tests.support.manifests import example
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until

SECRET = {"HF_TOKEN": {"name": "hf", "key": "token"}}
MLFLOW = {"trackingUri": "https://collector.example", "credentials": {"token": {"name": "hf", "key": "t"}}}

# (what the tenant writes, as dotted spec fields, the field the apiserver's refusal must name)
REFUSED_AT_ADMISSION: list[tuple[dict[str, Any], str]] = [
    ({"checkpoint.storagePath": "s3://fsdp-e2e/team-a/team-a/train-a#"}, "spec.checkpoint.storagePath"),
    ({"checkpoint.storagePath": "s3://fsdp-e2e/team-b?versionId=1"}, "spec.checkpoint.storagePath"),
    ({"checkpoint.storagePath": "s3://fsdp-e2e/team-b//x"}, "spec.checkpoint.storagePath"),
    ({"checkpoint.resume": "s3://fsdp-e2e/team-b/%2e%2e/team-a/run/checkpoints/step_10"},
     "spec.checkpoint.resume"),
    ({"data.source": "s3://fsdp-e2e/team-a/*.jsonl"}, "spec.data.source"),
    ({"runtimeEnv.env": {"XDG_CONFIG_HOME": "/tmp/x"}}, "spec.runtimeEnv.env"),
    ({"runtimeEnv.env": {"XDG_CONFIG_DIRS": "/tmp/x"}}, "spec.runtimeEnv.env"),
    ({"runtimeEnv.env": {"OPENSSL_CONF": "/tmp/openssl.cnf"}}, "spec.runtimeEnv.env"),
    ({"runtimeEnv.env": {"OPENSSL_MODULES": "/tmp"}}, "spec.runtimeEnv.env"),
    ({"runtimeEnv.env": {"NETRC": "/tmp/netrc"}}, "spec.runtimeEnv.env"),
    ({"runtimeEnv.secretEnv": {"NVIDIA_VISIBLE_DEVICES": {"name": "gpus", "key": "all"}}},
     "spec.runtimeEnv.secretEnv"),
    ({"network.ncclEnv": {"NCCL_NET_PLUGIN": "/tmp/x.so"}}, "spec.network.ncclEnv"),
    ({"network.ncclEnv": {"NCCL_TUNER_PLUGIN": "/tmp/x.so"}}, "spec.network.ncclEnv"),
    ({"network.ncclEnv": {"FI_PROVIDER_PATH": "/tmp"}}, "spec.network.ncclEnv"),
]  # fmt: skip

# (an edit to an active run that would need a grant, the field the refusal names)
REFUSED_WHILE_ACTIVE: list[tuple[dict[str, Any], str]] = [
    ({"runtimeEnv.secretEnv": SECRET}, "spec.runtimeEnv.secretEnv"),
    ({"tracking.mlflow": MLFLOW}, "spec.tracking"),
]

ROWS: dict[str, list[str]] = {}  # test -> its rows of docs/security.md's table, once it passes


def manifest(name: str, **changes: Any) -> dict[str, Any]:
    """The demo run with whole fields replaced (dotted paths), not merged into the example's."""
    run = example("cpu-demo")
    run["metadata"]["name"] = name
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        target = run["spec"]
        for key in parents:
            target = target.setdefault(key, {})
        target[leaf] = value
    return run


def apply_json(namespace: str, run: dict[str, Any], check: bool = True) -> Any:
    return kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(run), check=check)


def row(asked: dict[str, Any], refused: str, said: str, namespace: str) -> str:
    shown = json.dumps(asked, sort_keys=True).replace("|", "\\|")
    said = said.replace(namespace, "<namespace>").replace("|", "\\|")
    return f"| `{shown}` | {refused} | {said} |"


def test_names_libraries_read_differently_are_refused_at_admission_naming_the_field(
    namespace: str, crd_installed: None
) -> None:
    rows = []
    for changes, field in REFUSED_AT_ADMISSION:
        refused = apply_json(namespace, manifest("hostile", **changes), check=False)
        assert refused.returncode != 0, f"{changes} was admitted"
        assert field in refused.stderr, f"{changes}: the refusal does not name {field}: {refused.stderr}"
        said = refused.stderr.strip().splitlines()[-1]
        rows.append(row(changes, "at creation, by the apiserver (CRD rule)", said, namespace))
    assert kubectl_json("get", "fsdptrainingruns", "-n", namespace)["items"] == []
    ROWS["admission"] = rows


def set_phase(namespace: str, name: str, phase: str) -> None:
    """Plays the operator: writes a phase through the status subresource."""
    patch = json.dumps({"status": {"phase": phase}})
    kubectl("patch", "fsdptrainingrun", name, "-n", namespace, "--subresource=status", "--type=merge", "-p",
            patch)  # fmt: skip


def test_edits_that_would_need_a_grant_are_refused_while_the_run_is_active(
    namespace: str, crd_installed: None
) -> None:
    """The issue's exploit, first half: a Secret added to a running run's secretEnv was accepted."""
    apply_json(namespace, manifest("active"))
    set_phase(namespace, "active", "Running")
    rows = []
    for changes, field in REFUSED_WHILE_ACTIVE:
        refused = apply_json(namespace, manifest("active", **changes), check=False)
        assert refused.returncode != 0, f"{changes} was accepted while the run is active"
        assert f"{field} cannot change while the run is active" in refused.stderr, refused.stderr
        said = refused.stderr.strip().splitlines()[-1]
        rows.append(row(changes, "while active, by the apiserver (CRD rule)", said, namespace))
    # What needs no grant still may change: the next attempt's environment.
    apply_json(namespace, manifest("active", **{"runtimeEnv.env": {"MODE": "fast"}}))
    ROWS["active"] = rows


def test_a_grant_withdrawn_before_the_cluster_is_rebuilt_fails_the_run_and_nothing_is_built(
    namespace: str, operator: OperatorProcess
) -> None:
    """The issue's exploit, second half: the RayCluster rebuilt after a loss was made from the spec as it was
    then, unchecked. A grant the platform withdraws while the run holds a cluster holds from the rebuild."""
    grant(namespace, tenancy.SECRETS, "hf")
    kubectl("create", "secret", "generic", "hf", "-n", namespace, "--from-literal=token=x")
    apply(namespace, example("aws-sample", **{"runtimeEnv.secretEnv": SECRET}))
    wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
    kubectl("annotate", "namespace", namespace, f"{tenancy.SECRETS}-")
    time.sleep(POLICY_SECONDS)  # the operator reads a namespace's grants at most once per POLICY_SECONDS
    [cluster] = rayclusters(namespace)
    kubectl("delete", "raycluster", cluster["metadata"]["name"], "-n", namespace, "--wait=false")

    run = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=60)
    failed = conditions_of(run)["Failed"]
    assert failed["reason"] == tenancy.NOT_ALLOWED, failed
    assert failed["message"].startswith("spec.runtimeEnv.secretEnv.HF_TOKEN.name: Secret 'hf' is not granted")
    wait_until("the lost RayCluster to be gone", lambda: rayclusters(namespace) == [], timeout=30)
    rebuilt = [c for c in rayclusters(namespace) if c["metadata"]["uid"] != cluster["metadata"]["uid"]]
    assert rebuilt == [], "a RayCluster was rebuilt with a Secret no longer granted"
    asked = {"runtimeEnv.secretEnv": SECRET, "(grant withdrawn, then the cluster lost)": True}
    ROWS["rebuilt"] = [row(asked, "at the rebuild: Failed, NotAllowed", failed["message"], namespace)]


def test_a_refused_run_writes_nothing_under_its_paths(
    namespace: str, operator: OperatorProcess, s3_storage: str
) -> None:
    """A run failed NotAllowed wrote run.json under its storagePath with the operator's own S3 role: a path
    outside the namespace's grant, perhaps another team's run's."""
    apply(namespace, example("aws-sample", **{"checkpoint.storagePath": s3_storage}))
    run = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=60)
    failed = conditions_of(run)["Failed"]
    assert failed["reason"] == tenancy.NOT_ALLOWED and "spec.checkpoint.storagePath" in failed["message"]
    time.sleep(2)  # the pass that wrote Failed acts right after its status write; one more pass after it
    bucket = s3_storage.removeprefix("s3://").split("/")[0]
    written = boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents", [])
    assert written == [], f"the operator wrote under a refused run's path: {[o['Key'] for o in written]}"
    asked = {"checkpoint.storagePath": "s3://<another team's bucket>/runs"}
    said = "Failed, NotAllowed; nothing written under the path"
    ROWS["refused-writes"] = [row(asked, "at creation, by the operator", said, namespace)]


def test_deleting_a_run_never_deletes_a_raycluster_it_does_not_own(
    namespace: str, operator: OperatorProcess
) -> None:
    """Cluster names are hashed from run names and may collide within a namespace; deleting a run deleted
    whatever RayCluster had its cluster's name, by name alone."""
    others = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "victim"},
        "spec": {
            "suspend": True,  # no pods: only whether it survives matters
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [{"name": "ray-head", "image": "ray:x"}]}},
            },
        },
    }
    apply_json(namespace, others)
    kept = kubectl_json("get", "raycluster", "victim", "-n", namespace)
    run = example("aws-sample")
    run["metadata"]["name"] = "victim"  # its RayCluster's name too
    apply(namespace, run)
    wait_until(
        "the operator to take up the run (its finalizer)",
        lambda: kubectl_json("get", "fsdptrainingrun", "victim", "-n", namespace)["metadata"].get(
            "finalizers"
        ),
        timeout=30,
    )
    kubectl("delete", "fsdptrainingrun", "victim", "-n", namespace, "--timeout=60s")
    after = kubectl_json("get", "raycluster", "victim", "-n", namespace)
    assert (
        after["metadata"]["uid"] == kept["metadata"]["uid"] and "deletionTimestamp" not in after["metadata"]
    )
    asked = {"metadata.name": "<the name of another's RayCluster>", "(then deleted)": True}
    said = "the run is deleted; the RayCluster it does not own stays"
    ROWS["delete"] = [row(asked, "at deletion, by the operator (UID precondition)", said, namespace)]


IMDS_EXCEPTED = {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}}
OPEN = {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "ingress": [{}], "egress": [{}]}


def test_the_runs_network_policy_made_first_or_edited_by_the_tenant_is_put_back(
    namespace: str, operator: OperatorProcess
) -> None:
    """A tenant who could write NetworkPolicies pre-created one under the run's cluster name (the operator
    took it as its own) or edited it (only deletion was undone), reopening the metadata service and the
    dashboard."""
    name = "qwen25-sample"  # the run's RayCluster's, and its NetworkPolicy's
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name}}
    apply_json(namespace, {**policy, "spec": OPEN})
    apply(namespace, example("aws-sample"))
    run = wait_for_phase(namespace, name, "ClusterReady")

    def as_the_run_needs() -> dict[str, Any] | None:
        found = kubectl_json("get", "networkpolicy", name, "-n", namespace)
        owners = [o["uid"] for o in found["metadata"].get("ownerReferences") or []]
        egress = [peer for rule in found["spec"].get("egress") or [] for peer in rule.get("to") or []]
        return found if run["metadata"]["uid"] in owners and IMDS_EXCEPTED in egress else None

    made_first = wait_until("the pre-created NetworkPolicy to be put back", as_the_run_needs, timeout=10)
    opened = {**made_first["spec"], "egress": [{}]}
    patch = json.dumps({"metadata": {"ownerReferences": None}, "spec": opened})
    kubectl("patch", "networkpolicy", name, "-n", namespace, "--type=merge", "-p", patch)
    again = wait_until("the edited NetworkPolicy to be put back", as_the_run_needs, timeout=10)
    assert again["spec"] == made_first["spec"]
    warnings = kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", "reason=NetworkPolicyRestored"
    )["items"]
    said = sorted(e["message"] for e in warnings)
    assert len(said) == 2 and all(e["involvedObject"]["name"] == name for e in warnings), said
    # The RayCluster as KubeRay keeps it is what the run built: its pod templates are no drift.
    reasons = {e["reason"] for e in kubectl_json("get", "events", "-n", namespace)["items"]}
    assert "ClusterModified" not in reasons and run_of(namespace, name)["status"]["phase"] == "ClusterReady"
    ROWS["network-policy"] = [
        row({"NetworkPolicy": "<the run's cluster name>, made first, open"}, "before the RayCluster, by the "
            "operator", next(m for m in said if "not the run's" in m and "rules" in m), namespace),
        row({"NetworkPolicy": "egress: [{}], ownerReferences removed"}, "at once, by the operator", said[-1],
            namespace),
    ]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def security_table() -> Any:
    """docs/security.md's table of these cases, written when every one of them passed."""
    yield
    order = ["admission", "active", "rebuilt", "refused-writes", "delete", "network-policy"]
    if not all(key in ROWS for key in order):
        return
    lines = [
        f"Written by `{Path(__file__).relative_to(REPO)}` when it passes: what a tenant tried after "
        "admission or through the names it writes, and what it was told.",
        "",
        "| the tenant writes | refused | what it is told |",
        "|---|---|---|",
        *(line for key in order for line in ROWS[key]),
    ]
    write_section("hostile-after-admission", "\n".join(lines), REPO / "docs" / "security.md")
