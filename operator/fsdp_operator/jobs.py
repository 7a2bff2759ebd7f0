"""Ray jobs through Ray's job submission client, idempotent by submission id."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from fsdp_operator.settings import DashboardAddressMode, Settings

DASHBOARD_PORT = 8265
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class JobObservation:
    submission_id: str
    status: str | None  # PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED; None: Ray does not know the job
    message: str = ""
    logs_tail: str = ""
    start_time: dt.datetime | None = None


def dashboard_url(settings: Settings, namespace: str, cluster_name: str, apiserver: str) -> str:
    service = f"{cluster_name}-head-svc"
    if settings.dashboard_address_mode == DashboardAddressMode.OVERRIDE:
        assert settings.dashboard_url is not None  # enforced by Settings
        return settings.dashboard_url
    if settings.dashboard_address_mode == DashboardAddressMode.SERVICE_PROXY:
        return f"{apiserver.rstrip('/')}/api/v1/namespaces/{namespace}/services/{service}:dashboard/proxy"
    return f"http://{service}.{namespace}.svc:{DASHBOARD_PORT}"


class Jobs:
    """Job calls against one Ray dashboard. Construction does not connect; every call may raise
    ConnectionError while the head is (re)starting."""

    def __init__(self, address: str, headers: dict[str, str] | None = None) -> None:
        self.address = address
        self.headers = headers or {}
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            self._client = JobSubmissionClient(self.address, headers=self.headers)
        return self._client

    def observe(self, submission_id: str) -> JobObservation:
        try:
            info = self.client.get_job_info(submission_id)
        except RuntimeError as error:
            if "does not exist" in str(error) or "404" in str(error):
                return JobObservation(submission_id, None, "Ray has no job with this submission id")
            raise
        status = str(info.status.value if hasattr(info.status, "value") else info.status)
        logs = ""
        if status in ("FAILED", "STOPPED"):
            logs = self.client.get_job_logs(submission_id)[-LOG_TAIL_CHARS:]
        started = dt.datetime.fromtimestamp(info.start_time / 1000, dt.UTC) if info.start_time else None
        return JobObservation(submission_id, status, info.message or "", logs, started)

    def submit(
        self, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]
    ) -> None:
        """Submits unless Ray already has this submission id (then it is ours from an earlier pass)."""
        if self.observe(submission_id).status is not None:
            return
        try:
            self.client.submit_job(
                entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env, metadata=metadata
            )
        except RuntimeError as error:
            if "already exists" not in str(error):
                raise

    def stop(self, submission_id: str) -> None:
        try:
            self.client.stop_job(submission_id)
        except RuntimeError as error:
            if "does not exist" not in str(error):
                raise
