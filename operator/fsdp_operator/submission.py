"""What the operator submits to Ray: the trainer config, the entrypoint and the runtime env (pure).

The trainer package travels in the runtime env (`py_modules`), zipped from the operator's own copy of
`fsdp_trainer`, so the DLC image is used as it is and every attempt runs the same trainer bytes, whose
sha256 is recorded in the status.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsdp_operator import api, drainwindow, fabric
from fsdp_operator.builder import RunRef, ray_cluster_name
from fsdp_trainer import contract
from fsdp_trainer.contract import AttemptInfo, TrackingConfig, TrainerConfig

# The package the contract module belongs to: the operator reaches the trainer through the contract only.
TRAINER_PACKAGE = Path(contract.__file__).resolve().parent


def submission_prefix(run: RunRef) -> str:
    """Submission ids are `<prefix>-<attempt>`: deterministic per attempt, so a replayed event or a restarted
    operator finds the job it submitted; unique per run object (uid), whatever its name."""
    return f"{ray_cluster_name(run.name)}-{run.uid[:8]}"


def trainer_config(
    spec: api.FSDPTrainingRunSpec,
    run: RunRef,
    cpu_only: bool,
    min_bus_bandwidth_gbps: Mapping[str, float] | None = None,
) -> TrainerConfig:
    """The run's spec as the trainer reads it, with the fabric check's threshold resolved (the platform's
    figures by instance type). The run name is stable across attempts, so every attempt writes under the
    same storage prefix and resumes from the same checkpoints."""
    network = spec.network.model_copy(
        update={
            "min_bus_bandwidth_gbps": fabric.threshold(
                spec.network.min_bus_bandwidth_gbps, spec.cluster.instance_type, min_bus_bandwidth_gbps or {}
            )
        }
    )
    return TrainerConfig(
        run_name=run.name,
        namespace=run.namespace,
        workers=spec.cluster.workers,
        min_workers=spec.cluster.min_workers,
        gpus_per_worker=0 if cpu_only else spec.cluster.gpus(),
        max_failures=spec.recovery.in_job_max_failures,
        model=spec.model,
        fsdp=spec.fsdp,
        training=spec.training,
        data=spec.data,
        checkpoint=spec.checkpoint,
        network=network,
        tracking=TrackingConfig(mlflow=spec.tracking.mlflow.trainer_view()) if spec.tracking.mlflow else None,
        # The MLflow credentials are Secrets in the pods' environment too: redacted like secretEnv.
        secret_env_names=sorted(
            {
                *spec.runtime_env.secret_env,
                *(spec.tracking.mlflow.credentials.env() if spec.tracking.mlflow else {}),
            }
        ),
    )


def entrypoint(config: TrainerConfig, submission: str, attempt: AttemptInfo) -> str:
    return (
        f"python -m fsdp_trainer --config {shlex.quote(config.to_json())} "
        f"--submission-id {shlex.quote(submission)} --attempt-info {shlex.quote(attempt.to_json())}"
    )


def runtime_env(spec: api.FSDPTrainingRunSpec, package: Path = TRAINER_PACKAGE) -> dict[str, Any]:
    env: dict[str, Any] = {"py_modules": [str(package)]}
    pip = list(spec.runtime_env.pip)
    # An adapter needs peft, which the DLC lacks: Ray installs it for the job, unless the run names its own.
    if spec.fsdp.adapter is not None and not any(_names(requirement, "peft") for requirement in pip):
        pip.append(contract.ADAPTER_REQUIREMENT)
    if pip:
        env["pip"] = pip
    # Ray Train's drain notice within a second (its default 5 s), so that the drain window can be short.
    env["env_vars"] = {drainwindow.POLL_ENV: str(drainwindow.NOTICE_POLL_SECONDS), **spec.runtime_env.env}
    return env


def _names(requirement: str, project: str) -> bool:
    """Whether a pip requirement ("peft==0.21.2", "PEFT >= 0.20", "peft[extra]") is for `project`."""
    name = re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower() == project


def package_sha256(package: Path = TRAINER_PACKAGE) -> str:
    """sha256 over the package's source files (relative path and bytes, in path order)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
