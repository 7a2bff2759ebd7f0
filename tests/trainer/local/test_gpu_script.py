"""bench/gpu_fsdp.py runs on the GPU machine as it is. In a Python where every module the GPU machine lacks
fails to import, with only the wheels bench/gpu-wheels.sh downloads, installed and run by the very line it
prints, `--tiny` runs to the end; its JSON says what finished, with one record per measured step, and the
checkpoint figures, whose bytes the disk check counted beforehand."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.paths import REPO

# What the GPU machine's image holds (shared FACTS, "The GPU machine's Python"), with what these need.
GPU_MACHINE = ["torch", "transformers", "tokenizers", "safetensors", "pyarrow", "numpy", "huggingface-hub",
               "prometheus-client", "pytest", "pip"]  # fmt: skip
# What it lacks although the dependency metadata here would bring some of it along (typer, which
# transformers' CLI uses, requires pydantic in its newer releases; the image has an older one).
GPU_MACHINE_LACKS = {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "annotated-doc",
                     "boto3", "botocore", "s3transfer", "ray", "torchtitan"}  # fmt: skip
BLOCKER = '''
import importlib.machinery, sys

SITE = {site!r}
ALLOWED = {allowed!r}


class OnlyWhatTheGpuMachineHas(importlib.machinery.PathFinder):
    """sys.path's finder, except that top-level modules installed in this environment's site-packages but
    not on the GPU machine are not found: importing them fails, and probes (importlib.util.find_spec, as
    torch and transformers make for optional packages) see them missing."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or "." in name or name in ALLOWED:
            return spec
        places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
        return None if any(place.startswith(SITE) for place in places if place) else spec


sys.meta_path[:] = [
    OnlyWhatTheGpuMachineHas if finder is importlib.machinery.PathFinder else finder
    for finder in sys.meta_path
]
'''


def gpu_machine_distributions() -> set[str]:
    """The GPU machine's packages and what they require, as installed here, less what it lacks."""
    found: set[str] = set()
    pending = [canonicalize_name(name) for name in GPU_MACHINE]
    while pending:
        name = pending.pop()
        if name in found or name in GPU_MACHINE_LACKS:
            continue
        found.add(name)
        try:
            requirements = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonicalize_name(requirement.name))
    return found


@pytest.fixture(scope="module")
def gpu_machine_python(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a Python that imports only what the GPU machine has."""
    distributions = gpu_machine_distributions()
    allowed = sorted(
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if any(canonicalize_name(owner) in distributions for owner in owners)
    )
    site = str(importlib.metadata.distribution("torch").locate_file(""))
    blocker = tmp_path_factory.mktemp("gpu-machine")
    (blocker / "sitecustomize.py").write_text(BLOCKER.format(site=site, allowed=allowed))
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PYTHONPATH": str(blocker), "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("module", ["pydantic", "boto3", "botocore", "ray", "torchtitan", "kopf"])
def test_the_stand_in_lacks_what_the_gpu_machine_lacks(
    gpu_machine_python: dict[str, str], module: str
) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"], env=gpu_machine_python, capture_output=True, text=True
    )
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe.stderr[-500:]
    ok = subprocess.run(
        [sys.executable, "-c", "import torch, transformers, pyarrow, json"], env=gpu_machine_python
    )
    assert ok.returncode == 0


def test_the_tiny_run_goes_through_with_only_the_wheels_it_brings(
    gpu_machine_python: dict[str, str], tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"  # the GPU machine's is 3.12
    printed = subprocess.run(  # here, where the wheels are downloaded: no stand-in
        [str(REPO / "bench" / "gpu-wheels.sh"), str(wheels)],
        env={**os.environ, "PYTHON_VERSION": version, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=True,
    )
    install_and_run = printed.stdout.strip()
    output = tmp_path / "gpu_fsdp.json"
    run = subprocess.run(
        ["bash", "-c", f"{install_and_run} --tiny --output {output}"],
        cwd=REPO,
        env={**gpu_machine_python, "OUT": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(output.read_text())
    ours, baseline = summary["loops"]["eager"]["ours"], summary["loops"]["eager"]["baseline_a"]
    assert ours["finished"] and baseline["finished"], (ours, baseline)
    assert ours["measured_steps"] == summary["measured_steps"], "each measured step counted once"
    assert ours["checkpoint_blocked_seconds_last_step"] is not None
    assert ours["settings"]["cuda_graphs"] is False and ours["settings"]["compile"] == "off"
    saves = summary["checkpoint_saves"]
    assert saves["finished"] and saves["blocked_seconds_second"] >= 0 and saves["bytes"] > 0, saves
    # What a save wrote, against what the disk check counted for it: never more; over by DCP's per-tensor
    # allowance at most (a large share of this tiny model's bytes, a negligible one of Qwen2.5-1.5B's).
    assert saves["bytes"] <= summary["checkpoint_bytes"] <= 1.2 * saves["bytes"], saves["bytes"]
    assert set(summary["loops"]["eager"]) == {"ours", "baseline_a", "ours_over_baseline_a_p50"}
