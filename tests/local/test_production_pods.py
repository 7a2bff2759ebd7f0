"""The production pod path, read against KubeRay v1.5, Ray 2.58 and the AWS Ray Train DLC: each test pins a
defect that only real pods on a real cluster would show (a tag that does not exist, a head crash nobody sees,
a pod that never starts, a worker killed at its memory limit)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from fsdp_operator import api, builder, conditions, settings
from fsdp_operator.jobs import JobObservation
from fsdp_operator.reconcile import OomKill, observe_cluster, reconcile
from fsdp_operator.watched import pod_summary
from tests.support.chart import render
from tests.support.decision_inputs import NOW, job, observe, record, spec, status
from tests.support.paths import REPO

RUN = builder.RunRef(name="run", namespace="team-a", uid="0f1e2d3c-0000-4000-8000-000000000001")


def test_the_default_image_is_a_published_tag_of_the_ray_258_train_dlc() -> None:
    published = yaml.safe_load(
        (Path(__file__).parent / "data" / "dlc-ray-train-2.58-gpu-ec2.yml").read_text()
    )
    assert (published["version"], published["python"], published["cuda"]) == ("2.58", "py313", "cu130")
    tags = {
        f"public.ecr.aws/deep-learning-containers/{published['ecr_repository']}:{t}"
        for t in published["tags"]
    }
    changelog = yaml.safe_load((Path(__file__).parent / "data" / "dlc-ray-train-changelog.yml").read_text())
    newest = max(changelog["releases"], key=lambda r: r["date"])
    tags |= {
        f"public.ecr.aws/deep-learning-containers/{published['ecr_repository']}:{t}" for t in newest["tags"]
    }
    # The newest release's own minor tag, as the seed articles pin it (train-ml-cuda-v1.1), not a moving one.
    assert settings.DEFAULT_IMAGE in tags
    assert settings.DEFAULT_IMAGE.endswith(f"-v{newest['version']}"), settings.DEFAULT_IMAGE
    chart = yaml.safe_load((REPO / "charts" / "fsdp-operator" / "values.yaml").read_text())
    assert chart["defaultImage"] == settings.DEFAULT_IMAGE


def test_the_dlc_stand_in_pins_what_the_published_dlc_bundles() -> None:
    changelog = yaml.safe_load((Path(__file__).parent / "data" / "dlc-ray-train-changelog.yml").read_text())
    lock = (REPO / "hack" / "dlc" / "requirements.lock").read_text().splitlines()
    pins = dict(line.split("==") for line in lock if "==" in line and not line.startswith("#"))
    assert {name: pins.get(name) for name in changelog["packages"]} == changelog["packages"]
    assert pins["nvidia-nccl-cu13"] == changelog["nccl"]


def test_a_head_that_crashed_after_the_cluster_was_ready_once_is_seen() -> None:
    # KubeRay never sets RayClusterProvisioned or state back after the first time every pod was ready.
    crashed = {
        "status": {
            "state": "ready",
            "conditions": [
                {"type": "RayClusterProvisioned", "status": "True"},
                {"type": "HeadPodReady", "status": "False", "message": "ray-head container not ready"},
            ],
        }
    }
    observed = observe_cluster(crashed)
    assert not observed.ready
    assert "HeadPodReady=False" in observed.message


def test_service_proxy_with_network_policies_needs_the_apiservers_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE", "service-proxy")
    with pytest.raises(ValidationError, match="dashboard_ingress_cidrs"):
        settings.Settings()
    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_INGRESS_CIDRS", "10.0.0.0/16")
    assert settings.Settings().dashboard_ingress_cidrs == ["10.0.0.0/16"]
    monkeypatch.delenv("FSDP_OPERATOR_DASHBOARD_INGRESS_CIDRS")
    monkeypatch.setenv("FSDP_OPERATOR_NETWORK_POLICY", "false")
    settings.Settings()


def test_the_chart_grants_the_service_proxy_in_service_proxy_mode_only() -> None:
    # Ray's SDK uploads py_modules with PUT /api/packages/...; through a service proxy that is verb update.
    # In the other modes the proxy would reach every Service of the watched namespaces for nothing.
    def proxy_verbs(mode: str) -> set[str]:
        rendered = render(
            "r",
            "fsdp-system",
            {"dashboardAddressMode": mode, "networkPolicy": {"dashboardIngressCIDRs": ["10.0.0.0/16"]}},
        )
        roles = rendered.of_kind("ClusterRole") + rendered.of_kind("Role")
        rules = [rule for role in roles for rule in role.get("rules", [])]
        return {verb for rule in rules if "services/proxy" in rule["resources"] for verb in rule["verbs"]}

    assert proxy_verbs("service-proxy") == {"get", "create", "update"}
    assert proxy_verbs("service-dns") == set()


def _groups(manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return manifest["spec"]["headGroupSpec"], manifest["spec"]["workerGroupSpecs"][0]


def _cluster(platform: builder.Platform | None = None, **extra: Any) -> dict[str, Any]:
    return builder.build_raycluster(spec(**extra), RUN, "img:1", "us-west-2a", platform=platform)


def test_the_head_runs_where_the_platform_keeps_heads_and_tolerates_their_taint() -> None:
    platform = builder.pod_platform(
        settings.Settings(head_node_selector={"node-type": "cpu-ray-train-head"}, leader_election=False)
    )
    head, _ = _groups(_cluster(platform))
    pod = head["template"]["spec"]
    assert pod["nodeSelector"] == {"node-type": "cpu-ray-train-head"}
    assert "affinity" not in pod
    assert {"key": "ray.io/head-node", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    own = _groups(_cluster(platform, cluster={"head": {"nodeSelector": {"pool": "system"}}}))[0]
    assert own["template"]["spec"]["nodeSelector"] == {"pool": "system"}  # the run's own choice wins


def test_the_head_has_no_gpus_for_the_nvidia_runtime_and_no_cpus_for_training_workers() -> None:
    head, _ = _groups(_cluster())
    container = head["template"]["spec"]["containers"][0]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in container["env"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    # Not throttled at its request while Ray starts; memory stays bounded.
    assert container["resources"]["limits"] == {"memory": "16Gi"}


def test_ray_pods_write_to_a_volume_of_the_size_they_request_not_the_container_layer() -> None:
    head, workers = _groups(
        _cluster(cluster={"ephemeralStorage": "50Gi", "head": {"ephemeralStorage": "5Gi"}})
    )
    for group, size in ((head, "5Gi"), (workers, "50Gi")):
        pod = group["template"]["spec"]
        [container] = pod["containers"]
        assert container["resources"]["requests"]["ephemeral-storage"] == size
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volume = next(v for v in pod["volumes"] if v["name"] == mounts["/tmp"])
        assert volume["emptyDir"] == {"sizeLimit": size}


def test_workers_tolerate_the_gpu_and_efa_taints_of_their_node_groups() -> None:
    _, workers = _groups(_cluster())
    keys = {t["key"] for t in workers["template"]["spec"]["tolerations"]}
    assert {"nvidia.com/gpu", "vpc.amazonaws.com/efa", "aws.amazon.com/efa"} <= keys


@pytest.mark.parametrize(
    ("instance_type", "rdma"),
    [
        ("p6-b200.48xlarge", True),
        ("p6e-gb200.36xlarge", True),
        ("p5en.48xlarge", True),
        ("g6.12xlarge", False),
    ],
)
def test_gpudirect_rdma_is_set_for_the_families_that_have_it(instance_type: str, rdma: bool) -> None:
    env = builder.efa_environment(spec(cluster={"instanceType": instance_type}))
    assert ("FI_EFA_USE_DEVICE_RDMA" in env) is rdma


def _pod(node_type: str, containers: list[dict[str, Any]], conditions: list[dict[str, Any]] = ()) -> Any:
    return {
        "metadata": {"name": f"c-{node_type}", "labels": {"ray.io/node-type": node_type}},
        "spec": {"containers": [{"name": f"ray-{node_type}", "resources": {"limits": {"memory": "4Gi"}}}]},
        "status": {"containerStatuses": containers, "conditions": list(conditions)},
    }


def test_pods_that_will_not_come_up_by_themselves_are_problems() -> None:
    looping = {"name": "ray-worker", "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    once = {**looping, "restartCount": 1}
    failing = {"name": "ray-worker", "state": {"waiting": {"reason": "RunContainerError", "message": "exec"}}}
    assert [r for r, _ in pod_summary(_pod("worker", [looping]))["problems"]] == ["CrashLoopBackOff"]
    oom_looping = {**looping, "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}
    [(reason, message)] = pod_summary(_pod("worker", [oom_looping]))["problems"]
    assert reason == "OOMKilled" and "memory limit (4Gi" in message
    assert pod_summary(_pod("worker", [once]))["problems"] == []  # one kill and a restart is recovery
    assert [r for r, _ in pod_summary(_pod("worker", [failing]))["problems"]] == ["RunContainerError"]
    unschedulable = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/5"}]
    assert [r for r, _ in pod_summary(_pod("head", [], unschedulable))["problems"]] == ["HeadUnschedulable"]
    # Workers may wait for GPU nodes being added: only the provisioning timeout bounds that.
    assert pod_summary(_pod("worker", [], unschedulable))["problems"] == []


def test_a_crash_loop_is_named_with_its_node_exit_code_and_last_log_lines() -> None:
    """The kubelet keeps a crashed Ray container's log tail in its status (FallbackToLogsOnError, which the
    builder sets): the loop's cause is named from the pod alone."""
    traceback = (
        'Traceback (most recent call last):\n  File "ray", line 1\n\n' + "x" * 500 + "\n  )\nValueError: bad"
    )
    looping = {
        "name": "ray-worker",
        "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
        "lastState": {"terminated": {"reason": "Error", "exitCode": 1, "message": traceback}},
    }
    pod = _pod("worker", [looping])
    pod["spec"]["nodeName"] = "ip-10-0-1-7"
    [(reason, message)] = pod_summary(pod)["problems"]
    assert reason == "CrashLoopBackOff"
    assert message.startswith("pod c-worker: CrashLoopBackOff: back-off 40s restarting; on node ip-10-0-1-7")
    assert "exit code 1, last log lines: " in message and message.endswith("x | ValueError: bad")
    assert len(message) < 600, "the log's tail is bounded"
    built = builder.build_raycluster(spec(), RUN, "image:1", None)
    containers = [built["spec"]["headGroupSpec"], *built["spec"]["workerGroupSpecs"]]
    assert {c["template"]["spec"]["containers"][0]["terminationMessagePolicy"] for c in containers} == {
        "FallbackToLogsOnError"
    }


