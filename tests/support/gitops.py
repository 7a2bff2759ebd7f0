"""Applying runs as a GitOps tool does, and what it compares before a sync."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.support.kube import kubectl, kubectl_json


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
