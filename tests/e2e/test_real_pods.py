"""Real pods: the RayCluster the operator builds, started by KubeRay on the local cluster's real node (a real
kubelet, containerd and runc), in the DLC stand-in image, reached the way production reaches it.

The operator runs out of cluster in service-proxy mode with nothing but the chart's RBAC (a ServiceAccount
token), so every call to a run's Ray head goes through the apiserver's service proxy to the head pod, past
the run's NetworkPolicy (kube-router) and its Ray token; Ray Train's two workers train in the two worker
pods, over the pod network. Faults are real too: containers killed through containerd, a head no node takes.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fsdp_trainer.contract import PROGRESS_FILE, ProgressRecord
from kubectl_trainingrun.cli import RunObjects, metric_histories
from tests.support.chart import CHART
from tests.support.demo import BUCKET, CHAT_CORPUS
from tests.support.gitops import assert_in_sync
from tests.support.image import operator_image
from tests.support.kube import kubectl, kubectl_json
from tests.support.local_cluster import LocalCluster
from tests.support.manifests import CHATML
from tests.support.operator_process import TEST_S3_PREFIXES, OperatorProcess
from tests.support.paths import REPO, cluster_settings
from tests.support.probe_pod import TOLERATE_REAL_NODE, run_probe
from tests.support.real_node import CONTAINERS_CONF, OPERATOR_NAMESPACE, RUN_TIMEOUT, RealNode, real_pods_run
from tests.support.reliability import Recorder, seconds_between
from tests.support.runs import conditions_of, rayclusters, run_of, wait_for_phase
from tests.support.waiting import wait_until


def pods_of(namespace: str, run: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"fsdp.training.dev/run={run}"
    )["items"]
    return found


def ray_container(pod: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in pod["status"]["containerStatuses"] if s["name"] in ("ray-head", "ray-worker"))


def node_type(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"]["ray.io/node-type"])


def ray_list(namespace: str, head: str, what: str) -> list[dict[str, Any]]:
    """`ray list` inside the head pod (its Ray token is in the container's environment)."""
    out = kubectl(
        "exec",
        "-n",
        namespace,
        head,
        "-c",
        "ray-head",
        "--",
        "ray",
        "list",
        what,
        "--format",
        "json",
        "--limit",
        "1000",
    ).stdout
    listed: list[dict[str, Any]] = json.loads(out)
    return listed


def kill_container(node: RealNode, pod: dict[str, Any]) -> None:
    """SIGKILL a pod's Ray container through the node's containerd, as a crash would."""
    container_id = ray_container(pod)["containerID"].removeprefix("containerd://")
    subprocess.run(
        [
            "ctr",
            "--address",
            node.containerd_socket,
            "--namespace",
            "k8s.io",
            "tasks",
            "kill",
            "--signal",
            "SIGKILL",
            container_id,
        ],
        check=True,
        capture_output=True,
    )


def step_of(namespace: str, run: str) -> int:
    return int((run_of(namespace, run).get("status", {}).get("progress") or {}).get("step") or 0)


# Three starts of Ray in pods (the run's, the killed head's, the run's restart) on the node's 2 CPUs: more
# than the suite's per-test bound.
@pytest.mark.timeout(1500)
def test_the_demo_run_trains_on_real_pods_through_the_service_proxy_and_survives_killed_containers(
    namespace: str, proxied_operator: OperatorProcess, real_node: RealNode, s3: Any, reliability: Recorder
) -> None:
    """One run for the whole real-pod path (each RayCluster start costs minutes of the node's 2 CPUs): a
    worker container killed (the kubelet starts it again; the job goes on and the run is not restarted), then
    the head's (the kubelet starts a Ray head that never heard of the job: the operator sees the job lost and
    restarts the run from the latest checkpoint), then where its pods and Ray Train's workers ran."""
    every = 10
    # Steps enough that the run still trains when both kills have been seen (80 were not).
    steps = {"training.maxSteps": 160, "checkpoint.everySteps": every}
    manifest = real_pods_run(namespace, cleanupPolicy="KeepCluster", **steps)
    run = manifest["metadata"]["name"]
    wait_until(
        "the run past its second checkpoint",
        lambda: step_of(namespace, run) >= 2 * every + 2,
        timeout=RUN_TIMEOUT,
    )
    pods = pods_of(namespace, run)
    [head] = [p for p in pods if node_type(p) == "head"]
    worker = next(p for p in pods if node_type(p) == "worker")
    kill_container(real_node, worker)
    killed_at = step_of(namespace, run)
    wait_until(
        "training to go on after the worker's kill (the kubelet restarts the container)",
        lambda: step_of(namespace, run) > killed_at + every,
        timeout=RUN_TIMEOUT,
    )
    # The same job goes on (attempt 1, no restart of the run, the trainer's record from that submission) while
    # the kubelet starts the killed container again.
    status = run_of(namespace, run)["status"]
    assert status["attempt"] == 1 and status["restarts"]["count"] == 0, status
    record = ProgressRecord.model_validate_json(
        s3.get_object(Bucket=BUCKET, Key=f"runs/{namespace}/{run}/{PROGRESS_FILE}")["Body"].read()
    )
    assert record.submission_id == status["jobSubmissionId"] and record.step > killed_at, record
    # The kubelet reports the restart on its own schedule (PLEG), which a fast job's ten steps can beat.
    wait_until(
        "the kubelet to report the killed worker container restarted",
        lambda: any(
            ray_container(p).get("restartCount", 0) >= 1
            for p in pods_of(namespace, run)
            if p["metadata"]["uid"] == worker["metadata"]["uid"]
        ),
        timeout=180,
    )
    phase = run_of(namespace, run)["status"]["phase"]
    assert phase == "Running", f"the run is {phase} before its head's kill: it needs more steps"
    step_at_head_kill = step_of(namespace, run)  # the status's: at most what the trainer had reached
    head_killed = dt.datetime.now(dt.UTC)
    kill_container(real_node, head)
    wait_until(
        "the head's crash seen (ClusterReady False or a restart)",
        lambda: (
            (r := run_of(namespace, run))
            and (
                conditions_of(r).get("ClusterReady", {}).get("status") == "False"
                or r["status"]["restarts"]["count"]
            )
            and r
        ),
        timeout=300,
        interval=0.5,
    )
    finished = wait_for_phase(namespace, run, "Succeeded", timeout=RUN_TIMEOUT)
    assert finished["status"]["checkpoints"]["latest"]["step"] == 160
    # The restarted attempt's fabric check, with its figures: two pods, both ways between them.
    verified = conditions_of(finished)["FabricVerified"]
    assert verified["status"] == "True" and "bus bandwidth" in verified["message"], verified
    fabric = finished["status"]["fabric"]
    assert fabric["attempt"] == 2 and fabric["report"]["busBandwidthGbps"] > 0, fabric
    assert len(fabric["report"]["links"]) == 2 and fabric["report"]["sweep"], fabric
    restarts = finished["status"]["restarts"]
    assert restarts["count"] == 1, restarts
    [entry] = restarts["history"]
    assert entry["reason"] == "JobLost" and "Ray no longer knows job" in entry["message"], entry
    assert entry["resumedFromStep"] % every == 0 and entry["resumedFromStep"] >= 2 * every, entry
    # Where the second attempt's trainer resumed (its own record), which is what sets the steps redone: at
    # most one checkpoint interval lost, plus the one a save in flight at the kill did not finish.
    resumed = ProgressRecord.model_validate_json(
        s3.get_object(Bucket=BUCKET, Key=f"runs/{namespace}/{run}/{PROGRESS_FILE}")["Body"].read()
    ).resumed_from_step
    assert resumed is not None and resumed >= entry["resumedFromStep"], (resumed, entry)
    redone = step_at_head_kill - resumed
    assert redone <= 2 * every, f"killed at step {step_at_head_kill} or later, resumed from {resumed}"
    reliability.record(
        "The head pod's Ray container killed through containerd while a run trains on real pods (a worker's "
        "killed before); the kubelet starts it again",
        f"JobLost (the new head never heard of the job), resumed; at most {2 * every} steps redone",
        f"JobLost {seconds_between(head_killed, entry['time']):.0f} s after the kill; killed at step "
        f"{step_at_head_kill} or later, resumed from step {resumed}",
    )
    # Where it ran (checked at the end: `ray list` in a loaded head can take a minute, which the kills must
    # not wait for): the three pods on the real node, Ray Train's workers in the worker pods, one in each.
    pods = pods_of(namespace, run)
    assert sorted(node_type(p) for p in pods) == ["head", "worker", "worker"], [
        p["metadata"]["name"] for p in pods
    ]
    for pod in pods:
        assert pod["spec"]["nodeName"] == real_node.name, (
            f"{pod['metadata']['name']} ran on {pod['spec']['nodeName']}"
        )
        assert ray_container(pod)["containerID"].startswith("containerd://")
    [head_name] = [p["metadata"]["name"] for p in pods if node_type(p) == "head"]
    node_ips = {n["node_id"]: n["node_ip"] for n in ray_list(namespace, head_name, "nodes")}
    actors = ray_list(namespace, head_name, "actors")
    workers = [a for a in actors if "RayTrainWorker" in a.get("class_name", "") and a.get("node_id")]
    worker_ips = {node_ips[a["node_id"]] for a in workers}
    assert worker_ips == {p["status"]["podIP"] for p in pods if node_type(p) == "worker"}, workers
    # The digest in the status is the one containerd reports for the image every container ran.
    image_ids = {ray_container(p)["imageID"] for p in pods}
    assert len(image_ids) == 1, image_ids
    assert finished["status"]["image"]["digest"] == image_ids.pop()
    # KubeRay's command went through the image's entrypoint (the DLC's CUDA compatibility step) before
    # `ray start`, in the containers running now: the restarted ones too.
    for pod in pods:
        container = ray_container(pod)["name"]
        logs = kubectl("logs", pod["metadata"]["name"], "-n", namespace, "-c", container).stdout
        # Before Ray's first line (after the shell's word on the node's open-files limit, where it has one).
        first = [line for line in logs.splitlines()[:3] if not line.startswith("/bin/bash: ")]
        assert first and first[0].startswith("dlc-entrypoint: "), f"{pod['metadata']['name']}: {logs[:300]}"
    assert_in_sync(namespace, manifest)


def set_node_gpus(node: RealNode, gpus: int, efa: int = 2) -> None:
    """The real node's fake GPU and EFA capacity, as device plugins would report it, once allocatable shows
    it (2 EFA interfaces: the local cluster's, one per demo worker)."""
    wanted = {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa)}
    patch = {"status": {"capacity": wanted}}
    kubectl("patch", "node", node.name, "--subresource", "status", "--type", "merge", "-p", json.dumps(patch))
    wait_until(
        f"the real node's allocatable at {wanted}",
        lambda: all(
            kubectl_json("get", "node", node.name)["status"]["allocatable"].get(resource) == amount
            for resource, amount in wanted.items()
        ),
        timeout=60,
    )


