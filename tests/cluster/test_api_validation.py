"""The apiserver itself rejects bad FSDPTrainingRuns with a message that names the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kube import kubectl, kubectl_json
from tests.support.manifests import DELETE
from tests.support.manifests import with_changes as harness_with_changes
from tests.support.paths import REPO

BASE: dict[str, Any] = {
    "apiVersion": "fsdp.training.dev/v1alpha1",
    "kind": "FSDPTrainingRun",
    "metadata": {"name": "candidate"},
    "spec": {"model": {"source": "Qwen/Qwen2.5-1.5B"}, "checkpoint": {"storagePath": "s3://bucket/runs"}},
}


def with_changes(**changes: Any) -> dict[str, Any]:
    return {**BASE, "spec": harness_with_changes(BASE["spec"], changes)}


def set_phase(namespace: str, phase: str) -> None:
    """Plays the operator: writes a phase through the status subresource."""
    patch = json.dumps({"status": {"phase": phase}})
    kubectl(
        "patch",
        "fsdptrainingrun",
        "candidate",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        patch,
    )


def apply_json(namespace: str, manifest: dict[str, Any], check: bool = True) -> Any:
    return kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=check)


DIGEST = "0" * 64

# (name, changes to the valid base, text the rejection must contain)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("local-storage", {"checkpoint.storagePath": "/data/ckpt"}, "spec.checkpoint.storagePath"),
    ("single-worker-local-storage", {"cluster.workers": 1, "checkpoint.storagePath": "/ckpt"}, "s3:// URI"),
    ("too-many-restarts", {"recovery.maxRestarts": 101}, "spec.recovery.maxRestarts"),
    ("fp16-without-loss-scaling", {"fsdp.mixedPrecision": "fp16"}, "spec.fsdp.mixedPrecision fp16"),
    ("setup-timeout-too-short", {"recovery.setupTimeoutSeconds": 5}, "spec.recovery.setupTimeoutSeconds"),
    (
        "hybrid-shard-one-worker",
        {"fsdp.sharding": "HYBRID_SHARD", "cluster.workers": 1},
        "spec.fsdp.sharding",
    ),
    ("zero-gpus", {"cluster.gpusPerWorker": 0}, "spec.cluster.gpusPerWorker"),
    ("zero-workers", {"cluster.workers": 0}, "spec.cluster.workers"),
    ("short-digest", {"image": "public.ecr.aws/x/ray@sha256:abc"}, "spec.image"),
    ("uppercase-digest", {"image": f"public.ecr.aws/x/ray@sha256:{'A' * 64}"}, "spec.image"),
    ("image-with-space", {"image": "ray 2.58"}, "spec.image"),
    ("model-without-source", {"model": {"revision": "main"}}, "spec.model"),
    (
        "model-source-and-config",
        {"model": {"source": "m", "fromConfig": {"model_type": "qwen2"}}},
        "spec.model",
    ),
    (
        "from-config-without-tokenizer",
        {"model": {"fromConfig": {"model_type": "qwen2"}}},
        "spec.model.tokenizer",
    ),
    ("unknown-sharding", {"fsdp.sharding": "ZERO3"}, "spec.fsdp.sharding"),
    ("unknown-precision", {"fsdp.mixedPrecision": "int8"}, "spec.fsdp.mixedPrecision"),
    ("zero-steps", {"training.maxSteps": 0}, "spec.training.maxSteps"),
    ("zero-learning-rate", {"training.learningRate": 0}, "spec.training.learningRate"),
    ("huge-learning-rate", {"training.learningRate": 3}, "spec.training.learningRate"),
    (
        "warmup-longer-than-run",
        {"training.maxSteps": 10, "training.warmupSteps": 10},
        "spec.training.warmupSteps",
    ),
    ("eval-after-the-end", {"training.maxSteps": 10, "data.evalEvery": 20}, "spec.data.evalEvery"),
    ("eval-fraction-all", {"data.evalFraction": 1.0}, "spec.data.evalFraction"),
    ("no-checkpoint", {"checkpoint": DELETE}, "spec.checkpoint"),
    ("keep-zero-checkpoints", {"checkpoint.keep": 0}, "spec.checkpoint.keep"),
    ("unknown-efa-policy", {"network.efa": "maybe"}, "spec.network.efa"),
    ("efa-required-without-efa", {"network.efa": "required", "cluster.efaPerWorker": 0}, "spec.network.efa"),
    (
        "efa-disabled-with-efa",
        {"network.efa": "disabled", "cluster.efaPerWorker": 1},
        "spec.cluster.efaPerWorker",
    ),
    (
        "bad-toleration-effect",
        {"cluster.tolerations": [{"key": "k", "effect": "Sometimes"}]},
        "spec.cluster.tolerations[0].effect",
    ),
    ("short-hang-timeout", {"recovery.hangTimeoutSeconds": 10}, "spec.recovery.hangTimeoutSeconds"),
    (
        "unknown-preflight-policy",
        {"preflight.onInsufficientCapacity": "Maybe"},
        "spec.preflight.onInsufficientCapacity",
    ),
    ("zero-deadline", {"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds"),
    ("unknown-cleanup-policy", {"cleanupPolicy": "Nuke"}, "spec.cleanupPolicy"),
    ("misspelt-field", {"trainng": {"maxSteps": 5}}, "spec.trainng"),
]


@pytest.mark.parametrize(("case", "changes", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_run_is_rejected_naming_the_field(
    namespace: str, crd_installed: None, case: str, changes: dict[str, Any], field: str
) -> None:
    result = kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(with_changes(**changes)), check=False
    )
    assert result.returncode != 0, f"{case} was accepted"
    assert field in result.stderr, result.stderr
    assert kubectl("get", "fsdptrainingrun", "candidate", "-n", namespace, check=False).returncode != 0


def test_valid_runs_are_accepted_with_server_side_defaults(namespace: str, crd_installed: None) -> None:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        kubectl("apply", "-n", namespace, "-f", str(path))
    run = kubectl_json("get", "fsdptrainingrun", "qwen25-sample", "-n", namespace)
    spec = run["spec"]
    assert spec["fsdp"]["activationCheckpointing"] == "none"  # defaulted by the apiserver
    assert spec["training"]["seed"] == 0 and spec["checkpoint"]["keep"] == 3
    assert spec["recovery"] == {
        "maxRestarts": 3,
        "backoffSeconds": 30,
        "hangTimeoutSeconds": 1800,
        "forensicsSeconds": 60,
        "setupTimeoutSeconds": 1800,
        "provisioningTimeoutSeconds": 900,
        "provisioningAttempts": 3,
        "podErrorTimeoutSeconds": 300,
        "inJobMaxFailures": 1,
    }
    demo = kubectl_json("get", "trainingrun", "tiny-demo", "-n", namespace)
    assert demo["spec"]["model"]["fromConfig"]["hidden_size"] == 64  # kept: preserve-unknown-fields


def test_training_inputs_are_immutable_while_active_but_suspend_is_not(
    namespace: str, crd_installed: None
) -> None:
    apply_json(namespace, BASE)
    set_phase(namespace, "Running")
    changed = apply_json(namespace, with_changes(**{"training.maxSteps": 7}), check=False)
    assert changed.returncode != 0
    assert "spec.training cannot change while the run is active" in changed.stderr, changed.stderr
    apply_json(namespace, with_changes(suspend=True))
    set_phase(namespace, "Suspended")
    # Suspended: the cluster is gone, so its shape may change (checkpoints reshard on load).
    apply_json(namespace, with_changes(suspend=True, **{"cluster.workers": 4}))
    assert (
        kubectl_json("get", "fsdptrainingrun", "candidate", "-n", namespace)["spec"]["cluster"]["workers"]
        == 4
    )


def test_kubectl_explain_shows_the_field_docs(crd_installed: None) -> None:
    explained = " ".join(kubectl("explain", "fsdptrainingrun.spec.checkpoint.storagePath").stdout.split())
    assert "an s3:// prefix, under which each run has <namespace>/<runName>/" in explained
    deadline = " ".join(kubectl("explain", "ftr.spec.recovery.provisioningTimeoutSeconds").stdout.split())
    assert "not ready this long after it was created is deleted" in deadline
    finished = " ".join(kubectl("explain", "ftr.status.conditions.type").stdout.split())
    assert "Finished (True when the run ended either way: wait on it)" in finished
    explained = kubectl("explain", "trainingruns.spec.fsdp").stdout
    for field in ("sharding", "mixedPrecision", "activationCheckpointing", "cpuOffload", "compile"):
        assert field in explained


def test_examples_parse_as_the_operator_reads_them() -> None:
    from fsdp_operator.api import FSDPTrainingRunSpec

    for path in sorted(Path(REPO / "examples").glob("*.yaml")):
        FSDPTrainingRunSpec.model_validate(yaml.safe_load(path.read_text())["spec"])
