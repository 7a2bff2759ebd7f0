"""What goes wrong for someone driving runs from a notebook: each error is one line that says what happened
and what to do. IPython shows that line alone (`_render_traceback_`): the stack of this package's own frames
would only hide it."""

from __future__ import annotations

from typing import Any


class ClientError(RuntimeError):
    """The base of every error this package raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class NoClusterAccess(ClientError):
    """No kubeconfig, the cluster unreachable, or the credentials refused."""


class CrdNotInstalled(ClientError):
    """The cluster has no FSDPTrainingRun API: the operator's chart is not installed there."""


class NamespaceNotGranted(ClientError):
    """The user's identity may not act on runs in that namespace (Kubernetes RBAC said 403)."""


class RunNotFound(ClientError):
    pass


class RunExists(ClientError):
    pass


class InvalidSpec(ClientError, ValueError):
    """A spec the FSDPTrainingRun schema (or the cluster's admission) refuses; the message names the field."""


class StorageNotReadable(ClientError):
    """The run's S3 prefix cannot be read with this environment's AWS identity."""


class NotRecordedYet(ClientError):
    """What was asked for is not in S3 (yet): a log, a metric history or run.json."""


class WaitTimedOut(ClientError, TimeoutError):
    pass


class RunFailed(ClientError):
    """The run ended Failed while it was awaited; `reason` and `message` are the status's."""

    def __init__(self, run: Any, reason: str, message: str) -> None:
        super().__init__(f"run {run.namespace}/{run.name} failed: {reason}: {message}")
        self.run, self.reason, self.message = run, reason, message
