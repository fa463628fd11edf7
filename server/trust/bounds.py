"""Bounds on what a client can make a shard hold: time before it says who it is, connections and sessions
(per peer address and in total), calls waiting for their request, bytes queued for sessions that do not
read, bytes of pushes still arriving, log lines, file descriptors.

Shards face the internet, and a client that has no token can still open connections and streams. Every
such resource gets a limit here, and a client over it gets a clear refusal (RESOURCE_EXHAUSTED, a closed
connection) instead of the shard running short.

Addresses are counted by `address_group`: an IPv4 address alone, an IPv6 one by its /64 (what one
subscriber is given: counted per /128, one /64 had 2^64 times every per-address cap). What a flood makes give
way (`Crowd`: calls waiting for their request, Joins not yet followed by a Session) is taken from the address
holding the most, and among addresses holding as many from the network (`network_group`: an IPv4 /24, an IPv6
/48) holding the most: a flood from many addresses of one network ends its own calls first.

Pure: no sockets, no files. Beside it by job: the caps the open-file limit allows (server/trust/fds.py),
the bounded log lines a client can cause (server/trust/throttle.py), and the HTTP port's bounded accept
loop (server/httpconn.py).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field, fields
from typing import Generic, TypeVar
from urllib.parse import unquote

from streamdiloco.common.keepalive import LinkSettings

log = logging.getLogger("streamdiloco.shard")

MAX_DEFAULT_CONNECTIONS = 1024  # gRPC connections when --max-connections is 0 and the file limit allows more
MAX_STREAMS_PER_CONNECTION = 100  # HTTP/2 streams one gRPC connection may open at once (RFC 9113's minimum)
FETCHES_PER_PEER = 4  # Fetch calls at once from one address (a worker makes one per shard)
MIN_UNREAD_BYTES = 256 << 20  # the default unread budget is at least this much
MIN_STAGED_BYTES = 256 << 20  # the default budget of pushes arriving is at least this much
IPV6_GROUP = 64  # IPv6 addresses are counted together by this prefix (one subscriber's usual allocation)
# the networks that break ties between addresses holding as many of what a flood makes give way (Crowd): an
# IPv4 /24 and an IPv6 /48 (what one site is given) are one network each
IPV4_NETWORK = 24
IPV6_NETWORK = 48


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
            "past it one is ended (RESOURCE_EXHAUSTED, which workers retry): the oldest of the address "
            "holding the most (among those holding as many, of the /24 or IPv6 /48 holding the most)"
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
    its port: connections from one machine count together. grpc-core (1.85) writes an IPv6 peer's brackets
    percent-encoded ("ipv6:%5B::1%5D:5678"): read as it came, every connection of one machine was an address
    of its own, with every per-address cap of its own."""
    kind, _, rest = peer.partition(":")
    rest = unquote(rest)
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[") or rest
    return peer


def address_group(host: str) -> str:
    """What connections from `host` (an address without its port, as peer_host gives it) count under: an
    IPv4 address as it is, an IPv6 address by its /64 ("2001:db8:1:2::/64"), an IPv4-mapped IPv6 address
    as its IPv4 one; anything else (a unix socket) as it is."""
    return _group(host, 32, IPV6_GROUP)


def network_group(host: str) -> str:
    """The network of `host` (as address_group takes it): its IPv4 /24 ("10.1.2.0/24"), its IPv6 /48, an
    IPv4-mapped address's IPv4 /24; anything else as it is."""
    return _group(host, IPV4_NETWORK, IPV6_NETWORK)


def _group(host: str, v4_prefix: int, v6_prefix: int) -> str:
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])  # less a zone (fe80::1%eth0)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is None:
            return str(ipaddress.IPv6Network((ip, v6_prefix), strict=False))
        ip = ip.ipv4_mapped
    return str(ip) if v4_prefix == 32 else str(ipaddress.IPv4Network((ip, v4_prefix), strict=False))


K = TypeVar("K", bound=Hashable)


class Crowd(Generic[K]):
    """Things held for clients (calls waiting for their request, Joins not yet followed by a Session), each
    by the address it came from, and which one gives way when there is no room: `crowded()`, the oldest of
    the address (address_group) holding the most; among addresses holding as many, of the one whose network
    (network_group) holds the most; among those, the oldest. A client alone at its address loses nothing to
    a flood from fewer addresses than the things held (one of them then holds two), and a flood from many
    addresses of one network (an IPv4 /24, an IPv6 /48: one subscriber's /64s) gives way before a client
    alone in its network. Linear in the addresses held (a few dozen: --max-waiting-calls)."""

    def __init__(self) -> None:
        self._addresses: dict[str, dict[K, int]] = {}  # address group -> its things, oldest first (-> seq)
        self._network_of: dict[str, str] = {}  # address group -> its network
        self._networks: dict[str, int] = {}  # network -> things held from it
        self._where: dict[K, str] = {}  # thing -> its address group
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: object) -> bool:
        return item in self._where

    def add(self, item: K, host: str) -> None:
        """Hold `item` for `host` (an address without its port, as peer_host gives it)."""
        if item in self._where:
            raise ValueError(f"{item!r} is held already")
        group = address_group(host)
        if (held := self._addresses.get(group)) is None:
            held = self._addresses[group] = {}
            self._network_of[group] = network_group(host)
        held[item] = next(self._seq)
        network = self._network_of[group]
        self._networks[network] = self._networks.get(network, 0) + 1
        self._where[item] = group

    def discard(self, item: K) -> None:
        """Hold `item` no longer (nothing if it is not held)."""
        group = self._where.pop(item, None)
        if group is None:
            return
        held = self._addresses[group]
        del held[item]
        network = self._network_of[group]
        self._networks[network] -= 1
        if not self._networks[network]:
            del self._networks[network]
        if not held:
            del self._addresses[group], self._network_of[group]

    def held_from(self, host: str) -> int:
        """Things held for `host`'s address group."""
        return len(self._addresses.get(address_group(host), ()))

    def crowded(self, sparing: K | None = None) -> K | None:
        """The thing that gives way (see the class's docstring), never `sparing` (the newcomer that needs the
        room); None when nothing else is held."""
        best: tuple[int, int, int] | None = None
        chosen: K | None = None
        for group, held in self._addresses.items():
            items = iter(held.items())
            item, seq = next(items)
            if item == sparing:
                if (following := next(items, None)) is None:
                    continue
                item, seq = following
            key = (len(held), self._networks[self._network_of[group]], -seq)
            if best is None or key > best:
                best, chosen = key, item
        return chosen


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
