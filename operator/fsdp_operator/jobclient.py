"""A small client for Ray's job REST API, on urllib3 (already loaded by the kubernetes client and botocore).

What the operator asks a Ray dashboard, and nothing else, as Ray's own `JobSubmissionClient` asks it
(ray/dashboard/modules/dashboard_sdk.py and job/sdk.py, Ray 2.58), so that the operator process never imports
Ray (its client costs ~75 MiB of imports and `_raylet.so`):

- `POST /api/jobs/` submit, `GET /api/jobs/<id>` status, `POST /api/jobs/<id>/stop` stop;
- `GET /api/v0/logs/file?node_id=<driver node>&submission_id=<id>&lines=N`: the driver log's tail;
- `GET` / `PUT /api/packages/<protocol>/<name>`: a local py_modules directory is zipped (the directory itself
  at the top, as Ray's `create_package(include_parent_dir=True)`) and uploaded under a content-addressed
  `gcs://_ray_pkg_<hash>.zip` unless the dashboard has it already. The GET also pins the package in the GCS
  for a while (the dashboard's `pin_runtime_env_uri`), so it outlives the gap to the submit.

Like KubeRay's controller (ray-operator/controllers/ray/utils/dashboard_httpclient.go) it skips the SDK's
`GET /api/version` check: a head that is not up fails the call the operator actually makes.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import socket
import threading
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlencode

import urllib3
import urllib3.connection

RAY_PKG_PREFIX = "_ray_pkg_"
USER_AGENT = "fsdp-operator"
# Every entry of a package zip gets this time, so that the same files always make the same bytes.
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
POOL_SIZE = 32  # connections kept per dashboard host: one per handler thread (settings.worker_threads)
# The most of an answer read whole (a job's status, a submit's reply): the head runs the tenant's code, and
# Ray's own answers are a few KiB. A longer one is refused (ResponseTooLarge) after reading one byte more,
# and its connection closed, not drained.
MAX_RESPONSE_BYTES = 1 << 20
# The most one call may take, all of it: connecting, sending, the status line and headers, and the body. The
# sockets' own timeouts bound each read, so a head that answers a byte at a time would hold a handler thread
# for ever (and the run's lock, and other passes waiting on it); a package upload is a few MiB.
CALL_DEADLINE_SECONDS = 30.0

_calling = threading.local()  # .deadline: when the calling thread's request must be over (time.monotonic)


class DeadlineSocket:
    """A connection's socket whose every read and send ends by the calling thread's deadline (set by
    JobClient.request for the length of a call), where the socket's own timeout bounds each read only."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def _within_deadline(self, call: Any, *args: Any) -> Any:
        deadline = getattr(_calling, "deadline", None)
        if deadline is None:
            return call(*args)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the dashboard call took longer than {CALL_DEADLINE_SECONDS}s in all")
        own = self._sock.gettimeout()
        self._sock.settimeout(remaining if own is None else min(own, remaining))
        try:
            return call(*args)
        finally:
            self._sock.settimeout(own)

    def recv_into(self, *args: Any) -> int:
        return cast(int, self._within_deadline(self._sock.recv_into, *args))

    def recv(self, *args: Any) -> bytes:
        return cast(bytes, self._within_deadline(self._sock.recv, *args))

    def sendall(self, *args: Any) -> None:
        self._within_deadline(self._sock.sendall, *args)

    def makefile(self, mode: str = "rb", buffering: int | None = None, **_: Any) -> io.BufferedReader:
        """What http.client reads an answer through (mode "rb"): a buffered reader whose reads come here."""
        self._sock._io_refs += 1  # as socket.makefile counts it: the socket closes when its files have
        return io.BufferedReader(socket.SocketIO(cast(Any, self), "rb"), buffering or io.DEFAULT_BUFFER_SIZE)


