"""Which checkpoint a run resumes from: only complete ones (manifest, DCP metadata, all files at size)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from fsdp_trainer.checkpoint import Candidate, checkpoint_name, find_resume_point, newest_complete, prune
from fsdp_trainer.contract import MANIFEST_FILE, CheckpointManifest
from fsdp_trainer.errors import ConfigError
from fsdp_trainer.storage import Location

FILES = {".metadata": 100, "__0_0.distcp": 2000, "__1_0.distcp": 2000}
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
FINGERPRINT = "0123456789abcdef"


def manifest(
    step: int, submission: str = "s1", minutes: int = 0, fingerprint: str | None = FINGERPRINT
) -> CheckpointManifest:
    return CheckpointManifest(
        run_name="r",
        step=step,
        tokens_seen=step * 10,
        world_size=2,
        created_at=T0 + dt.timedelta(minutes=minutes),
        files=dict(FILES),
        submission_id=submission,
        fingerprint=fingerprint,
    )


def candidate(
    step: int, listing: dict[str, int] | None = None, submission: str = "s1", minutes: int = 0
) -> Candidate:
    files = dict(FILES) if listing is None else listing
    return Candidate(Location.parse(f"/tmp/ckpt-{step}"), manifest(step, submission, minutes), files)


def test_the_newest_complete_checkpoint_wins() -> None:
    chosen = newest_complete([candidate(8), candidate(24), candidate(16)])
    assert chosen is not None and chosen.manifest is not None and chosen.manifest.step == 24
    assert newest_complete([]) is None


@pytest.mark.parametrize(
    "broken",
    [
        Candidate(Location.parse("/tmp/x"), None, dict(FILES)),  # no manifest
        candidate(24, listing={k: v for k, v in FILES.items() if k != ".metadata"}),  # no DCP metadata
        candidate(24, listing={k: v for k, v in FILES.items() if k != "__1_0.distcp"}),  # lost shard
        candidate(24, listing={**FILES, "__1_0.distcp": 1999}),  # truncated shard
    ],
    ids=["no-manifest", "no-metadata", "missing-shard", "truncated-shard"],
)
def test_an_incomplete_checkpoint_is_never_chosen(broken: Candidate) -> None:
    chosen = newest_complete([candidate(8), broken])
    assert chosen is not None and chosen.manifest is not None and chosen.manifest.step == 8


def test_same_step_prefers_the_later_checkpoint() -> None:
    later = candidate(16, minutes=5)
    assert newest_complete([later, candidate(16)]) is later


def test_a_submission_filter_ignores_other_submissions() -> None:
    mine = candidate(8, submission="mine")
    assert newest_complete([candidate(24, submission="old"), mine], submission_id="mine") is mine


def write_checkpoint(
    run: Path,
    step: int,
    complete: bool = True,
    submission: str = "s1",
    fingerprint: str | None = FINGERPRINT,
) -> Path:
    directory = run / checkpoint_name(step, "20260101T000000000000")
    directory.mkdir(parents=True)
    for name, size in FILES.items():
        (directory / name).write_bytes(b"x" * size)
    if complete:
        (directory / MANIFEST_FILE).write_text(
            manifest(step, submission=submission, fingerprint=fingerprint).to_json()
        )
    return directory


def test_resume_skips_an_incomplete_newest_checkpoint_in_storage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_checkpoint(run, 8)
    write_checkpoint(run, 16)
    write_checkpoint(run, 24, complete=False)  # a save that never finished
    (run / "checkpoint_manager_snapshot.json").write_text("{}")  # not a checkpoint directory
    found = find_resume_point(Location.parse(str(run)), "auto", "s2", FINGERPRINT)
    assert found is not None and found.manifest is not None and found.manifest.step == 16


def test_resume_never_uses_only_this_submissions_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_checkpoint(run, 24, submission="earlier")
    assert find_resume_point(Location.parse(str(run)), "never", "now", FINGERPRINT) is None
    write_checkpoint(run, 8, submission="now")  # an in-job retry of this submission
    found = find_resume_point(Location.parse(str(run)), "never", "now", FINGERPRINT)
    assert found is not None and found.manifest is not None and found.manifest.step == 8


def test_an_explicit_uri_is_used_when_the_run_has_none_of_its_own(tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "other-run", 40)
    run = Location.parse(str(tmp_path / "run"))
    found = find_resume_point(run, str(other), "s1", FINGERPRINT)
    assert found is not None and found.location.path == str(other)
    write_checkpoint(tmp_path / "run", 8)
    own = find_resume_point(run, str(other), "s1", FINGERPRINT)
    assert own is not None and own.manifest is not None and own.manifest.step == 8, (
        "own progress wins on retry"
    )


def test_an_incomplete_explicit_uri_is_a_config_error(tmp_path: Path) -> None:
    broken = write_checkpoint(tmp_path / "other-run", 40, complete=False)
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        find_resume_point(Location.parse(str(tmp_path / "run")), str(broken), "s1", FINGERPRINT)


@pytest.mark.parametrize("theirs", ["fedcba9876543210", None], ids=["other-config", "no-fingerprint"])
def test_checkpoints_of_another_configuration_are_refused_not_loaded(
    tmp_path: Path, theirs: str | None
) -> None:
    run = tmp_path / "run"
    write_checkpoint(run, 8)
    write_checkpoint(run, 16, fingerprint=theirs)
    with pytest.raises(ConfigError) as refused:
        find_resume_point(Location.parse(str(run)), "auto", "s2", FINGERPRINT)
    message = str(refused.value)
    assert "another configuration" in message and FINGERPRINT in message
    assert (theirs or "none") in message
    assert refused.value.kind == "config"


def test_checkpoints_trained_on_other_data_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    directory = write_checkpoint(run, 8)
    written = manifest(8).model_copy(update={"data_fingerprint": "aaaaaaaaaaaaaaaa"})
    (directory / MANIFEST_FILE).write_text(written.to_json())
    location = Location.parse(str(run))
    found = find_resume_point(location, "auto", "s2", FINGERPRINT, "aaaaaaaaaaaaaaaa")
    assert found is not None and found.manifest is not None and found.manifest.step == 8
    with pytest.raises(ConfigError, match="training data changed") as refused:
        find_resume_point(location, "auto", "s2", FINGERPRINT, "bbbbbbbbbbbbbbbb")
    assert "aaaaaaaaaaaaaaaa" in str(refused.value) and "bbbbbbbbbbbbbbbb" in str(refused.value)


def test_an_explicit_uri_from_another_configuration_is_the_users_choice(tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "other-run", 40, fingerprint="fedcba9876543210")
    found = find_resume_point(Location.parse(str(tmp_path / "run")), str(other), "s1", FINGERPRINT)
    assert found is not None and found.location.path == str(other)


def test_checkpoint_names_sort_by_step() -> None:
    names = [checkpoint_name(step, "20260101T000000000000") for step in (100, 8, 16)]
    assert sorted(names) == [checkpoint_name(s, "20260101T000000000000") for s in (8, 16, 100)]


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (8, 16, 24, 32):
        write_checkpoint(run, step)
    leftover = write_checkpoint(run, 12, complete=False)
    unfinished = write_checkpoint(run, 40, complete=False)  # may still be uploading
    prune(Location.parse(str(run)), keep=2)
    remaining = sorted(path.name for path in run.iterdir())
    assert remaining == sorted(
        [checkpoint_name(s, "20260101T000000000000") for s in (24, 32)] + [unfinished.name]
    )
    assert not leftover.exists()


def test_a_manifest_storage_cannot_read_right_now_stops_pruning_and_resuming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # S3 resets the connection while pruning reads the manifest of step 16: taken as "no manifest", that
    # complete checkpoint would be deleted as a partial leftover older than the newest.
    run = tmp_path / "run"
    for step in (8, 16, 24):
        write_checkpoint(run, step)
    unreadable = checkpoint_name(16, "20260101T000000000000")
    read_text = Location.read_text

    def flaky(location: Location) -> str:
        if unreadable in location.path:
            raise OSError("Connection reset by peer")
        return read_text(location)

    monkeypatch.setattr(Location, "read_text", flaky)
    with pytest.raises(OSError, match="reset"):
        prune(Location.parse(str(run)), keep=2)
    assert len(list(run.iterdir())) == 3
    with pytest.raises(OSError, match="reset"):  # not a silent resume from an older checkpoint
        find_resume_point(Location.parse(str(run)), "auto", "s2", FINGERPRINT)
