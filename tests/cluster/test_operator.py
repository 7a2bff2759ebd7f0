"""The operator on the local cluster: preflight, a RayCluster on fake GPU nodes, ClusterReady, idempotency."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from fsdp_operator import tenancy
from tests.support.kube import apply, grant, kubectl, kubectl_json
from tests.support.manifests import example
from tests.support.operator_process import OperatorProcess
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until


def false_condition(namespace: str, run: str, type_: str) -> dict[str, Any] | None:
    """The run's condition of that type when it is False (for wait_until)."""
    found = conditions_of(run_of(namespace, run)).get(type_)
    return found if found and found["status"] == "False" else None


def test_example_run_reaches_cluster_ready_on_gpu_nodes_in_one_zone(
    namespace: str, operator: OperatorProcess
) -> None:
    apply(namespace, example("aws-sample"))
    run = wait_for_phase(namespace, "qwen25-sample", "ClusterReady")

    conditions = conditions_of(run)
    assert (
        conditions["Preflight"]["status"] == "True"
        and conditions["Preflight"]["reason"] == "CapacityAvailable"
    )
    assert conditions["ClusterReady"]["status"] == "True"
    assert all(c["observedGeneration"] == run["metadata"]["generation"] for c in conditions.values())
    assert run["status"]["observedGeneration"] == run["metadata"]["generation"]

    [cluster] = rayclusters(namespace)
    assert run["status"]["rayClusterName"] == cluster["metadata"]["name"]
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]
    assert worker["nvidia.com/gpu"] == "4" and worker["vpc.amazonaws.com/efa"] == "1"

    pods = kubectl_json("get", "pods", "-n", namespace, "-l", "ray.io/node-type=worker")["items"]
    nodes = {p["spec"]["nodeName"]: kubectl_json("get", "node", p["spec"]["nodeName"]) for p in pods}
    zones = {n["metadata"]["labels"]["topology.kubernetes.io/zone"] for n in nodes.values()}
    assert len(pods) == 2 and len(zones) == 1 and zones == {run["status"]["zone"]}
    assert all(
        n["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "g6.12xlarge" for n in nodes.values()
    )

    events = kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", "involvedObject.name=qwen25-sample"
    )
    ours = [e for e in events["items"] if e["involvedObject"]["kind"] == "FSDPTrainingRun"]
    reasons = [e["reason"] for e in ours]
    messages = {e["reason"]: e["message"] for e in ours}
    # One Event per pass: the preflight's placement with the creation, the readiness with the submission.
    assert messages["ClusterCreated"].startswith("preflight passed ("), messages
    assert messages["JobSubmitted"].startswith("RayCluster is ready; attempt 1 submitted"), messages
    assert len(reasons) == len(set(reasons)), f"a transition was announced twice: {reasons}"

    # The run's NetworkPolicy deleted while its cluster runs is created again at once, with a Warning.
    policy = kubectl_json("get", "networkpolicy", cluster["metadata"]["name"], "-n", namespace)
    kubectl("delete", "networkpolicy", policy["metadata"]["name"], "-n", namespace)

    def restored() -> dict[str, Any] | None:
        found = kubectl(
            "get", "networkpolicy", policy["metadata"]["name"], "-n", namespace, "-o", "json", check=False
        )
        again = json.loads(found.stdout) if found.returncode == 0 else None
        return again if again and again["metadata"]["uid"] != policy["metadata"]["uid"] else None

    again = wait_until("the deleted NetworkPolicy to be created again", restored, timeout=30)
    assert again["spec"] == policy["spec"]
    warnings = kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", "reason=NetworkPolicyRestored"
    )["items"]
    assert [e["involvedObject"]["name"] for e in warnings] == ["qwen25-sample"], warnings


