"""The FSDPTrainingRun API (fsdp.training.dev/v1alpha1): the one source of the CRD schema and field docs.

Training-relevant sections (model, fsdp, training, data, checkpoint, network) are the trainer contract's own
models, embedded as they are, so the CRD, `kubectl explain` and the trainer's config cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from fsdp_operator import instancetypes, localdisk
from fsdp_trainer.contract import (
    PLAIN_TEXT,
    CheckpointRef,
    CheckpointSpec,
    ContractModel,
    DataSpec,
    EfaPolicy,
    FabricReport,
    FsdpSpec,
    MlflowConfig,
    MlflowRunRef,
    ModelSpec,
    NetworkSpec,
    RestartEntry,
    TrainingSpec,
    TransportReport,
    Versions,
)

GROUP = "fsdp.training.dev"
VERSION = "v1alpha1"
KIND = "FSDPTrainingRun"
PLURAL = "fsdptrainingruns"
SINGULAR = "fsdptrainingrun"
SHORT_NAMES = ["trainingrun", "trainingruns", "ftr"]
API_VERSION = f"{GROUP}/{VERSION}"

# A Kubernetes object name that is also a valid label value (it is copied into a label).
LABEL_VALUE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # with max_length 253
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$"
LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
NodeSelector = dict[
    Annotated[str, Field(max_length=316, pattern=LABEL_KEY)],
    Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)],
]
# Requirement specifiers only (name, extras, versions, markers-free): no pip options (--index-url, -e, -r),
# no URLs, VCS or local paths, which would change where the job's code comes from.
PIP_REQUIREMENT = (
    r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?( *(==|!=|<=|>=|~=|<|>) *[A-Za-z0-9.*+!_-]+ *,?)*$"
)
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# Environment a run may not set for its job: it would steer the runtime (loader, interpreter, Ray, the
# cloud identity), where code comes from (pip, uv and conda, which Ray's runtime env runs with the job's
# environment; the model hub's endpoint) or where traffic goes and whom it trusts (proxies, CA bundles),
# rather than configure the training; NCCL/libfabric settings go in network.ncclEnv. Compared in upper case:
# most tools also read http_proxy and the like in lower case.
RESERVED_ENV_PREFIXES = (
    "LD_",
    "PYTHON",
    "RAY_",
    "AWS_",
    "KUBERNETES_",
    "NCCL_",
    "FI_",
    "OFI_",
    "PIP_",
    "UV_",
    "CONDA",
    "HF_HUB_",
    "NVIDIA_",  # the NVIDIA container toolkit's: NVIDIA_VISIBLE_DEVICES=all in a pod's env is every GPU
)
RESERVED_ENV_NAMES = (
    "PATH",
    "HOME",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "HF_ENDPOINT",
    "HF_HOME",
    "XDG_CONFIG_HOME",  # where git, pip and others find their configuration
    "XDG_CONFIG_DIRS",
    "OPENSSL_CONF",  # loads providers and engines: a library of the tenant's choosing
    "OPENSSL_MODULES",
    "NETRC",  # credentials curl, git and requests send to a host
)
# NCCL and libfabric settings that load a library (or a file naming one) into the workers' collectives:
# refused in network.ncclEnv as LD_* is in runtimeEnv.env.
REFUSED_NCCL_ENV = (
    "NCCL_NET_PLUGIN",
    "NCCL_TUNER_PLUGIN",
    "NCCL_PROFILER_PLUGIN",
    "NCCL_ENV_PLUGIN",
    "NCCL_CONF_FILE",
    "FI_PROVIDER_PATH",
)
# An s3:// URI every library the run meets reads alike: a bucket, then non-empty key segments of letters,
# digits and `._=-`. urlparse drops `?...` and `#...` and splits `;`, fsspec and the datasets library expand
# `*`, `?`, `[...]` and `{...}`, some clients decode `%` and `+`, and an empty segment (`//`) is collapsed by
# some and kept by S3: any of them could make one run's path another's.
S3_URI = r"^s3://[a-z0-9][a-z0-9.-]*(/[A-Za-z0-9._=-]+)*/?$"
# The run's fields that may hold an s3:// URI (by their names in the manifest).
S3_URI_FIELDS = (
    "checkpoint.storagePath",
    "checkpoint.resume",
    "model.source",
    "model.tokenizer",
    "data.source",
    "data.evalSource",
)


def reserved_env(name: str) -> bool:
    upper = name.upper()
    return upper in RESERVED_ENV_NAMES or upper.startswith(RESERVED_ENV_PREFIXES)


IMAGE_PATTERN = r"^[a-z0-9]+([._/:-][a-zA-Z0-9_.-]+)*(@sha256:[0-9a-f]{64})?$"


class Phase(StrEnum):
    PENDING = "Pending"  # accepted; waiting for preflight capacity
    QUEUED = "Queued"  # its RayCluster waits, suspended, for Kueue to admit it (again, after a preemption)
    PROVISIONING = "Provisioning"  # RayCluster created, not ready yet
    CLUSTER_READY = "ClusterReady"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


# Phases in which the run holds its cluster's capacity and its active time counts.
ACTIVE_PHASES = (Phase.PROVISIONING, Phase.CLUSTER_READY, Phase.RUNNING, Phase.RESTARTING)
# Phases in which a RayCluster of the run's shape exists, so the shape and training inputs may not change.
IMMUTABLE_PHASES = (*ACTIVE_PHASES, Phase.QUEUED)
FINISHED_PHASES = (Phase.SUCCEEDED, Phase.FAILED)


class Toleration(ContractModel):
    key: str | None = Field(
        default=None, max_length=316, pattern=LABEL_KEY, description="Taint key the toleration applies to."
    )
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal.")
    value: str | None = Field(
        default=None, max_length=63, pattern=LABEL_VALUE, description="Taint value for operator Equal."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty means all."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated."
    )


class HeadSpec(ContractModel):
    cpu: str = Field(
        default="4", max_length=32, pattern=QUANTITY, description="CPU request of the Ray head (no limit)."
    )
    memory: str = Field(
        default="16Gi",
        max_length=32,
        pattern=QUANTITY,
        description="Memory request and limit of the Ray head.",
    )
    node_selector: NodeSelector = Field(
        default_factory=dict,
        max_length=32,
        description="Where the head runs; the head never asks for GPUs. Default: any node that is not of "
        "the workers' instance type.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="Head tolerations, beside the operator's (by default the ray.io/head-node taint's).",
    )
    ephemeral_storage: str = Field(
        default="8Gi",
        max_length=32,
        pattern=QUANTITY,
        description="Local disk the head requests, and the size of its /tmp volume (Ray's session logs, the "
        "job's driver). The default fits an EKS managed node group's default 20 GiB root volume.",
    )


class ClusterSpec(ContractModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.minWorkers) || self.minWorkers <= self.workers",
                    "message": "spec.cluster.minWorkers cannot be more than spec.cluster.workers",
                    "fieldPath": ".minWorkers",
                }
            ]
        }
    )

    workers: int = Field(default=2, ge=1, le=1024, description="Ray worker pods, one per GPU node.")
    min_workers: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Elastic training: the fewest workers an attempt may train on. When a node is lost (spot "
        "reclaimed, a failed node) or capacity is short, the run trains on what there is, between this and "
        "`workers`, with the same global batch (training.globalBatchSize), and grows back when nodes return "
        "(Ray Train's elastic scaling: a resize resumes from the latest checkpoint). Default: `workers` (no "
        "elasticity).",
    )
    gpus_per_worker: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="nvidia.com/gpu per worker pod (>= 1). Default: every GPU of instanceType "
        "(p5.48xlarge 8, g6.12xlarge 4; 4 for a type the operator does not know).",
    )
    efa_per_worker: int | None = Field(
        default=None,
        ge=0,
        le=32,
        description="vpc.amazonaws.com/efa interfaces per worker; 0 runs without EFA. Default: every EFA "
        "interface of instanceType (p5.48xlarge 32, p5en.48xlarge 16, p4d.24xlarge 4, g6.12xlarge 1; 1 for "
        "a type the operator does not know), none when network.efa is disabled.",
    )
    instance_type: str = Field(
        default="g6.12xlarge",
        max_length=64,
        pattern=r"^[a-z0-9][a-z0-9.-]*$",
        description="EC2 instance type of the worker nodes (node.kubernetes.io/instance-type).",
    )
    cpu: str | None = Field(
        default=None,
        max_length=32,
        pattern=QUANTITY,
        description="CPU request and limit per worker pod. Default: the instance type's vCPUs less 4 for the "
        "node's daemons (g6.12xlarge 44, p5.48xlarge 188).",
    )
    memory: str | None = Field(
        default=None,
        max_length=32,
        pattern=QUANTITY,
        description="Memory request and limit per worker pod. Default: what Karpenter's AWS provider assumes "
        "a node of the instance type leaves pods before one has launched, less 4Gi for the node's DaemonSets "
        "(g6.12xlarge 170Gi, p5.48xlarge 1888Gi): a larger request never gets a node from Karpenter.",
    )
    shm_size: str = Field(
        default="64Gi", max_length=32, pattern=QUANTITY, description="Size of the /dev/shm volume per worker."
    )
    ephemeral_storage: str | None = Field(
        default=None,
        max_length=32,
        pattern=QUANTITY,
        description="Local disk each worker requests, and the size of its /tmp volume (checkpoint staging, "
        "the model cache, Ray's logs and object spilling); beyond it the kubelet evicts the pod. Default: "
        "what the run writes at its peak, from the model's size (model.fromConfig, or the size in "
        "model.source's name such as 1.5B): the downloaded model (2 bytes per parameter) and a whole "
        "checkpoint copied on resume (12 bytes per parameter), plus 8Gi for Ray and a quarter more "
        "(Qwen2.5-1.5B: 33Gi); 200Gi when the size is unknown.",
    )
    zone: str | None = Field(
        default=None,
        max_length=64,
        pattern=r"^[a-z0-9-]+$",
        description="Availability zone for all workers; default: the one preflight picks.",
    )
    node_selector: NodeSelector = Field(
        default_factory=dict, max_length=32, description="Extra node labels the workers require."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Worker tolerations (e.g. for a GPU taint)."
    )
    head: HeadSpec = Field(default_factory=HeadSpec, description="The Ray head pod.")
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Service account for head and workers.",
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="Priority class for head and workers.",
    )
    queue_name: str | None = Field(
        default=None,
        max_length=63,
        pattern=LABEL_VALUE_NAME,
        description="Kueue LocalQueue of the run's namespace. Kueue then decides when the run starts (no "
        "capacity preflight of the operator's own): the RayCluster is created suspended with the "
        "kueue.x-k8s.io/queue-name label, the run is Queued until Kueue admits it, and a preemption "
        "suspends it back to Queued without spending a restart.",
    )
    workload_priority_class: str | None = Field(
        default=None,
        max_length=63,
        pattern=LABEL_VALUE_NAME,
        description="Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class): the priority Kueue "
        "queues and preempts by, without a Kubernetes PriorityClass on the pods.",
    )

    @model_validator(mode="after")
    def _min_workers_within_workers(self) -> ClusterSpec:
        if self.min_workers is not None and self.min_workers > self.workers:
            raise ValueError(
                f"cluster.minWorkers {self.min_workers} is more than cluster.workers {self.workers}"
            )
        return self

    def gpus(self) -> int:
        """GPUs per worker: as set, or every GPU of the instance type."""
        return self.gpus_per_worker or instancetypes.of(self.instance_type).gpus

    def efa(self, network: NetworkSpec) -> int:
        """EFA interfaces per worker: as set, else every interface of the instance type, or none when the
        run's network.efa is disabled."""
        if self.efa_per_worker is not None:
            return self.efa_per_worker
        if network.efa == EfaPolicy.DISABLED:
            return 0
        return instancetypes.of(self.instance_type).efa_interfaces

    def worker_cpu(self) -> str:
        return self.cpu or instancetypes.of(self.instance_type).worker_cpu

    def worker_memory(self) -> str:
        return self.memory or instancetypes.of(self.instance_type).worker_memory


