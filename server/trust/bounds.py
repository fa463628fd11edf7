"""Bounds on what a client can make a shard hold: time before it says who it is, connections and sessions
(per peer address and in total), calls waiting for their request, bytes queued for sessions that do not
read, bytes of pushes still arriving, log lines, file descriptors.

Shards face the internet, and a client that has no token can still open connections and streams. Every
such resource gets a limit here, and a client over it gets a clear refusal (RESOURCE_EXHAUSTED, a closed
connection) instead of the shard running short. Running short of file descriptors must never stop a shard
(its next checkpoint write would fail): the connection caps are derived from the open-file limit, leaving
RESERVE_FDS for the shard's own files.

Addresses are counted by `address_group`: an IPv4 address alone, an IPv6 one by its /64 (what one
subscriber is given: counted per /128, one /64 had 2^64 times every per-address cap).

The pure parts (Limits, PeerCounts, UnreadBudget, Throttled) hold no sockets; HttpListener is the one piece
of I/O: the HTTP port's accept loop, in place of asyncio's (see its docstring).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from ssl import SSLContext

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from streamdiloco.common.keepalive import LinkSettings

log = logging.getLogger("streamdiloco.shard")

# descriptors the shard keeps for itself beyond what it holds when it starts: checkpoint writes (the file and
# its directory, per compute thread), the dashboard's static files, /proc reads for the process metrics,
# libraries loaded late, and the one descriptor an accept takes before a connection over a cap is closed
RESERVE_FDS = 64
MAX_DEFAULT_CONNECTIONS = 1024  # gRPC connections when --max-connections is 0 and the file limit allows more
MAX_STREAMS_PER_CONNECTION = 100  # HTTP/2 streams one gRPC connection may open at once (RFC 9113's minimum)
FETCHES_PER_PEER = 4  # Fetch calls at once from one address (a worker makes one per shard)
MIN_UNREAD_BYTES = 256 << 20  # the default unread budget is at least this much
MIN_STAGED_BYTES = 256 << 20  # the default budget of pushes arriving is at least this much
IPV6_GROUP = 64  # IPv6 addresses are counted together by this prefix (one subscriber's usual allocation)
ACCEPT_BATCH = 32  # HTTP connections accepted per wake-up of the loop, so that a flood cannot hog it
ACCEPT_PAUSE = 1.0  # seconds the HTTP port stops accepting after the process ran out of descriptors
LOG_PERIOD = 10.0  # seconds over which the lines of one kind of warning are counted, after the first few
LOG_BURST = 3  # lines of one kind written per period before the rest are only counted


@dataclass(frozen=True)
class Limits:
    """What one shard lets clients hold. Each field is a `streamdiloco server` flag (cli.py derives them)."""

    hello_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds a new gRPC connection has for its HTTP/2 handshake and a Session for its Hello; "
            "then it is closed (a worker sends both at once)"
        },
    )
    header_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds an HTTP connection has to send a whole request (its headers, and a body if it "
            "announces one); then it is closed"
        },
    )
    request_timeout: float = field(
        default=5.0,
        metadata={
            "help": "seconds a Join, Fetch, Pieces or Initialize call has to send its request (Initialize: "
            "its first message) once it starts; then it is ended (a worker sends it at once)"
        },
    )
    idle_timeout: float = field(
        default=60.0,
        metadata={
            "help": "a gRPC connection with no call for this many seconds is closed (a worker always holds "
            "its Session; one that reconnects is not hurt)"
        },
    )
    max_connections: int = field(
        default=0,
        metadata={
            "help": "gRPC connections at once; more are closed when they connect (default 0: what the "
            f"open-file limit leaves after the shard's own files and the HTTP connections, at most "
            f"{MAX_DEFAULT_CONNECTIONS})"
        },
    )
    max_http_connections: int = field(
        default=32, metadata={"help": "HTTP connections at once (dashboards, Prometheus, operators)"}
    )
    max_http_connections_per_peer: int = field(
        default=8, metadata={"help": "HTTP connections at once from one address (a browser opens up to 6)"}
    )
    max_sessions: int = field(
        default=512, metadata={"help": "Session streams at once, counted from their start (before Hello)"}
    )
    max_sessions_per_peer: int = field(
        default=8,
        metadata={
            "help": "Session streams at once from one address (workers behind one NAT share it: raise it "
            "for a site that runs more)"
        },
    )
    max_waiting_calls: int = field(
        default=64,
        metadata={
            "help": "Join, Fetch, Pieces and Initialize calls at once that have not sent their request yet; "
            "past it the one that has waited longest is ended"
        },
    )
    max_waiting_calls_per_peer: int = field(
        default=8,
        metadata={
            "help": "such calls at once from one address (an IPv6 /64); more are refused (a worker has one "
            "or two, for a round trip)"
        },
    )
    max_unread_bytes: int = field(
        default=0,
        metadata={
            "help": "bytes of messages waiting, over all sessions, for workers to read them; past it the "
            "session with the most unread is ended (default 0: four rounds of every fragment's update, at "
            "least 256 MiB)"
        },
    )
    max_staged_bytes: int = field(
        default=0,
        metadata={
            "help": "bytes of pushes whose chunks are still arriving, over all sessions; a chunk past it is "
            "refused with its push (default 0: every one of --max-sessions staging one push of the "
            "largest fragment, at least 256 MiB; a worker stages at most that one push's bytes)"
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if f.name.endswith("timeout"):
                if not 0 < v <= 3600:  # also refuses NaN
                    raise ValueError(f"{flag} must be a number of seconds in (0, 3600], got {v}")
            elif f.name in ("max_connections", "max_unread_bytes", "max_staged_bytes"):
                if v < 0:
                    raise ValueError(f"{flag} must be 0 (derived) or positive, got {v}")
            elif v < 1:
                raise ValueError(f"{flag} must be at least 1, got {v}")
        if self.max_http_connections_per_peer > self.max_http_connections:
            raise ValueError("--max-http-connections-per-peer cannot be above --max-http-connections")
        if self.max_sessions_per_peer > self.max_sessions:
            raise ValueError("--max-sessions-per-peer cannot be above --max-sessions")
        if self.max_waiting_calls_per_peer > self.max_waiting_calls:
            raise ValueError("--max-waiting-calls-per-peer cannot be above --max-waiting-calls")


def open_fds() -> int:
    """Descriptors this process holds now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opened
    except OSError:  # no /proc: count the hard way
        return sum(_is_open(fd) for fd in range(resource.getrlimit(resource.RLIMIT_NOFILE)[0]))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def connection_caps(limits: Limits) -> tuple[int, int]:
    """(gRPC connections, HTTP connections) that fit in the open-file limit beside what the shard holds and
    RESERVE_FDS, raising the soft limit towards the hard one if that makes room. ValueError (one line) when
    the limit is too low for the caps asked for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = open_fds()
    http = limits.max_http_connections
    grpc_want = limits.max_connections or MAX_DEFAULT_CONNECTIONS
    want = in_use + RESERVE_FDS + http + grpc_want
    if soft < want and (hard == resource.RLIM_INFINITY or soft < hard):
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    room = soft - in_use - RESERVE_FDS - http
    if limits.max_connections:
        if room < limits.max_connections:
            raise ValueError(
                f"the open-file limit ({soft}, ulimit -n) leaves room for {max(room, 0)} gRPC connections "
                f"beside the {in_use} files open, {RESERVE_FDS} kept for checkpoints and {http} for HTTP, "
                f"not --max-connections {limits.max_connections}: raise the limit or lower a cap"
            )
        return limits.max_connections, http
    if room < 8:
        raise ValueError(
            f"the open-file limit ({soft}, ulimit -n) is too low: {in_use} files are open, {RESERVE_FDS} are "
            f"kept for checkpoints and {http} for HTTP connections, leaving {max(room, 0)} for workers; "
            "raise it (ulimit -n 4096) or lower --max-http-connections"
        )
    return min(room, MAX_DEFAULT_CONNECTIONS), http


def grpc_options(
    limits: Limits, link: LinkSettings, max_connections: int, max_receive: int
) -> list[tuple[str, int]]:
    """gRPC's own bounds on connections: how many, how long one may take to finish its HTTP/2 handshake
    (a silent TCP connection is closed then), how long one may sit without a call, how soon a peer that
    stopped answering is noticed and how much one stream may send unread (`link`: keepalive pings do not
    count as calls), and streams at once on one connection; and the largest message it takes
    (`max_receive` bytes)."""
    return link.options() + [
        ("grpc.max_receive_message_length", max_receive),
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", round(limits.hello_timeout * 1000)),
        ("grpc.max_connection_idle_ms", round(limits.idle_timeout * 1000)),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ]


def peer_host(peer: str) -> str:
    """The address of a gRPC peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678", "unix:/path"), without
    its port: connections from one machine count together."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[") or rest
    return peer