def world_size_of(namespace: str, run: str) -> int | None:
    return (run_of(namespace, run).get("status", {}).get("progress") or {}).get("worldSize")


def training_records(s3: Any, namespace: str, run: str) -> list[ProgressRecord]:
    """Every training record of the run's metric histories (read as `kubectl trainingrun plot` reads them),
    oldest first (a step redone after a resize is there twice)."""
    histories = metric_histories(RunObjects(s3, f"s3://{BUCKET}/runs/{namespace}/{run}"))
    found = [record for history in histories for record in history if record.phase == "training"]
    return sorted(found, key=lambda record: record.updated_at)


@pytest.mark.timeout(1500)
def test_an_elastic_run_trains_on_the_worker_left_when_a_node_is_lost_and_grows_back_when_it_returns(
    namespace: str, proxied_operator: OperatorProcess, real_node: RealNode, s3: Any, reliability: Recorder
) -> None:
    """cluster.minWorkers 1 of 2: a worker pod lost while the node has GPUs for one worker only (as a spot
    reclaim of a node whose group cannot grow) leaves its replacement Pending; Ray Train goes on with one
    worker, from the checkpoint the trainer took at the drain notice, with the same global batch. The GPUs
    back, the replacement starts and Ray Train grows back to two. No restart of the run is spent; the history
    says at which size it ran."""
    every = 20
    manifest = real_pods_run(
        namespace,
        **{
            "cluster.minWorkers": 1,
            # More steps than the test waits for (this tiny model takes about 0.4 s a step here): it ends
            # once the run has trained past a checkpoint on two workers again.
            "training.maxSteps": 5000,
            "training.globalBatchSize": 8,  # two workers x microBatchSize 4; one worker accumulates two
            "checkpoint.everySteps": every,
            "recovery.inJobMaxFailures": 2,
        },
    )
    run = manifest["metadata"]["name"]
    try:
        wait_until(
            "the run past its first checkpoint on two workers",
            lambda: step_of(namespace, run) >= every + 2 and world_size_of(namespace, run) == 2,
            timeout=RUN_TIMEOUT,
        )
        set_node_gpus(real_node, 4)  # one worker's: the one still running holds them
        lost = next(p for p in pods_of(namespace, run) if node_type(p) == "worker")
        lost_at = dt.datetime.now(dt.UTC)
        kubectl("delete", "pod", "-n", namespace, lost["metadata"]["name"], "--wait=false")
        wait_until("training on one worker", lambda: world_size_of(namespace, run) == 1, timeout=600)
        shrunk_at = step_of(namespace, run)
        wait_until("steps on one worker", lambda: step_of(namespace, run) >= shrunk_at + 4, timeout=300)
        pending = [
            p
            for p in pods_of(namespace, run)
            if node_type(p) == "worker" and p["status"].get("phase") == "Pending"
        ]
        assert pending, "the lost worker's replacement should wait for GPUs"
        set_node_gpus(real_node, 8)
        wait_until("training on two workers again", lambda: world_size_of(namespace, run) == 2, timeout=600)
        grown_at = step_of(namespace, run)
        wait_until(
            "a checkpoint on two workers again",
            lambda: (
                (run_of(namespace, run)["status"].get("checkpoints", {}).get("latest") or {}).get("step", 0)
                >= grown_at + every
            ),
            timeout=600,
        )
    finally:
        set_node_gpus(real_node, 8)
    status = run_of(namespace, run)["status"]
    assert status["phase"] == "Running", status["phase"]
    assert status["restarts"]["count"] == 0 and status["attempt"] == 1, status["restarts"]
    resizes = [e for e in status["restarts"]["history"] if e["reason"] == "Resized"]
    assert [e["worldSize"] for e in resizes] == [2, 1], resizes
    # The pod's deletion is a drain (Ray 2.58's `ray start` drains its node on SIGTERM, reason PREEMPTION):
    # the trainer takes the notice at the next step boundary, checkpoints there and holds (issue 49), so the
    # shrink resumes from that step, not from the last periodic checkpoint: no step trained on two workers is
    # trained again (read from the metric history, not from the operator's record).
    history = training_records(s3, namespace, run)
    drained = {record.drain_checkpoint_step for record in history} - {None}
    assert len(drained) == 1, f"drain checkpoints in the history: {sorted(drained)}"
    [drain_step] = drained
    shrunk = min(record.updated_at for record in history if record.world_size == 1)
    last_on_two = max(
        record.step for record in history if record.world_size == 2 and record.updated_at < shrunk
    )
    assert resizes[0]["resumedFromStep"] == drain_step >= last_on_two, (drain_step, last_on_two, resizes)
    # Growing back is Ray Train's restart of the group on the newest complete checkpoint.
    assert resizes[1]["resumedFromStep"] % every == 0 or resizes[1]["resumedFromStep"] == drain_step
    # The loss curve goes on across both resizes: the same samples a step at either size, resumed from the
    # checkpoint (the trainer's own test shows a resume on one process equal to two within 1e-4); here only
    # that no resize jumps: the first loss after each within 25 % of the last before it.
    losses: dict[int, list[float]] = {}
    for record in history:
        if record.loss is not None:
            losses.setdefault(record.step, []).append(record.loss)
    for entry in resizes:
        resumed = entry["resumedFromStep"]
        after = min(step for step in losses if step > resumed)
        before = max(step for step in losses if step <= resumed)
        assert losses[after][-1] < 1.25 * losses[before][0], (entry, losses[before], losses[after])
    reliability.record(
        "A worker pod of an elastic run (minWorkers 1 of 2) lost while the node has GPUs for one worker; the "
        "GPUs back later",
        "Ray Train goes on with one worker from the checkpoint taken at the drain notice (no step trained "
        "twice), then grows back to two; no restart spent",
        f"one worker {seconds_between(lost_at, resizes[0]['time']):.0f} s after the loss (resumed from the "
        f"drain checkpoint at step {drain_step}, the last trained on two: {last_on_two}); two again from "
        f"step {resizes[1]['resumedFromStep']}",
    )