class PreflightPolicy(StrEnum):
    WAIT = "Wait"
    FAIL = "Fail"


class PreflightSpec(ContractModel):
    on_insufficient_capacity: PreflightPolicy = Field(
        default=PreflightPolicy.WAIT,
        description="Wait: keep the run Pending and re-check; Fail: fail the run at once.",
    )
    recheck_seconds: int = Field(default=60, ge=5, description="Seconds between capacity re-checks.")
    scale_from_zero: bool = Field(
        default=False,
        description="GPU nodes are created on demand (Karpenter, cluster autoscaler): check the EC2 API "
        "for the instance type's zones and EFA support instead of existing nodes.",
    )


MAX_RESTARTS = 100
RESTART_HISTORY_IN_STATUS = 10
MAX_AVOIDED_NODES = 8
MAX_CONDITION_REASON = 128
MAX_MESSAGE = 1024


class RecoverySpec(ContractModel):
    max_restarts: int = Field(
        default=3, ge=0, le=MAX_RESTARTS, description="Resubmissions after the job or cluster fails."
    )
    backoff_seconds: int = Field(
        default=30, ge=0, description="Base delay before a restart; doubles each time."
    )
    hang_timeout_seconds: int = Field(
        default=1800,
        ge=60,
        description="After the attempt's first training step, no new progress record for this long counts as "
        "a hang. Also the bound for a run whose progress and Ray job both cannot be read.",
    )
    forensics_seconds: int = Field(
        default=60,
        ge=0,
        le=600,
        description="When the attempt is declared hung or its setup timed out: how long every rank is given "
        "to store its threads' stacks and last log lines under the run's prefix (forensics/attempt-N/) "
        "before the attempt is stopped; `kubectl trainingrun forensics` prints them. 0: stop at once.",
    )
    setup_timeout_seconds: int = Field(
        default=1800,
        ge=60,
        description="Before the first training step (runtime env, model download, checkpoint load): one "
        "setup stage lasting this long, or no trainer heartbeat for this long counted from the submission, "
        "fails the attempt as SetupTimeout.",
    )
    provisioning_timeout_seconds: int = Field(
        default=900,
        ge=60,
        description="A RayCluster not ready this long after it was created is deleted; the run goes back to "
        "Pending (preflight policy Wait) or fails (policy Fail) with reason ProvisioningTimeout.",
    )
    provisioning_attempts: int = Field(
        default=3,
        ge=1,
        le=20,
        description="RayClusters created and given up after provisioningTimeoutSeconds before the run fails "
        "with reason ProvisioningTimeout and the last reason its pods waited (preflight policy Wait).",
    )
    pod_error_timeout_seconds: int = Field(
        default=300,
        ge=0,
        description="Head or worker pods that cannot start (ErrImagePull, ImagePullBackOff, "
        "CreateContainerConfigError, RunContainerError, CrashLoopBackOff after 3 restarts, also in KubeRay's "
        "init containers), pods KubeRay cannot create (FailedCreateHeadPod, FailedCreateWorkerPod: a "
        "ResourceQuota, a missing service account) or a head no node can take (HeadUnschedulable) for this "
        "long fail the run with that reason, and its RayCluster is "
        "deleted, which gives the workers' GPUs back; condition PodsHealthy shows the reason at once.",
    )
    in_job_max_failures: int = Field(
        default=1, ge=0, description="Worker failures Ray Train retries inside one job before it fails."
    )


