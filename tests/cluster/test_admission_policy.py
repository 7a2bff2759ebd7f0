"""The chart's optional ValidatingAdmissionPolicy, enforced by the real apiserver: per namespace, the service
accounts, image repositories and checkpoint prefixes a run may use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.chart import CHART, helm
from tests.support.kube import apply, kubectl
from tests.support.manifests import DELETE, example, with_changes
from tests.support.waiting import wait_until

ALLOWED = {
    "serviceAccounts": ["trainer"],
    "imageRepositories": ["registry.example/ray"],
    "storagePrefixes": ["s3://team-a/"],
}
WITHIN = {
    "cluster.serviceAccountName": "trainer",
    "image": "registry.example/ray:2.58.0",
    "checkpoint.storagePath": "s3://team-a/runs",
}


def create(namespace: str, manifest: dict[str, Any]) -> str:
    """Creates a run in a server-side dry run; returns the apiserver's refusal, or "" when it was admitted."""
    manifest_json = json.dumps(manifest)
    done = kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-", input=manifest_json, check=False)
    return done.stderr.strip() if done.returncode else ""


def run(name: str, **changes: Any) -> dict[str, Any]:
    manifest = example("cpu-demo", **WITHIN)
    manifest["spec"] = with_changes(manifest["spec"], changes)
    manifest["metadata"]["name"] = name
    return manifest


class Policy:
    """The chart's policy, installed cluster-wide by `kubectl apply` of what `helm template` renders."""

    def __init__(self, release: str) -> None:
        self.release = release
        self.rendered = ""

    def apply(self, lists: dict[str, dict[str, list[str]]]) -> None:
        self.rendered = helm(
            "template", self.release, str(CHART), "--kube-version", "1.35.0",
            "--set", "admissionPolicy.enabled=true",
            "--set-json", f"admissionPolicy.namespaces={json.dumps(lists)}",
            "--show-only", "templates/admission-policy.yaml",
        ).stdout  # fmt: skip
        kubectl("apply", "-f", "-", input=self.rendered)

    def delete(self) -> None:
        kubectl("delete", "--ignore-not-found", "-f", "-", input=self.rendered)


@pytest.fixture
def policy(namespace: str, crd_installed: None) -> Iterator[Policy]:
    """The chart's policy with an allow-list for the test's namespace, enforced."""
    installed = Policy(f"p{namespace[-6:]}")
    installed.apply({namespace: ALLOWED})
    try:
        wait_until_refused(namespace, "allowed: trainer")
        yield installed
    finally:
        installed.delete()


def wait_until_refused(namespace: str, message: str) -> None:
    """The apiserver loads a new or changed policy asynchronously: wait until it refuses as expected."""
    outside = run("probe", **{"cluster.serviceAccountName": "admin"})
    wait_until(
        f"the admission policy to refuse with {message!r}", lambda: message in create(namespace, outside), 30
    )


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"cluster.serviceAccountName": "admin"}, "spec.cluster.serviceAccountName: admin is not allowed"),
        ({"cluster.serviceAccountName": DELETE}, "spec.cluster.serviceAccountName: default is not allowed"),
        (
            {"image": "evil.example/ray:2.58.0"},
            "spec.image: evil.example/ray:2.58.0 is not from a repository",
        ),
        ({"image": "registry.example/ray-evil:1"}, "spec.image: registry.example/ray-evil:1 is not from"),
        (
            {"checkpoint.storagePath": "s3://team-b/runs"},
            "spec.checkpoint.storagePath: s3://team-b/runs is out",
        ),
        (
            {"checkpoint.storagePath": "s3://team-a-x/r"},
            "spec.checkpoint.storagePath: s3://team-a-x/r is out",
        ),
    ],
    ids=["service-account", "default-service-account", "image", "image-prefix", "storage", "storage-prefix"],
)
def test_a_run_outside_its_namespaces_allow_list_is_refused_naming_the_field(
    namespace: str, policy: Policy, changes: dict[str, Any], refusal: str
) -> None:
    refused = create(namespace, run("outside", **changes))
    assert refusal in refused, refused
    assert f"in namespace {namespace}" in refused and "allowed: " in refused


def test_runs_within_the_list_and_runs_elsewhere_are_admitted_and_a_narrowed_list_blocks_no_metadata_write(
    namespace: str, policy: Policy
) -> None:
    assert create(namespace, run("within")) == ""
    assert create(namespace, run("by-digest", image="registry.example/ray@sha256:" + "a" * 64)) == ""
    assert create("default", run("elsewhere", **{"cluster.serviceAccountName": "admin"})) == ""
    # Narrowed after the run exists: the operator's metadata writes (finalizers) still pass; a spec change is
    # checked against today's list.
    apply(namespace, run("existing"))
    policy.apply({namespace: {**ALLOWED, "serviceAccounts": ["other"]}})
    wait_until_refused(namespace, "allowed: other")
    kubectl("label", "fsdptrainingrun", "existing", "-n", namespace, "team=a")
    suspend = '{"spec":{"suspend":true}}'
    changed = kubectl(
        "patch", "fsdptrainingrun", "existing", "-n", namespace, "--type=merge", "-p", suspend, check=False
    )  # fmt: skip
    assert changed.returncode != 0 and "spec.cluster.serviceAccountName: trainer" in changed.stderr