def test_a_worker_over_its_memory_limit_fails_the_run_with_the_reason(
    namespace: str, proxied_operator: OperatorProcess, real_node: RealNode
) -> None:
    # A model whose weights, gradients and Adam state alone exceed the worker's memory limit. One worker:
    # each pod more is another Ray start on the node's 2 CPUs.
    run = real_pods_run(
        namespace,
        **{
            "cluster.workers": 1,
            "cluster.memory": "1500Mi",
            "model.fromConfig.hidden_size": 1024,
            "model.fromConfig.intermediate_size": 4096,
            "model.fromConfig.num_hidden_layers": 12,
            "model.fromConfig.num_attention_heads": 8,
            "recovery.inJobMaxFailures": 0,
        },
    )["metadata"]["name"]
    failed = wait_for_phase(namespace, run, "Failed", timeout=RUN_TIMEOUT)
    assert conditions_of(failed)["Failed"]["reason"] == "OOMKilled", failed["status"]["message"]
    assert "spec.cluster.memory" in failed["status"]["message"]


def test_a_head_no_node_takes_is_shown_at_once_and_gives_the_workers_back_within_the_bound(
    namespace: str, proxied_operator: OperatorProcess, real_node: RealNode
) -> None:
    bound = 30
    changes = {
        "cluster.workers": 1,  # its GPUs are what must be given back; one pod is enough to show it
        "cluster.head.nodeSelector": {"type": "no-such-node"},
        "recovery.podErrorTimeoutSeconds": bound,
    }
    run = real_pods_run(namespace, **changes)["metadata"]["name"]
    shown = wait_until(
        "PodsHealthy False with reason HeadUnschedulable",
        lambda: (
            (c := conditions_of(run_of(namespace, run)).get("PodsHealthy"))
            and c["status"] == "False"
            and c["reason"] == "HeadUnschedulable"
            and c
        ),
        timeout=120,
    )
    assert "didn't match Pod's node affinity/selector" in shown["message"] or "node(s)" in shown["message"]
    failed = wait_for_phase(namespace, run, "Failed", timeout=bound + 120)
    assert conditions_of(failed)["Failed"]["reason"] == "HeadUnschedulable"
    wait_until(
        "the RayCluster deleted (its workers' GPUs given back)",
        lambda: not rayclusters(namespace),
        timeout=120,
    )


