"""Counting a client's requests from the local kube-apiserver's audit log.

cluster-up runs the apiserver with hack/cluster/audit-policy.yaml: one Metadata event per request (two for a
watch: ResponseStarted, then ResponseComplete when it ends), JSON lines in the file named by
APISERVER_AUDIT_LOG in .local-cluster/env, rotated at 50 MB with two backups (audit-<time>.log beside it).
Clients are told apart by user agent, since every local client authenticates as the same admin user:

    log = AuditLog.of_local_cluster()
    since = datetime.now(UTC)
    ...  # let the operator run
    counts = log.count(KOPF_USER_AGENT, since)   # Counter{("patch", "fsdptrainingruns", "status"): 4, ...}

Events are written when a response completes, so a request that has just been answered may take a moment to
appear; poll (tests.support.waiting.wait_until) rather than read once.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.support.local_cluster import LocalCluster
from tests.support.paths import state_dir

KOPF_USER_AGENT = "kopf/"  # kopf's aiohttp session: kopf/<version>
OPERATOR_USER_AGENT = "fsdp-operator"  # handlers.USER_AGENT: the operator's own Python client
PYTHON_CLIENT_USER_AGENT = "OpenAPI-Generator/"  # the kubernetes package: OpenAPI-Generator/<v>/python

RequestKind = tuple[str, str, str]  # (verb, resource, subresource); resource "" for a non-resource URL


@dataclass(frozen=True)
class AuditEvent:
    """The fields of one audit event that tell who asked for what, and when the apiserver received it."""

    audit_id: str
    stage: str
    received: datetime
    verb: str
    resource: str
    subresource: str
    namespace: str
    name: str
    user: str
    user_agent: str
    uri: str
    code: int | None

    @property
    def kind(self) -> RequestKind:
        return (self.verb, self.resource, self.subresource)


def parse_line(line: str) -> AuditEvent | None:
    """One audit event from a line of the log; None for what is not one (a blank or half-written line)."""
    try:
        raw: dict[str, Any] = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(raw, dict) or raw.get("kind") != "Event":
        return None
    ref = raw.get("objectRef") or {}
    return AuditEvent(
        audit_id=raw["auditID"],
        stage=raw["stage"],
        received=datetime.fromisoformat(raw["requestReceivedTimestamp"]),
        verb=raw["verb"],
        resource=ref.get("resource", ""),
        subresource=ref.get("subresource", ""),
        namespace=ref.get("namespace", ""),
        name=ref.get("name", ""),
        user=raw.get("user", {}).get("username", ""),
        user_agent=raw.get("userAgent", ""),
        uri=raw.get("requestURI", ""),
        code=raw.get("responseStatus", {}).get("code"),
    )


def requests_of(lines: Iterable[str]) -> Iterator[AuditEvent]:
    """Each request once, in log order (the first of its events: a watch has a start and an end)."""
    seen: set[str] = set()
    for line in lines:
        event = parse_line(line)
        if event is not None and event.audit_id not in seen:
            seen.add(event.audit_id)
            yield event


def select(
    events: Iterable[AuditEvent], user_agent: str, since: datetime, until: datetime | None = None
) -> list[AuditEvent]:
    """The requests whose user agent starts with `user_agent`, received in [since, until)."""
    return [
        event
        for event in events
        if event.user_agent.startswith(user_agent)
        and since <= event.received
        and (until is None or event.received < until)
    ]


@dataclass(frozen=True)
class AuditLog:
    """The audit log of the local cluster's apiserver, with its rotated backups."""

    path: Path

    @classmethod
    def of_local_cluster(cls) -> AuditLog:
        """The log named by APISERVER_AUDIT_LOG: from the environment, else from the cluster's env file."""
        path = os.environ.get("APISERVER_AUDIT_LOG") or LocalCluster.from_env_file().env.get(
            "APISERVER_AUDIT_LOG"
        )
        if not path:
            raise RuntimeError(
                f"no APISERVER_AUDIT_LOG in the environment or {state_dir() / 'env'}: restart the local "
                "cluster "
                "(hack/cluster-down.sh; hack/cluster-up.sh) so that its apiserver writes an audit log"
            )
        return cls(Path(path))

    def files(self) -> list[Path]:
        """Rotated backups, oldest first (their names end in the rotation time), then the live file."""
        backups = sorted(self.path.parent.glob(f"{self.path.stem}-*{self.path.suffix}"))
        return [*backups, self.path]

    def lines(self) -> Iterator[str]:
        for file in self.files():
            try:
                with file.open(encoding="utf-8") as lines:
                    yield from lines
            except FileNotFoundError:
                continue  # rotated away while we read the one before it

    def requests(self, user_agent: str, since: datetime, until: datetime | None = None) -> list[AuditEvent]:
        """The requests from clients whose user agent starts with `user_agent`, received in [since, until)."""
        return select(requests_of(self.lines()), user_agent, since, until)

    def count(self, user_agent: str, since: datetime, until: datetime | None = None) -> Counter[RequestKind]:
        """How many requests of each (verb, resource, subresource) those clients made in [since, until)."""
        return Counter(event.kind for event in self.requests(user_agent, since, until))
