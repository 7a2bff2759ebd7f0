"""A loopback TCP proxy that can turn into a black hole: a peer that accepts connections and never answers.

    with BlackHoleProxy("127.0.0.1", 8265) as proxy:
        client = JobSubmissionClient(proxy.url)   # works: bytes pass through
        proxy.black_hole()                        # now every request hangs until the client's own timeout
        proxy.pass_through()                      # new connections work again
        proxy.crash()                             # as a killed server: connections reset, new ones too
        proxy.crash_after(1_000_000)              # the same, once clients have sent that many more bytes

In black-hole mode the proxy still accepts new connections and reads what clients send, but it never answers
and never closes them (no FIN, no RST): what a hung server or a silently dropping network looks like. The
connections that were open when the hole opened stop forwarding in both directions and stay swallowed, since
their byte streams are cut at an arbitrary point; only connections made after `pass_through()` forward
again. In crash mode every open connection is reset (RST) at once and new ones are reset as soon as they are
accepted: a server killed and not yet back, for clients that retry. `crash_after(n)` crashes it at a point in
the clients' byte stream rather than in time: the proxy forwards exactly n more bytes to the target, whatever
the machine's load, then crashes. `close()` (or leaving the `with` block)
closes every socket the proxy holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

_CHUNK = 64 * 1024
_CONTROL_TIMEOUT = 10.0  # seconds for a mode switch, start or close to be carried out by the proxy's loop


@dataclass(eq=False)
class _Connection:
    sock: socket.socket  # the accepted client socket, owned by `client` once its stream is set up
    black_holed: bool
    client: asyncio.StreamWriter | None = None
    upstream: asyncio.StreamWriter | None = None
    crashed: bool = False

    def swallow(self) -> None:
        """Stops forwarding for good; the client side stays open and unanswered."""
        self.black_holed = True
        if self.upstream is not None:
            self.upstream.close()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        else:
            self.sock.close()
        if self.upstream is not None:
            self.upstream.close()

    def reset(self) -> None:
        """Closes both sides at once with RST, not FIN, as the kernel does for a process that died."""
        if self.crashed:
            return
        self.black_holed = self.crashed = True
        linger = struct.pack("ii", 1, 0)
        for writer in (self.client, self.upstream):
            if writer is not None:
                with contextlib.suppress(OSError, AttributeError):  # AttributeError: no socket left
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                writer.transport.abort()
        if self.client is None:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            self.sock.close()


class BlackHoleProxy:
    """A TCP proxy on 127.0.0.1 (a free port) in front of target_host:target_port, on its own thread."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.accepted = 0  # connections accepted so far, in either mode
        self.answered_bytes = 0  # bytes passed from the target to clients so far (headers and bodies)
        self.sent_bytes = 0  # bytes passed from clients to the target so far
        self._crash_at: int | None = None  # the sent_bytes at which crash_after's crash comes
        self._black_hole = False
        self._crashed = False
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._acceptor: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"netproxy-{target_host}:{target_port}", daemon=True
        )

    @property
    def url(self) -> str:
        """http://127.0.0.1:<port>, for HTTP clients of the target."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> BlackHoleProxy:
        self._thread.start()
        self._run(self._listen)
        return self

    def black_hole(self) -> None:
        """From now on nothing is answered: open connections stop forwarding, new ones are only read."""
        self._run(self._set_black_hole, True)

    def pass_through(self) -> None:
        """New connections are forwarded to the target again."""
        self._run(self._set_black_hole, False)

    def crash(self) -> None:
        """From now on every connection, open or new, is reset, until pass_through()."""
        self._run(self._crash)

    def crash_after(self, sent: int) -> None:
        """Forwards `sent` more bytes from clients to the target, then crashes (at once for 0)."""
        self._run(self._arm_crash, sent)

    def close(self) -> None:
        """Stops listening and closes every client and upstream socket; idempotent."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._run(self._shutdown)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_CONTROL_TIMEOUT)
        self._listener.close()
        self._loop.close()

    def __enter__(self) -> BlackHoleProxy:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _run(self, step: Callable[..., object], *args: object) -> None:
        """Runs step(*args) on the proxy's loop and waits, so a switch is in effect when this returns."""

        async def call() -> None:
            result = step(*args)
            if asyncio.iscoroutine(result):
                await result

        asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=_CONTROL_TIMEOUT)

    def _listen(self) -> None:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._acceptor = self._loop.create_task(self._accept())

    async def _accept(self) -> None:
        # Our own accept loop rather than asyncio.start_server: every accepted socket has its handler
        # registered in the same step, so close() can never miss a connection that is still being set up.
        while True:
            client, _ = await self._loop.sock_accept(self._listener)
            self.accepted += 1
            if self._crashed:
                _Connection(client, black_holed=True).reset()
                continue
            connection = _Connection(client, black_holed=self._black_hole)
            self._connections.add(connection)
            handler = self._loop.create_task(self._handle(connection))
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)

    def _set_black_hole(self, on: bool) -> None:
        self._black_hole, self._crashed, self._crash_at = on, False, None
        if on:
            for connection in self._connections:
                connection.swallow()

    def _arm_crash(self, sent: int) -> None:
        self._crash_at = self.sent_bytes + sent
        if sent <= 0:
            self._crash()

    def _crash(self) -> None:
        self._crashed, self._crash_at = True, None
        for connection in list(self._connections):
            connection.reset()

    async def _shutdown(self) -> None:
        tasks = [*self._handlers, *([self._acceptor] if self._acceptor else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()
        await asyncio.sleep(0)  # let the transports' close callbacks run before the loop stops

    async def _handle(self, connection: _Connection) -> None:
        try:
            with contextlib.suppress(ConnectionError):  # the client reset: nothing left to hold open
                reader, connection.client = await asyncio.open_connection(sock=connection.sock)
                if not connection.black_holed:
                    await self._forward(connection, reader)
                if connection.black_holed and not connection.crashed:
                    while await reader.read(_CHUNK):  # read and ignore until the client gives up
                        pass
                    await self._loop.create_future()  # never answer, never close: only close() ends this
        finally:
            self._connections.discard(connection)
            connection.close()

    async def _forward(self, connection: _Connection, reader: asyncio.StreamReader) -> None:
        try:
            upstream_reader, connection.upstream = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError:
            return  # the target is down: the client's connection is closed, as a proxy would
        if connection.black_holed:  # the hole opened while connecting
            connection.swallow()
            return
        assert connection.client is not None
        answers = asyncio.create_task(self._pump(connection, upstream_reader, connection.client, True))
        try:
            await self._pump(connection, reader, connection.upstream)
            await answers
        finally:
            answers.cancel()

    async def _pump(
        self,
        connection: _Connection,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        answers: bool = False,
    ) -> None:
        """Copies source to sink until end of stream, an error, or the connection is swallowed; `answers`:
        the target's side, counted in answered_bytes."""
        # OSError, not only ConnectionError: a peer gone before write_eof's shutdown() is ENOTCONN.
        with contextlib.suppress(OSError):
            while data := await source.read(_CHUNK):
                if connection.black_holed:
                    return
                if answers:
                    self.answered_bytes += len(data)
                elif self._crash_at is not None and self.sent_bytes + len(data) >= self._crash_at:
                    sink.write(data[: self._crash_at - self.sent_bytes])
                    self.sent_bytes = self._crash_at
                    await sink.drain()
                    self._crash()
                    return
                else:
                    self.sent_bytes += len(data)
                sink.write(data)
                await sink.drain()
            if not connection.black_holed and sink.can_write_eof():
                sink.write_eof()
