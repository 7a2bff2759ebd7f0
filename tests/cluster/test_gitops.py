"""GitOps: every example, applied from git as Argo CD (ServerSideApply) or Flux applies it, never drifts.

The operator writes the status subresource and its own bookkeeping (a finalizer, kopf's annotations) only:
after each step of a run's life the manifest still describes the live object exactly, and no field the
manifest sets (spec, its labels, its annotations) is owned by anyone but the applier.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness import (
    REPO,
    OperatorProcess,
    drift,
    example,
    fields_others_own,
    kubectl,
    rayclusters,
    wait_for_phase,
    wait_until,
)

APPLIER = "gitops"  # the field manager of the GitOps tool
EXAMPLES = sorted(path.stem for path in (REPO / "examples").glob("*.yaml"))


def from_git(name: str, **spec_changes: Any) -> dict[str, Any]:
    """An example as a GitOps tool applies it: with its tracking label and a team's own annotation."""
    manifest = example(name, **spec_changes)
    manifest["metadata"]["labels"] = {"app.kubernetes.io/instance": "team-a-runs"}
    manifest["metadata"]["annotations"] = {"team.example/owner": "ml-platform"}
    return manifest


def sync(namespace: str, manifest: dict[str, Any]) -> None:
    kubectl(
        "apply",
        "--server-side",
        f"--field-manager={APPLIER}",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(manifest),
    )


def assert_in_sync(namespace: str, manifest: dict[str, Any]) -> None:
    assert drift(namespace, manifest, APPLIER) == ""
    assert fields_others_own(namespace, manifest, APPLIER) == []


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_from_git_stays_in_sync_through_provisioning_suspend_and_resume(
    name: str, namespace: str, operator: OperatorProcess
) -> None:
    manifest = from_git(name)
    run = manifest["metadata"]["name"]
    sync(namespace, manifest)
    wait_for_phase(namespace, run, "ClusterReady", timeout=120)
    assert_in_sync(namespace, manifest)

    suspended = from_git(name, suspend=True)
    sync(namespace, suspended)
    wait_for_phase(namespace, run, "Suspended", timeout=60)
    wait_until(
        "the suspended run's RayCluster to be deleted", lambda: rayclusters(namespace) == [], timeout=60
    )
    assert_in_sync(namespace, suspended)

    sync(namespace, manifest)
    wait_for_phase(namespace, run, "ClusterReady", timeout=120)
    assert_in_sync(namespace, manifest)