def import_into_node(node: RealNode, image: str, into: Path) -> None:
    """An image of podman's store into the real node's containerd (no registry is reachable)."""
    archive = into / "image.tar"
    podman = ["podman", "save", "--quiet", "--format", "oci-archive", "--output", str(archive), image]
    subprocess.run(
        podman, check=True, capture_output=True, env={**os.environ, "CONTAINERS_CONF": CONTAINERS_CONF}
    )
    ctr = [
        "ctr",
        "--address",
        node.containerd_socket,
        "--namespace",
        "k8s.io",
        "images",
        "import",
        str(archive),
    ]
    subprocess.run(ctr, check=True, capture_output=True)
    archive.unlink()


def dashboard_probe(namespace: str, node: RealNode, url: str, token: str | None) -> str:
    """What a pod of `namespace` gets from a Ray dashboard URL: an HTTP status, or the connection error."""
    headers = {"X-Ray-Authorization": f"Bearer {token}"} if token else {}
    command = f"""
import urllib.error, urllib.request
request = urllib.request.Request({url!r}, headers={headers!r})
try:
    print("status", urllib.request.urlopen(request, timeout=10).status)
except urllib.error.HTTPError as error:
    print("status", error.code)
except OSError as error:
    print("error", type(error).__name__, getattr(error, "reason", error))
"""
    return run_probe(namespace, node.image, node.name, command)[1].strip()


