"""Why two runs differ: their run records (run.json) and training histories, field by field.

What ran (image digest, versions, the trainer package), the resolved configuration, the transport NCCL used,
throughput, restarts, and the loss at the steps both runs reached. Names and times that differ between any
two runs (the run's name, namespace, uid, its start) are left out: they say nothing about the result.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from fsdp_client.storage import RunObjects, metric_histories, run_record
from fsdp_trainer.contract import ProgressRecord, RunRecord

# Per-run identity, not recipe: every two runs differ here.
_IDENTITY = {"run_name", "namespace", "uid", "start_time", "completion_time", "logs_uri", "checkpoints"}
_CONFIG_IDENTITY = {"run_name", "namespace"}
_PROGRESS = ("step", "loss", "eval_loss", "tokens_per_second", "tokens_per_second_per_device", "mfu")
LOSS_STEPS_SHOWN = 5  # spread over the steps both runs reached


class Difference(NamedTuple):
    field: str
    a: Any
    b: Any


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested maps as dotted keys; lists as their JSON text (compared whole)."""
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat |= flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return flat
    if isinstance(value, list):
        return {prefix: json.dumps(value, sort_keys=True)}
    return {prefix: value}


def losses(histories: Iterable[Iterable[ProgressRecord]]) -> dict[int, float]:
    """The loss at each step; a step trained again after a restart counts as its last attempt has it."""
    found: dict[int, float] = {}
    for history in histories:
        for record in history:
            if record.loss is not None:
                found[record.step] = record.loss
    return found


def fields(record: RunRecord) -> dict[str, Any]:
    dumped = record.model_dump(mode="json", exclude=_IDENTITY | {"final_progress", "restarts"})
    dumped["config"] = {k: v for k, v in dumped["config"].items() if k not in _CONFIG_IDENTITY}
    flat = flatten(dumped)
    progress = record.final_progress
    for name in _PROGRESS:
        flat[f"final.{name}"] = getattr(progress, name) if progress is not None else None
    flat["restarts"] = len(record.restarts)
    return flat


def differences(
    a: RunRecord,
    b: RunRecord,
    a_histories: Iterable[Iterable[ProgressRecord]] = (),
    b_histories: Iterable[Iterable[ProgressRecord]] = (),
    everything: bool = False,
) -> list[Difference]:
    """(field, a's value, b's value) for every field that differs (every field when `everything`)."""
    left, right = fields(a), fields(b)
    a_loss, b_loss = losses(a_histories), losses(b_histories)
    both = sorted(a_loss.keys() & b_loss.keys())
    if both:
        picks = {both[round(i * (len(both) - 1) / (LOSS_STEPS_SHOWN - 1))] for i in range(LOSS_STEPS_SHOWN)}
        for step in sorted(picks):
            left[f"loss at step {step}"], right[f"loss at step {step}"] = a_loss[step], b_loss[step]
    keys = list(left) + [key for key in right if key not in left]
    return [
        Difference(key, left.get(key), right.get(key))
        for key in keys
        if everything or left.get(key) != right.get(key)
    ]


def shown(value: Any) -> str:
    return "-" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))


def table(rows: list[Difference], a_name: str, b_name: str) -> str:
    if not rows:
        return "no differences\n"
    cells = [("FIELD", a_name, b_name), *((key, shown(a), shown(b)) for key, a, b in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(2)]
    return "".join(f"{key:<{widths[0]}}  {a:<{widths[1]}}  {b}\n" for key, a, b in cells)


@dataclass(frozen=True)
class RunDiff:
    """Two runs' differences as data: `rows` to iterate, `fields()` as a dict, an HTML table in Jupyter."""

    a_name: str
    b_name: str
    rows: list[Difference]

    def fields(self) -> dict[str, tuple[Any, Any]]:
        return {row.field: (row.a, row.b) for row in self.rows}

    def __str__(self) -> str:
        return table(self.rows, self.a_name, self.b_name)

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td>{html.escape(row.field)}</td><td>{html.escape(shown(row.a))}</td>"
            f"<td>{html.escape(shown(row.b))}</td></tr>"
            for row in self.rows
        )
        head = (
            f"<tr><th>field</th><th>{html.escape(self.a_name)}</th><th>{html.escape(self.b_name)}</th></tr>"
        )
        return f"<table>{head}{cells or '<tr><td colspan=3>no differences</td></tr>'}</table>"


def compare(a: RunObjects, b: RunObjects, everything: bool = False) -> RunDiff:
    """Two runs' differences, read from their S3 prefixes (run.json and the metric histories)."""
    (left, left_histories), (right, right_histories) = (
        (run_record(objects), metric_histories(objects)) for objects in (a, b)
    )
    rows = differences(left, right, left_histories, right_histories, everything=everything)
    return RunDiff(f"{left.namespace}/{left.run_name}", f"{right.namespace}/{right.run_name}", rows)
