"""What autoscalers say of a run's waiting pods, as the run's status reads it: Karpenter's and the
cluster-autoscaler's own words (their event reasons and messages as their sources write them)."""

from __future__ import annotations

from typing import Any

from fsdp_operator import api
from fsdp_operator.observe import (
    AutoscalerSaid,
    Verdict,
    disk_advice,
    newest_autoscaler_word,
    pods_to_ask_about,
    scheduling_of,
)
from fsdp_operator.reconcile import ClusterObservation
from fsdp_operator.watched import pod_summary

# karpenter: pkg/controllers/provisioning/scheduling/events.go (NominatePodEvent, PodFailedToScheduleEvent)
NOMINATED = AutoscalerSaid("Nominated", "Pod should schedule on: nodeclaim/gpu-8x2kq")
NO_POOL_FITS = AutoscalerSaid(
    "FailedScheduling",
    'Failed to schedule pod, incompatible with nodepool "gpu", daemonset overhead={"cpu":"200m","pods":"3"}, '
    "no instance type met the scheduling requirements or had enough resources",
)
POOL_AT_LIMITS = AutoscalerSaid(
    "FailedScheduling",
    'Failed to schedule pod, all available instance types exceed limits for nodepool: "gpu"',
)
# cluster-autoscaler: its NotTriggerScaleUp message lists each node group's reason
GROUP_AT_MAX = AutoscalerSaid(
    "NotTriggerScaleUp", "pod didn't trigger scale-up: 1 max node group size reached"
)
GROUP_IN_BACKOFF = AutoscalerSaid(
    "NotTriggerScaleUp", "pod didn't trigger scale-up: 1 in backoff after failed scale-up"
)
NO_GROUP_MATCHES = AutoscalerSaid(
    "NotTriggerScaleUp", "pod didn't trigger scale-up: 2 node(s) didn't match Pod's node affinity/selector"
)
UNSCHEDULABLE = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."


def pod(name: str, head: bool = False, ready: bool = False, **status: Any) -> dict[str, Any]:
    """A Ray pod as the apiserver returns it, summarised as the operator's pod index keeps it."""
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if status.pop("unschedulable", False):
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNSCHEDULABLE}
        )
    body = {
        "metadata": {"name": name, "labels": {"ray.io/node-type": "head" if head else "worker"}},
        "spec": {"containers": [{"name": "ray-head" if head else "ray-worker"}]},
        "status": {"conditions": conditions, **status},
    }
    return pod_summary(body)


def crash_looping(name: str) -> dict[str, Any]:
    looping = {
        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}
    }
    return pod(name, containerStatuses=[{"name": "ray-worker", "state": looping, "restartCount": 4}])


def test_a_nomination_is_waited_for_and_named() -> None:
    seen = scheduling_of([pod("w-0", unschedulable=True)], {"w-0": NOMINATED}, None)
    assert seen.problems == () and seen.scale_up == str(NOMINATED) and not seen.scale_up_delayed
    assert seen.waiting == (f"pod w-0: {UNSCHEDULABLE}; {NOMINATED}",)


def test_karpenter_finding_no_nodepool_that_fits_fails_at_once_with_its_reason() -> None:
    seen = scheduling_of([pod("w-0", unschedulable=True)], {"w-0": NO_POOL_FITS}, None)
    [problem] = seen.problems
    assert problem.reason == "NoNodePoolFits" and problem.at_once
    assert "no instance type met the scheduling requirements" in problem.message and seen.waiting == ()


def test_refusals_that_pass_by_themselves_are_waited_for_with_the_reason_shown() -> None:
    for said in (POOL_AT_LIMITS, GROUP_AT_MAX, GROUP_IN_BACKOFF):
        assert said.verdict == Verdict.DELAYED, said
        seen = scheduling_of([pod("w-0", unschedulable=True)], {"w-0": said}, None)
        assert seen.problems == () and seen.scale_up == str(said) and seen.scale_up_delayed, said


def test_a_cluster_autoscaler_refusal_with_no_group_that_matches_is_a_problem_but_not_at_once() -> None:
    seen = scheduling_of([pod("w-0", unschedulable=True)], {"w-0": NO_GROUP_MATCHES}, None)
    [problem] = seen.problems
    assert problem.reason == "NotTriggerScaleUp" and not problem.at_once


