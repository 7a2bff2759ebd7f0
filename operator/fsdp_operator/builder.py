"""Pure builders: an FSDPTrainingRun spec to the KubeRay RayCluster (ray.io/v1) that runs it."""

from __future__ import annotations

import copy
import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsdp_operator import api, drainwindow, fabric, quantity
from fsdp_operator.jobs import DASHBOARD_PORT
from fsdp_operator.settings import Settings
from fsdp_trainer.contract import NODE_NAME_ENV, EfaPolicy

RAY_VERSION = "2.58.0"
LABEL_RUN = f"{api.GROUP}/run"  # the run's name, hashed when longer than a label value may be
ANNOTATION_RUN = f"{api.GROUP}/run-name"  # the run's full name, always
ANNOTATION_IMAGE = f"{api.GROUP}/image"  # the image the cluster was built with (a tag before the first pull)
# KubeRay replaces a Ray container's command with `/bin/bash -c -- "ulimit ...; ray start ..."`, which skips
# the image's ENTRYPOINT: the DLC's entrypoint.sh (its CUDA forward-compatibility step for hosts whose driver
# is older than the image's CUDA 13.0) would never run. With this annotation KubeRay leaves the command alone
# and still puts its generated `ray start ... --block` in KUBERAY_GEN_RAY_START_CMD, which the command below
# runs through the DLC's entrypoint (directly on an image without one).
ANNOTATION_KEEP_COMMAND = "ray.io/overwrite-container-cmd"
EFA_CLAIM = "efa"  # the worker's resource claim on its EFA interfaces, where they come through DRA
RAY_METRICS_PORT = 8080  # KubeRay's default metrics-export-port of every Ray pod
DLC_ENTRYPOINT = "/usr/local/bin/entrypoint.sh"
RAY_START_COMMAND = ["/bin/bash", "-c", "--"]
RAY_START_ARGS = [
    "ulimit -n 65536; "
    f'if [ -x {DLC_ENTRYPOINT} ]; then exec {DLC_ENTRYPOINT} /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"; '
    'else exec /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"; fi'
]
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "fsdp-operator"
LABEL_INSTANCE_TYPE = "node.kubernetes.io/instance-type"
LABEL_ZONE = "topology.kubernetes.io/zone"
LABEL_KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
LABEL_KUEUE_PRIORITY = "kueue.x-k8s.io/priority-class"
GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
WORKER_GROUP = "gpu-workers"
LABEL_RAY_CLUSTER = "ray.io/cluster"  # KubeRay puts it on every pod of a RayCluster
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
RAY_AUTH_TOKEN_KEY = "token"
# EC2 families whose EFA supports GPUDirect RDMA; elsewhere (g5, g6, ...) NCCL stages through host memory. A
# family is the instance type before its first dot (p6-b200.48xlarge: p6-b200).
GPUDIRECT_RDMA_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300", "p6e-gb200")
# Every Ray pod's scratch space: Ray's session logs, object spilling, checkpoint staging and the model cache
# all write under /tmp, which would otherwise be the container layer.
SCRATCH_VOLUME = "scratch"
SCRATCH_PATH = "/tmp"
# KubeRay derives pod and Service names from the cluster name: keep them DNS-1035 labels within 63 chars.
_MAX_CHILD_NAME = 40
_MAX_LABEL_VALUE = 63
_NOT_DNS_1035 = re.compile(r"[^a-z0-9-]")
_LOOKS_HASHED = re.compile(r"-[0-9a-f]{6}$")  # what ray_cluster_name appends


@dataclass(frozen=True)
class Platform:
    """What the platform team sets for every run's pods (operator settings): where heads go, what they
    tolerate, and environment every Ray container gets (an S3-compatible endpoint, a proxy)."""

    head_node_selector: dict[str, str] = field(default_factory=dict)
    head_tolerations: tuple[dict[str, Any], ...] = ()
    pod_env: dict[str, str] = field(default_factory=dict)
    # Set where nodes expose EFA through DRA (AWS's EFA DRA driver): workers claim their interfaces from this
    # DeviceClass through a ResourceClaimTemplate of the run, not as vpc.amazonaws.com/efa.
    efa_device_class: str | None = None
    image_pull_policy: str | None = None  # None: by the image reference (image_pull_policy)


def image_pull_policy(image: str, platform: Platform) -> str:
    """Always for a tag: each node resolves it at the registry, not from an older copy it holds; a digest
    names one image, which a node that has it need not ask for."""
    return platform.image_pull_policy or ("IfNotPresent" if "@sha256:" in image else "Always")


