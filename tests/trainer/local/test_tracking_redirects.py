"""The trainer's MLflow credentials follow a redirect within the tracking server's origin, never out of it
(issue 46: urllib copies Authorization into every redirected request)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fsdp_trainer.tracking import MlflowClient


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers /moved with a 307 to the URL the server was given, anything else with {} after noting the
    Authorization header it came with."""

    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, RecordingServer)
        if self.path.startswith("/api/2.0/mlflow/moved"):
            self.send_response(307)
            self.send_header("Location", server.redirect_to)
            self.end_headers()
            return
        server.seen.append(self.headers.get("Authorization"))
        body = json.dumps({}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class RecordingServer(http.server.ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Recorder)
        self.seen: list[str | None] = []
        self.redirect_to = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@contextmanager
def serving() -> Iterator[RecordingServer]:
    server = RecordingServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_redirect_to_another_origin_gets_no_credentials_and_one_within_the_origin_keeps_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "team-a-secret")
    with serving() as tracking, serving() as elsewhere:
        client = MlflowClient(tracking.url)
        tracking.redirect_to = f"{elsewhere.url}/collect"
        client.call("GET", "moved")
        assert elsewhere.seen == [None], "the token went to another origin"
        tracking.redirect_to = f"{tracking.url}/api/2.0/mlflow/experiments/get"
        client.call("GET", "moved")
        assert tracking.seen == ["Bearer team-a-secret"]