# A policy a namespace's owner might add beside the run's: every pod of the namespace, from anywhere.
ADMIT_EVERY_POD = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "admit-every-pod"},
    "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]},
}


def admitted(probe: str) -> str | None:
    """A dashboard probe's answer when the network let it through (None for a refused connection)."""
    return None if probe.startswith("error") else probe


# A chat fine-tune of the demo's tiny model: conversations in the messages format, ChatML (the byte-level
# tokenizer has no template), the loss on the assistant turns, long enough for the median conversation (568
# bytes); evaluated at steps 4, 8 and 12.
CHAT_RUN = {
    "model.fromConfig.max_position_embeddings": 1024,
    "training.maxSteps": 12,
    "training.sequenceLength": 1024,
    "training.microBatchSize": 2,
    "training.learningRate": 1e-2,
    "training.warmupSteps": 0,
    "checkpoint.everySteps": 12,
    "data.source": f"s3://{BUCKET}/{CHAT_CORPUS}",
    "data.format": "messages",
    "data.chatTemplate": CHATML,
    "data.evalEvery": 4,
}


def test_the_operator_as_a_real_pod_drives_a_run_by_cluster_dns_and_only_it_reaches_the_dashboard(
    namespace: str,
    crd_installed: None,
    s3: Any,
    local_cluster: LocalCluster,
    real_node: RealNode,
    tmp_path: Path,
) -> None:
    image = operator_image()
    import_into_node(real_node, image, tmp_path)
    repository, tag = image.rsplit(":", 1)
    release = f"p{namespace[-6:]}"
    kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "replicaCount": 1,
        "watchNamespaces": [namespace],
        "defaultImage": real_node.image,
        "rayImagePullPolicy": "IfNotPresent",
        "dashboardAddressMode": "service-dns",
        "aws": {"region": "us-west-2", "endpointUrl": real_node.pod_s3_endpoint},
        "s3Prefixes": TEST_S3_PREFIXES.split(","),
        "observeIntervalSeconds": 3,
        "nodeSelector": {"type": "real"},
        "tolerations": TOLERATE_REAL_NODE,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "extraEnv": [
            {"name": "FSDP_OPERATOR_TRAINER_DEVICE", "value": "cpu"},
            {"name": "FSDP_OPERATOR_RAY_POD_ENV", "value": json.dumps(real_node.pod_env)},
            {"name": "AWS_ACCESS_KEY_ID", "value": "testing"},
            {"name": "AWS_SECRET_ACCESS_KEY", "value": "testing"},
            # No kube-proxy here: the kubernetes Service's address answers nothing; the apiserver is
            # forwarded at the host's end of the pod segment (in EKS the Service works as it is).
            {"name": "KUBERNETES_SERVICE_HOST", "value": real_node.host_address},
            {"name": "KUBERNETES_SERVICE_PORT", "value": local_cluster.env["FSDP_POD_APISERVER_PORT"]},
        ],
    }
    values_file = tmp_path / "values.json"
    values_file.write_text(json.dumps(values))
    helm = [
        str(REPO / "bin" / "helm"),
        "install",
        release,
        str(CHART),
        "-n",
        OPERATOR_NAMESPACE,
        "-f",
        str(values_file),
    ]
    subprocess.run([*helm, "--skip-crds"], check=True, capture_output=True)
    try:
        deployment = f"{release}-fsdp-operator"
        wait_until(
            "the operator's Deployment available on the real node",
            lambda: (
                kubectl_json("get", "deployment", deployment, "-n", OPERATOR_NAMESPACE)
                .get("status", {})
                .get("availableReplicas")
            ),
            timeout=300,
        )
        [operator_pod] = kubectl_json(
            "get", "pods", "-n", OPERATOR_NAMESPACE, "-l", f"app.kubernetes.io/instance={release}"
        )["items"]
        assert operator_pod["spec"]["nodeName"] == real_node.name
        # One worker: the run is here to be driven by the operator's pod, not to train on two. It is a chat
        # fine-tune (issue 48: the spec's chat fields through the operator to the trainer in the DLC's image).
        manifest = real_pods_run(namespace, cleanupPolicy="KeepCluster", **{"cluster.workers": 1, **CHAT_RUN})
        run = manifest["metadata"]["name"]
        finished = wait_for_phase(namespace, run, "Succeeded", timeout=RUN_TIMEOUT)
        # The operator's pod got through, start to end, with nothing to restart.
        assert finished["status"]["checkpoints"]["latest"]["step"] == CHAT_RUN["training.maxSteps"]
        assert finished["status"]["restarts"]["count"] == 0, finished["status"]["restarts"]
        # The loss on the answers alone, on held-out conversations, fell (3.61, 3.25, 3.22 when written).
        runs = RunObjects(s3, f"s3://{BUCKET}/runs/{namespace}/{run}")
        records = [record for history in metric_histories(runs) for record in history]
        learned = {r.training_data.learned for r in records if r.training_data}
        assert learned == {"assistant turns"}, records[-1]
        evaluated = list(dict.fromkeys(r.eval_loss for r in records if r.eval_loss is not None))
        print(f"chat fine-tune on a real pod: eval loss on the answers {evaluated}")
        assert len(evaluated) == 3 and evaluated[-1] < evaluated[0] - 0.2, evaluated
        [head] = [p for p in pods_of(namespace, manifest["metadata"]["name"]) if node_type(p) == "head"]
        dashboard = f"http://{head['status']['podIP']}:8265/api/jobs/"
        other = f"{namespace}-other"
        kubectl("create", "namespace", other)
        try:
            # The run's NetworkPolicy: a pod of another namespace is refused on the dashboard's port.
            refused = dashboard_probe(other, real_node, dashboard, token=None)
            assert refused.startswith("error"), refused
            # Deleted by hand while the cluster runs, the policy is created again, and enforced again.
            [policy] = kubectl_json("get", "networkpolicies", "-n", namespace)["items"]
            kubectl("delete", "networkpolicy", policy["metadata"]["name"], "-n", namespace)
            wait_until(
                "the operator to create the run's NetworkPolicy again",
                lambda: [
                    p
                    for p in kubectl_json("get", "networkpolicies", "-n", namespace)["items"]
                    if p["metadata"]["uid"] != policy["metadata"]["uid"]
                ],
                timeout=30,
            )
            wait_until(
                "the restored policy to refuse the other namespace's pod",
                lambda: dashboard_probe(other, real_node, dashboard, token=None).startswith("error"),
                timeout=90,
            )
            # Admitted by the network (a second policy that admits every pod, as a wrong one would), the
            # dashboard still needs the run's Ray token. Policies add up, so the run's own does not stop it.
            kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(ADMIT_EVERY_POD))
            unauthorised = wait_until(
                "the other namespace's pod admitted to the dashboard's port",
                lambda: admitted(dashboard_probe(other, real_node, dashboard, token=None)),
                timeout=90,
            )
            assert unauthorised == "status 401", unauthorised
            secret = kubectl_json(
                "get", "secret", "-n", namespace, f"{rayclusters(namespace)[0]['metadata']['name']}-ray-auth"
            )
            token = base64.b64decode(secret["data"]["token"]).decode()
            assert dashboard_probe(other, real_node, dashboard, token=token) == "status 200"
        finally:
            kubectl("delete", "namespace", other, "--wait=false", check=False)
    finally:
        kubectl("delete", "fsdptrainingruns", "--all", "-n", namespace, "--timeout=120s", check=False)
        subprocess.run(
            [str(REPO / "bin" / "helm"), "uninstall", release, "-n", OPERATOR_NAMESPACE], check=False
        )