def address_group(host: str) -> str:
    """What connections from `host` (an address without its port, as peer_host gives it) count under: an
    IPv4 address as it is, an IPv6 address by its /64 ("2001:db8:1:2::/64"), an IPv4-mapped IPv6 address
    as its IPv4 one; anything else (a unix socket) as it is."""
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])  # less a zone (fe80::1%eth0)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_GROUP), strict=False))
    return str(ip)


class PeerCounts:
    """Things held at once (sessions, connections), at most `total` and at most `per_peer` from one
    address (an IPv6 /64: address_group)."""

    def __init__(self, what: str, total: int, per_peer: int):
        self.what, self.total, self.per_peer = what, total, per_peer
        self.held = 0
        self.by_peer: dict[str, int] = {}  # address_group -> held

    def acquire(self, peer: str) -> str | None:
        """Takes one for `peer`; or returns why not (and takes nothing)."""
        group = address_group(peer)
        n = self.by_peer.get(group, 0)
        if n >= self.per_peer:
            return f"{self.what} from {group} are at their limit of {self.per_peer} per address"
        if self.held >= self.total:
            return f"the shard holds its limit of {self.total} {self.what}"
        self.by_peer[group] = n + 1
        self.held += 1
        return None

    def release(self, peer: str) -> None:
        peer = address_group(peer)
        n = self.by_peer[peer] - 1
        if n:
            self.by_peer[peer] = n
        else:
            del self.by_peer[peer]
        self.held -= 1


