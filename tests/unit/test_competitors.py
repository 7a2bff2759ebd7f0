"""What an admission pass remembers about the other runs."""

from __future__ import annotations

from typing import Any, cast

from fsdp_operator import builder
from fsdp_operator.handlers import Context, Indexes, _competitors
from fsdp_operator.settings import Settings

SPEC: dict[str, Any] = {
    "model": {"source": "Qwen/Qwen2.5-1.5B"},
    "checkpoint": {"storagePath": "s3://bucket/runs"},
}


def run(name: str) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "team-a",
            "name": name,
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": "2026-12-01T00:00:00Z",
        },
        "spec": SPEC,
        "status": {"phase": "Pending"},
    }


def admission_pass(ctx: Context, this: str, others: list[str]) -> None:
    runs = {("team-a", name): [run(name)] for name in [this, *others]}
    ref = builder.RunRef(namespace="team-a", name=this, uid=f"uid-{this}")
    _competitors(ctx, ref, Indexes(runs=runs, rayclusters={}, ray_pods={}), nodes=[], pods=[])


def test_specs_of_runs_gone_from_the_index_are_forgotten_without_a_delete_event() -> None:
    ctx = Context(settings=Settings(), kube=cast(Any, None), s3=None, ec2=cast(Any, None), package_sha256="x")
    admission_pass(ctx, "c", ["a", "b"])
    assert set(ctx.specs) == {"uid-a", "uid-b", "uid-c"}  # its own spec too: it is in the queue
    # "a" is deleted with its finalizer stripped by hand: the delete handler never runs for it.
    admission_pass(ctx, "b", ["c"])
    assert set(ctx.specs) == {"uid-b", "uid-c"}  # b's own entry (cached by c's pass) is kept for later passes