def pod_platform(settings: Settings) -> Platform:
    """The operator settings that shape every run's pods."""
    return Platform(
        head_node_selector=dict(settings.head_node_selector),
        head_tolerations=tuple(
            t.model_dump(by_alias=True, exclude_none=True) for t in settings.head_tolerations
        ),
        pod_env=dict(settings.ray_pod_env),
        efa_device_class=settings.efa_device_class,
        image_pull_policy=settings.ray_image_pull_policy,
    )


@dataclass(frozen=True)
class RunRef:
    """Identity of the FSDPTrainingRun a child object belongs to."""

    name: str
    namespace: str
    uid: str


def _digest(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def ray_cluster_name(run_name: str) -> str:
    """The RayCluster's name: deterministic, so a replayed event or a restarted operator finds the same
    cluster; a DNS-1035 label short enough for KubeRay's derived names. Any run name the API accepts (dots,
    a leading digit, up to 253 characters) maps to one, with a hash of the full name whenever it had to
    change, so two runs never share a child: a name that already ends as a hashed one does (llama-ft-fea645
    would otherwise be llama.ft's child)."""
    cleaned = _NOT_DNS_1035.sub("-", run_name)
    if not cleaned[:1].isalpha():
        cleaned = "r-" + cleaned
    if cleaned == run_name and len(run_name) <= _MAX_CHILD_NAME and not _LOOKS_HASHED.search(run_name):
        return run_name
    return f"{cleaned[: _MAX_CHILD_NAME - 7].rstrip('-')}-{_digest(run_name, 6)}"


def label_value(value: str) -> str:
    """A label value for any object name: kept when it fits, else cut with a hash of the whole."""
    if len(value) <= _MAX_LABEL_VALUE:
        return value
    return f"{value[: _MAX_LABEL_VALUE - 9].rstrip('-.')}-{_digest(value, 8)}"


def run_labels(run: RunRef) -> dict[str, str]:
    return {LABEL_RUN: label_value(run.name), LABEL_MANAGED_BY: MANAGER}


def owner_reference(run: RunRef) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": run.name,
        "uid": run.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def uses_efa(spec: api.FSDPTrainingRunSpec) -> bool:
    return spec.cluster.efa(spec.network) > 0 and spec.network.efa != EfaPolicy.DISABLED


def instance_family(instance_type: str) -> str:
    return instance_type.split(".", 1)[0]


def efa_environment(spec: api.FSDPTrainingRunSpec) -> dict[str, str]:
    """NCCL/libfabric settings for EFA, plus the NCCL logging the trainer turns into transport evidence."""
    if not uses_efa(spec):
        return {}
    env = {
        "FI_PROVIDER": "efa",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
    }
    if spec.network.efa == EfaPolicy.REQUIRED:
        env["NCCL_NET"] = "Libfabric"  # NCCL then fails instead of falling back to sockets
    if instance_family(spec.cluster.instance_type) in GPUDIRECT_RDMA_FAMILIES:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    env.update(spec.network.nccl_env)
    return env


def _secret_env(spec: api.FSDPTrainingRunSpec) -> list[dict[str, Any]]:
    """Kubernetes resolves these in the pods; the operator passes references and never reads a Secret."""
    mlflow = spec.tracking.mlflow
    refs = {**spec.runtime_env.secret_env, **(mlflow.credentials.env() if mlflow else {})}
    return [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        for name, ref in refs.items()
    ]


def ray_auth_secret_name(run_name: str) -> str:
    return f"{ray_cluster_name(run_name)}-ray-auth"


def ray_auth_token(key: bytes, namespace: str, cluster_name: str) -> str:
    """The Ray token of a run's cluster, derived from the operator's key: the operator never reads it back (it
    has no get on Secrets), and a run deleted and applied again under its name finds the same token in a
    Secret not yet collected."""
    return hmac.new(key, f"{namespace}/{cluster_name}".encode(), hashlib.sha256).hexdigest()


def build_ray_auth_secret(run: RunRef, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": ray_auth_secret_name(run.name),
            "namespace": run.namespace,
            "labels": run_labels(run),
            "ownerReferences": [owner_reference(run)],
        },
        "type": "Opaque",
        "stringData": {RAY_AUTH_TOKEN_KEY: token},
    }


