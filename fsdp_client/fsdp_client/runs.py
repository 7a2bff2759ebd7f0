"""One FSDPTrainingRun as the apiserver returned it: its status through the operator's own API models, and
its summary as HTML for Jupyter."""

from __future__ import annotations

import html
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fsdp_operator import api
from fsdp_trainer.contract import CheckpointRef


@dataclass(frozen=True)
class TrainingRun:
    """A snapshot: `Client.get` reads a newer one."""

    obj: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.obj["metadata"]["namespace"])

    @cached_property
    def model(self) -> api.FSDPTrainingRun:
        return api.FSDPTrainingRun.model_validate(self.obj)

    @property
    def spec(self) -> api.FSDPTrainingRunSpec:
        return self.model.spec

    @property
    def status(self) -> api.FSDPTrainingRunStatus:
        return self.model.status

    @property
    def phase(self) -> str | None:
        return self.status.phase

    def condition(self, kind: str) -> api.Condition | None:
        return next((c for c in self.status.conditions if c.type == kind), None)

    @property
    def checkpoints(self) -> list[CheckpointRef]:
        """The last few complete checkpoints, newest first (run.json keeps every one)."""
        return list(self.status.checkpoints.recent)

    @property
    def latest_checkpoint(self) -> CheckpointRef | None:
        return self.status.checkpoints.latest

    @property
    def exported_model_uri(self) -> str | None:
        """Where the trained model was exported (config, weights, tokenizer): a next run's model.source."""
        return self.status.record.exported_model_uri

    @property
    def goodput(self) -> api.GoodputStatus:
        return self.status.goodput

    @property
    def cost_usd(self) -> float | None:
        return self.status.goodput.cost_usd

    def summary(self) -> dict[str, Any]:
        """The run at a glance, as the HTML summary shows it."""
        status, progress, goodput = self.status, self.status.progress, self.status.goodput
        return {
            "run": f"{self.namespace}/{self.name}",
            "phase": status.phase,
            "message": status.message,
            "attempt": status.attempt,
            "step": f"{progress.step}/{progress.max_steps}" if progress.step is not None else None,
            "loss": progress.loss,
            "eval loss": progress.eval_loss,
            "tokens/s": progress.tokens_per_second,
            "MFU": progress.mfu,
            "world size": progress.world_size,
            "restarts": status.restarts.count,
            "goodput": goodput.fraction,
            "GPU-hours held": goodput.gpu_hours_held,
            "cost (USD)": goodput.cost_usd,
            "latest checkpoint": self.latest_checkpoint.uri if self.latest_checkpoint else None,
            "exported model": self.exported_model_uri,
            "image digest": status.image.digest,
        }

    def _repr_html_(self) -> str:
        def cell(value: Any) -> str:
            if isinstance(value, float):
                value = f"{value:.4g}"
            return html.escape("-" if value is None else str(value))

        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(key)}</th>"
            f"<td style='text-align:left'>{cell(value)}</td></tr>"
            for key, value in self.summary().items()
        )
        return f"<table>{rows}</table>"

    def __repr__(self) -> str:
        return f"TrainingRun({self.namespace}/{self.name}, phase={self.phase})"