def test_an_oom_killed_worker_fails_the_attempt_with_its_reason() -> None:
    killed = {
        "name": "ray-worker",
        "restartCount": 1,
        "state": {"running": {}},
        "lastState": {
            "terminated": {"reason": "OOMKilled", "exitCode": 137, "finishedAt": "2026-11-30T11:59:00Z"}
        },
    }
    [(finished, message)] = pod_summary(_pod("worker", [killed]))["oomKills"]
    assert "OOMKilled at its memory limit (4Gi, exit code 137)" in message
    kill = OomKill(dt.datetime.fromisoformat(finished), message)
    before_training = reconcile(
        spec(),
        status(),
        observe(job=job("FAILED"), oom_kills=(kill,), progress=record(step=0, phase="starting")),
    )
    assert before_training.status.phase == api.Phase.FAILED
    assert before_training.status.message.startswith("OOMKilled: container ray-worker")
    assert "spec.cluster.memory" in before_training.status.message
    after_progress = reconcile(
        spec(), status(), observe(job=job("FAILED"), oom_kills=(kill,), progress=record())
    )
    assert after_progress.status.phase == api.Phase.RESTARTING
    assert after_progress.status.restarts.history[-1].reason == "OOMKilled"
    stale = OomKill(NOW - dt.timedelta(hours=1), message)  # of an earlier attempt
    earlier = reconcile(spec(), status(), observe(job=job("FAILED"), oom_kills=(stale,), progress=record()))
    assert earlier.status.restarts.history[-1].reason != "OOMKilled"


