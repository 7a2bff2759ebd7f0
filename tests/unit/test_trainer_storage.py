"""Storage operations whose order matters to the user: the exported model is replaced, never emptied first."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_trainer.storage import Location


def exported(tmp_path: Path) -> tuple[Location, Path]:
    destination = tmp_path / "model"
    destination.mkdir()
    (destination / "model.safetensors").write_text("old weights")
    (destination / "pytorch_model.bin").write_text("an older format")
    new = tmp_path / "new"
    new.mkdir()
    (new / "model.safetensors").write_text("new weights")
    (new / "config.json").write_text("{}")
    return Location.parse(str(destination)), new


def test_replacing_a_model_leaves_exactly_the_new_files(tmp_path: Path) -> None:
    destination, new = exported(tmp_path)
    destination.replace_with(str(new))
    assert destination.list_files() == {"model.safetensors": 11, "config.json": 2}
    assert (tmp_path / "model" / "model.safetensors").read_text() == "new weights"


def test_a_failed_upload_keeps_the_previous_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    destination, new = exported(tmp_path)

    def no_connection(self: Location, local_dir: str) -> None:
        raise OSError("connection refused")

    monkeypatch.setattr(Location, "upload_from", no_connection)
    with pytest.raises(OSError):
        destination.replace_with(str(new))
    assert (tmp_path / "model" / "model.safetensors").read_text() == "old weights"