def test_run_asking_for_more_gpus_than_exist_gets_preflight_false_and_no_cluster(
    namespace: str, operator: OperatorProcess
) -> None:
    apply(namespace, example("aws-sample", **{"cluster.workers": 5, "preflight.recheckSeconds": 5}))

    condition = wait_until(
        "Preflight=False", lambda: false_condition(namespace, "qwen25-sample", "Preflight"), timeout=60
    )
    assert condition["reason"] == "InsufficientCapacity"
    assert "5 x (4 GPU, 1 EFA)" in condition["message"]
    run = run_of(namespace, "qwen25-sample")
    assert run["status"]["phase"] == "Pending" and rayclusters(namespace) == []


def test_a_worker_the_scheduler_cannot_place_is_named_in_the_status_and_the_daily_view(
    namespace: str, operator: OperatorProcess
) -> None:
    """Preflight subtracts what pods holding GPUs or EFA request; another team's CPU pods on the GPU nodes it
    does not see. The real scheduler refuses the workers: its message reaches PodsScheduled, the run's
    message and `kubectl get trainingruns` while the run provisions; after provisioningAttempts RayClusters
    that each timed out the run fails with that message instead of going back to Pending for ever."""
    gpu_nodes = kubectl_json("get", "nodes", "-l", "node.kubernetes.io/instance-type=g6.12xlarge")["items"]
    hogs = [f"cpu-hog-{node['metadata']['name']}" for node in gpu_nodes]
    for hog, node in zip(hogs, gpu_nodes, strict=True):
        container = {"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "40"}}}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": hog}}
        apply(namespace, {**pod, "spec": {"nodeName": node["metadata"]["name"], "containers": [container]}})
    try:
        bounded = {
            "recovery.provisioningTimeoutSeconds": 60,
            "recovery.provisioningAttempts": 2,
            "preflight.recheckSeconds": 5,
        }
        apply(namespace, example("aws-sample", **bounded))
        started = time.monotonic()

        shown = wait_until(
            "PodsScheduled=False with the scheduler's message",
            lambda: false_condition(namespace, "qwen25-sample", "PodsScheduled"),
            timeout=60,
        )
        print(f"the unschedulable worker named in the status {time.monotonic() - started:.1f}s after apply")
        assert "Insufficient cpu" in shown["message"], shown
        run = run_of(namespace, "qwen25-sample")
        assert run["status"]["phase"] == "Provisioning"
        assert "Insufficient cpu" in run["status"]["message"]
        assert "Insufficient cpu" in kubectl("get", "trainingruns", "-n", namespace).stdout
        failed = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=240)
        print(f"Failed after two provisioning timeouts {time.monotonic() - started:.1f}s after apply")
        reason = conditions_of(failed)["Failed"]
        assert reason["reason"] == "ProvisioningTimeout" and "Insufficient cpu" in reason["message"], reason
        assert failed["status"]["provisioningTimeouts"] == 2
    finally:
        kubectl("delete", "pod", "-n", namespace, "--wait", *hogs)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        (
            "cluster.ephemeralStorage",
            "600Gi",
            "600Gi ephemeral-storage per worker, at most 500Gi ephemeral-storage on a node",
        ),
        ("cluster.cpu", "64", "64 CPU per worker, at most 48 CPU on a node"),
        ("cluster.memory", "300Gi", "300Gi memory per worker, at most 192Gi memory on a node"),
    ],
)
def test_a_worker_larger_than_every_node_fails_at_once_naming_the_resource(
    namespace: str, operator: OperatorProcess, field: str, value: str, named: str
) -> None:
    """Nodes a group adds have the shape of the nodes it has: a worker no empty node can take would wait
    for ever under the default Wait policy. It fails at once, saying what to change; nothing is created."""
    apply(namespace, example("aws-sample", **{field: value}))
    started = time.monotonic()
    run = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=60)
    print(f"{field}={value}: Failed {time.monotonic() - started:.1f}s after apply")
    failed = conditions_of(run)["Failed"]
    assert failed["reason"] == "WorkerFitsNoNode" and named in failed["message"], failed
    assert f"lower spec.{field}" in failed["message"]
    assert rayclusters(namespace) == []


