"""The Argo CD health check: every case in Argo CD's interpreter, testdata that matches today's API, and the
snippets users install it from carrying the script verbatim."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fsdp_operator import api
from tests.support.paths import REPO

CUSTOMIZATIONS = REPO / "argocd" / "resource_customizations"
CHECK = CUSTOMIZATIONS / api.GROUP / api.KIND
CHECKER = REPO / "bin" / "argocd-health-test"
CM_KEY = f"resource.customizations.health.{api.GROUP}_{api.KIND}"
SNIPPETS = {
    REPO / "argocd" / "argocd-cm.yaml": (
        "# kubectl -n argocd patch configmap argocd-cm --type merge --patch-file argocd/argocd-cm.yaml\n",
        ["data"],
    ),
    REPO / "argocd" / "argo-helm-values.yaml": (
        "# helm upgrade --install argocd argo/argo-cd -n argocd -f argocd/argo-helm-values.yaml\n",
        ["configs", "cm"],
    ),
}


def run_checker(directory: Path) -> subprocess.CompletedProcess[str]:
    assert CHECKER.exists(), f"{CHECKER} is missing: `make tools` builds it (make test does)"
    return subprocess.run([str(CHECKER), str(directory)], capture_output=True, text=True, timeout=60)


def test_every_case_passes_in_argo_cds_interpreter_within_its_time_limit() -> None:
    result = run_checker(CUSTOMIZATIONS)
    cases = yaml.safe_load((CHECK / "health_test.yaml").read_text())["tests"]
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(cases)} cases, 0 failed" in result.stdout


def test_every_phase_and_every_argo_cd_status_but_missing_is_covered() -> None:
    cases = yaml.safe_load((CHECK / "health_test.yaml").read_text())["tests"]
    statuses = {case["healthStatus"]["status"] for case in cases}
    assert statuses == {"Healthy", "Progressing", "Degraded", "Suspended"}
    phases = {
        (yaml.safe_load((CHECK / case["inputPath"]).read_text()).get("status") or {}).get("phase")
        for case in cases
    }
    assert {phase.value for phase in api.Phase} <= phases


def test_testdata_are_runs_of_todays_api_and_each_is_a_case() -> None:
    cases = yaml.safe_load((CHECK / "health_test.yaml").read_text())["tests"]
    listed = {case["inputPath"] for case in cases}
    on_disk = {f"testdata/{path.name}" for path in (CHECK / "testdata").glob("*.yaml")}
    assert listed == on_disk
    for path in sorted(on_disk):
        api.FSDPTrainingRun.model_validate(yaml.safe_load((CHECK / path).read_text()))


def test_the_checker_refuses_a_wrong_message_and_a_library_argocd_cm_does_not_open(tmp_path: Path) -> None:
    copy = tmp_path / api.GROUP / api.KIND
    shutil.copytree(CHECK, copy)
    tests = yaml.safe_load((copy / "health_test.yaml").read_text())
    tests["tests"][0]["healthStatus"]["message"] += " (not what the script says)"
    (copy / "health_test.yaml").write_text(yaml.safe_dump(tests))
    wrong = run_checker(tmp_path)
    assert wrong.returncode == 1 and "1 failed" in wrong.stdout, wrong.stdout

    shutil.copy(CHECK / "health_test.yaml", copy / "health_test.yaml")
    script = (CHECK / "health.lua").read_text()
    (copy / "health.lua").write_text(script.replace("tostring(p.loss)", 'string.format("%.2f", p.loss)'))
    closed = run_checker(tmp_path)
    assert closed.returncode == 1 and 'uses "string."' in closed.stdout, closed.stdout


def rendered_snippet(header: str, path: list[str]) -> str:
    script = (CHECK / "health.lua").read_text()
    this = Path(__file__).relative_to(REPO)
    lines = [f"# Generated from {CHECK.relative_to(REPO)}/health.lua by UPDATE_GOLDEN=1 pytest {this}"]
    lines.append(header.rstrip("\n"))
    for depth, key in enumerate(path):
        lines.append("  " * depth + f"{key}:")
    indent = "  " * len(path)
    lines.append(f"{indent}{CM_KEY}: |")
    lines += [f"{indent}  {line}" if line else "" for line in script.splitlines()]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("snippet", sorted(SNIPPETS), ids=lambda p: p.name)
def test_install_snippets_carry_the_script_verbatim(snippet: Path) -> None:
    header, path = SNIPPETS[snippet]
    expected = rendered_snippet(header, path)
    if os.environ.get("UPDATE_GOLDEN"):
        snippet.write_text(expected)
    assert snippet.read_text() == expected, (
        f"{snippet} is stale: UPDATE_GOLDEN=1 pytest {Path(__file__).relative_to(REPO)}"
    )
    loaded = yaml.safe_load(snippet.read_text())
    for key in path:
        loaded = loaded[key]
    assert loaded[CM_KEY] == (CHECK / "health.lua").read_text()
