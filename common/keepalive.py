"""How soon a gRPC peer that stopped answering is noticed: HTTP/2 keepalive pings with a timeout.

A frozen process, or a laptop that sleeps with its TCP connection open, keeps its connection: its kernel
still acknowledges the bytes, so only a ping that goes unanswered tells. Both ends ping after half of the
bound without a frame from the peer and close the connection when that ping is not answered within the
other half. Torch-free and without I/O (the command line reads LIVENESS_SECONDS for --help): it only
computes gRPC options; common/wire.py and server/bounds.py apply them.
"""

from __future__ import annotations

LIVENESS_SECONDS = 10.0  # a stopped peer is noticed within this (a worker's; a shard's default)
MIN_PING_INTERVAL_MS = 1000  # the fastest pings a server accepts (a worker pings every LIVENESS_SECONDS / 2)


def keepalive_options(liveness_seconds: float) -> list[tuple[str, int]]:
    """gRPC keepalive that notices a peer that stopped answering within `liveness_seconds`: a ping after
    half of it without a frame from the peer, the connection closed when that ping is not answered within
    the other half. grpc-core (1.85) waits for the ack of any ping for `grpc.http2.ping_timeout_ms`
    (a minute by default) whatever `grpc.keepalive_timeout_ms` says: both are set."""
    half = max(MIN_PING_INTERVAL_MS, round(liveness_seconds * 500))
    return [
        ("grpc.keepalive_time_ms", half),
        ("grpc.keepalive_timeout_ms", half),
        ("grpc.http2.ping_timeout_ms", half),
    ]
