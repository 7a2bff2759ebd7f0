"""One active operator among replicas: a coordination.k8s.io/v1 Lease, with client-go's election rules.

The holder renews the Lease every RENEW_INTERVAL seconds. A candidate takes the Lease when it is free,
released, or has not changed for its leaseDurationSeconds as measured on the candidate's own monotonic clock
(never by comparing wall clocks across machines). The holder stops acting - the process exits - when no
renewal succeeded for RENEW_DEADLINE seconds, counted from when the last successful renewal began; a
candidate waits LEASE_DURATION from when it saw that renewal, so the two are never active at once. Every
write is conditional on the resourceVersion that was read, so two candidates never both win one round.

kubernetes.leaderelection (37.0.1) is not used: its calls have no timeout, its renew deadline is only checked
between calls, it compares wall-clock times, and it cannot release the Lease.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("fsdp_operator.leader")

LEASE_DURATION = 15  # seconds a Lease that stops changing keeps its holder
RENEW_INTERVAL = 5.0  # the holder renews this often
RENEW_DEADLINE = 10.0  # the holder gives up when no renewal succeeded for this long
RETRY_PERIOD = 2.0  # a candidate, or a holder whose renewal failed, tries again this often
REQUEST_TIMEOUT = 5.0  # longest wait for one apiserver call
WATCHDOG_TICK = 0.5  # how often the watchdog compares the clock with the renew deadline


def new_identity() -> str:
    """The pod's name (or the host's) with a random suffix: a restarted container is a new candidate."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


def coordination_api() -> client.CoordinationV1Api:
    """A client of its own, without urllib3's retries: a call's timeout is then the whole wait."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    configuration.retries = 0
    return client.CoordinationV1Api(client.ApiClient(configuration))


UNREACHABLE = (OSError, urllib3.exceptions.HTTPError)  # connection refused or reset, timeouts


@dataclass(frozen=True)
class Lease:
    """What the apiserver holds, as far as the election cares."""

    holder: str
    duration_seconds: int
    acquire_time: dt.datetime | None
    transitions: int
    resource_version: str


class Move(StrEnum):
    CREATE = "create"  # there is no Lease yet
    ACQUIRE = "acquire"  # free, released, or expired: take it
    RENEW = "renew"  # ours: renew it
    WAIT = "wait"  # another candidate holds it and renews it


def next_move(lease: Lease | None, identity: str, unchanged_for: float) -> Move:
    """What a candidate does about `lease`, unchanged for `unchanged_for` seconds on the candidate's clock."""
    if lease is None:
        return Move.CREATE
    if lease.holder == identity:
        return Move.RENEW
    if not lease.holder or unchanged_for >= lease.duration_seconds:
        return Move.ACQUIRE
    return Move.WAIT


def micro_time(now: dt.datetime) -> dt.datetime:
    """`now` as a Lease time: the client writes datetimes with isoformat(), which drops a zero fraction of a
    second, and the apiserver's MicroTime refuses a time without its six fractional digits."""
    return now if now.microsecond else now.replace(microsecond=1)


def claimed_spec(lease: Lease | None, identity: str, now: dt.datetime) -> client.V1LeaseSpec:
    """The Lease spec that makes `identity` the holder: acquireTime kept on renewal, transitions counted."""
    ours = lease is not None and lease.holder == identity
    kept_acquire_time = lease.acquire_time if ours and lease else None
    transitions = 0 if lease is None else lease.transitions if ours else lease.transitions + 1
    return client.V1LeaseSpec(
        holder_identity=identity,
        lease_duration_seconds=LEASE_DURATION,
        acquire_time=micro_time(kept_acquire_time or now),
        renew_time=micro_time(now),
        lease_transitions=transitions,
    )


def released_spec(lease: Lease, now: dt.datetime) -> client.V1LeaseSpec:
    """No holder, as client-go releases: any candidate takes it at its next try."""
    return client.V1LeaseSpec(
        holder_identity=None,
        lease_duration_seconds=1,
        acquire_time=micro_time(now),
        renew_time=micro_time(now),
        lease_transitions=lease.transitions,
    )


class LeaseStore:
    """Reads and conditionally writes one Lease; every call bounded by a timeout."""

    def __init__(self, api: client.CoordinationV1Api, namespace: str, name: str) -> None:
        self.api, self.namespace, self.name = api, namespace, name

    def read(self, timeout: float) -> Lease | None:
        try:
            found = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        spec = found.spec or client.V1LeaseSpec()
        return Lease(
            holder=spec.holder_identity or "",
            duration_seconds=spec.lease_duration_seconds or LEASE_DURATION,
            acquire_time=spec.acquire_time,
            transitions=spec.lease_transitions or 0,
            resource_version=(found.metadata and found.metadata.resource_version) or "",
        )

    def create(self, spec: client.V1LeaseSpec, timeout: float) -> None:
        metadata = client.V1ObjectMeta(name=self.name, namespace=self.namespace)
        self.api.create_namespaced_lease(
            self.namespace, client.V1Lease(metadata=metadata, spec=spec), _request_timeout=timeout
        )

    def replace(self, resource_version: str, spec: client.V1LeaseSpec, timeout: float) -> None:
        """Fails with 409 Conflict when anyone wrote the Lease since `resource_version` was read."""
        metadata = client.V1ObjectMeta(
            name=self.name, namespace=self.namespace, resource_version=resource_version
        )
        self.api.replace_namespaced_lease(
            self.name, self.namespace, client.V1Lease(metadata=metadata, spec=spec), _request_timeout=timeout
        )