def test_an_elastic_range_with_a_size_that_cannot_train_fails_at_once_naming_the_fields(
    namespace: str, operator: OperatorProcess
) -> None:
    """minWorkers 1 of 2 workers of 4 GPUs: Ray Train may start on 4 to 8 processes, and a global batch of 24
    cannot be split among 5 or 7. Refused before any GPU is held, not at the resize that reaches such a size
    (the trainer would end the run there with a permanent error)."""
    apply(namespace, example("aws-sample", **{"cluster.minWorkers": 1, "training.globalBatchSize": 24}))
    run = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=60)
    failed = conditions_of(run)["Failed"]
    assert failed["reason"] == "InvalidSpec", failed
    assert failed["message"].startswith("spec: cluster.minWorkers 1: the run may train on 4 to 8 processes")
    assert "5 (training.globalBatchSize 24 is not divisible" in failed["message"], failed
    assert rayclusters(namespace) == []


def test_a_run_on_a_node_group_left_at_eks_default_disk_fails_saying_what_to_change(
    namespace: str, operator: OperatorProcess
) -> None:
    """us-west-2d's g6.12xlarge group has EKS's default 20 GiB root volume (17Gi for pods): Qwen2.5-1.5B's
    default worker disk (its download, a resumed checkpoint and Ray's files) does not fit there."""
    apply(namespace, example("aws-sample", **{"cluster.zone": "us-west-2d"}))
    started = time.monotonic()
    run = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=60)
    print(f"default disk on a 20 GiB node group: Failed {time.monotonic() - started:.1f}s after apply")
    message = conditions_of(run)["Failed"]["message"]
    assert "no g6.12xlarge node in us-west-2d can take one worker" in message, message
    assert "at most 17Gi ephemeral-storage on a node" in message and "diskSize is 20 GiB" in message, message
    assert "spec.cluster.ephemeralStorage" in message and "instance store" in message, message
    assert rayclusters(namespace) == []


def test_pods_kuberay_cannot_create_are_named_and_fail_the_run_within_the_bound(
    namespace: str, operator: OperatorProcess
) -> None:
    """A service account that does not exist: the apiserver refuses every pod, which only KubeRay's
    ReplicaFailure tells. The run says so at once and fails after podErrorTimeoutSeconds, not after a
    provisioning timeout and a return to Pending."""
    # The platform granted the namespace's runs an account that nobody has created yet.
    grant(namespace, tenancy.SERVICE_ACCOUNTS, "no-such-account")
    changes = {"cluster.serviceAccountName": "no-such-account", "recovery.podErrorTimeoutSeconds": 20}
    apply(namespace, example("aws-sample", **changes))
    started = time.monotonic()

    shown = wait_until(
        "PodsHealthy=False naming the missing service account",
        lambda: false_condition(namespace, "qwen25-sample", "PodsHealthy"),
        timeout=60,
    )
    print(f"the refused pods named in the status {time.monotonic() - started:.1f}s after apply")
    assert shown["reason"].startswith("FailedCreate") and "no-such-account" in shown["message"], shown
    assert "no-such-account" in kubectl("get", "trainingruns", "-n", namespace).stdout
    run = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=90)
    assert conditions_of(run)["Failed"]["reason"].startswith("FailedCreate")
    wait_until("the RayCluster to be deleted", lambda: rayclusters(namespace) == [], timeout=60)


EFA_DEVICE_CLASS = "efa.networking.k8s.aws"  # what AWS's EFA DRA driver (aws-dranet) installs


def efa_dra_objects(gpu_nodes: list[str]) -> list[dict[str, Any]]:
    """The EFA DRA driver's DeviceClass and, per GPU node, a ResourceSlice of one EFA device as DRANET
    publishes it (driver dra.net, attribute pciDevice); the nodes advertise no vpc.amazonaws.com/efa then."""
    efa_device = 'device.attributes["dra.net"].pciDevice == "Elastic Fabric Adapter (EFA)"'
    selector = f'device.driver == "dra.net" && {efa_device}'
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": EFA_DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": selector}}]},
    }
    efa = {"dra.net/pciDevice": {"string": "Elastic Fabric Adapter (EFA)"}, "dra.net/rdma": {"bool": True}}
    slices = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"efa-{node}"},
            "spec": {
                "driver": "dra.net",
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "pci-0000-10-1b-0", "attributes": efa}],
            },
        }
        for node in gpu_nodes
    ]
    return [device_class, *slices]