class SecretKeyRef(ContractModel):
    name: str = Field(max_length=253, pattern=DNS_SUBDOMAIN, description="A Secret in the run's namespace.")
    key: str = Field(max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The key within the Secret.")


class RuntimeEnvSpec(ContractModel):
    pip: list[Annotated[str, Field(max_length=256, pattern=PIP_REQUIREMENT)]] = Field(
        default_factory=list,
        max_length=256,
        description="Extra pip requirements, from the image's package index: requirement specifiers only "
        "(name, extras, versions), no pip options, URLs, VCS or local paths.",
    )
    env: dict[
        Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=32768, pattern=PLAIN_TEXT)]
    ] = Field(
        default_factory=dict,
        max_length=256,
        description="Extra environment variables for the job. Names that steer the runtime rather than "
        f"the training are refused: {', '.join(RESERVED_ENV_NAMES)} and "
        f"{', '.join(p + '*' for p in RESERVED_ENV_PREFIXES)} (NCCL and libfabric go in network.ncclEnv).",
    )

    secret_env: dict[Annotated[str, Field(max_length=128)], SecretKeyRef] = Field(
        default_factory=dict,
        max_length=64,
        description="Environment variables from Secrets in the run's namespace (an HF token, for instance), "
        "set in the Ray pods by Kubernetes; the job inherits them. The operator never reads the Secret: its "
        "value appears nowhere in the run, its status, its events or run.json. Names as for env, and not "
        "also in env.",
    )

    @field_validator("env", "secret_env")
    @classmethod
    def _no_runtime_steering(cls, env: dict[str, Any]) -> dict[str, Any]:
        refused = sorted(name for name in env if reserved_env(name) or not re.fullmatch(ENV_NAME, name))
        if refused:
            raise ValueError(f"these environment names are not allowed: {', '.join(refused)}")
        return env

    @model_validator(mode="after")
    def _one_source_per_name(self) -> RuntimeEnvSpec:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"set in both env and secretEnv: {', '.join(both)}")
        return self


