"""What saves apiserver requests while runs start: a queued pass starts from the run the pass before it
stored, and RayCluster events start a pass only when something a pass acts on changed."""

from __future__ import annotations

from typing import Any, cast

from fsdp_operator.handlers import Context, cluster_reaction
from fsdp_operator.settings import Settings


def run(version: str, phase: str) -> dict[str, Any]:
    return {"metadata": {"uid": "u", "resourceVersion": version}, "status": {"phase": phase}}


def test_a_pass_queued_behind_a_write_starts_from_what_that_write_stored() -> None:
    ctx = Context(settings=Settings(), kube=cast(Any, None), s3=None, ec2=cast(Any, None), package_sha256="x")
    first = run("10", "Pending")
    assert ctx.newest(first) is first  # nothing written yet
    ctx.wrote("u", "10", run("11", "Provisioning"))
    assert ctx.newest(first)["metadata"]["resourceVersion"] == "11"
    ctx.wrote("u", "11", run("12", "ClusterReady"))
    # Any version our writes replaced gives the last stored; a version they did not make is kept as it is.
    assert ctx.newest(first)["status"]["phase"] == "ClusterReady"
    assert ctx.newest(run("11", "Provisioning"))["status"]["phase"] == "ClusterReady"
    other = run("13", "ClusterReady")  # written by someone else (kopf's annotations, a user)
    assert ctx.newest(other) is other
    ctx.forget("u")
    assert ctx.newest(first) is first


def raycluster(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "c", "namespace": "n", "generation": 1}, "spec": {}, "status": status}


def test_raycluster_progress_notes_do_not_start_a_pass_readiness_does() -> None:
    empty = cluster_reaction(raycluster())
    provisioning = cluster_reaction(
        raycluster(
            conditions=[
                {"type": "HeadPodReady", "status": "False"},
                {"type": "RayClusterProvisioned", "status": "False"},
            ]
        )
    )
    head_up = cluster_reaction(
        raycluster(
            conditions=[
                {"type": "HeadPodReady", "status": "True"},
                {"type": "RayClusterProvisioned", "status": "False"},
            ]
        )
    )
    ready = cluster_reaction(
        raycluster(
            state="ready",
            conditions=[
                {"type": "HeadPodReady", "status": "True"},
                {"type": "RayClusterProvisioned", "status": "True"},
            ],
        )
    )
    assert empty == provisioning == head_up != ready
    edited = raycluster()
    edited["metadata"]["generation"] = 2
    assert cluster_reaction(edited) != empty  # a spec edit (drift) is acted on at once
    going = raycluster()
    going["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert cluster_reaction(going) != empty
