"""Contract: the operator's job client (fsdp_operator.jobclient, Ray's REST API without Ray) and Ray's own
JobSubmissionClient, side by side against the real local Ray head, agree on every call the operator makes:
package upload, submit (and a repeated submit), status, the log tail, stop, and an unknown job."""

from __future__ import annotations

import io
import re
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest

from fsdp_operator import jobclient
from fsdp_operator.jobs import DashboardAuth, Jobs
from tests.support.local_cluster import LocalCluster
from tests.support.waiting import wait_until

TIMEOUT = 240
PROBE = """import os
import sys

print("probe", os.environ["PROBE"], sys.argv[1:])
for i in range(80):
    print(f"line {i}")
sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
"""


def probe_package(tmp_path: Path, tag: str) -> Path:
    """A module of a content new to the head (the tag), so that both clients upload it."""
    module = tmp_path / "contract_probe"
    (module / "data").mkdir(parents=True)
    (module / "__init__.py").write_text("")
    (module / "__main__.py").write_text(PROBE)
    (module / "data" / "notes.txt").write_text(f"bytes that travel with the package {tag}\n")
    return module


def driver_lines(log: str) -> list[str]:
    """What the driver printed, without the job manager's own timestamped lines."""
    own = re.compile(r"\d{4}-\d\d-\d\d \d\d:|Running entrypoint for job ")
    return [line for line in log.splitlines() if not own.match(line)]


def clients(cluster: LocalCluster) -> tuple[Jobs, Any]:
    auth = DashboardAuth(headers=tuple(cluster.ray_token_header.items()))
    return Jobs(cluster.ray_dashboard_url, auth), cluster.ray_jobs()


def finished(ours: Jobs, ray: Any, submission_id: str) -> str | None:
    """The job's status once both clients report the same terminal one."""
    mine, theirs = (
        ours.observe(submission_id, with_logs=False).status,
        ray.get_job_status(submission_id).value,
    )
    if mine in ("SUCCEEDED", "FAILED", "STOPPED") and theirs in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert mine == theirs, (submission_id, mine, theirs)
        return mine
    return None


