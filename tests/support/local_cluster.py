"""The local cluster's endpoints, read from the env file cluster-up writes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.paths import state_dir


@dataclass(frozen=True)
class LocalCluster:
    """Endpoints of the running local cluster, read from the env file cluster-up writes."""

    env: dict[str, str]

    @classmethod
    def from_env_file(cls, path: Path | None = None) -> LocalCluster:
        env = {}
        for line in (path or state_dir() / "env").read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = value
        return cls(env)

    @property
    def kubeconfig(self) -> str:
        return self.env["KUBECONFIG"]

    @property
    def s3_endpoint(self) -> str:
        return self.env["AWS_ENDPOINT_URL"]

    @property
    def ray_dashboard_url(self) -> str:
        return self.env["RAY_DASHBOARD_URL"]

    @property
    def ray_token_header(self) -> dict[str, str]:
        """What the local Ray head (token auth, as every run's cluster) asks of a caller."""
        return {"X-Ray-Authorization": f"Bearer {self.env['FSDP_LOCAL_RAY_TOKEN']}"}

    def ray_jobs(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.ray_dashboard_url, headers=self.ray_token_header)