DEGRADED_LABEL = "fsdp.training.dev/fabric-degraded"


def slow_pod_link(namespace: str, pod: str, rate: str) -> None:
    """Shapes what reaches `pod` to `rate` with tc on its veth in the real node's network namespace (the
    node's bridge side), as a bad NIC or cable would; the veth and its shaping go away with the pod."""
    iflink = kubectl(
        "exec", "-n", namespace, pod, "-c", "ray-worker", "--", "cat", "/sys/class/net/eth0/iflink"
    )
    [node_dir] = cluster_settings("NODE_DIR")
    holder = (Path(node_dir) / "pids" / "namespaces.pid").read_text().strip()
    in_node = ["nsenter", "--target", holder, "--net", "--"]
    links = subprocess.run([*in_node, "ip", "-o", "link", "show"], check=True, capture_output=True, text=True)
    [veth] = [
        line.split(":")[1].strip().split("@")[0]
        for line in links.stdout.splitlines()
        if line.split(":")[0] == iflink.stdout.strip()
    ]
    shape = [
        "tc",
        "qdisc",
        "add",
        "dev",
        veth,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        "32kbit",
        "latency",
        "2s",
    ]
    subprocess.run([*in_node, *shape], check=True, capture_output=True)


def node_labels(node: RealNode) -> dict[str, str]:
    return dict(kubectl_json("get", "node", node.name)["metadata"].get("labels") or {})