class _HTTPConnection(urllib3.connection.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock = cast(Any, DeadlineSocket(self.sock))


class _HTTPSConnection(urllib3.connection.HTTPSConnection):
    def connect(self) -> None:
        super().connect()
        self.sock = cast(Any, DeadlineSocket(self.sock))


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


class DashboardError(RuntimeError):
    """The dashboard answered, but not with success; worded as Ray's client words it."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"Request failed with status code {status}: {text}.")
        self.status = status
        self.text = text


class ResponseTooLarge(RuntimeError):
    """The dashboard's answer is longer than the operator reads (MAX_RESPONSE_BYTES)."""

    def __init__(self, url: str, cap: int) -> None:
        super().__init__(f"the answer to {url} is longer than the operator's cap of {cap} bytes: not read")
        self.url = url
        self.cap = cap


@dataclass(frozen=True)
class Response:
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


@functools.cache
def _pool(verify: str | bool, client_cert: tuple[str, str] | None) -> urllib3.PoolManager:
    """One connection pool per TLS set-up, shared by every dashboard client of the process."""
    tls: dict[str, Any] = {}
    if verify is False:
        tls["cert_reqs"] = "CERT_NONE"
    else:
        tls["cert_reqs"] = "CERT_REQUIRED"
        if isinstance(verify, str):
            tls["ca_cert_dir" if Path(verify).is_dir() else "ca_certs"] = verify
    if client_cert:
        tls["cert_file"], tls["key_file"] = client_cert
    manager = urllib3.PoolManager(num_pools=16, maxsize=POOL_SIZE, block=False, retries=False, **tls)
    manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
    return manager


def package_files(directory: Path) -> list[Path]:
    """The files a package of `directory` holds: its files, without bytecode caches, in path order."""
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and "__pycache__" not in p.relative_to(directory).parts and p.suffix != ".pyc"
    )


@functools.cache
def zip_package(directory: Path) -> tuple[str, bytes]:
    """`directory` zipped with itself as the top-level entry, and its content-addressed GCS URI. The same
    files always give the same bytes (fixed times and order): the URI names the content, not the moment."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in package_files(directory):
            info = zipfile.ZipInfo((Path(directory.name) / path.relative_to(directory)).as_posix(), ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, path.read_bytes())
    data = buffer.getvalue()
    return f"gcs://{RAY_PKG_PREFIX}{hashlib.sha256(data).hexdigest()[:32]}.zip", data


def normalized_runtime_env(runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime env as Ray's client sends it (`RuntimeEnv(...).to_dict()`): a pip list becomes
    `{"packages": [...], "pip_check": false}`; env_vars must map strings to strings."""
    env = dict(runtime_env)
    pip = env.get("pip")
    if isinstance(pip, list | tuple):
        env["pip"] = {"packages": list(pip), "pip_check": False}
    for key, value in (env.get("env_vars") or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"runtime_env env_vars must map str to str, got {key!r}: {value!r}")
    return env