def _ray_auth_env(run: RunRef) -> list[dict[str, Any]]:
    """Ray's token auth (Ray >= 2.52): its dashboard, job API and GCS refuse a caller without the token."""
    token = {"secretKeyRef": {"name": ray_auth_secret_name(run.name), "key": RAY_AUTH_TOKEN_KEY}}
    return [{"name": "RAY_AUTH_MODE", "value": "token"}, {"name": "RAY_AUTH_TOKEN", "valueFrom": token}]


# Every address but the EC2 instance metadata service's (IPv4, and IPv6 on Nitro instances).
NOT_METADATA = (("0.0.0.0/0", "169.254.169.254/32"), ("::/0", "fd00:ec2::254/128"))


def build_network_policy(
    run: RunRef,
    operator_namespace: str,
    operator_pod_labels: dict[str, str],
    cidrs: list[str],
    scrape_namespaces: list[str] = [],  # noqa: B006 (never mutated)
) -> dict[str, Any]:
    """Ingress to the run's Ray pods: from each other on any port (Ray's own traffic); on the dashboard port
    (jobs, logs: code execution) from the operator's pods and the given address ranges only; on Ray's metrics
    port from the pods of the namespaces that scrape it (Prometheus). Egress: anywhere (the hub, S3, the
    tracking server, each other) but the instance metadata service, where the node's IAM role is one request
    away for the tenant's code, and the operator's pods (its metrics name every tenant's runs)."""
    ray_pods = {"matchLabels": {LABEL_RAY_CLUSTER: ray_cluster_name(run.name)}}
    dashboard_peers: list[dict[str, Any]] = [{"ipBlock": {"cidr": cidr}} for cidr in cidrs]
    if operator_pod_labels:
        dashboard_peers.insert(
            0,
            {
                "namespaceSelector": {"matchLabels": {LABEL_NAMESPACE_NAME: operator_namespace}},
                "podSelector": {"matchLabels": dict(operator_pod_labels)},
            },
        )
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": ray_pods}]}]
    if dashboard_peers:
        ingress.append({"from": dashboard_peers, "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]})
    if scrape_namespaces:
        scrapers = {
            "matchExpressions": [{"key": LABEL_NAMESPACE_NAME, "operator": "In", "values": scrape_namespaces}]
        }
        ingress.append(
            {
                "from": [{"namespaceSelector": scrapers}],
                "ports": [{"protocol": "TCP", "port": RAY_METRICS_PORT}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": ray_cluster_name(run.name),
            "namespace": run.namespace,
            "labels": run_labels(run),
            "ownerReferences": [owner_reference(run)],
        },
        "spec": {
            "podSelector": ray_pods,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": [
                {
                    "to": [
                        {"ipBlock": {"cidr": block, "except": [metadata]}} for block, metadata in NOT_METADATA
                    ]
                },
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchExpressions": [
                                    {
                                        "key": LABEL_NAMESPACE_NAME,
                                        "operator": "NotIn",
                                        "values": [operator_namespace],
                                    }
                                ]
                            }
                        }
                    ]
                },
            ],
        },
    }


def build_efa_claim_template(spec: api.FSDPTrainingRunSpec, run: RunRef, device_class: str) -> dict[str, Any]:
    """Each worker's claim on its EFA interfaces where nodes expose them through DRA: that many devices of
    the DeviceClass, allocated by the scheduler with the pod (one ResourceClaim per pod, from this)."""
    request = {
        "deviceClassName": device_class,
        "allocationMode": "ExactCount",
        "count": spec.cluster.efa(spec.network),
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": ray_cluster_name(run.name),
            "namespace": run.namespace,
            "labels": run_labels(run),
            "ownerReferences": [owner_reference(run)],
        },
        "spec": {"spec": {"devices": {"requests": [{"name": EFA_CLAIM, "exactly": request}]}}},
    }


def _tolerations(tolerations: list[api.Toleration]) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]


# A Ray container that exits with an error leaves its log's tail in its status (lastState.terminated.message):
# the operator names a crash loop's cause from the pod it watches, reading no logs.
CRASH_LOG_IN_STATUS = "FallbackToLogsOnError"
# Ray pods run the tenant's code: no way up to more privilege than the container starts with, no Linux
# capability (Ray, PyTorch and NCCL need none; EFA's pinned memory needs RLIMIT_MEMLOCK raised, which the EKS
# accelerated AMIs' container runtime does, not CAP_IPC_LOCK), the runtime's default seccomp filter.
RAY_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
RAY_POD_SECURITY = {"seccompProfile": {"type": "RuntimeDefault"}}


