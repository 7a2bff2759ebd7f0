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


def active(name: str, namespace: str) -> dict[str, Any]:
    found = run(name)
    found["metadata"]["namespace"] = namespace
    found["status"] = {"phase": "Running"}
    return found


def test_a_namespace_at_its_limit_of_active_runs_waits_and_others_do_not() -> None:
    limited = Admission(watch_namespaces=[], kube=None, ec2=lambda: None, max_active_per_namespace=2)
    bodies = [active("a1", "team-a"), active("a2", "team-a"), active("b1", "team-b"), run("a0")]  # a0 waits
    runs = {(b["metadata"]["namespace"], b["metadata"]["name"]): [b] for b in bodies}
    active_runs: dict[str, list[str]] = {}
    for body in bodies:  # as kopf builds the index
        for namespace, uid in (Admission.active_run(body) or {}).items():
            active_runs.setdefault(namespace, []).append(uid)
    indexes = Indexes(
        runs=runs, rayclusters={}, ray_pods={}, nodes={None: []}, accelerator_pods={}, active_runs=active_runs
    )
    spec = api.FSDPTrainingRunSpec.model_validate(SPEC)
    at_limit = limited.admit(builder.RunRef("a3", "team-a", "uid-a3"), spec, "2026-12-01T00:00:00Z", indexes)
    assert at_limit.reason == "NamespaceRunLimit" and "namespace team-a has 2 active runs" in at_limit.message
    # team-b has one: its next run goes on to placement (and waits there for GPUs, of which there are none).
    other = limited.admit(builder.RunRef("b2", "team-b", "uid-b2"), spec, "2026-12-01T00:00:00Z", indexes)
    assert other.reason != "NamespaceRunLimit", other
    unlimited = Admission(watch_namespaces=[], kube=None, ec2=lambda: None)
    assert (
        unlimited.admit(builder.RunRef("a3", "team-a", "uid-a3"), spec, "", indexes).reason != at_limit.reason
    )


class CountingEc2:
    """EC2's two Describe calls for a g6.12xlarge offered in one zone, counted."""

    calls = 0

    def describe_instance_types(self, InstanceTypes: list[str]) -> dict[str, Any]:
        self.calls += 1
        gpus = {"Gpus": [{"Count": 4}]}
        sizes = {"VCpuInfo": {"DefaultVCpus": 48}, "MemoryInfo": {"SizeInMiB": 196_608}}
        return {
            "InstanceTypes": [{"InstanceType": InstanceTypes[0], "GpuInfo": gpus, "NetworkInfo": {}, **sizes}]
        }

    def describe_instance_type_offerings(self, **_: Any) -> dict[str, Any]:
        self.calls += 1
        return {"InstanceTypeOfferings": [{"Location": "us-west-2a"}]}


def test_scale_from_zero_runs_share_one_ec2_answer_per_instance_type() -> None:
    ec2 = CountingEc2()
    admission = Admission(watch_namespaces=[], kube=None, ec2=lambda: ec2)
    spec = api.FSDPTrainingRunSpec.model_validate(
        {**SPEC, "cluster": {"workers": 1, "efaPerWorker": 0}, "network": {"efa": "disabled"},
         "preflight": {"scaleFromZero": True}}
    )  # fmt: skip
    indexes = Indexes(runs={}, rayclusters={}, ray_pods={}, nodes={None: []}, accelerator_pods={})
    for i in range(20):  # twenty waiting runs, or one run's twenty rechecks
        result = admission.admit(builder.RunRef(f"r{i}", "team-a", f"uid-{i}"), spec, "", indexes)
        assert result.ok, result
    assert ec2.calls == 2


def test_scale_from_zero_runs_admitted_count_against_their_namespaces_limit_at_once() -> None:
    """Issue 46: a scale-from-zero run skipped admission's memory, so a namespace at its limit started any
    number of them before the index showed the first active."""
    admission = Admission(watch_namespaces=[], kube=None, ec2=CountingEc2, max_active_per_namespace=1)
    spec = api.FSDPTrainingRunSpec.model_validate(
        {**SPEC, "cluster": {"workers": 1, "efaPerWorker": 0}, "network": {"efa": "disabled"},
         "preflight": {"scaleFromZero": True}}
    )  # fmt: skip
    runs = {
        ("team-a", f"r{i}"): [{**run(f"r{i}"), "spec": spec.model_dump(by_alias=True)}] for i in (1, 2, 3)
    }
    indexes = Indexes(runs=runs, rayclusters={}, ray_pods={}, nodes={None: []}, accelerator_pods={})
    first = admission.admit(builder.RunRef("r1", "team-a", "uid-r1"), spec, "", indexes)
    # a placed run's pass in between: it must not make admission forget the first
    admission.admit(
        builder.RunRef("r3", "team-a", "uid-r3"), api.FSDPTrainingRunSpec.model_validate(SPEC), "", indexes
    )
    second = admission.admit(builder.RunRef("r2", "team-a", "uid-r2"), spec, "", indexes)
    assert first.ok, first
    assert second.reason == "NamespaceRunLimit", second
