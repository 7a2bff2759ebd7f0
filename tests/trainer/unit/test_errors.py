"""Failure classification: only runtime failures are worth retrying."""

from __future__ import annotations

import pytest

from fsdp_trainer.contract import PERMANENT_ERROR_KINDS, ErrorKind
from fsdp_trainer.driver import root_cause
from fsdp_trainer.errors import ConfigError, DataError, ModelError, TransportError, classify


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError, recognised by name."""


class WorkerGroupError(Exception):
    """Shaped like ray.train.WorkerGroupError: the error of each failed rank."""

    def __init__(self, worker_failures: dict[int, BaseException]) -> None:
        super().__init__("Training failed due to worker errors")
        self.worker_failures = worker_failures


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ConfigError("x"), ErrorKind.CONFIG),
        (DataError("x"), ErrorKind.DATA),
        (ModelError("x"), ErrorKind.MODEL),
        (TransportError("x"), ErrorKind.TRANSPORT),
        (OutOfMemoryError("CUDA out of memory"), ErrorKind.OOM),
        (RuntimeError("NCCL timeout"), ErrorKind.RUNTIME),
    ],
)
def test_classify(error: BaseException, kind: ErrorKind) -> None:
    assert classify(error) == kind


def test_classify_follows_the_cause_chain() -> None:
    try:
        try:
            raise DataError("no column 'text'")
        except DataError as inner:
            raise RuntimeError("worker failed") from inner
    except RuntimeError as outer:
        assert classify(outer) == ErrorKind.DATA


def test_a_permanent_worker_error_explains_the_collateral_ones() -> None:
    oom = OutOfMemoryError("CUDA out of memory")
    kind, cause = root_cause(WorkerGroupError({0: RuntimeError("collective aborted"), 1: oom}))
    assert kind == ErrorKind.OOM and cause is oom
    kind, cause = root_cause(WorkerGroupError({1: ConnectionError("peer lost")}))
    assert kind == ErrorKind.RUNTIME and isinstance(cause, ConnectionError)
    assert kind not in PERMANENT_ERROR_KINDS