# The variables MLflow's own client reads its credentials from; the trainer's client reads the same.
MLFLOW_ENV_PREFIX = "MLFLOW_TRACKING_"
MLFLOW_CREDENTIAL_ENV = {
    "token": "MLFLOW_TRACKING_TOKEN",
    "username": "MLFLOW_TRACKING_USERNAME",
    "password": "MLFLOW_TRACKING_PASSWORD",
}


class MlflowCredentials(ContractModel):
    token: SecretKeyRef | None = Field(
        default=None, description="A bearer token (MLFLOW_TRACKING_TOKEN in the Ray pods)."
    )
    username: SecretKeyRef | None = Field(
        default=None, description="HTTP basic user name (MLFLOW_TRACKING_USERNAME); needs password."
    )
    password: SecretKeyRef | None = Field(
        default=None, description="HTTP basic password (MLFLOW_TRACKING_PASSWORD); needs username."
    )

    @model_validator(mode="after")
    def _basic_auth_in_pairs(self) -> MlflowCredentials:
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password go together")
        return self

    def env(self) -> dict[str, SecretKeyRef]:
        """The credentials as environment variables from Secrets."""
        refs = {"token": self.token, "username": self.username, "password": self.password}
        return {MLFLOW_CREDENTIAL_ENV[field]: ref for field, ref in refs.items() if ref is not None}


class MlflowSpec(MlflowConfig):
    credentials: MlflowCredentials = Field(
        default_factory=MlflowCredentials,
        description="Secrets in the run's namespace holding the tracking server's credentials, set in the "
        "Ray pods by Kubernetes as secretEnv is: the operator never reads them.",
    )

    def trainer_view(self) -> MlflowConfig:
        return MlflowConfig.model_validate(self.model_dump(exclude={"credentials"}))


