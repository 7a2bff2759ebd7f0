"""`make test` runs both tiers whatever the first one's outcome, and names each tier's failures at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO, dlc_python

FAILING = "def test_{name}() -> None:\n    assert 1 == 2, 'the {name} tier is broken'\n"


def test_a_broken_trainer_test_still_shows_when_an_operator_test_fails_too(tmp_path: Path) -> None:
    """Two tiers, each with a failing test, laid out as the repository's are (the trainer's in a folder of
    its own, run in the DLC's environment): both run, both failures are named in the summary, exit not 0."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_operator_side.py").write_text(FAILING.format(name="operator"))
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "test_trainer_side.py").write_text(FAILING.format(name="trainer"))
    run = subprocess.run(
        [REPO / "hack" / "test.sh", sys.executable, dlc_python(), "trainer", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = run.stdout[run.stdout.index("make test: both tiers") :]
    assert run.returncode != 0, run.stdout[-3000:]
    assert "operator tier: exit 1: 1 failed" in summary, summary
    assert "trainer tier: exit 1: 1 failed" in summary, summary
    assert "FAILED test_operator_side.py::test_operator" in summary, summary
    assert "FAILED trainer/test_trainer_side.py::test_trainer" in summary, summary
