"""FSDPTrainingRuns and their RayClusters, read back as a user reads them."""

from __future__ import annotations

import json
from typing import Any

from tests.support.kube import get_custom, kubectl
from tests.support.waiting import wait_until


def run_of(namespace: str, name: str) -> dict[str, Any]:
    from fsdp_operator.api import GROUP, PLURAL, VERSION

    found: dict[str, Any] = get_custom(
        f"fsdptrainingrun {namespace}/{name}",
        lambda api: api.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _request_timeout=30
        ),
    )
    return found


def conditions_of(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in run.get("status", {}).get("conditions", [])}


def run_summary(run: dict[str, Any]) -> str:
    """Where a run stands, in one line: its phase, step, attempt and every condition's reason and message."""
    status = run.get("status", {})
    step = (status.get("progress") or {}).get("step")
    conditions = "; ".join(
        f"{c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}"
        for c in status.get("conditions", [])
    )
    return f"phase {status.get('phase')}, step {step}, attempt {status.get('attempt')}; {conditions}"


def wait_for_phase(namespace: str, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        nonlocal last
        last = run_of(namespace, name)
        return last if last.get("status", {}).get("phase") == phase else None

    try:
        return wait_until(f"run {name} to reach phase {phase}", reached, timeout=timeout)
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}; the run was at {run_summary(last)}") from None


def set_suspend(namespace: str, name: str, suspend: bool) -> None:
    patch = json.dumps({"spec": {"suspend": suspend}})
    kubectl("patch", "fsdptrainingrun", name, "-n", namespace, "--type=merge", "-p", patch)


def rayclusters(namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_custom(
        f"rayclusters in {namespace}",
        lambda api: api.list_namespaced_custom_object(
            "ray.io", "v1", namespace, "rayclusters", _request_timeout=30
        ),
    )["items"]
    return items