class UnreadBudget:
    """Bytes of messages queued for sessions and not yet taken by their writers, over all sessions. A message
    queued to several sessions (an update's chunk: the same bytes to every member) is counted once, as it is
    held once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._refs: dict[int, list[int]] = {}  # id(message) -> [sessions holding it, its size]

    def add(self, msg: object, size: int) -> None:
        ref = self._refs.get(id(msg))
        if ref is None:
            self._refs[id(msg)] = [1, size]
            self.held += size
        else:
            ref[0] += 1

    def remove(self, msg: object) -> None:
        ref = self._refs[id(msg)]
        ref[0] -= 1
        if not ref[0]:
            del self._refs[id(msg)]
            self.held -= ref[1]

    @property
    def over(self) -> bool:
        return self.held > self.limit


class Throttled:
    """Warnings that a client can cause, written at most LOG_BURST times per LOG_PERIOD seconds per kind;
    the ones held back are counted in the next line written. One line each, never a traceback."""

    def __init__(self, logger: logging.Logger = log, clock: Callable[[], float] = time.monotonic):
        self.logger, self.clock = logger, clock
        self._kinds: dict[str, list[float]] = {}  # kind -> [period start, lines written, lines held back]

    def allow(self, kind: str) -> tuple[bool, int]:
        """Whether a line of this kind may be written now, and how many were held back before it."""
        now = self.clock()
        k = self._kinds.get(kind)
        held = 0
        if k is None or now - k[0] >= LOG_PERIOD:
            held = int(k[2]) if k is not None else 0
            k = self._kinds[kind] = [now, 0, 0]
        if k[1] >= LOG_BURST:
            k[2] += 1
            return False, 0
        k[1] += 1
        return True, held

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, kind, msg, *args)

    def log(self, level: int, kind: str, msg: str, *args: object) -> bool:
        """Log `msg % args` unless this kind has had its lines this period; True if it was written. `kind`
        must come from a small fixed set (not from what the client sent)."""
        ok, held = self.allow(kind)
        if ok:
            more = f" ({held} more like it in the last {LOG_PERIOD:g} s, not logged)" if held else ""
            self.logger.log(level, msg + more, *args)
        return ok


class ThrottleFilter(logging.Filter):
    """The same bound on the lines of the libraries the shard runs on (uvicorn's "Invalid HTTP request
    received." for every bad request, gRPC's for a failed call): per message template, a few per period."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.throttled = Throttled(clock=clock)
        self._templates: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = str(record.msg)[:200]
        if kind not in self._templates and len(self._templates) >= 256:
            kind = "other"  # templates are the library's own: a few dozen at most
        self._templates.add(kind)
        ok, held = self.throttled.allow(kind)
        if ok and held:
            record.msg = f"{record.msg} ({held} more like it in the last {LOG_PERIOD:g} s, not logged)"
        return ok


def throttle_library_logs() -> None:
    """Put ThrottleFilter on the loggers of uvicorn and gRPC (once per process)."""
    for name in ("uvicorn.error", "grpc._cython.cygrpc", "grpc.aio._server"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ThrottleFilter) for f in logger.filters):
            logger.addFilter(ThrottleFilter())


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
