"""Where things are: the repository, this process's local cluster instance, and hack/lib.sh's settings of it.
Nothing runs on import: a setting is read (hack/settings.sh) the first time it is asked for."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Which local cluster this process uses (hack/lib.sh, FSDP_CLUSTER_INSTANCE): pytest-xdist's worker gwN uses
# the instance N above its run's first (FSDP_TEST_FIRST_INSTANCE, 0 unless set), so that two workers never
# share a control plane, a Ray head or an S3 server, nor two pytest runs side by side given first instances
# apart (hack/test.sh's two tiers). A worker's children inherit both variables and compute the same.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
INSTANCE = (
    int(os.environ.get("FSDP_TEST_FIRST_INSTANCE", "0")) + int(_WORKER[2:])
    if _WORKER
    else int(os.environ.get("FSDP_CLUSTER_INSTANCE", "0"))
)


def cluster_settings(*names: str) -> list[str]:
    """hack/lib.sh's values of these settings for this process's local cluster (arrays space-separated)."""
    return subprocess.run(
        [REPO / "hack" / "settings.sh", *names],
        env={**os.environ, "FSDP_CLUSTER_INSTANCE": str(INSTANCE)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()


@functools.cache
def state_dir() -> Path:
    """The local cluster's state directory (pids, logs, the env file cluster-up writes)."""
    return Path(cluster_settings("STATE")[0])


@functools.cache
def mlflow_venv() -> Path:
    """The MLflow server's venv, which hack/venv.sh installs."""
    return Path(cluster_settings("MLFLOW_VENV")[0])


@functools.cache
def dlc_python() -> Path:
    """The DLC's Python (3.13, torch): where the trainer runs, for tests that start it in a process."""
    return Path(cluster_settings("DLC_VENV")[0]) / "bin" / "python"
