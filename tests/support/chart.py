"""The operator's Helm chart as the tests render it: `helm template` with values, parsed into objects."""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import yaml

from tests.support.paths import REPO

CHART = REPO / "charts" / "fsdp-operator"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The repo's helm; with check, a failure raises (its output in the exception)."""
    return subprocess.run([str(REPO / "bin" / "helm"), *args], text=True, capture_output=True, check=check)


@dataclass
class Rendered:
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    @property
    def deployment(self) -> dict[str, Any]:
        [deployment] = self.of_kind("Deployment")
        return deployment


def render(release: str, namespace: str, values: dict[str, Any]) -> Rendered:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as values_file:
        json.dump(values, values_file)
        values_file.flush()
        out = helm(
            "template",
            release,
            str(CHART),
            "-n",
            namespace,
            "-f",
            values_file.name,
            "--kube-version",
            "1.35.0",
        ).stdout
    return Rendered([o for o in yaml.safe_load_all(out) if o])
