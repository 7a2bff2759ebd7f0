"""FSDPTrainingRuns from Python (a notebook, a pipeline): `Client` creates, waits for, follows and compares
runs. It shares its readers of what a run leaves in S3 with the kubectl plugin, and validates specs with the
operator's API models (fsdp_operator.api, the CRD's source). pandas is imported only for a DataFrame."""

from fsdp_client.client import Client
from fsdp_client.errors import (
    ClientError,
    CrdNotInstalled,
    InvalidSpec,
    NamespaceNotGranted,
    NoClusterAccess,
    NotRecordedYet,
    RunExists,
    RunFailed,
    RunNotFound,
    StorageNotReadable,
    WaitTimedOut,
)
from fsdp_client.rundiff import Difference, RunDiff
from fsdp_client.runs import TrainingRun
from fsdp_operator.api import FSDPTrainingRunSpec

__all__ = [
    "Client",
    "ClientError",
    "CrdNotInstalled",
    "Difference",
    "FSDPTrainingRunSpec",
    "InvalidSpec",
    "NamespaceNotGranted",
    "NoClusterAccess",
    "NotRecordedYet",
    "RunDiff",
    "RunExists",
    "RunFailed",
    "RunNotFound",
    "StorageNotReadable",
    "TrainingRun",
    "WaitTimedOut",
]
