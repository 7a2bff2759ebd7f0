"""The suite's layout: what tests share lives in tests/support; tests use the product's public names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import REPO

SOURCES = [
    *sorted((REPO / "tests").rglob("*.py")),
    *sorted((REPO / "bench").glob("*.py")),
]


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every import in the file, at any depth."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
    return found


def test_no_test_or_bench_imports_a_test_module() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {module}"
        for path in SOURCES
        for module, names in imports(path)
        if module.startswith("tests.")
        and (
            any(part.startswith("test_") for part in module.split("."))
            or any(n.startswith("test_") for n in names)
        )
    ]
    assert offenders == [], f"shared test code belongs in tests/support: {offenders}"


def test_no_test_or_bench_imports_a_private_name_of_the_product() -> None:
    offenders = [
        f"{path.relative_to(REPO)}: {module}.{name}"
        for path in SOURCES
        for module, names in imports(path)
        if module.split(".")[0] in ("fsdp_operator", "fsdp_trainer", "kubectl_trainingrun", "fsdp_client")
        for name in names
        if name.startswith("_")
    ]
    assert offenders == [], f"tests go through public names: {offenders}"


def test_tests_find_the_repository_through_one_name() -> None:
    """A file that moves between folders keeps working: the repository is tests.support.paths.REPO, never a
    count of parent folders (prometheus.py's rules path broke that way when it moved into tests/support)."""
    counted = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path != REPO / "tests" / "support" / "paths.py"
        and re.search(r"__file__\)\S*\.parents\[", path.read_text())
    ]
    assert counted == [], f"use tests.support.paths.REPO: {counted}"