def _pod_common(spec: api.FSDPTrainingRunSpec, run: RunRef) -> dict[str, Any]:
    common: dict[str, Any] = {"securityContext": copy.deepcopy(RAY_POD_SECURITY)}
    if spec.cluster.service_account_name:  # one the namespace grants runs (tenancy.py): its token is wanted
        common["serviceAccountName"] = spec.cluster.service_account_name
    else:  # the namespace's default account, whose token Ray never uses: not in the tenant's code's reach
        common["automountServiceAccountToken"] = False
    if spec.cluster.priority_class_name:
        common["priorityClassName"] = spec.cluster.priority_class_name
    return common


def _scratch(size: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The /tmp volume of a Ray pod (on the node's disk, evicted beyond its size) and its mount."""
    return (
        {"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": size}},
        {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_PATH},
    )


def _plain_env(values: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": name, "value": value} for name, value in values.items()]


def _head_group(
    spec: api.FSDPTrainingRunSpec, run: RunRef, image: str, ray_auth: bool, platform: Platform
) -> dict[str, Any]:
    head = spec.cluster.head
    resources = {"cpu": head.cpu, "memory": head.memory}
    volume, mount = _scratch(head.ephemeral_storage)
    # The head has no GPU: without this, the NVIDIA container runtime (a GPU node group's default runtime)
    # fails to start it on a GPU-less node ("failed to initialize NVML"), as AWS's DLC guide says.
    env = _plain_env({"NVIDIA_VISIBLE_DEVICES": "void", **platform.pod_env})
    env += (_ray_auth_env(run) if ray_auth else []) + _secret_env(spec)  # the job's driver runs on the head
    pod: dict[str, Any] = {
        **_pod_common(spec, run),
        "containers": [
            {
                "name": "ray-head",
                "image": image,
                "imagePullPolicy": image_pull_policy(image, platform),
                "securityContext": copy.deepcopy(RAY_CONTAINER_SECURITY),
                "command": RAY_START_COMMAND,
                "args": RAY_START_ARGS,
                "terminationMessagePolicy": CRASH_LOG_IN_STATUS,
                "env": env,
                # No CPU limit: Ray's start and the job driver's imports come in bursts, and throttled at
                # the request Ray's own start-up timeouts fire (a head in a crash loop on a busy node); a
                # head holds no GPUs, so Guaranteed QoS would buy it nothing.
                "resources": {
                    "requests": {**resources, "ephemeral-storage": head.ephemeral_storage},
                    "limits": {"memory": head.memory},
                },
                "volumeMounts": [mount],
            }
        ],
        "volumes": [volume],
    }
    node_selector = head.node_selector or platform.head_node_selector
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    else:  # keep the head off the GPU nodes it would otherwise take a slot on
        pod["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": LABEL_INSTANCE_TYPE,
                                    "operator": "NotIn",
                                    "values": [spec.cluster.instance_type],
                                }
                            ]
                        }
                    ]
                }
            }
        }
    tolerations = [*platform.head_tolerations, *_tolerations(head.tolerations)]
    if tolerations:
        pod["tolerations"] = tolerations
    return {
        # No CPUs for Ray tasks either: Ray Train's workers and their data tasks run in the worker pods.
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {"metadata": {"labels": run_labels(run)}, "spec": pod},
    }


EFA_TAINTS = ("vpc.amazonaws.com/efa", "aws.amazon.com/efa")


def worker_tolerations(spec: api.FSDPTrainingRunSpec) -> list[api.Toleration]:
    """The taints GPU and EFA node groups carry (EKS, AWS's tested manifest), then the spec's own: what the
    workers tolerate, and so what preflight counts them able to land on."""
    keys = [GPU, *(EFA_TAINTS if uses_efa(spec) else [])]
    return accelerator_tolerations(keys) + list(spec.cluster.tolerations)


def accelerator_tolerations(keys: Iterable[str] = (GPU, *EFA_TAINTS)) -> list[api.Toleration]:
    return [api.Toleration(key=key, operator="Exists", effect="NoSchedule") for key in keys]


