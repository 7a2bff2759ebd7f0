"""Operator settings: environment and flags, validated with errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import CliApp, SettingsError

from fsdp_operator import settings as settings_module
from fsdp_operator.settings import DashboardAddressMode, Settings, TrainerDevice


def test_defaults_watch_everything_in_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    assert (
        settings.watch_namespaces == []
        and settings.dashboard_address_mode == DashboardAddressMode.SERVICE_DNS
    )
    assert settings.trainer_device == TrainerDevice.GPU and settings.default_image.endswith(
        ":train-ml-cuda-v1.1"
    )


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_OPERATOR_WATCH_NAMESPACES", "team-a, team-b")
    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE", "override")
    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_URL", "http://127.0.0.1:8265")
    settings = Settings()
    assert (
        settings.watch_namespaces == ["team-a", "team-b"]
        and settings.dashboard_url == "http://127.0.0.1:8265"
    )


def test_flags() -> None:
    settings = CliApp.run(
        Settings,
        cli_args=["--watch-namespaces", "ml", "--trainer-device", "cpu", "--observe-interval-seconds", "5"],
    )
    assert settings.watch_namespaces == ["ml"] and settings.trainer_device == TrainerDevice.CPU
    assert settings.ray_token_auth and settings.network_policy  # secure unless turned off
    assert settings.observe_interval_seconds == 5


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE": "override"}, "dashboard_url"),
        ({"FSDP_OPERATOR_DASHBOARD_URL": "127.0.0.1:8265"}, "dashboard_url"),
        ({"FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE": "telepathy"}, "dashboard_address_mode"),
        ({"FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS": "120"}, "observe_interval_seconds"),
        ({"FSDP_OPERATOR_TRAINER_DEVICE": "tpu"}, "trainer_device"),
        ({"FSDP_OPERATOR_HEALTH_PORT": "70000"}, "health_port"),
        ({"FSDP_OPERATOR_LEASE_NAMESPACE": "Team_A"}, "lease_namespace"),
        ({"FSDP_OPERATOR_WORKER_THREADS": "0"}, "worker_threads"),
        ({"FSDP_OPERATOR_DASHBOARD_INGRESS_CIDRS": "10.0.0.0/16,10.0.0.300/32"}, "dashboard_ingress_cidrs"),
        ({"FSDP_OPERATOR_OPERATOR_POD_LABELS": "app=operator"}, "operator_pod_labels"),
        ({"FSDP_OPERATOR_RAY_AUTH_KEY_SECRET": "Key_Secret"}, "ray_auth_key_secret"),
        ({"FSDP_OPERATOR_WATCH_TIMEOUT_SECONDS": "1"}, "watch_timeout_seconds"),
        ({"FSDP_OPERATOR_S3_PREFIXES": "s3://ok/,gs://other/"}, "s3_prefixes"),
        ({"FSDP_OPERATOR_S3_PREFIXES": "s3:///runs"}, "s3_prefixes"),
    ],
)
def test_bad_settings_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises((ValidationError, SettingsError), match=named):  # SettingsError: a bad JSON value
        Settings()


def test_leader_election_and_probe_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings_module, "SERVICE_ACCOUNT_NAMESPACE_FILE", Path("/nonexistent/namespace"))
    settings = Settings()
    assert settings.leader_election and settings.lease_name == "fsdp-operator"
    assert settings.health_port == 8080 and settings.worker_threads == 32
    assert settings.health_bind_address == "127.0.0.1"  # loopback outside a pod; the chart opens it up


@pytest.mark.parametrize(
    ("pod_namespace", "watched", "lease_namespace"),
    [("ops", "team-a", "ops"), (None, "team-a,team-b", "team-a"), (None, "", "default")],
    ids=["the-pod's", "first-watched", "default"],
)
def test_lease_namespace_defaults_to_the_pod_then_the_first_watched_namespace(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    pod_namespace: str | None,
    watched: str,
    lease_namespace: str,
) -> None:
    namespace_file = tmp_path / "namespace"
    if pod_namespace:
        namespace_file.write_text(pod_namespace)
    monkeypatch.setattr(settings_module, "SERVICE_ACCOUNT_NAMESPACE_FILE", namespace_file)
    monkeypatch.setenv("FSDP_OPERATOR_WATCH_NAMESPACES", watched)
    assert Settings().lease_namespace == lease_namespace
    monkeypatch.setenv("FSDP_OPERATOR_LEASE_NAMESPACE", "elsewhere")
    assert Settings().lease_namespace == "elsewhere"


def test_leader_election_flags() -> None:
    settings = CliApp.run(
        Settings,
        cli_args=["--leader-election", "false", "--health-port", "0", "--worker-threads", "8"],
    )
    assert not settings.leader_election and settings.health_port == 0 and settings.worker_threads == 8


def test_override_dashboards_per_namespace_before_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_operator.jobs import dashboard_url

    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE", "override")
    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_URLS", '{"team-b": "http://127.0.0.1:2"}')
    settings = Settings()
    assert dashboard_url(settings, "team-b", "c", "https://api") == "http://127.0.0.1:2"
    assert dashboard_url(settings, "team-a", "c", "https://api") == "http://127.0.0.1:1"
    monkeypatch.setenv("FSDP_OPERATOR_DASHBOARD_URLS", '{"team-b": "ftp://x"}')
    with pytest.raises(ValidationError, match="http:// or https://"):
        Settings()