class JobClient:
    """Requests to one Ray dashboard. Every request is bounded by `timeout` (connect, read) and carries
    `headers` (the Ray token, and the apiserver's credentials through its service proxy); none is retried
    here: the operator's next pass is the retry. Raises urllib3's errors (a timeout, a refused connection)
    and DashboardError."""

    def __init__(
        self,
        address: str,
        headers: Mapping[str, str] | None = None,
        verify: str | bool = True,
        client_cert: tuple[str, str] | None = None,
        timeout: tuple[float, float] = (5.0, 15.0),
        deadline: float = CALL_DEADLINE_SECONDS,
    ) -> None:
        self.address = address.rstrip("/")
        self.deadline = deadline
        self.headers = {"User-Agent": USER_AGENT, **(headers or {})}
        self.timeout = urllib3.Timeout(connect=timeout[0], read=timeout[1])
        self.http = _pool(verify, client_cert)

    def request(
        self,
        method: str,
        endpoint: str,
        *,
        json_data: Any = None,
        data: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        limit: int | None = None,
    ) -> Response:
        """One request; the body is read whole up to MAX_RESPONSE_BYTES (longer: ResponseTooLarge), or only
        its first `limit` bytes (a streamed log). Never more: an answer not read to its end closes its
        connection (draining it could read without end)."""
        url = self.address + endpoint + (f"?{urlencode(params)}" if params else "")
        headers = dict(self.headers)
        body = data
        if json_data is not None:
            body = json.dumps(json_data).encode()
            headers["Content-Type"] = "application/json"
        _calling.deadline = time.monotonic() + self.deadline
        try:
            answer = self.http.request(
                method, url, body=body, headers=headers, timeout=self.timeout, preload_content=False
            )
            cap = MAX_RESPONSE_BYTES if limit is None else limit
            ended = False
            try:
                raw = answer.read(cap + 1, decode_content=True)
                ended = len(raw) <= cap and not answer.read(1, decode_content=True)
            finally:
                if not ended:
                    answer.close()  # the rest is never read: the connection goes, not back to the pool
                answer.release_conn()
        finally:
            _calling.deadline = None
        if len(raw) > cap and limit is None:
            raise ResponseTooLarge(self.address + endpoint, cap)
        return Response(answer.status, raw[:cap].decode(errors="replace"))

    def ok(self, response: Response) -> Response:
        if response.status != 200:
            raise DashboardError(response.status, response.text)
        return response

    # -- the calls --------------------------------------------------------------------------------------

    def job_info(self, submission_id: str) -> Response:
        """`GET /api/jobs/<id>`, as answered (404 "Job <id> does not exist" for an unknown job)."""
        return self.request("GET", f"/api/jobs/{submission_id}")

    def stop_job(self, submission_id: str) -> Response:
        return self.request("POST", f"/api/jobs/{submission_id}/stop")

    def log_tail(self, submission_id: str, node_id: str, lines: int, limit: int) -> Response:
        """The driver log's last `lines` (at most `limit` bytes of them), as Ray's `get_log` asks for it."""
        params = {"node_id": node_id, "submission_id": submission_id, "lines": lines}
        return self.request("GET", "/api/v0/logs/file", params=params, limit=limit)

    def package_exists(self, uri: str) -> bool:
        protocol, name = uri.split("://", 1)
        response = self.request("GET", f"/api/packages/{protocol}/{name}")
        if response.status == 404:
            return False
        self.ok(response)
        return True

    def upload_package(self, uri: str, data: bytes) -> None:
        protocol, name = uri.split("://", 1)
        self.ok(self.request("PUT", f"/api/packages/{protocol}/{name}", data=data))

    def upload_py_modules(self, runtime_env: Mapping[str, Any]) -> dict[str, Any]:
        """Local py_modules directories uploaded (unless the dashboard has them) and named by their URIs."""
        env = dict(runtime_env)
        modules = []
        for module in env.get("py_modules") or []:
            if "://" in str(module):
                modules.append(str(module))
                continue
            path = Path(module).resolve()
            if not path.is_dir():
                raise ValueError(f"py_modules entry {module} is not a directory or a URI")
            uri, data = zip_package(path)
            if not self.package_exists(uri):
                self.upload_package(uri, data)
            modules.append(uri)
        if "py_modules" in env:
            env["py_modules"] = modules
        return env

    def submit_job(
        self,
        *,
        entrypoint: str,
        submission_id: str,
        runtime_env: Mapping[str, Any],
        metadata: Mapping[str, str],
    ) -> str:
        """Uploads the runtime env's local packages, then `POST /api/jobs/`; returns the submission id."""
        env = normalized_runtime_env(self.upload_py_modules(runtime_env))
        body = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": env,
            "metadata": dict(metadata),
        }
        answer = self.ok(self.request("POST", "/api/jobs/", json_data=body)).json()
        return str(answer["submission_id"])