@dataclass(frozen=True)
class SlowLinkThenHang:
    """What the fabric and hang rows' run showed, read when each thing happened."""

    slowed: str  # the worker pod whose link was slowed
    slowed_at: dt.datetime
    restarted: dict[str, Any]  # the run at its restart after the failed fabric check
    labels: dict[str, str]  # the node's labels then
    annotation: str  # the node's degraded annotation then
    waiting: dict[str, Any]  # the run while the next attempt's workers waited
    pods_waiting: list[dict[str, Any]]
    passed: dict[str, Any]  # the run once the next check passed and it trained
    hung: dict[str, Any]  # the run once the hung rank's forensics concluded
    workers_hung: set[str]  # the worker pods then
    stored: set[str]  # the forensics objects of that attempt in S3


HANG_STEP = 12


@pytest.fixture(scope="module")
def slow_link_then_hang(
    shared_namespace: str, shared_proxied_operator: OperatorProcess, real_node: RealNode, s3: Any
) -> SlowLinkThenHang:
    """One run for the fabric and hang rows (each RayCluster start costs minutes of the node's 2 CPUs): three
    workers (three pods, so one pod's link can be told apart); one worker pod's link slowed to 20 Mbit/s
    with tc before the job starts. The attempt's fabric check finds the links into that pod below
    network.minBusBandwidthGbps, names the pod and the node, and the operator labels the node and restarts on
    a new cluster whose workers avoid it: on this one-node cluster they wait, Pending for the label, until the
    platform takes it off; then the next check passes on fresh pods and the run trains, until rank 0 stops
    making progress at step 12 in its worker pod, its process alive (the others wait for it in a collective):
    after the hang timeout, before the job is stopped, every rank's stacks go to S3 and the status names
    rank 0 with its pod and node. The first attempt trains no step, so the hang is the second's."""
    namespace = shared_namespace
    set_node_gpus(real_node, 12, efa=3)  # three workers x (4 GPUs, 1 EFA)
    manifest = real_pods_run(
        namespace,
        **{
            "cluster.workers": 3,
            "cluster.cpu": "500m",  # three workers and the head on the node's 2 CPUs
            "network.minBusBandwidthGbps": 0.05,  # 400 Mbit/s: far under a veth's, far over the slowed link
            "training.maxSteps": 20,
            "recovery.hangTimeoutSeconds": 60,
            "runtimeEnv": {"env": {"FSDP_TRAINER_FAULT": f"rank=0,step={HANG_STEP},action=hang"}},
        },
    )
    run = manifest["metadata"]["name"]
    try:

        def first_worker_running() -> str | None:
            workers = [p for p in pods_of(namespace, run) if node_type(p) == "worker"]
            running = [p for p in workers if p["status"].get("phase") == "Running"]
            return running[0]["metadata"]["name"] if running else None

        slowed = wait_until("a worker pod running", first_worker_running, timeout=RUN_TIMEOUT, interval=0.5)
        slow_pod_link(namespace, slowed, "20mbit")
        slowed_at = dt.datetime.now(dt.UTC)
        restarted = wait_until(
            "a restart after the fabric check",
            lambda: (r := run_of(namespace, run)) and r["status"]["restarts"]["history"] and r,
            timeout=RUN_TIMEOUT,
        )
        labels = node_labels(real_node)
        annotation = kubectl_json("get", "node", real_node.name)["metadata"]["annotations"].get(
            DEGRADED_LABEL, ""
        )
        # The next attempt's workers avoid the node: on a one-node cluster they wait, and the run says why.
        waiting = wait_until(
            "the next attempt's workers Pending, kept off the labelled node",
            lambda: (
                (r := run_of(namespace, run))
                and conditions_of(r).get("PodsScheduled", {}).get("status") == "False"
                and r
            ),
            timeout=600,
        )
        pods_waiting = pods_of(namespace, run)
        kubectl(
            "label", "node", real_node.name, f"{DEGRADED_LABEL}-"
        )  # the platform's call, once it is fixed
        passed = wait_until(
            "the next attempt's fabric check passed and training going on",
            lambda: (
                (r := run_of(namespace, run))
                and conditions_of(r).get("FabricVerified", {}).get("status") == "True"
                and step_of(namespace, run) > 0
                and r
            ),
            timeout=RUN_TIMEOUT,
        )
        hung = wait_until(
            "the hang declared and the ranks' stacks collected",
            lambda: (
                (r := run_of(namespace, run))
                and (r.get("status", {}).get("forensics") or {}).get("concludedAt")
                and r
            ),
            timeout=RUN_TIMEOUT,
        )
        workers_hung = {p["metadata"]["name"] for p in pods_of(namespace, run) if node_type(p) == "worker"}
        attempt = hung["status"]["forensics"]["attempt"]
        listed = s3.list_objects_v2(
            Bucket=BUCKET, Prefix=f"runs/{namespace}/{run}/forensics/attempt-{attempt}/"
        )
        stored = {o["Key"].rpartition("/")[2] for o in listed.get("Contents", [])}
        kubectl("delete", "fsdptrainingrun", run, "-n", namespace, "--wait=false")
    finally:
        kubectl("label", "node", real_node.name, f"{DEGRADED_LABEL}-", check=False)
        kubectl("annotate", "node", real_node.name, f"{DEGRADED_LABEL}-", check=False)
        set_node_gpus(real_node, 8)
    return SlowLinkThenHang(
        slowed,
        slowed_at,
        restarted,
        labels,
        annotation,
        waiting,
        pods_waiting,
        passed,
        hung,
        workers_hung,
        stored,
    )