def _worker_group(
    spec: api.FSDPTrainingRunSpec,
    run: RunRef,
    image: str,
    zone: str | None,
    ray_auth: bool,
    platform: Platform,
    drain_seconds: int,
) -> dict[str, Any]:
    cluster = spec.cluster
    resources = {"cpu": cluster.worker_cpu(), "memory": cluster.worker_memory(), GPU: str(cluster.gpus())}
    efa_by_claim = uses_efa(spec) and platform.efa_device_class is not None
    if uses_efa(spec) and not efa_by_claim:
        resources[EFA] = str(cluster.efa(spec.network))
    node_selector = {**cluster.node_selector, LABEL_INSTANCE_TYPE: cluster.instance_type}
    placement_zone = cluster.zone or zone
    if placement_zone:  # EFA traffic does not cross availability zones
        node_selector[LABEL_ZONE] = placement_zone
    disk = spec.worker_ephemeral_storage()
    scratch, scratch_mount = _scratch(disk)
    container: dict[str, Any] = {
        "name": "ray-worker",
        "image": image,
        "imagePullPolicy": image_pull_policy(image, platform),
        "securityContext": copy.deepcopy(RAY_CONTAINER_SECURITY),
        "command": RAY_START_COMMAND,
        "args": RAY_START_ARGS,
        "terminationMessagePolicy": CRASH_LOG_IN_STATUS,
        "resources": {
            "requests": {**resources, "ephemeral-storage": disk},
            "limits": dict(resources),
        },
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, scratch_mount],
    }
    # `ray start --block` drains its node this long on SIGTERM: the trainer's checkpoint at the notice.
    drain = {drainwindow.DRAIN_ENV: str(drain_seconds)}
    env = _plain_env({**platform.pod_env, **efa_environment(spec), **drain})
    env += (_ray_auth_env(run) if ray_auth else []) + _secret_env(spec)
    # Hang forensics name the node a hung rank ran on.
    env.append({"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    container["env"] = env
    pod: dict[str, Any] = {
        **_pod_common(spec, run),
        "terminationGracePeriodSeconds": drainwindow.grace_period(drain_seconds),
        "nodeSelector": node_selector,
        # Off any node a fabric check found slow (fabric.py), whichever run's check it was.
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [fabric.avoid_degraded_nodes()]}]
                }
            }
        },
        "tolerations": _tolerations(worker_tolerations(spec)),
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}},
            scratch,
        ],
    }
    if efa_by_claim:
        container["resources"]["claims"] = [{"name": EFA_CLAIM}]
        pod["resourceClaims"] = [{"name": EFA_CLAIM, "resourceClaimTemplateName": ray_cluster_name(run.name)}]
    return {
        "groupName": WORKER_GROUP,
        "replicas": cluster.workers,
        "minReplicas": cluster.workers,
        "maxReplicas": cluster.workers,
        "rayStartParams": {},
        "template": {"metadata": {"labels": run_labels(run)}, "spec": pod},
    }


def build_raycluster(
    spec: api.FSDPTrainingRunSpec,
    run: RunRef,
    image: str,
    zone: str | None,
    ray_auth: bool = True,
    platform: Platform | None = None,
    drain_seconds: int = drainwindow.DEFAULT_SECONDS,
) -> dict[str, Any]:
    """The RayCluster for a run: head on a non-GPU node, one worker group of GPU+EFA pods in one zone; with
    ray_auth, every Ray process takes the token of the run's Secret (build_ray_auth_secret). The workers'
    drain window (drainwindow.py) is the one recorded in the run's status when the creation was decided.

    With a Kueue queue it is created suspended, as Kueue's defaulting webhook would make it (and the
    webhook may not run): Kueue unsuspends it on admission, and the operator never writes spec.suspend."""
    platform = platform or Platform()
    labels = run_labels(run)
    queued = spec.cluster.queue_name is not None
    if spec.cluster.queue_name:
        labels[LABEL_KUEUE_QUEUE] = spec.cluster.queue_name
    if spec.cluster.workload_priority_class:
        labels[LABEL_KUEUE_PRIORITY] = spec.cluster.workload_priority_class
    cluster_spec: dict[str, Any] = {"suspend": True} if queued else {}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": ray_cluster_name(run.name),
            "namespace": run.namespace,
            "labels": labels,
            "annotations": {
                ANNOTATION_RUN: run.name,
                ANNOTATION_IMAGE: image,
                ANNOTATION_KEEP_COMMAND: "true",
            },
            "ownerReferences": [owner_reference(run)],
        },
        "spec": {
            **cluster_spec,
            "rayVersion": RAY_VERSION,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": _head_group(spec, run, image, ray_auth, platform),
            "workerGroupSpecs": [_worker_group(spec, run, image, zone, ray_auth, platform, drain_seconds)],
        },
    }


