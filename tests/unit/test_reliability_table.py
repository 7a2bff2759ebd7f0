"""docs/reliability.md is rendered from the rows the fault tests record, in the suite's order."""

from __future__ import annotations

from pathlib import Path

from tests.support.reliability import Row, write_table


def test_rows_are_written_in_test_order_with_the_date_machine_and_versions(tmp_path: Path) -> None:
    table = tmp_path / "reliability.md"
    rows = {
        "tests/e2e/test_b.py::test_second": Row("head killed", "JobLost", "3 s | 7 steps"),
        "tests/e2e/test_a.py::test_first[x]": Row("rank dies", "one restart", "resumed from step 20"),
    }
    write_table(rows, ["tests/e2e/test_a.py::test_first[x]", "tests/e2e/test_b.py::test_second"], table)
    text = table.read_text()
    body = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert body == [
        "| rank dies | one restart | resumed from step 20 | `test_first[x]` |",
        "| head killed | JobLost | 3 s \\| 7 steps | `test_second` |",
    ]
    assert "- Date: " in text and "CPUs" in text and "Kubernetes v" in text and "ray 2." in text


def test_a_run_in_one_environment_keeps_the_other_environments_section(tmp_path: Path) -> None:
    table = tmp_path / "reliability.md"
    test = "tests/e2e/test_a.py::test_first"
    write_table({test: Row("first", "kept", "1 s")}, [test], table)
    other = table.read_text().replace("reliability-python", "reliability-pythonX").replace("first", "other")
    table.write_text(other)
    write_table({test: Row("second", "new", "2 s")}, [test], table)
    text = table.read_text()
    assert text.startswith("# Reliability") and text.count("# Reliability") == 1
    assert "| other | kept | 1 s |" in text and "| second | new | 2 s |" in text and "| first |" not in text
