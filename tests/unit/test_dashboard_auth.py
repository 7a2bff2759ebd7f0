"""Reaching a dashboard through the apiserver's service proxy with the operator's own credentials."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from kubernetes import client

from fsdp_operator.handlers import Context
from fsdp_operator.settings import DashboardAddressMode, Settings


def context(configuration: client.Configuration, mode: DashboardAddressMode) -> Context:
    kube = SimpleNamespace(configuration=configuration)
    settings = Settings(dashboard_address_mode=mode)
    return Context(settings=settings, kube=cast(Any, kube), s3=None, ec2=None, package_sha256="x")


def test_service_proxy_uses_the_clients_bearer_token_ca_and_client_certificate() -> None:
    # What load_incluster_config / load_kube_config leave in the client's configuration.
    configuration = client.Configuration()
    configuration.host = "https://10.0.0.1:443"
    configuration.api_key = {"BearerToken": "Bearer abc"}
    configuration.ssl_ca_cert = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    configuration.cert_file, configuration.key_file = "/tmp/client.crt", "/tmp/client.key"
    ctx = context(configuration, DashboardAddressMode.SERVICE_PROXY)
    auth = ctx.dashboard_auth()
    assert auth is not None and dict(auth.headers) == {"Authorization": "Bearer abc"}
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


def test_inside_the_cluster_no_credentials_travel_to_the_dashboard() -> None:
    ctx = context(client.Configuration(), DashboardAddressMode.SERVICE_DNS)
    assert ctx.dashboard_auth() is None
    assert ctx.jobs("ns", "c").address == "http://c-head-svc.ns.svc:8265"
