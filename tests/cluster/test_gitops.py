"""GitOps: every example, applied from git as Argo CD (ServerSideApply) or Flux applies it, never drifts.

The operator writes the status subresource and its own bookkeeping (a finalizer, kopf's annotations) only:
after each step of a run's life the manifest still describes the live object exactly, and no field the
manifest sets (spec, its labels, its annotations) is owned by anyone but the applier.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.gitops import assert_in_sync, gitops_sync
from tests.support.manifests import example
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.runs import rayclusters, wait_for_phase
from tests.support.waiting import wait_until

# The real-pod example's pods run for real, three starts of a RayCluster here: tests/e2e/test_real_pods.py
# syncs it as a GitOps tool does and checks it for drift at the end of its runs.
EXAMPLES = sorted(p.stem for p in (REPO / "examples").glob("*.yaml") if p.stem != "cpu-demo-real-pods")


def from_git(name: str, **spec_changes: Any) -> dict[str, Any]:
    """An example as a GitOps tool applies it: with its tracking label and a team's own annotation."""
    manifest = example(name, **spec_changes)
    manifest["metadata"]["labels"] = {"app.kubernetes.io/instance": "team-a-runs"}
    manifest["metadata"]["annotations"] = {"team.example/owner": "ml-platform"}
    return manifest


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_from_git_stays_in_sync_through_provisioning_suspend_and_resume(
    name: str, namespace: str, operator: OperatorProcess
) -> None:
    manifest = from_git(name)
    run = manifest["metadata"]["name"]
    gitops_sync(namespace, manifest)
    wait_for_phase(namespace, run, "ClusterReady", timeout=120)
    assert_in_sync(namespace, manifest)

    suspended = from_git(name, suspend=True)
    gitops_sync(namespace, suspended)
    wait_for_phase(namespace, run, "Suspended", timeout=60)
    wait_until(
        "the suspended run's RayCluster to be deleted", lambda: rayclusters(namespace) == [], timeout=60
    )
    assert_in_sync(namespace, suspended)

    gitops_sync(namespace, manifest)
    wait_for_phase(namespace, run, "ClusterReady", timeout=120)
    assert_in_sync(namespace, manifest)
