"""Reaching a dashboard through the apiserver's service proxy with the operator's own credentials."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from kubernetes import client

from fsdp_operator import builder
from fsdp_operator.context import Context
from fsdp_operator.settings import DashboardAddressMode, Settings

KEY = b"k" * 32


def context(configuration: client.Configuration, mode: DashboardAddressMode, **settings: Any) -> Context:
    kube = SimpleNamespace(configuration=configuration)
    if mode == DashboardAddressMode.OVERRIDE:
        settings.setdefault("dashboard_url", "http://127.0.0.1:8265")
    if mode == DashboardAddressMode.SERVICE_PROXY:
        settings.setdefault("dashboard_ingress_cidrs", ["10.0.0.0/24"])  # the apiserver's (required)
    ctx = Context(
        settings=Settings(dashboard_address_mode=mode, **settings),
        kube=cast(Any, kube),
        s3=None,
        ec2=None,
        package_sha256="x",
    )
    ctx.ray_auth_key = KEY
    return ctx


def ray_token(namespace: str, cluster: str) -> str:
    return f"Bearer {builder.ray_auth_token(KEY, namespace, cluster)}"


def test_service_proxy_uses_the_clients_bearer_token_ca_and_client_certificate() -> None:
    # What load_incluster_config / load_kube_config leave in the client's configuration.
    configuration = client.Configuration()
    configuration.host = "https://10.0.0.1:443"
    configuration.api_key = {"BearerToken": "Bearer abc"}
    configuration.ssl_ca_cert = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    configuration.cert_file, configuration.key_file = "/tmp/client.crt", "/tmp/client.key"
    ctx = context(configuration, DashboardAddressMode.SERVICE_PROXY)
    auth = ctx.dashboard_auth("team-a", "run-1")
    # The apiserver takes Authorization for itself; the run's Ray token travels in Ray's own header.
    assert auth is not None and dict(auth.headers) == {
        "Authorization": "Bearer abc",
        "X-Ray-Authorization": ray_token("team-a", "run-1"),
    }
    assert auth.verify == configuration.ssl_ca_cert and auth.client_cert == (
        "/tmp/client.crt",
        "/tmp/client.key",
    )
    jobs = ctx.jobs("team-a", "run-1")
    assert (
        jobs.address
        == "https://10.0.0.1:443/api/v1/namespaces/team-a/services/run-1-head-svc:dashboard/proxy"
    )
    assert jobs.auth == auth


def test_a_rotated_token_gets_a_client_of_its_own() -> None:
    configuration = client.Configuration()
    configuration.host = "https://10.0.0.1:443"
    configuration.api_key = {"BearerToken": "Bearer old"}
    ctx = context(configuration, DashboardAddressMode.SERVICE_PROXY)
    before = ctx.jobs("ns", "c")
    configuration.api_key = {"BearerToken": "Bearer new"}
    after = ctx.jobs("ns", "c")
    assert (
        after is not before
        and after.auth is not None
        and dict(after.auth.headers)["Authorization"] == "Bearer new"
    )


def test_inside_the_cluster_only_the_runs_ray_token_travels_to_its_dashboard() -> None:
    ctx = context(client.Configuration(), DashboardAddressMode.SERVICE_DNS)
    jobs = ctx.jobs("ns", "c")
    assert jobs.address == "http://c-head-svc.ns.svc:8265"
    assert jobs.auth is not None and dict(jobs.auth.headers) == {"X-Ray-Authorization": ray_token("ns", "c")}
    assert dict(ctx.jobs("ns", "other").auth.headers) != dict(jobs.auth.headers)  # type: ignore[union-attr]
    assert (
        context(client.Configuration(), DashboardAddressMode.SERVICE_DNS, ray_token_auth=False)
        .jobs("ns", "c")
        .auth
        is None
    )


def test_an_overridden_dashboard_gets_the_token_it_was_given() -> None:
    ctx = context(client.Configuration(), DashboardAddressMode.OVERRIDE, dashboard_token="shared")
    auth = ctx.dashboard_auth("ns", "c")
    assert auth is not None and dict(auth.headers) == {"X-Ray-Authorization": "Bearer shared"}
    assert context(client.Configuration(), DashboardAddressMode.OVERRIDE).dashboard_auth("ns", "c") is None