def test_workers_claim_efa_through_dra_where_nodes_expose_it_that_way(
    namespace: str, crd_installed: None, tmp_path: Any
) -> None:
    """With the operator's efa-device-class set, each worker claims its EFA interface from the DeviceClass
    through the run's ResourceClaimTemplate (no vpc.amazonaws.com/efa, which DRA nodes do not advertise): the
    real scheduler allocates a device of the worker's node to each, and the run reaches ClusterReady."""
    nodes = kubectl_json("get", "nodes", "-l", "node.kubernetes.io/instance-type=g6.12xlarge")["items"]
    objects = efa_dra_objects([n["metadata"]["name"] for n in nodes])
    kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    proc = OperatorProcess(
        namespace=namespace, env={"FSDP_OPERATOR_EFA_DEVICE_CLASS": EFA_DEVICE_CLASS}, log=tmp_path / "op.log"
    ).start()
    try:
        apply(namespace, example("aws-sample"))
        wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
        [cluster] = rayclusters(namespace)
        worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
        assert worker["resourceClaims"] == [
            {"name": "efa", "resourceClaimTemplateName": cluster["metadata"]["name"]}
        ]
        assert "vpc.amazonaws.com/efa" not in worker["containers"][0]["resources"]["limits"]
        pods = kubectl_json("get", "pods", "-n", namespace, "-l", "ray.io/node-type=worker")["items"]
        claims = {
            c["metadata"]["name"]: c for c in kubectl_json("get", "resourceclaims", "-n", namespace)["items"]
        }
        assert len(pods) == 2
        for pod in pods:
            [status] = pod["status"]["resourceClaimStatuses"]
            [allocated] = claims[status["resourceClaimName"]]["status"]["allocation"]["devices"]["results"]
            assert (allocated["driver"], allocated["pool"]) == ("dra.net", pod["spec"]["nodeName"]), allocated
    finally:
        proc.stop()
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        for obj in objects:
            kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found", check=False)
        print(f"--- operator log ({proc.log}) ---\n{proc.log.read_text()[-6000:]}")


def test_three_workers_fit_only_across_zones_and_fail_by_policy(
    namespace: str, operator: OperatorProcess
) -> None:
    apply(
        namespace, example("aws-sample", **{"cluster.workers": 3, "preflight.onInsufficientCapacity": "Fail"})
    )
    run = wait_for_phase(namespace, "qwen25-sample", "Failed")
    assert conditions_of(run)["Preflight"]["reason"] == "WouldSpanZones"
    assert rayclusters(namespace) == []


