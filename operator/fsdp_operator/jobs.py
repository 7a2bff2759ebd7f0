"""Ray jobs through Ray's job REST API (`jobclient`), idempotent by submission id, every request bounded."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from fsdp_operator.jobclient import DashboardError, JobClient
from fsdp_operator.settings import DashboardAddressMode, Settings

DASHBOARD_PORT = 8265
LOG_TAIL_CHARS = 4000
LOG_TAIL_LINES = 60
# The driver log kept in S3 when a job ends: its newest lines, within these bounds.
DRIVER_LOG_LINES = 50_000
MAX_DRIVER_LOG_BYTES = 8 << 20
ENDED_JOB_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
# What of a job's status reply is kept: its status and driver node id as short text, its message's start
# (classification reads it; conditions keep 1 KiB of it).
MAX_JOB_FIELD = 128
MAX_JOB_MESSAGE = 16 << 10
# (connect, read) seconds for every dashboard request: a head that accepts and never answers costs its own
# run at most this per call, and never blocks a worker thread for good.
REQUEST_TIMEOUT = (5.0, 15.0)


@dataclass(frozen=True)
class JobObservation:
    submission_id: str
    status: str | None  # PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED; None: Ray does not know the job
    message: str = ""
    logs_tail: str = ""
    start_time: dt.datetime | None = None
    driver_node_id: str | None = None


@dataclass(frozen=True)
class DashboardAuth:
    """How to reach dashboards through the apiserver's service proxy: its credentials and CA."""

    headers: tuple[tuple[str, str], ...]  # a tuple, so that the auth can key a cache of clients
    verify: str | bool = True
    client_cert: tuple[str, str] | None = None


def dashboard_url(settings: Settings, namespace: str, cluster_name: str, apiserver: str) -> str:
    service = f"{cluster_name}-head-svc"
    if settings.dashboard_address_mode == DashboardAddressMode.OVERRIDE:
        url = settings.dashboard_urls.get(namespace, settings.dashboard_url)
        assert url is not None  # enforced by Settings
        return url
    if settings.dashboard_address_mode == DashboardAddressMode.SERVICE_PROXY:
        return f"{apiserver.rstrip('/')}/api/v1/namespaces/{namespace}/services/{service}:dashboard/proxy"
    return f"http://{service}.{namespace}.svc:{DASHBOARD_PORT}"


def job_not_found(status_code: int, text: str, submission_id: str) -> bool:
    """Ray's own answer for an unknown job, not any 404 (a missing Service behind the apiserver proxy is a 404
    too, and means the head is unreachable, not that the job is gone)."""
    return status_code == 404 and f"Job {submission_id} does not exist" in text


class Jobs:
    """Job calls against one Ray dashboard, over Ray's job REST API (`jobclient`; no Ray import in the
    operator). Construction does not connect; every call may raise (a timeout, a refused connection) while
    the head is (re)starting or unreachable."""

    def __init__(self, address: str, auth: DashboardAuth | None = None) -> None:
        self.address = address
        self.auth = auth
        self._client: JobClient | None = None

    @property
    def client(self) -> JobClient:
        if self._client is None:
            auth = self.auth
            self._client = JobClient(
                self.address,
                headers=dict(auth.headers) if auth else None,
                verify=auth.verify if auth else True,
                client_cert=auth.client_cert if auth else None,
                timeout=REQUEST_TIMEOUT,
            )
        return self._client

    def observe(self, submission_id: str, with_logs: bool = True) -> JobObservation:
        response = self.client.job_info(submission_id)
        if job_not_found(response.status, response.text, submission_id):
            return JobObservation(submission_id, None, "Ray has no job with this submission id")
        info = self.client.ok(response).json()
        if not isinstance(info, dict):
            raise ValueError(f"the job's status is not a JSON object but {type(info).__name__}")
        # The head runs the tenant's code: what it says is text of a bounded length (the reply is capped).
        status = str(info.get("status"))[:MAX_JOB_FIELD]
        node = info.get("driver_node_id")
        node_id = str(node)[:MAX_JOB_FIELD] if node else None
        ended = with_logs and status in ("FAILED", "STOPPED")
        logs = self.logs_tail(submission_id, node_id) if ended else ""
        started = info.get("start_time")
        start_time = dt.datetime.fromtimestamp(float(started) / 1000, dt.UTC) if started else None
        message = str(info.get("message") or "")[:MAX_JOB_MESSAGE]
        return JobObservation(submission_id, status, message, logs, start_time, node_id)

    def logs_tail(self, submission_id: str, node_id: str | None = None) -> str:
        """The driver log's last lines, from the dashboard's log API (it reads only the tail), never the
        whole log; empty when the head cannot serve it. Ray 2.58's log API finds a submission's driver log
        only on the node named (the job's driver_node_id): without it, it answers 500."""
        try:
            if node_id is None:
                node_id = self.client.ok(self.client.job_info(submission_id)).json().get("driver_node_id")
            if not node_id:
                return ""
            response = self.client.log_tail(submission_id, node_id, LOG_TAIL_LINES, LOG_TAIL_CHARS * 4)
        except Exception:  # the tail is evidence for classification, never a reason to fail the pass
            return ""
        return response.text[-LOG_TAIL_CHARS:] if response.status == 200 else ""

    def driver_log(self, submission_id: str, node_id: str) -> str:
        """The driver log's newest lines, at most DRIVER_LOG_LINES and MAX_DRIVER_LOG_BYTES of them."""
        response = self.client.log_tail(submission_id, node_id, DRIVER_LOG_LINES, MAX_DRIVER_LOG_BYTES)
        return self.client.ok(response).text

    def submit(
        self, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]
    ) -> None:
        """Submits unless Ray already has this submission id (then it is ours from an earlier pass)."""
        if self.observe(submission_id, with_logs=False).status is not None:
            return
        try:
            self.client.submit_job(
                entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env, metadata=metadata
            )
        except DashboardError as error:
            if "already exists" not in error.text:
                raise

    def stop(self, submission_id: str) -> None:
        response = self.client.stop_job(submission_id)
        if response.status != 200 and not job_not_found(response.status, response.text, submission_id):
            self.client.ok(response)
