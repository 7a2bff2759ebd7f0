"""Operator settings, from FSDP_OPERATOR_* environment variables or the equivalent command-line flags."""

from __future__ import annotations

import ipaddress
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from fsdp_operator.api import MAX_AVOIDED_NODES, Toleration

# Where a kubelet mounts the pod's namespace, next to its service-account token.
SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# The Ray 2.58 Train DLC as AWS publishes it (aws/deep-learning-containers docs/src/data/ray-train/
# 2.58-gpu-ec2.yml: Python 3.13, CUDA 13.0, Amazon Linux 2023; tests/unit/test_settings.py checks the copy).
DEFAULT_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
# Where AWS's tested DLC manifest keeps Ray heads: nodes with this taint, which every head tolerates.
HEAD_NODE_TAINT = "ray.io/head-node"


class DashboardAddressMode(StrEnum):
    SERVICE_DNS = "service-dns"  # http://<cluster>-head-svc.<ns>.svc:8265, for an operator inside the cluster
    SERVICE_PROXY = "service-proxy"  # through the apiserver's service proxy, for an operator outside it
    OVERRIDE = "override"  # one fixed address for every run: tests and the local demo


class TrainerDevice(StrEnum):
    GPU = "gpu"  # the spec's GPUs per worker, as in production
    CPU = "cpu"  # CPU workers with gloo, for a Ray head that has no GPUs (the local demo)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FSDP_OPERATOR_", extra="forbid", cli_kebab_case=True)

    watch_namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Namespaces to watch, comma-separated; empty watches all namespaces.",
    )
    default_image: str = Field(default=DEFAULT_IMAGE, description="Ray Train DLC image when a run sets none.")
    ray_image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None,
        description="imagePullPolicy of the Ray containers. Unset: Always for an image named by tag, so "
        "that every node asks the registry what the tag names now instead of running an older copy it holds "
        "(one NCCL build per cluster; layers already on the node are not pulled again), IfNotPresent for one "
        "named by digest (as every attempt after the first is). Clusters with no registry set IfNotPresent.",
    )
    dashboard_address_mode: DashboardAddressMode = Field(
        default=DashboardAddressMode.SERVICE_DNS,
        description="How the operator reaches each run's Ray dashboard.",
    )
    dashboard_url: str | None = Field(
        default=None, description="The Ray dashboard address when dashboard_address_mode is override."
    )
    dashboard_urls: dict[str, str] = Field(
        default_factory=dict,
        description="With override: per-namespace dashboard addresses (JSON object), before dashboard_url.",
    )
    dashboard_token: SecretStr | None = Field(
        default=None,
        description="With override: the Ray token of the one dashboard every run is sent to (a shared head "
        "cannot take per-run tokens); unset: the dashboard has no token auth.",
    )
    ray_token_auth: bool = Field(
        default=True,
        description="Ray's token auth on every run's cluster (RAY_AUTH_MODE=token, Ray >= 2.52): a token per "
        "run in a Secret of the run, derived from a key in the operator's namespace.",
    )
    ray_auth_key_secret: str = Field(
        default="fsdp-operator-ray-auth-key",
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="The Secret, in the Lease's namespace, with the key of the per-run Ray tokens; the "
        "operator creates it at start when absent.",
    )
    network_policy: bool = Field(
        default=True,
        description="A NetworkPolicy per run: its Ray pods admit each other, and on the dashboard port only "
        "the operator's pods and dashboard_ingress_cidrs.",
    )
    operator_pod_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the operator's pods (JSON object), admitted to each run's dashboard from the "
        "Lease's namespace; the chart sets them.",
    )
    dashboard_ingress_cidrs: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Address ranges also admitted to each run's dashboard, comma-separated: the apiserver's "
        "with service-proxy.",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts runs may send credentials to (an MLflow tracking server named with "
        "tracking.mlflow.credentials), comma-separated; empty: none.",
    )
    max_active_runs_per_namespace: int = Field(
        default=16,
        ge=0,
        description="Runs of one namespace that may hold a cluster at once; more wait in Pending "
        "(NamespaceRunLimit). 0: no limit (one team could then take every node of a shared cluster).",
    )
    instance_hour_prices: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="USD per instance-hour by instance type (JSON object), what the platform charges for a "
        "node: `<type>:spot` and `<type>:on-demand` price a worker by its node's capacity type (EKS's or "
        "Karpenter's label), `<type>` any node of the type. Runs report their cost "
        "(status.goodput.costUsd), each stretch of time at the price of the capacity it held; a worker whose "
        "price is unknown: no cost.",
    )
    fabric_min_bus_bandwidth_gbps: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="The fabric check's threshold by instance type (JSON object, GB/s of all-reduce bus "
        "bandwidth), over the operator's table of EFA instance types; a run's network.minBusBandwidthGbps "
        "wins over both.",
    )
    fabric_label_nodes: bool = Field(
        default=True,
        description="Label a node fsdp.training.dev/fabric-degraded when a run's fabric check finds its link "
        "slow (runs with network.slowFabric avoidNode), so that every run's workers avoid it; false: never "
        "(the run's attempt fails as with slowFabric fail).",
    )
    fabric_label_max_per_run: int = Field(
        default=2,
        ge=1,
        le=MAX_AVOIDED_NODES,
        description="The most nodes one run's fabric checks label within fabric_label_window_seconds.",
    )
    fabric_label_max_per_namespace: int = Field(
        default=4,
        ge=1,
        description="The most nodes the runs of one namespace label within fabric_label_window_seconds.",
    )
    fabric_label_window_seconds: int = Field(
        default=86400, ge=60, description="The window of the fabric labels' limits per run and per namespace."
    )
    s3_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="s3:// prefixes every namespace's runs may read and write, comma-separated; "
        "'{namespace}' in one stands for the run's namespace (s3://ml-runs/{namespace}/); empty: none but "
        "what a namespace's fsdp.training.dev/run-s3-prefixes annotation grants.",
    )
    ray_metrics_scrape_namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Namespaces whose pods (Prometheus) each run's NetworkPolicy admits to Ray's metrics "
        "port, comma-separated.",
    )
    efa_device_class: str | None = Field(
        default=None,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="The DRA DeviceClass of EFA interfaces where nodes expose them through DRA and advertise "
        "no vpc.amazonaws.com/efa (AWS's EFA DRA driver installs efa.networking.k8s.aws): workers then claim "
        "their interfaces through a ResourceClaimTemplate of the run.",
    )
    head_node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels of the nodes for Ray heads (JSON object), for runs that set none; empty: "
        "any node that is not of the run's worker instance type.",
    )
    head_tolerations: list[Toleration] = Field(
        default_factory=lambda: [Toleration(key=HEAD_NODE_TAINT, operator="Exists", effect="NoSchedule")],
        description="Tolerations of every Ray head (JSON list), before the run's own.",
    )
    ray_pod_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of every Ray container of every run (JSON object), e.g. AWS_ENDPOINT_URL "
        "of an S3-compatible store. Visible in each RayCluster: never a secret (runs name Secrets in "
        "runtimeEnv.secretEnv).",
    )
    trainer_device: TrainerDevice = Field(
        default=TrainerDevice.GPU, description="gpu in production; cpu when the Ray head has no GPUs."
    )
    aws_region: str = Field(default="us-west-2", description="Region for EC2 capacity checks.")
    aws_endpoint_url: str | None = Field(
        default=None, description="Endpoint override for the EC2 and S3 APIs (a local AWS API server)."
    )
    observe_interval_seconds: float = Field(
        default=15, gt=0, le=30, description="Seconds between observations of a running job."
    )
    watch_timeout_seconds: int = Field(
        default=60,
        ge=5,
        le=600,
        description="Seconds each watch request lasts before it is renewed: a watch connection gone silent "
        "(a dead peer that never closed it) is noticed and replaced within about this long.",
    )
    leader_election: bool = Field(
        default=True, description="Reconcile only while holding the Lease, so one of several replicas acts."
    )
    lease_name: str = Field(
        default="fsdp-operator", max_length=253, pattern=DNS_SUBDOMAIN, description="Name of the Lease."
    )
    lease_namespace: str = Field(
        default="",
        max_length=63,
        pattern=rf"({DNS_LABEL})|^$",
        description="Namespace of the Lease; empty: the pod's own, else the first watched one, else default.",
    )
    health_port: int = Field(
        default=8080, ge=0, le=65535, description="Port of /healthz and /readyz; 0 serves no probes."
    )
    health_bind_address: str = Field(
        default="127.0.0.1",
        description="Address of the probe server; the chart sets 0.0.0.0 so that the kubelet reaches it.",
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Port of Prometheus' /metrics; 0 (the default) serves none."
    )
    metrics_bind_address: str = Field(
        default="127.0.0.1",
        description="Address of the metrics server; the chart sets 0.0.0.0 so that Prometheus reaches it.",
    )
    worker_threads: int = Field(
        default=32, ge=1, le=512, description="Threads that run handlers (each run's pass holds one)."
    )

    @field_validator(
        "watch_namespaces",
        "dashboard_ingress_cidrs",
        "ray_metrics_scrape_namespaces",
        "allowed_hosts",
        "s3_prefixes",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("s3_prefixes")
    @classmethod
    def _valid_s3_prefixes(cls, value: list[str]) -> list[str]:
        for prefix in value:
            if not prefix.startswith("s3://") or not prefix.removeprefix("s3://").split("/")[0]:
                raise ValueError(f"s3-prefixes: {prefix!r} is not an s3://bucket/... prefix")
        return value

    @field_validator("dashboard_ingress_cidrs")
    @classmethod
    def _valid_cidrs(cls, value: list[str]) -> list[str]:
        for cidr in value:
            ipaddress.ip_network(cidr)  # its ValueError names the bad range
        return value

    @model_validator(mode="after")
    def _resolve_lease_namespace(self) -> Self:
        if not self.lease_namespace:
            self.lease_namespace = own_namespace() or next(iter(self.watch_namespaces), "default")
        return self

    @model_validator(mode="after")
    def _proxy_needs_ingress(self) -> Self:
        if (
            self.dashboard_address_mode == DashboardAddressMode.SERVICE_PROXY
            and self.network_policy
            and not self.dashboard_ingress_cidrs
        ):
            raise ValueError(
                "dashboard_address_mode service-proxy with network_policy on needs dashboard_ingress_cidrs "
                "(FSDP_OPERATOR_DASHBOARD_INGRESS_CIDRS; chart: networkPolicy.dashboardIngressCIDRs): the "
                "apiserver's proxied connections come from its own addresses, which each run's NetworkPolicy "
                "admits to the dashboard only when listed; without them every submission would be dropped"
            )
        return self

    @model_validator(mode="after")
    def _override_needs_url(self) -> Self:
        if self.dashboard_address_mode == DashboardAddressMode.OVERRIDE and not self.dashboard_url:
            raise ValueError(
                "dashboard_url (FSDP_OPERATOR_DASHBOARD_URL) is required with dashboard_address_mode override"
            )
        for url in [self.dashboard_url, *self.dashboard_urls.values()]:
            if url and not url.startswith(("http://", "https://")):
                raise ValueError(f"dashboard URLs must start with http:// or https://, got {url!r}")
        return self


def own_namespace() -> str | None:
    """The namespace of the pod this runs in, as its service account mount says; None outside a pod."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None
