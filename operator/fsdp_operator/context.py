"""What every pass of the operator shares: its settings, its clients (apiserver, S3, EC2, each run's Ray
dashboard), admission, and each run's memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_operator import api, builder, drainwindow, instancetypes, preflight, submission, tenancy
from fsdp_operator.admission import Admission
from fsdp_operator.disruption import Disruptions
from fsdp_operator.jobs import DashboardAuth, Jobs, dashboard_url
from fsdp_operator.kube import Kube
from fsdp_operator.records import RunStorage
from fsdp_operator.runmemory import RunMemories
from fsdp_operator.settings import DashboardAddressMode, Settings
from fsdp_trainer.contract import run_prefix

RAY_TOKEN_HEADER = "X-Ray-Authorization"  # Ray's header for callers behind a proxy that owns Authorization
POLICY_SECONDS = 10.0


@dataclass
class Context:
    settings: Settings
    kube: Kube
    s3: Any
    ec2: Callable[[], Any]  # the EC2 client, built on first use
    autoscaling: Callable[[], Any] = lambda: None  # the EC2 Auto Scaling client, built on first use
    package_sha256: str = field(default_factory=submission.package_sha256)
    runs: RunMemories = field(default_factory=RunMemories)
    admission: Admission = field(init=False)
    job_clients: dict[tuple[str, DashboardAuth | None], Jobs] = field(default_factory=dict)
    disruptions: Disruptions = field(default_factory=Disruptions)
    ray_auth_key: bytes | None = None  # read at start when settings.ray_token_auth
    # namespace -> when its grants were read, and them (or why they cannot be read)
    policies: dict[str, tuple[float, tenancy.NamespacePolicy | str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.admission = Admission(
            self.settings.watch_namespaces,
            self.kube,
            self.ec2,
            efa_through_dra=self.settings.efa_device_class is not None,
            max_active_per_namespace=self.settings.max_active_runs_per_namespace,
            autoscaling=self.autoscaling,
            platform=self.platform,
            ray_pod_env=self.settings.ray_pod_env,
        )

    def sized(self, spec: api.FSDPTrainingRunSpec) -> api.FSDPTrainingRunSpec:
        """The spec with the worker sizes it leaves unset from EC2's facts where its instance type is not in
        instancetypes' table and the run asks EC2 anyway (scale-from-zero). The facts live in admission's
        cache of EC2's answers, not in the builder: it stays a function of the spec. Every pass sizes the
        spec again, so that the RayCluster compared for drift is the one created (EC2 unanswered: the pass
        fails and is retried, never built with another shape)."""
        kind = spec.cluster.instance_type
        if not spec.preflight.scale_from_zero or kind in instancetypes.GPU_INSTANCE_TYPES:
            return spec
        shape = self.admission.instance_type_facts(kind).shape
        return spec if shape is None else preflight.sized_by(spec, shape)

    @property
    def platform(self) -> builder.Platform:
        return builder.pod_platform(self.settings)

    def requested_image(self, spec: api.FSDPTrainingRunSpec) -> str:
        return spec.image or self.settings.default_image

    def raycluster(
        self,
        run: builder.RunRef,
        spec: api.FSDPTrainingRunSpec,
        image: str,
        status: api.FSDPTrainingRunStatus,
    ) -> dict[str, Any]:
        """The RayCluster as built for the run's status: its zone (none for a queued run: Kueue's flavor
        pins it) and the drain window recorded when its creation was decided."""
        return builder.build_raycluster(
            spec,
            run,
            image,
            None if spec.cluster.queue_name else status.zone,
            ray_auth=self.settings.ray_token_auth,
            platform=self.platform,
            drain_seconds=status.drain_seconds or drainwindow.DEFAULT_SECONDS,
        )

    def desired_raycluster(
        self, run: builder.RunRef, spec: api.FSDPTrainingRunSpec, status: api.FSDPTrainingRunStatus
    ) -> dict[str, Any]:
        """The RayCluster the run's next creation makes: after the first pull every attempt runs the pinned
        digest, even if the tag has moved since."""
        return self.raycluster(run, spec, status.image.digest or self.requested_image(spec), status)

    def network_policy(self, run: builder.RunRef) -> dict[str, Any]:
        settings = self.settings
        return builder.build_network_policy(
            run,
            settings.lease_namespace,
            settings.operator_pod_labels,
            settings.dashboard_ingress_cidrs,
            settings.ray_metrics_scrape_namespaces,
        )

    def ray_token(self, namespace: str, cluster_name: str) -> str | None:
        if self.settings.dashboard_address_mode == DashboardAddressMode.OVERRIDE:
            token = self.settings.dashboard_token
            return token.get_secret_value() if token else None
        if not self.settings.ray_token_auth:
            return None
        assert self.ray_auth_key is not None, "read at start"
        return builder.ray_auth_token(self.ray_auth_key, namespace, cluster_name)

    def dashboard_auth(self, namespace: str, cluster_name: str) -> DashboardAuth | None:
        """The run's Ray token in Ray's own header (the apiserver's proxy passes it on and strips
        Authorization). Through that proxy, the operator's own credentials too: its bearer token (refreshed
        by the client's hook), its client certificate, and the cluster's CA."""
        ray_token = self.ray_token(namespace, cluster_name)
        ray_headers = ((RAY_TOKEN_HEADER, f"Bearer {ray_token}"),) if ray_token else ()
        if self.settings.dashboard_address_mode != DashboardAddressMode.SERVICE_PROXY:
            return DashboardAuth(headers=ray_headers) if ray_headers else None
        configuration = self.kube.configuration
        token = configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        cert = (configuration.cert_file, configuration.key_file) if configuration.cert_file else None
        verify: str | bool = configuration.ssl_ca_cert or bool(configuration.verify_ssl)
        headers = ((("Authorization", token),) if token else ()) + ray_headers
        return DashboardAuth(headers=headers, verify=verify, client_cert=cert)

    def jobs(self, namespace: str, cluster_name: str) -> Jobs:
        address = dashboard_url(self.settings, namespace, cluster_name, self.kube.configuration.host)
        key = (address, self.dashboard_auth(namespace, cluster_name))
        if key not in self.job_clients:
            self.job_clients[key] = Jobs(address, key[1])
        return self.job_clients[key]

    def storage(self, spec: api.FSDPTrainingRunSpec, run: builder.RunRef) -> RunStorage:
        """The run's S3 prefix, kept in its memory with the checkpoint manifests read there."""
        uri = run_prefix(spec.checkpoint.storage_path, run.namespace, run.name)
        memory = self.runs.of(run.uid)
        if memory.storage is None or memory.storage.uri != uri:
            memory.storage = RunStorage(self.s3, uri)
        return memory.storage

    def refusals(self, namespace: str, spec: api.FSDPTrainingRunSpec) -> tuple[str, ...]:
        """What the run asks for that its namespace does not grant; its policy read at most once per
        POLICY_SECONDS (a grant the platform adds is seen within that)."""
        now = time.monotonic()
        kept = self.policies.get(namespace)
        if kept is None or now - kept[0] > POLICY_SECONDS:
            try:
                policy: tenancy.NamespacePolicy | str = tenancy.NamespacePolicy.of(
                    namespace, self.kube.namespace_annotations(namespace)
                )
            except tenancy.PolicyError as error:
                policy = str(error)
            kept = self.policies[namespace] = (now, policy)
        if isinstance(kept[1], str):
            return (f"the namespace's grants cannot be read: {kept[1]}",)
        settings = self.settings
        platform = tenancy.Platform(
            frozenset(settings.allowed_hosts), tuple(settings.head_tolerations), tuple(settings.s3_prefixes)
        )
        return tuple(tenancy.refusals(spec, kept[1], platform))

    def forget(self, uid: str) -> None:
        """Everything kept about a deleted run: its memory, and what admission kept of it."""
        self.runs.forget(uid)
        self.admission.forget(uid)