def test_a_worker_rays_memory_monitor_killed_at_the_pod_limit_fails_with_its_reason() -> None:
    # Ray kills a worker at 95 % of the pod's limit before the kernel would: the container survives.
    ray_said = (
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.\n"
        "Memory on the node (IP: 198.18.0.12) where the task was running was 2.85GB / 3.00GB (0.95)"
    )
    failed = JobObservation("run-0f1e2d3c-1", "FAILED", message="Job failed", logs_tail=ray_said)
    decision = reconcile(spec(), status(), observe(job=failed, progress=record(step=0, phase="starting")))
    assert decision.status.phase == api.Phase.FAILED
    assert decision.status.message.startswith("OOMKilled: ray.exceptions.OutOfMemoryError")


def ray_pod(node_type: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": f"r-{node_type}-x", "labels": {"ray.io/node-type": node_type}},
        "spec": {"containers": [{"name": f"ray-{node_type}"}]},
        "status": status,
    }


NO_NODE = (
    "0/5 nodes are available: 1 node(s) had untolerated taint {node-role: system}, 4 Insufficient "
    "ephemeral-storage. preemption: 0/5 nodes are available: 5 No preemption victims found."
)


def test_a_worker_no_node_can_take_is_named_in_the_status_and_provisioning_is_bounded() -> None:
    """The scheduler's message for a worker reaches PodsScheduled and the run's message at once; after
    recovery.provisioningAttempts timeouts the run fails with it instead of going back to Pending for ever."""
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": NO_NODE}
    worker = pod_summary(ray_pod("worker", phase="Pending", conditions=[unschedulable]))
    assert worker["problems"] == [] and worker["unschedulable"] == f"pod r-worker-x: {NO_NODE}"
    provisioning = status(
        api.Phase.PROVISIONING, attempt=0, job_submission_id=None, phase_transition_time=NOW
    )
    waiting = observe_cluster({"status": {"conditions": [{"type": "HeadPodReady", "status": "True"}]}})
    seen = observe(cluster=waiting, unschedulable=(worker["unschedulable"],))
    first = reconcile(spec(), provisioning, seen)
    shown = conditions.condition(first.status.conditions, conditions.PODS_SCHEDULED)
    assert shown is not None and shown.status == "False" and "Insufficient ephemeral-storage" in shown.message
    assert first.status.phase == api.Phase.PROVISIONING and "Insufficient ephemeral-storage" in (
        first.status.message or ""
    )
    assert [e.reason for e in first.events] == ["Unschedulable"]
    assert [e.reason for e in reconcile(spec(), first.status, seen).events] == []  # announced once

    run_spec = spec(recovery={"provisioningAttempts": 2})
    late = observe(901, cluster=waiting, unschedulable=(worker["unschedulable"],))
    again = reconcile(run_spec, provisioning, late)
    assert again.status.phase == api.Phase.PENDING and again.status.provisioning_timeouts == 1
    second = provisioning.model_copy(update={"provisioning_timeouts": 1})
    failed = reconcile(run_spec, second, late)
    assert failed.status.phase == api.Phase.FAILED and failed.delete_cluster
    reason = conditions.condition(failed.status.conditions, conditions.FAILED)
    assert reason is not None and reason.reason == "ProvisioningTimeout"
    assert "Insufficient ephemeral-storage" in reason.message and "2 of recovery.provisioningAttempts 2" in (
        reason.message
    )


