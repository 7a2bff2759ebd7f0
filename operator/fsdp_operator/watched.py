"""What the operator keeps of the objects it watches: runs and RayClusters without what only the apiserver and
kopf read, a Ray pod as the few facts a pass needs, and what of an event is worth a pass at once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from fsdp_operator import builder
from fsdp_operator.reconcile import observe_cluster

# Waiting reasons of a container that will not start by itself (kubelet's names).
POD_START_ERRORS = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)
# A container that has crashed this often and waits in CrashLoopBackOff is not coming up by itself (one crash
# and a restart is what a killed process looks like, and KubeRay's pods are restarted in place).
CRASH_LOOP_RESTARTS = 3
# Of a crashed container's last log lines (the kubelet keeps its log's tail in the container's status: the
# Ray containers' terminationMessagePolicy is FallbackToLogsOnError), those named with its crash loop.
CRASH_LOG_LINES = 3
CRASH_LOG_CHARS = 400
RAY_CONTAINERS = ("ray-head", "ray-worker")


def kept(body: Mapping[str, Any]) -> dict[str, Any]:
    """A run or RayCluster as the operator keeps it (kopf's indexes, its last status write), without what only
    the apiserver and kopf read: managedFields, and the annotations that copy a whole manifest (kubectl's
    last-applied-configuration, kopf's last-handled-configuration). A third or more of each object."""
    meta = dict(body["metadata"])
    meta.pop("managedFields", None)
    image = (meta.pop("annotations", None) or {}).get(builder.ANNOTATION_IMAGE)
    if image is not None:
        meta["annotations"] = {builder.ANNOTATION_IMAGE: image}
    return {**body, "metadata": meta}


def cluster_reaction(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a RayCluster event a pass reacts to at once: readiness as the pass reads it (every worker ready
    too, which a provisioning run waits for), KubeRay's state (failed), suspension, its spec's generation
    (drift), its deletion."""
    seen = observe_cluster(dict(body))
    state = (body.get("status") or {}).get("state")
    readiness = (seen.ready, seen.every_worker_ready)
    return (body["metadata"].get("generation"), readiness, seen.deleting, seen.suspended, state)


def _memory_limit(body: Mapping[str, Any], container: str) -> str | None:
    for spec in (body.get("spec") or {}).get("containers") or []:
        if spec.get("name") == container:
            return cast(str | None, ((spec.get("resources") or {}).get("limits") or {}).get("memory"))
    return None


def _has_words(line: str) -> bool:
    return any(c.isalnum() for c in line)


def last_exit(status: Mapping[str, Any]) -> str:
    """How a container's previous run ended: its exit code and, where the kubelet kept them, its last log
    lines (a traceback's last lines name the cause: CUDA compatibility, EFA, `ray start`)."""
    ended = (status.get("lastState") or {}).get("terminated") or {}
    if not ended:
        return ""
    # Lines with words only: a traceback's closing brackets say nothing.
    lines = [line.strip() for line in str(ended.get("message") or "").splitlines() if _has_words(line)]
    said = f"exit code {ended.get('exitCode')}"
    if lines:
        said += ", last log lines: " + " | ".join(lines[-CRASH_LOG_LINES:])[-CRASH_LOG_CHARS:]
    return said


def pod_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a pass needs of a Ray pod: the digests its Ray container ran, why it cannot start (a container or
    init container that cannot, such as KubeRay's wait-gcs-ready with a missing Secret or an image that does
    not pull, or a head no node can take), why the scheduler cannot place a worker, and the Ray container's
    last OOM kill, if any."""
    name = body["metadata"]["name"]
    status_of = body.get("status") or {}
    image_ids, problems, oom_kills = [], [], []
    init_statuses = [(s, True) for s in status_of.get("initContainerStatuses") or []]
    for status, init in [*init_statuses, *((s, False) for s in status_of.get("containerStatuses") or [])]:
        ray = not init and status.get("name") in RAY_CONTAINERS
        where = f"pod {name}" + (f", init container {status.get('name')}" if init else "")
        if ray and status.get("imageID"):
            image_ids.append(status["imageID"])
        waiting = (status.get("state") or {}).get("waiting") or {}
        kill = None
        for state in (status.get("state") or {}, status.get("lastState") or {}) if ray else ():
            terminated = state.get("terminated") or {}
            if terminated.get("reason") == "OOMKilled":
                limit = _memory_limit(body, status["name"])
                kill = (
                    terminated.get("finishedAt") or "",
                    f"container {status['name']} of pod {name} was OOMKilled at its memory limit "
                    f"({limit or 'none set'}, exit code {terminated.get('exitCode')})",
                )
                oom_kills.append(kill)
        reason = str(waiting.get("reason") or "")
        looping = reason == "CrashLoopBackOff" and status.get("restartCount", 0) >= CRASH_LOOP_RESTARTS
        if looping and kill is not None:  # Ray itself does not fit: the reason is the memory limit
            problems.append(("OOMKilled", f"{kill[1]}, {status['restartCount']} times"))
        elif (ray or init) and (reason in POD_START_ERRORS or looping):
            message = f"{where}: {reason}: {waiting.get('message', '')}".strip()
            if looping:  # where it crashed and how: a node's fault (its driver, its EFA) or the run's
                node = (body.get("spec") or {}).get("nodeName")
                message = f"{message}; on node {node}, {last_exit(status)}".rstrip(", ")
            problems.append((reason, message))
    head = (body["metadata"].get("labels") or {}).get("ray.io/node-type") == "head"
    unschedulable = None
    for condition in status_of.get("conditions") or []:
        if condition.get("type") != "PodScheduled" or condition.get("reason") != "Unschedulable":
            continue
        # Workers may wait for GPU nodes being added (scale-from-zero; provisioningTimeoutSeconds bounds it);
        # a head waits for nothing but a CPU node, which a cluster has or never gets.
        unschedulable = f"pod {name}: {condition.get('message', '')}".strip()
        if head:  # unless an autoscaler is adding a node for it (observe.py reads its events)
            problems.append(("HeadUnschedulable", unschedulable))
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status_of.get("conditions") or []
    )
    every_status = [
        *(status_of.get("initContainerStatuses") or []),
        *(status_of.get("containerStatuses") or []),
    ]
    owners = body["metadata"].get("ownerReferences") or []
    owner: Mapping[str, Any] = next((o for o in owners if o.get("controller")), {})
    return {
        "name": name,
        "owner": owner.get("uid"),  # the RayCluster's UID, for a pod KubeRay made
        "node": (body.get("spec") or {}).get("nodeName"),
        "head": head,
        "ready": ready,
        # A container was created, so its image is on the node: the pod is past its pull.
        "started": ready
        or any(s.get("imageID") or "running" in (s.get("state") or {}) for s in every_status),
        "imageIds": image_ids,
        "problems": problems,
        "oomKills": oom_kills,
        "unschedulable": unschedulable,
    }
