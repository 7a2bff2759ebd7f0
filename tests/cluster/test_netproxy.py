"""The black-hole proxy: pass-through answers, a black hole makes clients time out (never refused or reset), a
crash resets at once (or at a given byte of what clients send), and pass-through works again afterwards;
close() closes every socket."""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.netproxy import BlackHoleProxy
from tests.support.waiting import wait_until

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so one connection can carry several requests

    def do_GET(self) -> None:
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        received = len(self.rfile.read(int(self.headers["Content-Length"])))
        body = str(received).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture
def proxy(server: ThreadingHTTPServer) -> Iterator[BlackHoleProxy]:
    host, port = server.server_address[:2]
    with BlackHoleProxy(str(host), int(port)) as started:
        yield started


def get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def closed_by_peer(client: socket.socket) -> bool:
    """True when the peer has closed the connection; a hang raises TimeoutError (the socket's timeout)."""
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True  # the kernel resets instead of FIN when the closed socket still held unread bytes


def test_pass_through_then_black_hole_then_pass_through(proxy: BlackHoleProxy) -> None:
    assert get(proxy.url, timeout=5) == b"hello"

    proxy.black_hole()
    accepted = proxy.accepted
    # Only the client's own read timeout raises TimeoutError: a refused or reset connection raises
    # URLError/ConnectionError, an answer or a close returns.
    with pytest.raises(TimeoutError):
        get(proxy.url, timeout=2)
    assert proxy.accepted == accepted + 1, "the black hole must accept the connection"

    proxy.pass_through()
    assert get(proxy.url, timeout=5) == b"hello"


def test_black_hole_reads_and_never_closes(proxy: BlackHoleProxy) -> None:
    proxy.black_hole()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
        client.sendall(REQUEST * 100)  # read by the proxy: nothing blocks or bounces
        client.settimeout(0.5)
        with pytest.raises(TimeoutError):  # neither an answer nor b"" (FIN) nor ConnectionResetError
            client.recv(1)


def test_open_connection_stops_forwarding(proxy: BlackHoleProxy) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=1)
    try:
        connection.request("GET", "/")
        assert connection.getresponse().read() == b"hello"
        proxy.black_hole()
        connection.request("GET", "/")  # same keep-alive connection
        with pytest.raises(TimeoutError):
            connection.getresponse()
    finally:
        connection.close()
    proxy.pass_through()
    assert get(proxy.url, timeout=5) == b"hello"


def test_crash_resets_open_and_new_connections_until_pass_through(proxy: BlackHoleProxy) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        connection.request("GET", "/")
        assert connection.getresponse().read() == b"hello"
        proxy.crash()
        # Reset (or seen closed), not timed out: TimeoutError is no ConnectionError, and urllib's URLError
        # names a timeout as its reason.
        with pytest.raises(ConnectionError):
            connection.request("GET", "/")  # same keep-alive connection
            connection.getresponse()
        with pytest.raises((ConnectionError, urllib.error.URLError)) as new_connection:
            get(proxy.url, timeout=5)
        assert not isinstance(getattr(new_connection.value, "reason", None), TimeoutError), new_connection
    finally:
        connection.close()
    proxy.pass_through()
    assert get(proxy.url, timeout=5) == b"hello"


def test_crash_after_forwards_that_many_bytes_then_resets(proxy: BlackHoleProxy) -> None:
    body = b"x" * 200_000
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        proxy.crash_after(len(body) * 10)  # far beyond one request: it passes
        connection.request("POST", "/", body=body)
        assert connection.getresponse().read() == str(len(body)).encode()
        sent = proxy.sent_bytes
        proxy.crash_after(len(body) // 2)  # halfway through the next body
        with pytest.raises(ConnectionError):
            connection.request("POST", "/", body=body)
            connection.getresponse()
        assert proxy.sent_bytes == sent + len(body) // 2, "the crash came elsewhere than at the byte asked"
        with pytest.raises((ConnectionError, urllib.error.URLError)):
            get(proxy.url, timeout=5)  # crashed, as crash() leaves it
    finally:
        connection.close()
    proxy.pass_through()
    assert get(proxy.url, timeout=5) == b"hello"


def test_close_closes_every_socket(server: ThreadingHTTPServer) -> None:
    host, port = server.server_address[:2]
    proxy = BlackHoleProxy(str(host), int(port)).start()
    forwarding = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    forwarding.sendall(REQUEST)
    answer = b""
    while not answer.endswith(b"hello"):
        answer += forwarding.recv(4096)
    proxy.black_hole()
    swallowed = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    swallowed.sendall(REQUEST)
    wait_until("the proxy to accept the second connection", lambda: proxy.accepted == 2, 5, interval=0.05)
    proxy.close()
    with forwarding, swallowed:
        assert closed_by_peer(forwarding) and closed_by_peer(swallowed), "close() must close client sockets"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=5).close()
    proxy.close()  # idempotent