def test_kuberays_init_container_that_cannot_start_is_named() -> None:
    """KubeRay's wait-gcs-ready runs first in every worker: a missing Secret or an image that does not pull
    shows only in initContainerStatuses."""
    missing = {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}
    worker = pod_summary(
        ray_pod(
            "worker",
            phase="Pending",
            initContainerStatuses=[{"name": "wait-gcs-ready", "state": {"waiting": missing}}],
            containerStatuses=[{"name": "ray-worker", "state": {"waiting": {"reason": "PodInitializing"}}}],
        )
    )
    assert worker["problems"] == [
        (
            "CreateContainerConfigError",
            'pod r-worker-x, init container wait-gcs-ready: CreateContainerConfigError: secret "hf-token" '
            "not found",
        )
    ]


def test_pods_kuberay_cannot_create_are_named_and_fail_the_run_after_the_bound() -> None:
    """A service account that does not exist: the apiserver refuses the pods, and only KubeRay's
    ReplicaFailure says so. Before, the run waited in Provisioning ("waiting for KubeRay") for 900 s."""
    refused = {
        "type": "ReplicaFailure",
        "status": "True",
        "reason": "FailedCreateHeadPod",
        # KubeRay joins its errors one per line (errors.Join): its own reason, then the apiserver's refusal.
        "message": 'FailedCreateHeadPod\npods "r-head-x" is forbidden: error looking up service account '
        'team-a/trainer: serviceaccount "trainer" not found',
    }
    cluster = observe_cluster({"status": {"conditions": [refused]}})
    provisioning = status(
        api.Phase.PROVISIONING, attempt=0, job_submission_id=None, phase_transition_time=NOW
    )
    first = reconcile(spec(), provisioning, observe(cluster=cluster))
    shown = conditions.condition(first.status.conditions, conditions.PODS_HEALTHY)
    assert shown is not None and shown.status == "False" and shown.reason == "FailedCreateHeadPod"
    assert 'serviceaccount "trainer" not found' in shown.message
    message = first.status.message or ""
    assert 'serviceaccount "trainer" not found' in message and "\n" not in message  # one line for kubectl get
    assert "FailedCreateHeadPod: pods" in shown.message  # the reason said once
    failed = reconcile(spec(), first.status, observe(301, cluster=cluster))
    assert failed.status.phase == api.Phase.FAILED and failed.delete_cluster
    deleting = dict(refused, reason="FailedDeleteWorkerPod", message="pods r-worker-x not found")
    healthy = reconcile(
        spec(), provisioning, observe(cluster=observe_cluster({"status": {"conditions": [deleting]}}))
    )
    found = conditions.condition(healthy.status.conditions, conditions.PODS_HEALTHY)
    assert found is not None and found.status == "True"  # a failed deletion is not a pod that cannot start