# The shared run's setup (two RayClusters, the hang timeout) falls in the first of its tests to run.
@pytest.mark.timeout(1800)
def test_a_slow_pod_link_fails_the_fabric_check_naming_the_pod_and_node_which_the_next_attempt_avoids(
    slow_link_then_hang: SlowLinkThenHang, real_node: RealNode, reliability: Recorder
) -> None:
    seen = slow_link_then_hang
    slowed = seen.slowed
    entry = seen.restarted["status"]["restarts"]["history"][0]
    assert entry["reason"] == "FabricBelowThreshold", entry
    assert f"every slow link touches pod {slowed} on node {real_node.name}" in entry["message"], entry
    fabric = seen.restarted["status"]["fabric"]
    assert fabric["report"]["suspectPod"] == slowed and not fabric["report"]["passed"], fabric
    assert [n["node"] for n in fabric["avoidedNodes"]] == [real_node.name], fabric
    verified = conditions_of(seen.restarted)["FabricVerified"]
    assert verified["status"] == "False" and verified["reason"] == "BelowThreshold", verified
    assert DEGRADED_LABEL in seen.labels, seen.labels
    assert slowed in seen.annotation, seen.annotation
    assert "affinity" in conditions_of(seen.waiting)["PodsScheduled"]["message"], conditions_of(seen.waiting)
    pods = seen.pods_waiting
    assert all(p["metadata"]["name"] != slowed for p in pods), "the slowed pod should be gone"
    assert all(p["status"].get("phase") == "Pending" for p in pods if node_type(p) == "worker"), [
        (p["metadata"]["name"], p["status"].get("phase")) for p in pods
    ]
    report = seen.passed["status"]["fabric"]["report"]
    assert report["passed"] and len(report["links"]) >= 6 and report["busBandwidthGbps"] >= 0.05, report
    reliability.record(
        "One worker pod's link slowed to 20 Mbit/s (tc on its veth) before the job starts; three workers, "
        "network.minBusBandwidthGbps 0.05",
        "The fabric check fails naming the pod and node; the node is labelled and the next attempt's workers "
        "avoid it",
        f"FabricBelowThreshold {seconds_between(seen.slowed_at, entry['time']):.0f} s after the slowing, "
        f"naming pod {slowed} on {real_node.name}; the next check, label removed: "
        f"{report['busBandwidthGbps']} GB/s in {report['seconds']} s",
    )


@pytest.mark.timeout(1800)
def test_a_rank_that_hangs_in_a_worker_pod_is_named_with_its_pod_and_node_and_every_ranks_stacks_kept(
    slow_link_then_hang: SlowLinkThenHang, real_node: RealNode, reliability: Recorder
) -> None:
    """Rank 0 of three stops making progress at step 12 in its worker pod, its process alive (ranks 1 and 2
    wait for it in a collective): after the hang timeout, before the job is stopped, every rank's stacks go
    to S3 and the status names rank 0 with the worker pod it ran in and the real node."""
    forensics = slow_link_then_hang.hung["status"]["forensics"]
    suspect = forensics["suspect"]
    assert (forensics["ranksAnswered"], forensics["worldSize"]) == (3, 3), forensics
    assert suspect["rank"] == 0 and suspect["pod"] in slow_link_then_hang.workers_hung, suspect
    assert suspect["node"] == real_node.name, suspect
    assert "while ranks 1, 2 wait in a collective" in suspect["why"], suspect
    assert slow_link_then_hang.stored == {"request.json", "rank-0.json", "rank-1.json", "rank-2.json"}
    collected = seconds_between(forensics["requestedAt"], forensics["concludedAt"])
    reliability.record(
        f"Rank 0 of three stops making progress at step {HANG_STEP} in its worker pod on the real node, "
        "every process alive",
        "every rank's stacks in S3 and rank 0 named with its pod and node before the job is stopped",
        f"stacks of {forensics['ranksAnswered']} ranks {collected:.0f} s after the hang was declared; "
        f"suspect rank 0 in pod {suspect['pod']} on {suspect['node']}",
    )