def test_the_schedulers_own_failed_scheduling_is_not_an_autoscalers_word() -> None:
    scheduler = {
        "reason": "FailedScheduling",
        "message": UNSCHEDULABLE,
        "lastTimestamp": "2026-12-06T10:00:02Z",
    }
    nominated = {"reason": "Nominated", "message": NOMINATED.message, "lastTimestamp": "2026-12-06T10:00:01Z"}
    assert newest_autoscaler_word([scheduler]) is None
    assert newest_autoscaler_word([scheduler, nominated]) == NOMINATED
    refused = {**nominated, "reason": "FailedScheduling", "message": NO_POOL_FITS.message}
    assert (
        newest_autoscaler_word([nominated, {**refused, "lastTimestamp": "2026-12-06T10:00:05Z"}])
        == NO_POOL_FITS
    )


def test_the_heads_scale_up_is_seen_whatever_the_order_of_the_pods() -> None:
    """After an operator restart the pod index lists workers before the head: the head's events are read
    first, and every waiting pod's (only the first three in index order were, so the head's nomination was
    never seen and the head failed at 300 s while its node was being added)."""
    workers = [pod(f"w-{i}", unschedulable=True) for i in range(4)]
    head = pod("h", head=True, unschedulable=True)
    assert pods_to_ask_about([*workers, head]) == ["h", "w-0", "w-1", "w-2", "w-3"]
    seen = scheduling_of([head, *workers], {"h": NOMINATED}, None)
    assert seen.problems == () and seen.scale_up == str(NOMINATED)


def test_a_workers_crash_loop_is_named_while_the_cluster_provisions_once_its_head_is_up() -> None:
    not_ready = ClusterObservation(ready=False, message="")
    with_head_up = scheduling_of([pod("h", head=True, ready=True), crash_looping("w-0")], {}, not_ready)
    [problem] = with_head_up.problems
    assert problem.reason == "CrashLoopBackOff" and "pod w-0" in problem.message
    # Without its head (no GCS) a worker exits and loops until the head is back: not its fault.
    assert scheduling_of([pod("h", head=True), crash_looping("w-0")], {}, not_ready).problems == ()


def test_karpenter_short_of_disk_says_what_to_change_in_the_ec2nodeclass() -> None:
    qwen = api.FSDPTrainingRunSpec.model_validate(
        {"model": {"source": "Qwen/Qwen2.5-1.5B"}, "checkpoint": {"storagePath": "s3://b/p"}}
    )
    advice = disk_advice(qwen)
    assert "EC2NodeClass a root volume of at least" in advice and "spec.cluster.ephemeralStorage" in advice
    seen = scheduling_of([pod("w-0", unschedulable=True)], {"w-0": NO_POOL_FITS}, None, advice)
    assert seen.problems[0].message.endswith(advice)
    small = qwen.model_copy(update={"cluster": qwen.cluster.model_copy(update={"ephemeral_storage": "10Gi"})})
    assert disk_advice(small) == ""


def test_a_long_karpenter_refusal_keeps_the_requests_it_could_not_fit() -> None:
    """Karpenter lists every requirement first and the pod's requests last: those stay in the status."""
    requirements = ", ".join(f'key-{i} In ["value-{i}"]' for i in range(60))
    message = f'Failed to schedule pod, incompatible with nodepool "gpu", requirements {requirements}, '
    message += "no instance type which had enough resources and the required offering met the scheduling "
    message += 'requirements, resources={"cpu":"48","memory":"170Gi","nvidia.com/gpu":"4","pods":"1"}'
    event = {"reason": "FailedScheduling", "message": message, "lastTimestamp": "2026-12-06T10:00:01Z"}
    said = newest_autoscaler_word([event])
    assert said is not None and len(said.message) <= 600 and said.message.endswith('"pods":"1"}')
    assert said.message.startswith("Failed to schedule pod") and said.verdict == Verdict.REFUSED
    seen = scheduling_of([pod("w-0", unschedulable=True)], {"w-0": said}, None, "; advice")
    assert '"cpu":"48"' in seen.problems[0].message and seen.problems[0].message.endswith("; advice")
