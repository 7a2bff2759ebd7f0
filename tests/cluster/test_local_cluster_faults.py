"""Faults and instruments of the local cluster itself, which the operator's tests build on: pods whose
container never starts (KWOK stage pod-container-waiting, keyed on the image name) and the apiserver's audit
log (tests/apiserver_audit.py)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch

from tests.support.apiserver_audit import (
    KOPF_USER_AGENT,
    PYTHON_CLIENT_USER_AGENT,
    AuditLog,
    RequestKind,
    parse_line,
    requests_of,
    select,
)
from tests.support.kube import kubectl
from tests.support.local_cluster import LocalCluster
from tests.support.waiting import wait_until


@pytest.fixture
def api(local_cluster: LocalCluster) -> Iterator[k8s.ApiClient]:
    with k8s_config.new_client_from_config(config_file=local_cluster.kubeconfig) as client:
        yield client


def pod(name: str, image: str, init_image: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeSelector": {"kubernetes.io/hostname": "system-0"},
        "containers": [{"name": "main", "image": image}],
    }
    if init_image:
        spec["initContainers"] = [{"name": "wait", "image": init_image}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def waiting_reasons(status: dict[str, Any], key: str) -> list[str]:
    return [s["state"]["waiting"]["reason"] for s in status.get(key) or [] if "waiting" in s.get("state", {})]


def test_containers_that_never_start_wait_with_a_kubelets_reasons(namespace: str, api: k8s.ApiClient) -> None:
    """Each faulty pod goes through the kubelet's waiting reasons and stays Pending and unready, while a
    normal pod next to them runs."""
    pods = [
        pod("pull", "example.invalid/never-pulls:1"),
        pod("config", "example.invalid/bad-config:1"),
        pod("init-pull", "rayproject/ray:2.58.0", init_image=f"example.invalid/never-pulls@{DIGEST}"),
        pod("normal", "rayproject/ray:2.58.0"),
    ]
    final = {
        "pull": "ImagePullBackOff",
        "config": "CreateContainerConfigError",
        "init-pull": "ImagePullBackOff",
    }
    seen: dict[str, list[str]] = {p["metadata"]["name"]: [] for p in pods}  # reasons in the order they came
    last: dict[str, dict[str, Any]] = {}
    core = k8s.CoreV1Api(api)
    listed = core.list_namespaced_pod(namespace).metadata
    assert listed is not None
    version = listed.resource_version  # watch from here on, so that no transition goes unseen
    started = time.monotonic()
    kubectl("apply", "-n", namespace, "-f", "-", input="\n".join(json.dumps(p) for p in pods))

    def done() -> bool:
        running = last.get("normal", {}).get("phase") == "Running"
        return running and all(seen[name][-1:] == [reason] for name, reason in final.items())

    watcher = k8s_watch.Watch()
    stream = watcher.stream(core.list_namespaced_pod, namespace, resource_version=version, timeout_seconds=60)
    for event in stream:
        raw = event["raw_object"]
        name, status = raw["metadata"]["name"], raw.get("status", {})
        last[name] = status
        key = "initContainerStatuses" if name == "init-pull" else "containerStatuses"
        for reason in waiting_reasons(status, key):
            if seen[name][-1:] != [reason]:
                seen[name].append(reason)
        if done():
            watcher.stop()
    elapsed = time.monotonic() - started
    assert done(), f"not every pod reached its state within 60 s: reasons {seen}, last statuses {last}"
    assert elapsed < 30, f"the faulty pods took {elapsed:.0f}s to show their reasons"

    assert seen["pull"] == seen["init-pull"] == ["ErrImagePull", "ImagePullBackOff"]
    assert seen["config"] == ["CreateContainerConfigError"]
    for name in final:
        status = last[name]
        assert status["phase"] == "Pending" and status.get("podIP"), status
        assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "False"
        assert not any(c["ready"] for c in status["containerStatuses"]), status
    pull = last["pull"]["containerStatuses"][0]["state"]["waiting"]
    assert pull["message"] == 'Back-off pulling image "example.invalid/never-pulls:1"'
    init_pull = last["init-pull"]
    assert waiting_reasons(init_pull, "containerStatuses") == ["PodInitializing"]
    assert {c["type"]: c["status"] for c in init_pull["conditions"]}["Initialized"] == "False"
    assert waiting_reasons(last["config"], "containerStatuses") == ["CreateContainerConfigError"]
    assert last["normal"]["containerStatuses"][0]["imageID"].startswith("rayproject/ray@sha256:")


def test_audit_log_counts_one_clients_requests(
    local_cluster: LocalCluster, namespace: str, api: k8s.ApiClient
) -> None:
    """A client with its own user agent makes a known set of requests; the audit log counts exactly those,
    in the window asked for, and none of another client's."""
    log = AuditLog.of_local_cluster()
    agent = f"audit-probe-{uuid4().hex[:8]}/1.0"
    api.user_agent = agent
    probe = k8s.CoreV1Api(api)
    probe.read_namespace(namespace)  # before the window
    since = datetime.now(UTC)
    for _ in range(3):
        probe.list_namespaced_pod(namespace)
    middle = datetime.now(UTC)
    probe.read_namespace(namespace)
    probe.read_namespace(namespace)
    probe.create_namespaced_config_map(namespace, k8s.V1ConfigMap(metadata=k8s.V1ObjectMeta(name="probe")))
    probe.patch_namespaced_config_map("probe", namespace, {"data": {"a": "b"}})
    probe.delete_namespaced_config_map("probe", namespace)
    with k8s_config.new_client_from_config(config_file=local_cluster.kubeconfig) as other:
        k8s.CoreV1Api(other).list_namespaced_pod(namespace)  # the default agent: another client

    expected = Counter(
        {
            ("list", "pods", ""): 3,
            ("get", "namespaces", ""): 2,
            ("create", "configmaps", ""): 1,
            ("patch", "configmaps", ""): 1,
            ("delete", "configmaps", ""): 1,
        }
    )

    def logged() -> tuple[Counter[RequestKind], list[RequestKind]] | None:
        counts = log.count(agent, since)
        others = [e.kind for e in log.requests(PYTHON_CLIENT_USER_AGENT, since) if e.namespace == namespace]
        return (counts, others) if counts.total() >= expected.total() and others else None

    # An event is written as its response completes, so the last ones may lag behind the client a little.
    counts, others = wait_until(f"the requests of {agent} in {log.path}", logged, timeout=30, interval=0.5)
    assert counts == expected
    assert others == [("list", "pods", "")]
    assert log.count(agent, since, until=middle) == Counter({("list", "pods", ""): 3})