class TrackingSpec(ContractModel):
    mlflow: MlflowSpec | None = Field(
        default=None,
        description="Log params (every resolved config field), metrics (loss, eval loss, learning rate, "
        "tokens/s, MFU per logged step), tags (run, attempt, image digest, trainer package sha256, data "
        "fingerprint) and the exported model to an MLflow tracking server: one MLflow run per training "
        "run, continued by every restart. A server that is down costs a warning, never the training.",
    )


class CleanupPolicy(StrEnum):
    DELETE_CLUSTER = "DeleteCluster"
    KEEP_CLUSTER = "KeepCluster"


class FSDPTrainingRunSpec(ContractModel):
    model: ModelSpec = Field(description="The model to fine-tune.")
    image: str | None = Field(
        default=None,
        max_length=512,
        pattern=IMAGE_PATTERN,
        description="Ray Train DLC image for head and workers, by tag or @sha256: digest; default from the "
        "operator's settings. After the first pull the run pins the digest that ran.",
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Shape of the RayCluster.")
    preflight: PreflightSpec = Field(
        default_factory=PreflightSpec, description="Capacity check before creating."
    )
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec, description="FSDP2 sharding and precision.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Optimisation hyperparameters.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training and evaluation data.")
    checkpoint: CheckpointSpec = Field(description="Checkpoint storage, cadence and resume policy.")
    recovery: RecoverySpec = Field(default_factory=RecoverySpec, description="Restarts after failures.")
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="EFA policy and NCCL settings.")
    runtime_env: RuntimeEnvSpec = Field(
        default_factory=RuntimeEnvSpec, description="Extra pip packages and environment for the trainer job."
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="Experiment tracking (MLflow).")
    suspend: bool = Field(
        default=False, description="Tear the cluster down and keep checkpoints; false again resumes."
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Fail the run when it has been active (from the creation of its RayCluster, not counting "
        "time suspended or waiting for capacity) for longer than this.",
    )
    cleanup_policy: CleanupPolicy = Field(
        default=CleanupPolicy.DELETE_CLUSTER,
        description="After the run finishes: DeleteCluster frees the GPUs (the CR and run.json remain); "
        "KeepCluster leaves the RayCluster for inspection.",
    )

    def worker_disk(self) -> localdisk.DiskPlan:
        """What each worker writes locally at its peak, from which its disk request defaults."""
        return localdisk.plan(self.model, self.fsdp.mixed_precision, self.cluster.workers)

    def worker_ephemeral_storage(self) -> str:
        """The disk each worker requests: as set, or what it writes at its peak."""
        return self.cluster.ephemeral_storage or self.worker_disk().quantity

    def s3_uris(self) -> dict[str, str]:
        """The run's s3:// URIs, by their fields' names in the manifest (S3_URI_FIELDS)."""
        found = {}
        for field in S3_URI_FIELDS:
            parent_alias, alias = field.split(".")
            parent = getattr(self, _by_alias(type(self), parent_alias))
            value = getattr(parent, _by_alias(type(parent), alias))
            if isinstance(value, str) and value.startswith("s3://"):
                found[field] = value
        return found

    @model_validator(mode="after")
    def _s3_uris_read_alike(self) -> FSDPTrainingRunSpec:
        for field, uri in self.s3_uris().items():
            if not re.fullmatch(S3_URI, uri):
                raise ValueError(
                    f"spec.{field}: {uri!r} is not an s3:// URI of a bucket and key segments of letters, "
                    "digits and ._=- (characters such as ? # * % + and // are read differently by the "
                    "libraries that open it)"
                )
        return self

    @model_validator(mode="after")
    def _no_library_loading_nccl_env(self) -> FSDPTrainingRunSpec:
        refused = sorted(set(self.network.nccl_env) & set(REFUSED_NCCL_ENV))
        if refused:
            raise ValueError(f"spec.network.ncclEnv: {', '.join(refused)} would load a library; not allowed")
        return self

    @model_validator(mode="after")
    def _mlflow_credentials_in_one_place(self) -> FSDPTrainingRunSpec:
        if self.tracking.mlflow is not None:
            names = [*self.runtime_env.env, *self.runtime_env.secret_env]
            if any(name.startswith(MLFLOW_ENV_PREFIX) for name in names):
                raise ValueError(
                    f"runtimeEnv: with tracking.mlflow, {MLFLOW_ENV_PREFIX}* credentials go in "
                    "tracking.mlflow.credentials"
                )
        return self


def _by_alias(model: type[ContractModel], alias: str) -> str:
    return next(name for name, field in model.model_fields.items() if (field.alias or name) == alias)


# ----------------------------------------------------------------------------------------------------------
# Status


class Condition(ContractModel):
    type: str = Field(
        max_length=64,
        description="Preflight, ClusterReady, PodsHealthy, PodsScheduled (False with the scheduler's message "
        "while a worker pod waits for a node), JobRunning, Finished (True when the run ended "
        "either way: wait on it), Succeeded (False when the run failed), Failed (Unknown while a failure "
        "past maxRestarts waits 30 s for a disruption that would excuse it), Suspended, "
        "TransportDegraded, FabricVerified (the attempt's fabric check: False below "
        "network.minBusBandwidthGbps, naming the slow pod and node), ImageConsistent, StorageReadable or "
        "Admitted (by Kueue, for runs with a queue).",
    )
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=MAX_CONDITION_REASON, description="CamelCase reason.")
    message: str = Field(default="", max_length=MAX_MESSAGE)
    last_transition_time: dt.datetime
    observed_generation: int | None = None


