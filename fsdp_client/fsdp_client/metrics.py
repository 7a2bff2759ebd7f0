"""A run's metric history (the trainer's record of every logged step, one file per attempt) as rows, and as a
pandas DataFrame for whoever asks for one: pandas is imported then, not before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fsdp_client.errors import ClientError
from fsdp_trainer.contract import ProgressRecord

if TYPE_CHECKING:
    import pandas

COLUMNS = ("attempt", "step", "loss", "eval_loss", "tokens_per_second", "mfu", "world_size", "updated_at")
_LOGGED_PHASES = ("training", "finished")  # "starting" records precede the first step


def attempt_of(record: ProgressRecord, ordinal: int) -> int:
    """The operator's attempt number, the suffix of the Ray job's submission id (status.jobSubmissionId
    `<prefix>-<attempt>`); the history's place among the run's histories for records that name no job."""
    suffix = (record.submission_id or "").rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else ordinal


def rows(histories: Sequence[Sequence[ProgressRecord]]) -> list[dict[str, Any]]:
    """One row per logged step of each attempt (a step logged twice counts as its last record has it), in
    the order the attempts ran: a step an attempt trains again after a restart appears once per attempt."""
    found: list[dict[str, Any]] = []
    for ordinal, records in enumerate(histories, start=1):
        by_step: dict[int, dict[str, Any]] = {}
        for record in records:
            if record.phase in _LOGGED_PHASES and record.step > 0:
                row = {column: getattr(record, column, None) for column in COLUMNS}
                by_step[record.step] = row | {"attempt": attempt_of(record, ordinal)}
        found += [by_step[step] for step in sorted(by_step)]
    return found


def dataframe(table: list[dict[str, Any]]) -> pandas.DataFrame:
    try:
        import pandas
    except ImportError as error:
        raise ClientError("the metric history as a DataFrame needs pandas: pip install pandas") from error
    return pandas.DataFrame(table, columns=list(COLUMNS))
