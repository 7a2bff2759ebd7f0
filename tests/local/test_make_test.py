"""`make test` runs both tiers side by side, each on cluster instances of its own, whatever the other's
outcome, and names each tier's failures at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


# Each side records its cluster instance and pytest worker, then waits (bounded) for the other side's record:
# it passes only while the other tier runs at the same time.
MEETS = textwrap.dedent(
    """
    import os, pathlib, time

    def test_{name}_meets_the_other_tier() -> None:
        meeting = pathlib.Path(os.environ["MEETING"])
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        (meeting / "{name}").write_text(f"{{os.environ['FSDP_TEST_FIRST_INSTANCE']}} {{worker}}")
        deadline = time.monotonic() + 120
        while not (meeting / "{other}").exists():
            assert time.monotonic() < deadline, "the {other} tier did not run beside this one within 120 s"
            time.sleep(0.2)
    """
)


def test_the_two_tiers_run_side_by_side_on_cluster_instances_of_their_own(tmp_path: Path) -> None:
    """The trainer's tier runs beside the operator's (which leaves the machine idle half its time), its one
    worker on the instance above the operator's workers': it never finds an operator worker's cluster (and its
    S3) running, to lose it when that worker's session ends."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_operator_side.py").write_text(MEETS.format(name="operator", other="trainer"))
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "test_trainer_side.py").write_text(MEETS.format(name="trainer", other="operator"))
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    run = subprocess.run(
        [REPO / "hack" / "test.sh", sys.executable, dlc_python(), "trainer", "2"],
        cwd=tmp_path,
        env={**os.environ, "MEETING": str(meeting), "FSDP_TEST_FIRST_INSTANCE": "5"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert (meeting / "operator").read_text() in ("5 gw0", "5 gw1"), "the operator's workers: 5 and 6"
    assert (meeting / "trainer").read_text() == "7 gw0", "the trainer's one worker: the instance above them"


def test_a_pytest_worker_takes_the_instance_its_number_above_its_runs_first() -> None:
    """Worker gwN of a run whose first instance is B (FSDP_TEST_FIRST_INSTANCE) uses cluster instance B + N
    (tests/support/paths.py): the trainer's tier, given the instance above the operator's workers, shares no
    cluster with them. A worker's child, which also inherits the worker's FSDP_CLUSTER_INSTANCE, agrees."""
    worker = {**os.environ, "PYTEST_XDIST_WORKER": "gw1", "FSDP_TEST_FIRST_INSTANCE": "5"}
    for env in (worker, {**worker, "FSDP_CLUSTER_INSTANCE": "6"}):
        instance = subprocess.run(
            [sys.executable, "-c", "from tests.support.paths import INSTANCE; print(INSTANCE)"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert instance == "6", f"gw1 of a run whose first instance is 5 took instance {instance}"
