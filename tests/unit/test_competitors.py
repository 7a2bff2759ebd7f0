"""Admission through its one entry point: what it remembers about the other runs, and what it forgets."""

from __future__ import annotations

from typing import Any

from fsdp_operator import api, builder
from fsdp_operator.admission import Admission
from fsdp_operator.kube import Indexes

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


def admission_pass(admission: Admission, this: str, others: list[str]) -> None:
    runs = {("team-a", name): [run(name)] for name in [this, *others]}
    ref = builder.RunRef(namespace="team-a", name=this, uid=f"uid-{this}")
    spec = api.FSDPTrainingRunSpec.model_validate(SPEC)
    indexes = Indexes(runs=runs, rayclusters={}, ray_pods={}, nodes={None: []}, accelerator_pods={})
    result = admission.admit(ref, spec, "2026-12-01T00:00:00Z", indexes)
    assert not result.ok  # no GPU node at all


def test_specs_of_runs_gone_from_the_index_are_forgotten_without_a_delete_event() -> None:
    admission = Admission(watch_namespaces=[], kube=None, ec2=lambda: None)
    admission_pass(admission, "c", ["a", "b"])
    assert all(admission.remembers(uid) for uid in ("uid-a", "uid-b", "uid-c"))  # its own: it is queued
    # "a" is deleted with its finalizer stripped by hand: the delete handler never runs for it.
    admission_pass(admission, "b", ["c"])
    assert not admission.remembers("uid-a")
    assert admission.remembers("uid-b") and admission.remembers("uid-c")  # kept for later passes


def test_a_deleted_run_is_forgotten_by_admission() -> None:
    admission = Admission(watch_namespaces=[], kube=None, ec2=lambda: None)
    admission_pass(admission, "c", ["a"])
    admission.forget("uid-a")
    assert not admission.remembers("uid-a") and admission.remembers("uid-c")