class ImageStatus(ContractModel):
    requested: str | None = Field(default=None, description="The image reference the spec asked for.")
    digest: str | None = Field(default=None, description="repo@sha256 digest the pods actually ran.")
    consistent: bool | None = Field(default=None, description="False when pods reported different digests.")


class DataRowsStatus(ContractModel):
    """Rows that could not be learned from are counted, never a crash: data.overLength says whether a long row
    is truncated or dropped."""

    read: int = 0
    unparsable: int = 0
    truncated: int = 0
    dropped: int = 0


class ProgressStatus(ContractModel):
    stage: str | None = Field(default=None, description="Setup stage of the trainer before its first step.")
    stage_since: dt.datetime | None = Field(default=None, description="When that stage was first reported.")
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    world_size: int | None = Field(
        default=None,
        description="Training processes of the latest step (workers x GPUs per worker; fewer while an "
        "elastic run trains on fewer nodes than cluster.workers).",
    )
    non_finite_steps: int | None = Field(
        default=None,
        description="Optimizer steps this attempt skipped for a non-finite loss or gradient norm "
        "(training.maxNonFiniteSteps in a row fail it with reason NonFiniteLoss).",
    )
    data_rows: DataRowsStatus | None = Field(
        default=None, description="What became of the data's rows read so far (by rank 0)."
    )
    adapter_bytes: int | None = Field(
        default=None, description="A LoRA run's adapter in bytes (fsdp.adapter): what its export holds."
    )
    updated_at: dt.datetime | None = None


class CheckpointsStatus(ContractModel):
    latest: CheckpointRef | None = Field(default=None, description="Latest complete checkpoint.")
    recent: list[CheckpointRef] = Field(
        default_factory=list, description="The last few complete checkpoints."
    )


class QueueStatus(ContractModel):
    workload: str | None = Field(default=None, description="The Kueue Workload of the run's RayCluster.")
    cluster_queue: str | None = Field(default=None, description="The ClusterQueue that admitted it.")
    flavors: list[str] = Field(
        default_factory=list, max_length=16, description="ResourceFlavors Kueue assigned, as pod-set:flavor."
    )
    admitted_time: dt.datetime | None = Field(default=None, description="When Kueue last admitted it.")


class RestartsStatus(ContractModel):
    count: int = Field(default=0, description="Restarts after failures; at most spec.recovery.maxRestarts.")
    preemptions: int = Field(
        default=0, description="Times Kueue took the capacity back; they never count against maxRestarts."
    )
    history: list[RestartEntry] = Field(
        default_factory=list,
        max_length=RESTART_HISTORY_IN_STATUS,
        description=f"The last {RESTART_HISTORY_IN_STATUS} restarts and preemptions (reason Preempted); "
        "run.json keeps every one.",
    )


class MlflowRunStatus(ContractModel):
    tracking_uri: str = Field(description="The tracking server.")
    experiment_id: str
    run_id: str = Field(description="The MLflow run every attempt of this training run logs to.")
    url: str = Field(description="The run's page in the MLflow UI.")

    @classmethod
    def of(cls, ref: MlflowRunRef) -> MlflowRunStatus:
        base = ref.tracking_uri.rstrip("/")
        return cls(
            tracking_uri=ref.tracking_uri,
            experiment_id=ref.experiment_id,
            run_id=ref.run_id,
            url=f"{base}/#/experiments/{ref.experiment_id}/runs/{ref.run_id}",
        )


class RecordStatus(ContractModel):
    uri: str | None = Field(default=None, description="Where run.json is written.")
    logs_uri: str | None = Field(
        default=None,
        description="Where the logs are: attempt-<n>/rank-<k>.log (each rank's log lines and Python "
        "warnings, streamed) and attempt-<n>/driver.log (the Ray job's log, when the job ends); "
        "`kubectl trainingrun logs` reads them.",
    )
    package_sha256: str | None = Field(default=None, description="sha256 of the trainer package submitted.")
    versions: Versions = Field(default_factory=Versions)
    exported_model_uri: str | None = None
    mlflow_run: MlflowRunStatus | None = Field(
        default=None,
        description="With tracking.mlflow: the MLflow run the trainer logs to (from mlflow.json beside the "
        "checkpoints), once the trainer has created it.",
    )


