"""The shard's HTTP connections, bounded: HttpListener, the HTTP port's accept loop in place of asyncio's
(connections per address and in all, a pause when the process runs out of descriptors), and BoundedH11,
uvicorn's h11 protocol with a deadline on a request's headers. The one piece of I/O of the bounds: what
it must not do is decide the limits (server/trust/bounds.py's Limits does)."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from ssl import SSLContext

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from streamdiloco.server.trust.bounds import Limits, PeerCounts
from streamdiloco.server.trust.throttle import Throttled

log = logging.getLogger("streamdiloco.shard")

ACCEPT_BATCH = 32  # HTTP connections accepted per wake-up of the loop, so that a flood cannot hog it
ACCEPT_PAUSE = 1.0  # seconds the HTTP port stops accepting after the process ran out of descriptors


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request: uvicorn has none, so a connection that sends
    nothing, or a header a byte a minute, was held for ever; and so was one whose request announced a body
    that never ended (a GET with a Content-Length, trickled: each byte also stopped uvicorn's keep-alive
    timer). The deadline runs from the connection (or the end of the previous response) until the request
    is whole, headers and body."""

    header_timeout = 10.0
    on_lost: Callable[[], None] = staticmethod(lambda: None)
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.header_timeout, self._headers_due)

    def _headers_due(self) -> None:
        # no whole request yet: its headers, or a body announced that has not ended
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            super().connection_lost(exc)
        finally:
            self.on_lost()


class HttpListener:
    """The HTTP port's accept loop, in place of asyncio's. asyncio's accepts up to its backlog at each
    wake-up, hands each connection to a task, and when the process is out of descriptors logs a traceback
    and tries again a second later, for as long as that lasts. This one accepts at most ACCEPT_BATCH at a
    time, closes at once a connection over the total or per-address cap (so the descriptors it holds stay
    within the cap), and on running out pauses ACCEPT_PAUSE seconds with one throttled line."""

    def __init__(
        self,
        sock: socket.socket,
        make_protocol: Callable[[], H11Protocol],
        limits: Limits,
        total: int,
        throttled: Throttled,
        ssl: SSLContext | None = None,
    ):
        self.sock, self.make_protocol, self.ssl, self.throttled = sock, make_protocol, ssl, throttled
        self.header_timeout = limits.header_timeout
        self.conns = PeerCounts("HTTP connections", total, limits.max_http_connections_per_peer)
        self.refused = 0  # connections closed at once: over a cap
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self.sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if self._loop is not None and self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
        if self._paused is not None:
            self._paused.cancel()
        self.sock.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.throttled.warning(
                        "http-accept",
                        "HTTP port: out of descriptors (%s); not accepting for %g s",
                        e.strerror,
                        ACCEPT_PAUSE,
                    )
                    self._pause()
                    return
                raise
            peer = addr[0] if isinstance(addr, tuple) else str(addr)
            if (why := self.conns.acquire(peer)) is not None:
                self.refused += 1
                self.throttled.warning("http-refused", "closed an HTTP connection at once: %s", why)
                conn.close()
                continue
            task = asyncio.ensure_future(self._serve(conn, peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _pause(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self.sock.fileno())

        def resume() -> None:
            self._paused = None
            if self.sock.fileno() >= 0:
                self._loop.add_reader(self.sock.fileno(), self._accept)  # type: ignore[union-attr]

        self._paused = self._loop.call_later(ACCEPT_PAUSE, resume)

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        assert self._loop is not None
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.conns.release(peer)

        def protocol() -> H11Protocol:
            p = self.make_protocol()
            p.header_timeout = self.header_timeout  # type: ignore[attr-defined]
            p.on_lost = release  # type: ignore[attr-defined]
            return p

        try:
            handshake = self.header_timeout if self.ssl else None  # a deadline for TLS's handshake
            await self._loop.connect_accepted_socket(
                protocol, conn, ssl=self.ssl, ssl_handshake_timeout=handshake
            )
        except (OSError, asyncio.TimeoutError) as e:  # a TLS handshake that failed or never came
            release()
            conn.close()
            self.throttled.warning("http-handshake", "an HTTP connection from %s failed: %s", peer, e)