class Elector:
    """One candidate's view of the Lease: each `try_acquire_or_renew` reads it once, maybe writes it once."""

    def __init__(
        self,
        store: LeaseStore,
        identity: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.store, self.identity = store, identity
        self.clock, self.wall_clock = clock, wall_clock
        # The Lease's resourceVersion when this candidate last saw it change, and when (on its own clock).
        self.seen_version: str | None = None
        self.seen_at = 0.0
        self.last_contact: float | None = None  # when the apiserver last answered (standby readiness)
        self.renewed_at = 0.0  # when the last successful acquisition or renewal began (its write came later)
        self.holder = ""

    def try_acquire_or_renew(self, timeout: float = REQUEST_TIMEOUT) -> bool:
        """True when this candidate holds the Lease now; False when another does or the apiserver failed."""
        began = self.clock()
        try:
            lease = self.store.read(timeout)
            self.last_contact = self.clock()
            if lease is None or lease.resource_version != self.seen_version:
                self.seen_version = lease.resource_version if lease else None
                self.seen_at = self.clock()
            self.holder = lease.holder if lease else ""
            move = next_move(lease, self.identity, self.clock() - self.seen_at)
            if move == Move.WAIT:
                return False
            spec = claimed_spec(lease, self.identity, self.wall_clock())
            if lease is None:
                self.store.create(spec, timeout)
            else:
                self.store.replace(lease.resource_version, spec, timeout)
            self.last_contact = self.clock()
        except ApiException as error:
            if error.status != 409:  # 409: another candidate wrote first; not worth a warning
                log.warning(
                    "lease %s/%s: %s %s", self.store.namespace, self.store.name, error.status, error.reason
                )
            return False
        except UNREACHABLE as error:
            log.warning(
                "lease %s/%s: apiserver unreachable: %s", self.store.namespace, self.store.name, error
            )
            return False
        if move != Move.RENEW:
            log.info(
                "%s leads now (lease %s/%s, was %r)",
                self.identity,
                self.store.namespace,
                self.store.name,
                self.holder,
            )
        self.holder, self.renewed_at = self.identity, began
        return True

    def release(self, timeout: float = REQUEST_TIMEOUT) -> bool:
        """Frees the Lease if this candidate still holds it, so a standby takes over at its next try."""
        try:
            lease = self.store.read(timeout)
            if lease is None or lease.holder != self.identity:
                return False
            self.store.replace(lease.resource_version, released_spec(lease, self.wall_clock()), timeout)
        except (ApiException, *UNREACHABLE) as error:
            log.warning("could not release lease %s/%s: %s", self.store.namespace, self.store.name, error)
            return False
        log.info("%s released lease %s/%s", self.identity, self.store.namespace, self.store.name)
        return True


class Leadership:
    """Keeps the Lease while the operator acts, from two threads that do not depend on the event loop.

    The renewer renews every RENEW_INTERVAL (every RETRY_PERIOD after a failure). The watchdog calls `on_lost`
    once RENEW_DEADLINE has passed since the last successful renewal began, even while a call hangs, or as
    soon as `unable_to_act` gives a reason (a frozen event loop); the renewer calls it at once when it finds
    another candidate holding the Lease.
    """

    def __init__(
        self,
        elector: Elector,
        on_lost: Callable[[str], None],
        unable_to_act: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.elector, self.on_lost, self.unable_to_act = elector, on_lost, unable_to_act
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._renew, name="lease-renewer", daemon=True),
            threading.Thread(target=self._watch, name="lease-watchdog", daemon=True),
        ]

    def start(self) -> Leadership:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stops renewing (before a release); returns once no renewal is in flight."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=REQUEST_TIMEOUT + 1)

    def _time_left(self) -> float:
        return self.elector.renewed_at + RENEW_DEADLINE - self.elector.clock()

    def _renew(self) -> None:
        wait = RENEW_INTERVAL
        while not self.stopping.wait(wait):
            timeout = max(0.1, min(REQUEST_TIMEOUT, self._time_left()))
            if self.elector.try_acquire_or_renew(timeout):
                wait = RENEW_INTERVAL
            elif self.elector.holder not in ("", self.elector.identity):
                self.on_lost(f"lease taken by {self.elector.holder}")
                return
            else:
                wait = RETRY_PERIOD

    def _watch(self) -> None:
        while not self.stopping.wait(WATCHDOG_TICK):
            why = self.unable_to_act()
            if why is None and self._time_left() < 0:
                why = f"lease not renewed for {RENEW_DEADLINE:g}s"
            if why is not None:
                self.on_lost(why)
                return