DIGEST = "sha256:" + 64 * "0"


# Audit events as kube-apiserver v1.35 writes them (trimmed of fields the parser ignores).
SAMPLE = [
    '{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a1","stage":"ResponseComplete",'
    '"requestURI":"/apis/fsdp.training.dev/v1alpha1/namespaces/t/fsdptrainingruns/r/status","verb":"patch",'
    '"user":{"username":"kwok-admin","groups":["system:masters","system:authenticated"]},'
    '"sourceIPs":["127.0.0.1"],"userAgent":"kopf/1.45.2","objectRef":{"resource":"fsdptrainingruns",'
    '"namespace":"t","name":"r","apiGroup":"fsdp.training.dev","apiVersion":"v1alpha1","subresource":"status"},'
    '"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-30T05:00:01.000100Z",'
    '"stageTimestamp":"2026-11-30T05:00:01.004000Z"}',
    # a watch: ResponseStarted now, ResponseComplete when it ends; one request
    '{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a2","stage":"ResponseStarted",'
    '"requestURI":"/api/v1/namespaces/t/pods?watch=true","verb":"watch","user":{"username":"kwok-admin"},'
    '"userAgent":"kopf/1.45.2","objectRef":{"resource":"pods","namespace":"t","apiVersion":"v1"},'
    '"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-30T05:00:02.000000Z"}',
    '{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a2","stage":"ResponseComplete",'
    '"requestURI":"/api/v1/namespaces/t/pods?watch=true","verb":"watch","user":{"username":"kwok-admin"},'
    '"userAgent":"kopf/1.45.2","objectRef":{"resource":"pods","namespace":"t","apiVersion":"v1"},'
    '"responseStatus":{"metadata":{},"code":200},"requestReceivedTimestamp":"2026-11-30T05:00:02.000000Z"}',
    '{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a3","stage":"ResponseComplete",'
    '"requestURI":"/version","verb":"get","user":{"username":"kwok-admin"},'
    '"userAgent":"OpenAPI-Generator/37.0.1/python","responseStatus":{"metadata":{},"code":200},'
    '"requestReceivedTimestamp":"2026-11-30T05:00:03.000000Z"}',
    '{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a4","stage":"ResponseComplete",'
    '"requestURI":"/apis/fsdp.training.dev/v1alpha1/namespaces/t/fsdptrainingruns/r","verb":"get",'
    '"user":{"username":"kwok-admin"},"userAgent":"kopf/1.45.2","objectRef":{"resource":"fsdptrainingruns",'
    '"namespace":"t","name":"r","apiGroup":"fsdp.training.dev","apiVersion":"v1alpha1"},'
    '"responseStatus":{"metadata":{},"code":404},"requestReceivedTimestamp":"2026-11-30T05:00:04.000000Z"}',
    '{"kind":"Event","apiVersion":"audit.k8s.io/v1","level":"Metadata","auditID":"a5","stage":"Respo',  # torn
]


def test_audit_lines_parse_into_requests_counted_once() -> None:
    """No cluster needed: the parser on sample lines."""
    events = list(requests_of(SAMPLE))
    assert [e.audit_id for e in events] == ["a1", "a2", "a3", "a4"]
    status = events[0]
    assert status.kind == ("patch", "fsdptrainingruns", "status") and status.code == 200
    assert (status.namespace, status.name, status.user) == ("t", "r", "kwok-admin")
    assert events[2].kind == ("get", "", "") and events[2].uri == "/version"
    assert parse_line("") is None and parse_line("[]") is None

    start = datetime(2026, 11, 30, 5, 0, 1, 100, tzinfo=UTC)
    kopf = select(events, KOPF_USER_AGENT, since=start)
    assert [e.kind for e in kopf] == [
        ("patch", "fsdptrainingruns", "status"),
        ("watch", "pods", ""),
        ("get", "fsdptrainingruns", ""),
    ]
    assert [e.audit_id for e in select(events, KOPF_USER_AGENT, since=start, until=events[3].received)] == [
        "a1",
        "a2",
    ]
    assert select(events, KOPF_USER_AGENT, since=events[3].received.replace(microsecond=1)) == []
    assert [e.audit_id for e in select(events, PYTHON_CLIENT_USER_AGENT, since=start)] == ["a3"]
