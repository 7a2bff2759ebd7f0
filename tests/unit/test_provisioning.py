"""A provisioning run on EKS as platform teams build it: Karpenter's and the autoscaler's answers, its pods'
progress (a slow image pull is not a hang), and a message that stays true once the job trains."""

from __future__ import annotations

import datetime as dt

from fsdp_operator import api, conditions
from fsdp_operator.observe import pull_under_way
from fsdp_operator.preflight import NOT_LAUNCHABLE, PreflightResult
from fsdp_operator.reconcile import ClusterObservation, PodProblem, PodsProgress, reconcile
from tests.support.decision_inputs import NOW, job, observe, record, spec, status

PROVISIONING = ClusterObservation(ready=False, message="RayClusterProvisioned=False")
NO_POOL = (
    "pod w-0: 0/3 nodes are available; FailedScheduling: Failed to schedule pod, incompatible with nodepool "
    '"gpu", no instance type met the scheduling requirements or had enough resources'
)
STARTED = NOW - dt.timedelta(seconds=600)  # the provisioning stretch began 10 minutes before NOW


def provisioning(**extra: object) -> api.FSDPTrainingRunStatus:
    return status(api.Phase.PROVISIONING, phase_transition_time=STARTED, job_submission_id=None, **extra)


def progress(placed: int, started: int = 0, pulls: tuple[str, ...] = ()) -> PodsProgress:
    return PodsProgress(
        pods=3,
        placed=placed,
        started=started,
        ready=0,
        pulls=pulls,
        pulling_since=NOW - dt.timedelta(minutes=4),
    )


def test_karpenter_finding_no_nodepool_fails_the_run_at_once_naming_its_reason() -> None:
    refused = PodProblem("NoNodePoolFits", NO_POOL, at_once=True)
    decision = reconcile(spec(), provisioning(), observe(cluster=PROVISIONING, pod_problems=(refused,)))
    failed = conditions.condition(decision.status.conditions, conditions.FAILED)
    assert decision.status.phase == api.Phase.FAILED and decision.delete_cluster
    assert failed is not None and failed.reason == "NoNodePoolFits" and "nodepool" in failed.message
    # A container that cannot start yet waits podErrorTimeoutSeconds as before.
    pulling = PodProblem("ImagePullBackOff", "pod w-0: ImagePullBackOff: back-off pulling image")
    waits = reconcile(spec(), provisioning(), observe(cluster=PROVISIONING, pod_problems=(pulling,)))
    assert waits.status.phase == api.Phase.PROVISIONING


def test_a_node_group_at_its_maximum_is_waited_for_with_its_reason_shown() -> None:
    said = "NotTriggerScaleUp: pod didn't trigger scale-up: 1 max node group size reached"
    seen = observe(
        cluster=PROVISIONING, unschedulable=(f"pod w-0: 0/3 nodes are available; {said}",), scale_up=said,
        scale_up_delayed=True,
    )  # fmt: skip
    decision = reconcile(spec(), provisioning(), seen)
    scheduled = conditions.condition(decision.status.conditions, conditions.PODS_SCHEDULED)
    assert decision.status.phase == api.Phase.PROVISIONING
    assert scheduled is not None and (scheduled.status, scheduled.reason) == ("False", "ScaleUpDelayed")
    assert "max node group size reached" in scheduled.message


def test_the_provisioning_bound_counts_from_the_pods_last_progress() -> None:
    """provisioningTimeoutSeconds is 900: a worker placed at 14 min keeps the cluster (it was deleted at 15
    min and the next attempt started cold), and the run times out 15 minutes after that if nothing moves."""
    run = spec(recovery={"provisioningTimeoutSeconds": 900})
    first = reconcile(run, provisioning(), observe(ago=240, cluster=PROVISIONING, pods_progress=progress(1)))
    moved = first.status.provisioning
    assert moved is not None and moved.last_progress_time == NOW + dt.timedelta(seconds=240)
    assert (moved.pods, moved.pods_placed) == (3, 1)

    later = reconcile(run, first.status, observe(ago=400, cluster=PROVISIONING, pods_progress=progress(1)))
    assert later.status.phase == api.Phase.PROVISIONING and not later.delete_cluster  # 1,000 s since creation

    stale = reconcile(run, later.status, observe(ago=1150, cluster=PROVISIONING, pods_progress=progress(1)))
    assert stale.status.phase != api.Phase.PROVISIONING and stale.delete_cluster
    assert "of its pods' last progress" in (stale.status.message or "")


def test_an_image_pull_shows_as_progress_in_the_message() -> None:
    pull = "pulling image public.ecr.aws/deep-learning-containers/ray:2.58 on node ip-10-0-1-7"
    decision = reconcile(
        spec(), provisioning(), observe(cluster=PROVISIONING, pods_progress=progress(3, 1, (pull,)))
    )
    assert (
        decision.status.message == f"waiting for KubeRay: 3/3 pods placed, 1 started, 0 ready; {pull} for 4m"
    )
    assert decision.status.provisioning is not None and decision.status.provisioning.pods_pulling == 1


def test_the_message_says_the_run_trains_at_its_step() -> None:
    """The demo's MESSAGE column said 'attempt 1: Ray job ... is PENDING' at steps 16, 28 and 40."""
    was = status(message="attempt 1: Ray job run-0f1e2d3c-1 is PENDING")
    decision = reconcile(spec(), was, observe(job=job("RUNNING"), progress=record(step=16, loss=3.30191)))
    assert decision.status.message == "attempt 1: training, step 16 of 100, loss 3.302"
    starting = reconcile(
        spec(), was, observe(job=job("RUNNING"), progress=record("starting", stage="downloading-model"))
    )
    assert (
        starting.status.message
        == "attempt 1: Ray job run-0f1e2d3c-1 is RUNNING: setting up (downloading-model)"
    )


def test_a_pull_is_under_way_from_the_kubelets_pulling_event_until_it_pulled() -> None:
    image = "public.ecr.aws/deep-learning-containers/ray:2.58.0-gpu-py313-cu130"
    pulling = {
        "reason": "Pulling",
        "message": f'Pulling image "{image}"',
        "firstTimestamp": "2026-12-06T10:00:00Z",
    }
    pulling["lastTimestamp"] = pulling["firstTimestamp"]
    pulled = {
        "reason": "Pulled",
        "message": f'Successfully pulled image "{image}"',
        "lastTimestamp": "2026-12-06T10:04:10Z",
    }
    assert pull_under_way([pulling]) == ("2026-12-06T10:00:00Z", image)
    assert pull_under_way([pulled, pulling]) is None
    assert pull_under_way([]) is None


def test_no_nodepool_or_node_group_that_can_launch_the_type_fails_before_any_cluster() -> None:
    """Preflight read every NodePool and node group and none can make the workers' node: Karpenter would
    refuse the pods the same way once they exist (NoNodePoolFits), so the run fails now, holding nothing."""
    why = "NodePool gpu makes no node labelled karpenter.sh/capacity-type=spot"
    refused = PreflightResult(
        False, NOT_LAUNCHABLE, f"no NodePool or node group can launch g6.12xlarge: {why}"
    )
    decision = reconcile(spec(), api.FSDPTrainingRunStatus(), observe(cluster=None, preflight=refused))
    failed = conditions.condition(decision.status.conditions, conditions.FAILED)
    assert decision.status.phase == api.Phase.FAILED and not decision.create_cluster
    assert failed is not None and failed.reason == NOT_LAUNCHABLE and why in failed.message
