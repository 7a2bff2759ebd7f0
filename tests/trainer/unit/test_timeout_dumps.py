"""NCCL's flight-recorder dump from a collective timeout (written on the node as the process ends) reaches
the run's forensics under its prefix when the next attempt's ranks start, uploaded once by whichever rank
claims it (issue 47 item 1)."""

from __future__ import annotations

from pathlib import Path

from fsdp_trainer import forensics
from fsdp_trainer.storage import Location


def test_a_timeout_dump_left_on_the_node_is_uploaded_once_and_removed(tmp_path: Path) -> None:
    dumps, run = tmp_path / "dumps", tmp_path / "run"
    dumps.mkdir()
    (dumps / "rank-3").write_bytes(b"flight recorder")
    assert forensics.TIMEOUT_DUMP_SETTINGS["TORCH_FR_DUMP_TEMP_FILE"].endswith("rank-")  # what NCCL writes

    [name] = forensics.upload_timeout_dumps(Location.parse(str(run)), dumps)
    assert name.startswith("forensics/timeout-dumps/") and "-rank-3-" in name
    assert (run / name).read_bytes() == b"flight recorder"
    assert list(dumps.iterdir()) == [], "uploaded once: the next rank finds nothing"
    assert forensics.upload_timeout_dumps(Location.parse(str(run)), dumps) == []