def test_a_pod_an_autoscaler_adds_a_node_for_is_shown_waiting_for_it() -> None:
    provisioning = status(
        api.Phase.PROVISIONING, attempt=0, job_submission_id=None, phase_transition_time=NOW
    )
    waiting = observe_cluster({"status": {"conditions": [{"type": "HeadPodReady", "status": "True"}]}})
    added = "TriggeredScaleUp: pod triggered scale-up: [{eks-p5 0->1 (max: 2)}]"
    seen = observe(cluster=waiting, unschedulable=(f"pod w: {NO_NODE}; {added}",), scale_up=added)
    decision = reconcile(spec(), provisioning, seen)
    shown = conditions.condition(decision.status.conditions, conditions.PODS_SCHEDULED)
    assert shown is not None and (shown.status, shown.reason) == ("False", "WaitingForScaleUp")
    assert "triggered scale-up" in shown.message and decision.status.phase == api.Phase.PROVISIONING


def test_pods_of_a_new_cluster_that_pulled_different_images_are_recreated_on_one_digest() -> None:
    """A republished tag, cached differently on two nodes: before any job runs, the RayCluster is deleted
    and created again on the digest most pods run, pinned for every later attempt."""
    old, new = "dlc@sha256:" + "1" * 64, "dlc@sha256:" + "2" * 64
    provisioning = status(
        api.Phase.PROVISIONING, attempt=0, job_submission_id=None, phase_transition_time=NOW
    )
    decision = reconcile(spec(), provisioning, observe(pod_image_ids=(new, new, old)))
    assert decision.delete_cluster and decision.submit_attempt is None
    assert decision.status.image.digest == new and decision.status.phase == api.Phase.PROVISIONING
    shown = conditions.condition(decision.status.conditions, conditions.IMAGE_CONSISTENT)
    assert shown is not None and (shown.status, shown.reason) == ("False", "Recreating")
    gone = reconcile(spec(), decision.status, observe(cluster=None))
    assert gone.create_cluster  # on the pinned digest: the glue builds the cluster from status.image.digest
    agreeing = reconcile(spec(), provisioning, observe(pod_image_ids=(new, new, new)))
    assert agreeing.submit_attempt == 1 and agreeing.status.image.digest == new


def test_one_image_reported_by_its_registry_digest_and_by_its_bare_id_is_one_image() -> None:
    """A node's runtime reports an image by its registry digest, or by its bare config digest before it has
    recorded one (seen on the real node: a cluster recreated for ever, the bare ID pinned, pods then reporting
    a third form). Only registry digests are compared, and the one pinned is pullable."""
    digest, bare = "localhost/dlc@sha256:" + "c" * 64, "sha256:" + "1" * 64
    provisioning = status(
        api.Phase.PROVISIONING, attempt=0, job_submission_id=None, phase_transition_time=NOW
    )
    decision = reconcile(spec(), provisioning, observe(pod_image_ids=(digest, bare, bare)))
    assert not decision.delete_cluster and decision.submit_attempt == 1
    assert decision.status.image.digest == digest and decision.status.image.consistent is True
    only_bare = reconcile(spec(), provisioning, observe(pod_image_ids=(bare, bare)))
    assert only_bare.submit_attempt == 1 and only_bare.status.image.digest == bare


def test_a_tag_is_pulled_from_the_registry_by_every_node_and_a_digest_only_where_missing() -> None:
    """A node holding an older copy of a republished tag would otherwise run it (IfNotPresent, the
    default for any tag but latest): one cluster, two NCCL builds."""

    def pull_policies(image: str, platform: builder.Platform | None = None) -> set[str]:
        spec = api.FSDPTrainingRunSpec.model_validate(
            {"model": {"source": "m"}, "checkpoint": {"storagePath": "s3://b/p"}}
        )
        manifest = builder.build_raycluster(spec, RUN, image, zone="us-west-2a", platform=platform)
        groups = [manifest["spec"]["headGroupSpec"], *manifest["spec"]["workerGroupSpecs"]]
        return {c["imagePullPolicy"] for g in groups for c in g["template"]["spec"]["containers"]}

    assert pull_policies(settings.DEFAULT_IMAGE) == {"Always"}
    assert pull_policies(f"{settings.DEFAULT_IMAGE.split(':')[0]}@sha256:{'0' * 64}") == {"IfNotPresent"}
    no_registry = builder.pod_platform(settings.Settings(ray_image_pull_policy="IfNotPresent"))
    assert pull_policies(settings.DEFAULT_IMAGE, no_registry) == {"IfNotPresent"}
