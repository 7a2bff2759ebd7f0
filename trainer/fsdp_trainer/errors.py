"""Failure classes that carry a contract.ErrorKind, and the classification of any exception.

The operator retries only RUNTIME failures, so a failure is marked permanent only when retrying the same
input cannot succeed.
"""

from __future__ import annotations

from fsdp_trainer.contract import ErrorKind


class TrainerError(Exception):
    kind: ErrorKind = ErrorKind.RUNTIME


class ConfigError(TrainerError):
    kind = ErrorKind.CONFIG


class DataError(TrainerError):
    kind = ErrorKind.DATA


class ModelError(TrainerError):
    kind = ErrorKind.MODEL


class TransportError(TrainerError):
    kind = ErrorKind.TRANSPORT


class FabricError(TrainerError):
    """The fabric check found the network between the pods below network.minBusBandwidthGbps. Permanent for
    the trainer; the operator restarts without the node to blame where the run's policy says so."""

    kind = ErrorKind.FABRIC


class NonFiniteLossError(TrainerError):
    """training.maxNonFiniteSteps steps in a row had a non-finite loss or gradient norm. Permanent: a retry
    resumes from the newest checkpoint with the same weights, data order and hyperparameters, so it meets
    the same steps again; a lower learning rate or other data is the user's call."""

    kind = ErrorKind.NON_FINITE_LOSS


class DeviceError(TrainerError):
    """The node cannot run what was asked (no usable GPU): RUNTIME, since another node may."""


def classify(error: BaseException) -> ErrorKind:
    """The kind of the first classified exception in the chain (Ray wraps worker errors around their cause).

    Out-of-memory is recognised by class name so that this module needs no torch import
    (torch.OutOfMemoryError, formerly torch.cuda.OutOfMemoryError).
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, TrainerError):
            return current.kind
        if any(cls.__name__ == "OutOfMemoryError" for cls in type(current).__mro__):
            return ErrorKind.OOM
        if type(current).__name__ == "ValidationError":  # pydantic: the config did not parse
            return ErrorKind.CONFIG
        cause = getattr(current, "cause", None)  # ray.exceptions.RayTaskError keeps the worker's error here
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return ErrorKind.RUNTIME