def test_deleting_the_run_deletes_its_raycluster(namespace: str, operator: OperatorProcess) -> None:
    apply(namespace, example("aws-sample"))
    wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
    kubectl("delete", "fsdptrainingrun", "qwen25-sample", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_until("the RayCluster to be garbage-collected", lambda: rayclusters(namespace) == [], timeout=60)


def test_operator_killed_mid_reconcile_creates_no_duplicate(
    namespace: str, operator: OperatorProcess
) -> None:
    apply(namespace, example("aws-sample"))
    # Kill -9 as soon as the RayCluster exists: the status write may or may not have happened.
    wait_until("the RayCluster to be created", lambda: rayclusters(namespace), timeout=60, interval=0.05)
    operator.kill()
    [first] = rayclusters(namespace)
    for _ in range(2):  # two restarts replay every event
        operator.start()
        run = wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
        operator.kill()
    clusters = rayclusters(namespace)
    assert [c["metadata"]["uid"] for c in clusters] == [first["metadata"]["uid"]]
    assert run["status"]["rayClusterName"] == first["metadata"]["name"]


def test_operator_never_writes_spec(namespace: str, crd_installed: None, tmp_path: Any) -> None:
    apply(namespace, example("aws-sample"))
    before = run_of(namespace, "qwen25-sample")
    proc = OperatorProcess(namespace=namespace, env={}, log=tmp_path / "operator.log").start()
    try:
        after = wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
    finally:
        proc.stop()
    assert after["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    managed = kubectl_json(
        "get", "fsdptrainingrun", "qwen25-sample", "-n", namespace, "--show-managed-fields"
    )
    spec_writers = {
        m["manager"]
        for m in managed["metadata"]["managedFields"]
        if m.get("subresource") != "status" and "f:spec" in m.get("fieldsV1", {})
    }
    assert spec_writers == {"kubectl-client-side-apply"}


def test_kubectl_get_trainingruns_shows_the_daily_view(namespace: str, operator: OperatorProcess) -> None:
    apply(namespace, example("aws-sample"))
    wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
    table = kubectl("get", "trainingruns", "-n", namespace).stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "PHASE",
        "STEP",
        "LOSS",
        "LAST",
        "CHECKPOINT",
        "RESTARTS",
        "AGE",
        "MESSAGE",
    ]
    assert table[1].split()[:2] == ["qwen25-sample", "ClusterReady"]
    wide = kubectl("get", "ftr", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert (
        wide[0].split()[-7:] == ["AGE", "IMAGE", "DIGEST", "RAY", "CLUSTER", "TRANSPORT"][-7:]
        or "RAY CLUSTER" in wide[0]
    )
    assert "IMAGE DIGEST" in wide[0] and "RAY CLUSTER" in wide[0] and "TRANSPORT" in wide[0]
    assert "qwen25-sample" in wide[1].split()


def test_an_image_that_never_pulls_fails_the_run_with_the_kubelets_reason(
    namespace: str, operator: OperatorProcess
) -> None:
    # KWOK's stage keeps pods whose image names `never-pulls` in ErrImagePull, then ImagePullBackOff.
    changes = {"image": "example.invalid/never-pulls:1", "recovery.podErrorTimeoutSeconds": 20}
    apply(namespace, example("aws-sample", **changes))

    shown = wait_until(
        "PodsHealthy=False", lambda: false_condition(namespace, "qwen25-sample", "PodsHealthy"), timeout=60
    )
    assert shown["reason"] in ("ErrImagePull", "ImagePullBackOff") and "never-pulls" in shown["message"]
    run = wait_for_phase(namespace, "qwen25-sample", "Failed", timeout=90)
    failed = conditions_of(run)["Failed"]
    assert failed["reason"] in ("ErrImagePull", "ImagePullBackOff"), failed
    assert conditions_of(run)["Finished"]["status"] == "True"
    wait_until("the RayCluster to be deleted", lambda: rayclusters(namespace) == [], timeout=60)


def test_suspend_and_resume_at_once_never_uses_the_terminating_cluster_and_pins_a_new_image(
    namespace: str, operator: OperatorProcess
) -> None:
    apply(namespace, example("aws-sample"))
    first = wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
    old_digest = wait_until(
        "the first image digest to be pinned",
        lambda: run_of(namespace, "qwen25-sample")["status"]["image"].get("digest"),
        timeout=30,
    )
    [old] = rayclusters(namespace)
    # A finalizer holds the old RayCluster in deletion for as long as the test wants.
    hold = '{"metadata":{"finalizers":["test.fsdp.training.dev/hold"]}}'
    kubectl("patch", "raycluster", old["metadata"]["name"], "-n", namespace, "--type=merge", "-p", hold)
    run_name = f"fsdptrainingrun/{first['metadata']['name']}"
    kubectl("patch", run_name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_for_phase(namespace, "qwen25-sample", "Suspended", timeout=60)
    new_image = "public.ecr.aws/deep-learning-containers/ray:2.58.0-gpu-py312-cu130-ubuntu22.04-ec2-v2"
    resume = json.dumps({"spec": {"suspend": False, "image": new_image}})
    kubectl("patch", run_name, "-n", namespace, "--type=merge", "-p", resume)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the old cluster is terminating: the run must wait, not use it
        status = run_of(namespace, "qwen25-sample")["status"]
        assert status["phase"] not in ("ClusterReady", "Running"), status
        assert [c["metadata"]["uid"] for c in rayclusters(namespace)] == [old["metadata"]["uid"]]
        time.sleep(1)
    kubectl(
        "patch",
        "raycluster",
        old["metadata"]["name"],
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
    )

    def on_a_new_cluster() -> dict[str, Any] | None:
        run = run_of(namespace, "qwen25-sample")
        clusters = rayclusters(namespace)
        fresh = [c for c in clusters if c["metadata"]["uid"] != old["metadata"]["uid"]]
        ready = run["status"].get("phase") == "ClusterReady" and run["status"]["image"].get("digest")
        return run if fresh and len(clusters) == 1 and ready else None

    run = wait_until("the run on a new RayCluster with the new image", on_a_new_cluster, timeout=90)
    [new] = rayclusters(namespace)
    worker = new["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["image"] == new_image  # the old pin was dropped
    digest = run["status"]["image"]["digest"]
    assert digest != old_digest and digest.startswith(new_image.rsplit(":", 1)[0] + "@sha256:")
    assert run["status"]["image"]["requested"] == new_image


@pytest.mark.parametrize("point", ["after-status-write:0", "after-create-cluster:0"])
def test_operator_killed_before_or_after_creating_the_cluster_creates_one(
    namespace: str, crd_installed: None, tmp_path: Any, point: str
) -> None:
    log = tmp_path / "operator.log"
    proc = OperatorProcess(namespace, {"FSDP_OPERATOR_FAULT_POINT": point}, log).start()
    try:
        apply(namespace, example("aws-sample"))
        assert proc.process is not None
        assert proc.process.wait(timeout=90) == -signal.SIGKILL, (
            f"no SIGKILL at {point}: {log.read_text()[-2000:]}"
        )
        created = [c["metadata"]["uid"] for c in rayclusters(namespace)]
        assert len(created) == (1 if point.startswith("after-create") else 0)
        proc = OperatorProcess(namespace, {}, log).start()
        run = wait_for_phase(namespace, "qwen25-sample", "ClusterReady")
    finally:
        proc.stop()  # whichever runs now: a failed wait must not leave an operator behind
    [cluster] = rayclusters(namespace)
    assert created in ([], [cluster["metadata"]["uid"]])
    assert run["status"]["attempt"] == 1  # recorded once, whatever Ray says of it


def test_cluster_wide_operator_admits_runs_for_one_zone_one_at_a_time(
    namespace: str, crd_installed: None, tmp_path: Any
) -> None:
    # Cluster-wide, preflight reads nodes and GPU pods from the operator's watches (kopf indexes).
    proc = OperatorProcess("", {}, tmp_path / "operator.log").start()
    try:
        zone_a = {"cluster.zone": "us-west-2a", "preflight.recheckSeconds": 5}
        first, second = example("aws-sample", **zone_a), example("aws-sample", **zone_a)
        first["metadata"]["name"], second["metadata"]["name"] = "first", "second"
        apply(namespace, first)
        wait_until(
            "first to be admitted", lambda: run_of(namespace, "first").get("status", {}).get("zone"), 60
        )
        apply(namespace, second)
        wait_for_phase(namespace, "first", "ClusterReady")

        def second_waits() -> dict[str, Any] | None:
            found = conditions_of(run_of(namespace, "second")).get("Preflight")
            return found if found and found["status"] == "False" else None

        waiting = wait_until("the second run to wait for the zone", second_waits, timeout=60)
        assert waiting["reason"] in ("InsufficientCapacity", "WaitingForEarlierRun"), waiting
        time.sleep(10)  # re-checked twice meanwhile: still waiting, still one cluster
        assert run_of(namespace, "second")["status"]["phase"] == "Pending"
        assert [c["metadata"]["name"] for c in rayclusters(namespace)] == ["first"]
        kubectl("delete", "fsdptrainingrun", "first", "-n", namespace, "--timeout=60s")
        wait_for_phase(namespace, "second", "ClusterReady", timeout=90)
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=60s", check=False)
        proc.stop()
        print(f"--- operator log ---\n{proc.log.read_text()[-4000:]}")