def test_the_operators_client_and_rays_agree_on_every_call(
    local_cluster: LocalCluster, tmp_path: Path
) -> None:
    from ray._private.runtime_env.packaging import create_package
    from ray.runtime_env import RuntimeEnv

    ours, ray = clients(local_cluster)
    tag = uuid.uuid4().hex[:6]
    module = probe_package(tmp_path, tag)
    env: dict[str, Any] = {"py_modules": [str(module)], "env_vars": {"PROBE": tag}}
    metadata = {"run": "contract", "attempt": "1"}
    ids = {"ours": f"contract-ours-{tag}", "ray": f"contract-ray-{tag}"}

    # The runtime env as sent: Ray's client normalises it with RuntimeEnv; ours must send the same.
    with_pip = {**env, "pip": ["six"], "py_modules": ["gcs://_ray_pkg_x.zip"]}
    expected = RuntimeEnv(**with_pip).to_dict()
    expected.pop("_ray_commit", None)  # the client's Ray commit: the server adds its own
    assert jobclient.normalized_runtime_env(with_pip) == expected

    started = time.monotonic()
    ours.submit(ids["ours"], "python -m contract_probe", env, metadata)
    ours_submit_s = time.monotonic() - started
    started = time.monotonic()
    ray.submit_job(entrypoint="python -m contract_probe", submission_id=ids["ray"], runtime_env=env,
                   metadata=metadata)  # fmt: skip
    ray_submit_s = time.monotonic() - started
    print(f"submit with a package upload: ours {ours_submit_s:.3f} s, Ray's client {ray_submit_s:.3f} s")

    # Submitting an id again: ours sees the job and does nothing; Ray's client is refused.
    ours.submit(ids["ours"], "python -m contract_probe", env, metadata)
    with pytest.raises(RuntimeError, match="already exists"):
        ray.submit_job(entrypoint="python -m contract_probe", submission_id=ids["ray"], runtime_env=env)

    for submission_id in ids.values():
        wait_until(
            f"{submission_id} finished", lambda s=submission_id: finished(ours, ray, s), timeout=TIMEOUT
        )
        assert finished(ours, ray, submission_id) == "SUCCEEDED"
    infos = {who: ray.get_job_info(submission_id) for who, submission_id in ids.items()}
    for field in ("entrypoint", "metadata", "status", "message"):
        assert getattr(infos["ours"], field) == getattr(infos["ray"], field), field
    assert infos["ours"].runtime_env["env_vars"] == infos["ray"].runtime_env["env_vars"]
    observed = ours.observe(ids["ray"])
    assert observed.start_time is not None
    assert int(observed.start_time.timestamp()) == infos["ray"].start_time // 1000
    # The same driver output, read by Ray's client whole and by ours as the tail.
    logs = {who: ray.get_job_logs(submission_id) for who, submission_id in ids.items()}
    assert driver_lines(logs["ours"]) == driver_lines(logs["ray"])  # Ray's own lines name the job and time
    assert f"probe {tag} []" in logs["ours"]
    tail = ours.logs_tail(ids["ours"])
    # The job manager writes its "Running entrypoint" line from another process: it can follow the driver's.
    assert tail and logs["ours"].endswith(tail) and driver_lines(tail)[-1] == "line 79"

    # Each package as the other side named it is on the head; the bytes in it are the same files.
    packages = {who: info.runtime_env["py_modules"][0] for who, info in infos.items()}
    assert all(uri.startswith("gcs://_ray_pkg_") and uri.endswith(".zip") for uri in packages.values())
    assert ours.client.package_exists(packages["ray"]) and ours.client.package_exists(packages["ours"])
    rays_zip = tmp_path / "rays.zip"
    create_package(str(module), rays_zip, include_gitignore=True, include_parent_dir=True)
    with (
        zipfile.ZipFile(rays_zip) as theirs,
        zipfile.ZipFile(io.BytesIO(jobclient.zip_package(module)[1])) as mine,
    ):
        assert sorted(theirs.namelist()) == sorted(mine.namelist())
        assert all(theirs.read(name) == mine.read(name) for name in theirs.namelist())

    # A failing job: the same status and message; the tail carries the driver's last words.
    failing = {who: f"{submission_id}-fail" for who, submission_id in ids.items()}
    ours.submit(failing["ours"], "python -m contract_probe 3", env, metadata)
    ray.submit_job(entrypoint="python -m contract_probe 3", submission_id=failing["ray"], runtime_env=env)
    for submission_id in failing.values():
        wait_until(f"{submission_id} failed", lambda s=submission_id: finished(ours, ray, s), timeout=TIMEOUT)
        seen = ours.observe(submission_id)
        assert seen.status == "FAILED" and seen.message == ray.get_job_info(submission_id).message
        # The driver's last words; the job manager's own line may land after them (seen once in CI's order).
        assert driver_lines(seen.logs_tail)[-1] == "line 79", seen.logs_tail[-300:]

    # Stop: each client stops the job the other submitted, and both then see it STOPPED.
    sleeping = {who: f"{submission_id}-stop" for who, submission_id in ids.items()}
    ours.submit(sleeping["ours"], "sleep 120", {}, metadata)
    ray.submit_job(entrypoint="sleep 120", submission_id=sleeping["ray"])
    for submission_id in sleeping.values():
        wait_until(
            "running", lambda s=submission_id: ray.get_job_status(s).value == "RUNNING", timeout=TIMEOUT
        )
    ours.stop(sleeping["ray"])
    assert ray.stop_job(sleeping["ours"]) is True
    for submission_id in sleeping.values():
        wait_until(
            f"{submission_id} stopped", lambda s=submission_id: finished(ours, ray, s), timeout=TIMEOUT
        )
        assert finished(ours, ray, submission_id) == "STOPPED"

    # An unknown job: ours says Ray has none (stopping it does nothing); Ray's client says it does not exist.
    unknown = f"contract-unknown-{tag}"
    assert ours.observe(unknown).status is None
    ours.stop(unknown)
    with pytest.raises(RuntimeError, match="does not exist"):
        ray.get_job_info(unknown)
    with pytest.raises(RuntimeError, match="does not exist"):
        ray.stop_job(unknown)

    # Without the run's token the head refuses ours (the headers are what lets it in).
    with pytest.raises(jobclient.DashboardError, match="401"):
        Jobs(local_cluster.ray_dashboard_url).observe(unknown)
