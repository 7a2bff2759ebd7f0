"""How long a run's status lags its trainer: each step the trainer recorded (its progress history in S3, with
updatedAt on the trainer's clock, which is this host's: the Ray head runs here) against the moment a watch of
the run first shows that step or a later one (this process's clock)."""

from __future__ import annotations

import datetime as dt
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fsdp_trainer.contract import METRICS_DIR
from tests.support.kube import custom_objects


@dataclass(frozen=True)
class Lags:
    seconds: list[float]  # one per step the trainer recorded, in step order

    @property
    def p50(self) -> float:
        return statistics.median(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    def __str__(self) -> str:
        return f"p50 {self.p50:.1f} s, max {self.max:.1f} s over {len(self.seconds)} steps"


def recorded_steps(s3: Any, bucket: str, run_prefix: str) -> dict[int, float]:
    """Each training step of the run's progress history (every record its trainers made, stored or not,
    metrics/<attempt>.jsonl under the run's prefix) and when it was first recorded (epoch seconds)."""
    found: dict[int, float] = {}
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{run_prefix}{METRICS_DIR}/").get("Contents", [])
    for obj in listed:
        for line in s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read().decode().splitlines():
            record = json.loads(line)
            if record["phase"] == "training" and record["step"] > 0:
                written = dt.datetime.fromisoformat(record["updatedAt"]).timestamp()
                found[record["step"]] = min(written, found.get(record["step"], written))
    return found


@dataclass
class StatusLag:
    """A watch of the run's status.progress.step, from before it trains to after it ends."""

    namespace: str
    name: str
    shown: list[tuple[float, int]] = field(default_factory=list)  # (epoch seconds, step) at each change
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> StatusLag:
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the watch of the run's status did not stop within 30 s"

    def _watch(self) -> None:
        from kubernetes import watch

        from fsdp_operator.api import GROUP, PLURAL, VERSION

        while not self._stop.is_set():
            watcher = watch.Watch()
            try:
                for event in watcher.stream(
                    custom_objects().list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL,
                    field_selector=f"metadata.name={self.name}", timeout_seconds=5,
                ):  # fmt: skip
                    seen = time.time()
                    step = ((event["object"].get("status") or {}).get("progress") or {}).get("step")
                    if step and (not self.shown or self.shown[-1][1] != step):
                        self.shown.append((seen, step))
                    if self._stop.is_set():
                        break
            except Exception as error:  # a dropped watch is opened again; said if a step is never seen
                self.errors.append(f"{type(error).__name__}: {error}")
            finally:
                watcher.stop()

    def lags(self, recorded: dict[int, float]) -> Lags:
        """Per step recorded (recorded_steps): seconds from then to the first status showing it or a later
        one. A step the status never caught up with fails, naming it."""
        found = []
        for step, written in sorted(recorded.items()):
            caught_up = next((seen for seen, shown in self.shown if shown >= step), None)
            assert caught_up is not None, (
                f"the status never showed step {step} (recorded at {written:.1f}); it showed "
                f"{self.shown[-5:]}; watch errors: {self.errors[-3:]}"
            )
            found.append(caught_up - written)
        assert found, "the trainer recorded no training step"
        return Lags(found)