def _images(group: dict[str, Any]) -> list[str]:
    return [c.get("image", "") for c in group.get("template", {}).get("spec", {}).get("containers", [])]


# What a pod template must not gain beyond what the operator built (the grants of tenancy.py, the hardening
# of every Ray pod): fields compared as they are, and lists whose every observed item must be one built.
POD_FIELDS = (
    "serviceAccountName",
    "automountServiceAccountToken",
    "securityContext",
    "hostNetwork",
    "hostPID",
    "hostIPC",
    "priorityClassName",
    "runtimeClassName",
    "nodeName",
)
POD_LISTS = ("volumes", "tolerations")
CONTAINER_FIELDS = ("securityContext",)
CONTAINER_LISTS = ("env", "envFrom", "volumeMounts")


def _devices_gained(built: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    """The devices (extended resources: GPUs, EFA interfaces) a container requests or limits above what was
    built, which admission shares out among runs. CPU, memory and disk are left out: their defaults move
    between operator versions (Karpenter's estimate lowered the default worker memory), and an upgrade must
    not restart every running run; the namespace's ResourceQuota bounds them."""
    gained = []
    for kind in ("requests", "limits"):
        want = (built.get("resources") or {}).get(kind) or {}
        for name, value in ((observed.get("resources") or {}).get(kind) or {}).items():
            if "/" not in name:  # not an extended resource
                continue
            try:
                more = name not in want or quantity.parse(value) > quantity.parse(want[name])
            except ValueError:
                more = True
            if more:
                gained.append(f"{kind}.{name} {str(value)[:32]}")
    return gained


def _template_drift(group: str, want: dict[str, Any], have: dict[str, Any], queued: bool) -> list[str]:
    """What a group's pod template gained or changed that the operator did not build: a service account, a
    privileged container, a hostPath volume, a toleration, a Secret in the environment. Kueue's admission adds
    its flavor's tolerations to a queued run's templates: those are Kueue's to set."""
    want_pod, have_pod = want.get("template", {}).get("spec", {}), have.get("template", {}).get("spec", {})
    changed = [f"{group} {key}" for key in POD_FIELDS if want_pod.get(key) != have_pod.get(key)]
    for key in POD_LISTS:
        if queued and key == "tolerations":
            continue
        if any(item not in (want_pod.get(key) or []) for item in have_pod.get(key) or []):
            changed.append(f"{group} {key}")
    want_containers = {c.get("name"): c for c in want_pod.get("containers", [])}
    for kind in ("containers", "initContainers"):
        for container in have_pod.get(kind) or []:
            built = want_containers.get(container.get("name")) if kind == "containers" else None
            where = f"{group} {kind[:-1]} {str(container.get('name'))[:63]}"
            if built is None:
                changed.append(f"{where} added")
                continue
            changed += [f"{where} {key}" for key in CONTAINER_FIELDS if built.get(key) != container.get(key)]
            changed += [f"{where} {gained}" for gained in _devices_gained(built, container)]
            for key in CONTAINER_LISTS:
                if any(item not in (built.get(key) or []) for item in container.get(key) or []):
                    changed.append(f"{where} {key}")
    return changed


def cluster_drift(desired: dict[str, Any], observed: dict[str, Any]) -> str | None:
    """How a RayCluster differs from what the run needs (edited by hand: workers, replicas, images, what its
    pods may do), or None. Only fields the operator sets and KubeRay never changes are compared."""
    want, have = desired["spec"], observed.get("spec", {})
    queued = LABEL_KUEUE_QUEUE in (desired["metadata"].get("labels") or {})
    differences = _template_drift("head", want["headGroupSpec"], have.get("headGroupSpec", {}), queued)
    if _images(want["headGroupSpec"]) != _images(have.get("headGroupSpec", {})):
        differences.append(f"head image {_images(have.get('headGroupSpec', {}))}")
    have_groups = {g.get("groupName"): g for g in have.get("workerGroupSpecs", [])}
    for group in want["workerGroupSpecs"]:
        found = have_groups.get(group["groupName"])
        if found is None:
            differences.append(f"worker group {group['groupName']} missing")
            continue
        for key in ("replicas", "minReplicas", "maxReplicas"):
            if found.get(key) != group[key]:
                differences.append(f"{group['groupName']}.{key} {found.get(key)} (want {group[key]})")
        if _images(group) != _images(found):
            differences.append(f"{group['groupName']} image {_images(found)} (want {_images(group)})")
        differences += _template_drift(group["groupName"], group, found, queued)
    return "; ".join(differences) or None