class SuspectStatus(ContractModel):
    rank: int
    pod: str | None = None
    node: str | None = None
    why: str = Field(max_length=MAX_MESSAGE)


class NcclHangDetectorStatus(ContractModel):
    """Ray Train's NCCL hang detector (NCCL RAS, Ray >= 2.60), as the attempt's rank 0 reported it."""

    state: str = Field(
        max_length=MAX_CONDITION_REASON,
        description="observe (the trainer turns it on for GPU runs), fail (the run's own setting), off (CPU "
        "runs, or the run turned it off), or 'unavailable in Ray X' (the image's Ray lacks it).",
    )
    confirmed: bool = Field(
        default=False,
        description="It confirmed a hang (a communicator whose ranks disagree made no progress for 120 s) "
        "and stored NCCL RAS's report and every rank's stack under uri.",
    )
    uri: str | None = Field(default=None, max_length=MAX_MESSAGE)
    finding: str = Field(
        default="",
        max_length=MAX_MESSAGE,
        description="From its last NCCL RAS poll: each communicator whose ranks disagree, the ranks behind.",
    )


class ForensicsStatus(ContractModel):
    attempt: int = Field(description="The attempt declared hung (or whose setup timed out).")
    reason: str = Field(max_length=MAX_CONDITION_REASON, description="Hang or SetupTimeout.")
    requested_at: dt.datetime = Field(description="When every rank was asked for its stacks.")
    uri: str = Field(description="Where the ranks' stacks are (rank-<k>.json).")
    ranks_answered: int = 0
    world_size: int | None = Field(default=None, description="The ranks asked.")
    concluded_at: dt.datetime | None = Field(
        default=None, description="When the operator stopped waiting for answers and stopped the attempt."
    )
    suspect: SuspectStatus | None = Field(
        default=None,
        description="The rank that most likely hung: one whose training thread is not in a collective while "
        "others wait in one, else the one behind in steps.",
    )
    nccl_hang_detector: NcclHangDetectorStatus | None = Field(
        default=None, description="Ray Train's NCCL hang detector: its state, and what it found of this hang."
    )


class AvoidedNode(ContractModel):
    node: str
    labelled_at: dt.datetime
    why: str = Field(max_length=MAX_MESSAGE)


class FabricStatus(ContractModel):
    attempt: int = Field(description="The attempt whose fabric check this is.")
    report: FabricReport = Field(
        description="Its figures (the sweep, the slowest links) and verdict, bounded; run.json and the "
        "progress record hold the rest."
    )
    avoided_nodes: list[AvoidedNode] = Field(
        default_factory=list,
        max_length=MAX_AVOIDED_NODES,
        description=f"Nodes this run's checks found slow and labelled {GROUP}/fabric-degraded (the last "
        f"{MAX_AVOIDED_NODES}); every run's workers avoid them until the platform removes the label.",
    )


class GoodputSeconds(ContractModel):
    """Seconds since the run was created, by what they went to; they add up to accountedUntil minus the
    run's creation."""

    queued: int = Field(default=0, description="Pending or Queued: waiting for capacity or for Kueue.")
    provisioning: int = Field(
        default=0,
        description="The cluster starting, the job submitted, the trainer setting up before its first step.",
    )
    fabric_check: int = Field(
        default=0, description="Each attempt's fabric check before its first step (status.fabric)."
    )
    training: int = Field(default=0, description="Training steps that count.")
    checkpoint_stall: int = Field(
        default=0, description="Training held up by checkpoints (their staging off the device)."
    )
    lost_to_restarts: int = Field(
        default=0,
        description="Restarting, and the training time of steps a restart redoes (those after the checkpoint "
        "it resumes from).",
    )
    lost_to_preemptions: int = Field(
        default=0,
        description="The same for restarts after a disruption (a node or pod taken away: status.restarts."
        "preemptions): what spot capacity and drains cost the run.",
    )
    idle: int = Field(default=0, description="Suspended (holding no capacity).")


