"""Operator settings, from FSDP_OPERATOR_* environment variables or the equivalent command-line flags."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_IMAGE = "public.ecr.aws/deep-learning-containers/ray:2.58.0-gpu-py312-cu130-ubuntu22.04-ec2"


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
    dashboard_address_mode: DashboardAddressMode = Field(
        default=DashboardAddressMode.SERVICE_DNS,
        description="How the operator reaches each run's Ray dashboard.",
    )
    dashboard_url: str | None = Field(
        default=None, description="The Ray dashboard address when dashboard_address_mode is override."
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

    @field_validator("watch_namespaces", mode="before")
    @classmethod
    def _split_namespaces(cls, value: object) -> object:
        if isinstance(value, str):
            return [ns.strip() for ns in value.split(",") if ns.strip()]
        return value

    @model_validator(mode="after")
    def _override_needs_url(self) -> Self:
        if self.dashboard_address_mode == DashboardAddressMode.OVERRIDE and not self.dashboard_url:
            raise ValueError(
                "dashboard_url (FSDP_OPERATOR_DASHBOARD_URL) is required with dashboard_address_mode override"
            )
        if self.dashboard_url and not self.dashboard_url.startswith(("http://", "https://")):
            raise ValueError(f"dashboard_url must start with http:// or https://, got {self.dashboard_url!r}")
        return self
