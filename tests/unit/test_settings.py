"""Operator settings: environment and flags, validated with errors that name the setting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from pydantic_settings import CliApp

from fsdp_operator.settings import DashboardAddressMode, Settings, TrainerDevice


def test_defaults_watch_everything_in_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    assert (
        settings.watch_namespaces == []
        and settings.dashboard_address_mode == DashboardAddressMode.SERVICE_DNS
    )
    assert settings.trainer_device == TrainerDevice.GPU and "2.58.0" in settings.default_image


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
    assert settings.observe_interval_seconds == 5


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE": "override"}, "dashboard_url"),
        ({"FSDP_OPERATOR_DASHBOARD_URL": "127.0.0.1:8265"}, "dashboard_url"),
        ({"FSDP_OPERATOR_DASHBOARD_ADDRESS_MODE": "telepathy"}, "dashboard_address_mode"),
        ({"FSDP_OPERATOR_OBSERVE_INTERVAL_SECONDS": "120"}, "observe_interval_seconds"),
        ({"FSDP_OPERATOR_TRAINER_DEVICE": "tpu"}, "trainer_device"),
    ],
)
def test_bad_settings_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError, match=named):
        Settings()
