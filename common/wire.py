"""The one place that builds gRPC servers and channels, and turns Encoded slices into wire chunks and back.

Keepalive, and liveness (common/keepalive.py): an end that has read nothing from its peer for a third of
the liveness bound pings it, even without calls in flight, and closes the connection when the ping is not
answered within the rest; no other pings are sent (no bandwidth probes), so a slow link that is delivering
bytes is never taken for a dead peer. A peer that stopped answering (a frozen process, a laptop
that sleeps with its TCP connection open: its kernel still acknowledges the bytes) is then noticed within
the bound: its calls end with UNAVAILABLE (the worker reconnects) or are cancelled (the shard drops the
member). The pings also keep NATs and firewalls from dropping a quiet WAN link between syncs. Servers
accept pings down to every MIN_PING_INTERVAL_MS and never answer them with GOAWAY (no ping strikes). Each
end sets its own bound and receive window (`--liveness-timeout`, `--receive-window`: the shard's in
server/trust/bounds.py, a worker's through `make_channel`'s `link`).

Messages are about 1 MiB (chunks); the limits leave room for a bigger `--chunk-bytes`. A shard receives at
most what its largest legitimate message needs (server/edge/slots.py's receive_limit), not MAX_MESSAGE_BYTES.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch

from streamdiloco.common.codecs import Encoded, split
from streamdiloco.common.keepalive import MIN_PING_INTERVAL_MS, LinkSettings
from streamdiloco.common.ports import parse_target  # noqa: F401 (re-exported: the link dials with it)
from streamdiloco.common.tls import ClientTLS
from streamdiloco.protos import streamdiloco_pb2 as pb

PROTOCOL = 1
MAX_MESSAGE_BYTES = 64 << 20

_COMMON = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_CHANNEL = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    # after a lost connection, try again within 0.25 .. 4 s (grpc adds jitter): a restarted shard is found
    # within seconds by calls that wait for the channel (the worker's reconnecting Join)
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 4000),
]


def channel_options(link: LinkSettings | None = None) -> list[tuple[str, int]]:
    """A worker's channel arguments: message limits, its liveness bound and receive window, reconnects."""
    return [*_COMMON, *(link or LinkSettings()).options(), *_CHANNEL]


CHANNEL_OPTIONS = channel_options()
SERVER_OPTIONS = [
    *_COMMON,
    *LinkSettings().options(),
    ("grpc.so_reuseport", 0),  # a second shard on a port in use must fail, not share the port
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.max_pings_without_data", 0),
]


def make_server(
    options: list[tuple[str, int]] | None = None,
    maximum_concurrent_rpcs: int | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> grpc.aio.Server:
    """An asyncio gRPC server with the run's message limits and keepalive, and the shard's `options`
    (its bounds on connections and messages: server/trust/bounds.py), which replace the defaults of the same
    name; `interceptors`: its bounds on calls (server/edge/slots.py)."""
    mine = {name for name, _ in options or []}
    return grpc.aio.server(
        options=[o for o in SERVER_OPTIONS if o[0] not in mine] + (options or []),
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        interceptors=list(interceptors) or None,
    )


def make_channel(target: str, tls: ClientTLS | None = None, link: LinkSettings | None = None) -> grpc.Channel:
    """A (blocking-API) channel to a shard at HOST:PORT; over TLS when `tls` is given (the shard's
    certificate must name HOST and be signed by the run's CA); `link`: this end's liveness bound and
    receive window (default: LIVENESS_SECONDS and RECEIVE_WINDOW)."""
    options = channel_options(link)
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.grpc_credentials(), options=options)


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """A call's credential: the worker's token as gRPC metadata (on every call, Session included, so that
    a session id alone proves nothing)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# --- chunks ----------------------------------------------------------------------------------------------
def to_chunks(enc: Encoded, fragment: int, round: int, values_per_chunk: int) -> list[pb.Chunk]:
    parts = split(enc, values_per_chunk)
    return [
        pb.Chunk(
            fragment=fragment,
            round=round,
            seq=seq,
            offset=offset,
            numel=part.numel,
            total=enc.numel,
            codec=part.codec,
            block_size=part.block_size,
            scales=part.scales.contiguous().numpy().tobytes(),
            payload=part.payload.contiguous().numpy().tobytes(),
            last=seq == len(parts) - 1,
        )
        for seq, (offset, part) in enumerate(parts)
    ]


def from_chunk(chunk: pb.Chunk) -> Encoded:
    """The chunk's values as an Encoded, without validation (the receiver checks sizes and values).
    Raises ValueError when the scales' bytes are not whole fp32 numbers."""
    if len(chunk.scales) % 4:
        raise ValueError(f"scales must be whole fp32 values, got {len(chunk.scales)} bytes")
    payload = (
        torch.frombuffer(bytearray(chunk.payload), dtype=torch.uint8)
        if chunk.payload
        else torch.empty(0, dtype=torch.uint8)
    )
    scales = (
        torch.frombuffer(bytearray(chunk.scales), dtype=torch.float32)
        if chunk.scales
        else torch.empty(0, dtype=torch.float32)
    )
    return Encoded(chunk.codec, int(chunk.numel), payload, scales, int(chunk.block_size))


def values_to_bytes(x: torch.Tensor) -> bytes:
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()


def bytes_to_values(b: bytes) -> torch.Tensor:
    if len(b) % 4:
        raise ValueError(f"fp32 values must be whole 4-byte numbers, got {len(b)} bytes")
    return torch.frombuffer(bytearray(b), dtype=torch.float32) if b else torch.empty(0, dtype=torch.float32)
