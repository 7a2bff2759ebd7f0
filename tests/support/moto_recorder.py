"""The requests the local AWS (moto: S3, STS, EC2) receives while a test watches, from moto's own recorder
(/moto-api/recorder), whose file cluster-up keeps in the cluster's state directory."""

from __future__ import annotations

import base64
import json
import re
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    url: str
    headers: dict[str, str]
    body: bytes

    @property
    def form(self) -> dict[str, str]:
        """A query API's parameters (STS's Action, RoleArn, ...), from the form it posts."""
        if not self.headers.get("Content-Type", "").startswith("application/x-www-form-urlencoded"):
            return {}
        return dict(urllib.parse.parse_qsl(self.body.decode(errors="replace")))

    @property
    def access_key(self) -> str | None:
        """The access key ID a SigV4 signature names (None for an unsigned request)."""
        authorization = self.headers.get("Authorization", "")
        _, found, rest = authorization.partition("Credential=")
        return rest.split("/", 1)[0] if found else None


def _recorder(endpoint: str, action: str) -> str:
    request = urllib.request.Request(f"{endpoint}/moto-api/recorder/{action}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(response.read().decode())


def parsed_recording(text: str) -> list[RecordedRequest]:
    """The requests in moto's recording file. moto's threaded server appends each entry and its newline in
    two writes with no lock, so two requests answered at once leave two objects on one line (seen with
    checkpoint uploads): the text is read as a stream of objects, not as lines. A last object cut short, with
    no newline after it, is a request still being written: it is left for the next read."""
    decoder = json.JSONDecoder()
    requests: list[RecordedRequest] = []
    at = _SPACE.match(text).end()
    while at < len(text):
        try:
            entry, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            if "\n" in text[at:]:
                raise
            break
        requests.append(_request(entry))
        at = _SPACE.match(text, end).end()
    return requests


def _request(entry: dict[str, Any]) -> RecordedRequest:
    body = entry.get("body") or ""
    return RecordedRequest(
        method=entry["method"],
        url=entry["url"],
        headers=entry["headers"],
        body=base64.b64decode(body) if entry.get("body_encoded") else body.encode(),
    )


@contextmanager
def recorded_requests(endpoint: str) -> Iterator[Callable[[], list[RecordedRequest]]]:
    """Records every request moto at `endpoint` answers until the block ends (then stops and empties the
    recording); the callable returns those so far."""
    _recorder(endpoint, "reset-recording")
    _recorder(endpoint, "start-recording")
    try:
        yield lambda: parsed_recording(_recorder(endpoint, "download-recording"))
    finally:
        _recorder(endpoint, "stop-recording")
        _recorder(endpoint, "reset-recording")
