"""How soon a gRPC peer that stopped answering is noticed, without taking a slow link for a dead one.

A frozen process, or a laptop that sleeps with its TCP connection open, keeps its connection: its kernel
still acknowledges the bytes, so only a ping that goes unanswered tells. grpc-core (1.85) sends a keepalive
ping only after `grpc.keepalive_time_ms` in which nothing was read from the peer (every read restarts that
timer), and closes the connection when the ping's ack has not come within `grpc.http2.ping_timeout_ms`.
Here the silence is a third of the liveness bound and the wait the other two thirds: a peer that sends
nothing is noticed within the bound, and a link that is delivering bytes is never pinged, however slow.

What this must keep out is every other ping. grpc-core holds *every* ping to the same ping timeout (only
the ack cancels it), and by default a receiver probes the bandwidth-delay product with pings while data
arrives (`grpc.http2.bdp_probe`); on a slow link their acks wait behind the data the sender has queued
(its flow-control window, at least 4 MiB once probing starts: half a minute at 1 Mbit/s, more behind a
modem's buffer), so a healthy link was cut every few seconds. Probing is off here, and the window it would
have grown is fixed instead (`receive_window`, each end's own for what it receives): a stream moves at most
receive_window / RTT (4 MiB: 335 Mbit/s at 100 ms), and a peer can make us buffer at most that much per
stream.

What is left: an end that sends a long transfer hears from the receiver only its window updates (one per
half window it reads: every 16 s at 1 Mbit/s), so it may ping mid-transfer, and that ping waits behind its
own queued bytes (the socket's and the modem's: up to 3.9 s measured at 1 Mbit/s behind a 1 s modem
queue). Two thirds of the bound (6.7 s at the default 10 s) is that ping's room; a link whose queue holds
more needs a longer --liveness-timeout. TCP's own bound (TCP_USER_TIMEOUT, which grpc-core takes from
`grpc.keepalive_timeout_ms`) is the whole bound: sent data unacknowledged that long, the path is gone.

Torch-free and without I/O (the command line reads LinkSettings for its flags): it only computes gRPC
options; common/wire.py applies them to channels (a worker's), server/trust/bounds.py to the shard's server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LIVENESS_SECONDS = 10.0  # a stopped peer is noticed within this (a worker's and a shard's default)
MIN_LIVENESS_SECONDS = 2.0  # below this, a ping every second would be too many for a shard
MIN_PING_INTERVAL_MS = 1000  # the fastest pings a shard accepts (a peer pings after a third of its bound)
RECEIVE_WINDOW = 4 << 20  # bytes a peer may send on one stream before we read them (flow control)
MIN_RECEIVE_WINDOW = 64 << 10  # HTTP/2's own initial window
MAX_RECEIVE_WINDOW = 1 << 30  # grpc-core's largest


@dataclass(frozen=True)
class LinkSettings:
    """How one end of every gRPC connection tells a dead peer from a slow one (see the module's docstring):
    a section of the config file, [link], that shards and workers both read; each end applies its own."""

    liveness_timeout: float = field(
        default=LIVENESS_SECONDS,
        metadata={
            "help": "a peer that stops answering (a frozen process, a machine asleep with its TCP connection "
            "open) is noticed within this many seconds: a ping after a third of it in which nothing arrived, "
            "not answered within the rest (at least 2; a slow link that is delivering bytes is never "
            "pinged; one whose modem queues seconds of data may need more). A shard then drops the "
            "member, a worker reconnects"
        },
    )
    receive_window: int = field(
        default=RECEIVE_WINDOW,
        metadata={
            "help": "bytes the peer may send on one stream before this end reads them (HTTP/2 flow "
            "control): a stream moves at most this per round trip (4 MiB: 335 Mbit/s at 100 ms); raise it "
            "for fast links with long round trips",
            "metavar": "BYTES",
        },
    )

    def __post_init__(self) -> None:
        if not MIN_LIVENESS_SECONDS <= self.liveness_timeout <= 3600:  # also refuses NaN
            raise ValueError(
                f"--liveness-timeout must be at least {MIN_LIVENESS_SECONDS:g} seconds (a ping after a third "
                f"of it) and at most an hour, got {self.liveness_timeout:g}"
            )
        if not MIN_RECEIVE_WINDOW <= self.receive_window <= MAX_RECEIVE_WINDOW:
            raise ValueError(
                f"--receive-window must be {MIN_RECEIVE_WINDOW} bytes (64 KiB) to {MAX_RECEIVE_WINDOW} "
                f"(1 GiB), got {self.receive_window}"
            )

    def options(self) -> list[tuple[str, int]]:
        """gRPC's channel arguments for this end (see the module's docstring)."""
        bound = round(self.liveness_timeout * 1000)
        silence = max(MIN_PING_INTERVAL_MS, bound // 3)
        return [
            ("grpc.keepalive_time_ms", silence),  # after this long without a read, a ping
            ("grpc.http2.ping_timeout_ms", bound - silence),  # how long its ack is waited for (else a minute)
            # grpc-core's watchdog of this name never fires (the ping timeout does its job); it sets the
            # socket's TCP_USER_TIMEOUT: sent data unacknowledged this long, the path is gone
            ("grpc.keepalive_timeout_ms", bound),
            ("grpc.http2.bdp_probe", 0),  # no pings while data flows (their acks queue behind it)
            ("grpc.http2.lookahead_bytes", self.receive_window),  # the window that probing would have grown
        ]