class GoodputStatus(ContractModel):
    accounted_until: dt.datetime | None = Field(
        default=None,
        description="The seconds cover the run's creation up to this moment (its completion once finished; "
        "at most a minute behind while it is not).",
    )
    seconds: GoodputSeconds = Field(default_factory=GoodputSeconds)
    fraction: float | None = Field(
        default=None,
        description="Goodput: training seconds over the seconds the run held its cluster (provisioning, "
        "fabric check, training, checkpoint stall, lost to restarts and to preemptions).",
    )
    worker_seconds_held: int = Field(default=0, description="Worker-seconds the run's clusters held.")
    gpu_seconds_held: int = Field(default=0, description="GPU-seconds the run's clusters held.")
    gpu_hours_held: float = Field(default=0.0, description="The same in hours.")
    tokens: int = Field(default=0, description="Tokens trained on (the data position of the latest step).")
    progress_percent: float | None = Field(default=None, description="The latest step over maxSteps.")
    eta: dt.datetime | None = Field(
        default=None, description="While Running: when maxSteps is reached at the latest step time."
    )
    cost_usd: float | None = Field(
        default=None,
        description="Worker-hours held, each stretch at the platform's price for the instance type and the "
        "capacity type (spot or on-demand) of the workers' nodes then (the operator's instance-hour-prices; "
        "chart pricing.instanceHourUSD), a worker counting for its share of a node's GPUs; unset without a "
        "price.",
    )
    cost_per_million_tokens_usd: float | None = None


class ProvisioningStatus(ContractModel):
    """How far the current RayCluster's pods have come while it provisions.
    recovery.provisioningTimeoutSeconds counts from lastProgressTime: a slow image pull or a node being added
    is not a hang, and a cluster that keeps coming up is not deleted to start cold again."""

    pods: int = Field(default=0, description="The RayCluster's Ray pods (head and workers) seen.")
    pods_placed: int = Field(default=0, description="Of them, bound to a node.")
    pods_pulling: int = Field(default=0, description="Of them, pulling their image now.")
    pods_started: int = Field(
        default=0, description="Of them, with a container created (the image is there)."
    )
    pods_ready: int = 0
    last_progress_time: dt.datetime | None = Field(
        default=None, description="When a count last grew, or a pull began (else when provisioning began)."
    )


class FSDPTrainingRunStatus(ContractModel):
    observed_generation: int | None = None
    phase: Phase | None = None
    phase_transition_time: dt.datetime | None = Field(
        default=None, description="When the phase last changed."
    )
    message: str | None = Field(default=None, max_length=MAX_MESSAGE)
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    ray_cluster_name: str | None = None
    drain_seconds: int | None = Field(
        default=None,
        description="The drain window the RayCluster's worker pods were created with (Ray's "
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; their terminationGracePeriodSeconds 15 s more): twice the "
        "slowest recent checkpoint's save and a margin, 20-300 s; before any save was measured, the save "
        "estimated from a worker's checkpoint shards at 250 MB/s (30 s where the model's size is unknown).",
    )
    zone: str | None = Field(default=None, description="Availability zone the workers were placed in.")
    job_submission_id: str | None = Field(
        default=None, description="The current attempt's Ray job, recorded before it is submitted."
    )
    attempt: int = Field(default=0, description="Job submissions so far, counting from 1.")
    provisioning_timeouts: int = Field(
        default=0, description="RayClusters given up after recovery.provisioningTimeoutSeconds."
    )
    attempt_time: dt.datetime | None = Field(
        default=None, description="When the current attempt was decided."
    )
    provisioning: ProvisioningStatus | None = Field(
        default=None, description="The current RayCluster's pods coming up, while the run is Provisioning."
    )
    image: ImageStatus = Field(default_factory=ImageStatus)
    progress: ProgressStatus = Field(default_factory=ProgressStatus)
    checkpoints: CheckpointsStatus = Field(default_factory=CheckpointsStatus)
    transport: TransportReport | None = None
    restarts: RestartsStatus = Field(default_factory=RestartsStatus)
    queue: QueueStatus | None = Field(default=None, description="Kueue's admission, for runs with a queue.")
    record: RecordStatus = Field(default_factory=RecordStatus)
    start_time: dt.datetime | None = Field(default=None, description="When the first RayCluster was created.")
    completion_time: dt.datetime | None = None
    active_since: dt.datetime | None = Field(
        default=None,
        description="Start of the current active stretch (a cluster exists); unset while waiting.",
    )
    active_seconds: int = Field(
        default=0, description="Active seconds before active_since; activeDeadlineSeconds counts both."
    )
    next_check_time: dt.datetime | None = Field(
        default=None, description="When the operator next re-checks capacity or restarts."
    )
    goodput: GoodputStatus = Field(default_factory=GoodputStatus)
    fabric: FabricStatus | None = Field(
        default=None, description="The latest fabric check, run before each attempt's first step."
    )
    forensics: ForensicsStatus | None = Field(
        default=None, description="The latest hang forensics: what every rank was doing when it was stopped."
    )


class FSDPTrainingRun(ContractModel):
    api_version: Literal["fsdp.training.dev/v1alpha1"] = API_VERSION  # type: ignore[assignment]
    kind: Literal["FSDPTrainingRun"] = KIND  # type: ignore[assignment]
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: FSDPTrainingRunSpec
    status: FSDPTrainingRunStatus = Field(default_factory=FSDPTrainingRunStatus)
