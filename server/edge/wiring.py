"""How a shard's servicer sizes its traffic from the run's settings and its limits: the values per chunk in
each direction, the budget of bytes queued for members and not read yet, the budget of pushes arriving, and
the counts of calls per peer.
The servicer (server/edge/service.py) builds its parts from these; what this module must not do: hold state of
its own, or serve a call.
"""

from __future__ import annotations

from streamdiloco.common.codecs import chunk_values, get_codec
from streamdiloco.common.config import SyncConfig
from streamdiloco.server.trust.bounds import (
    FETCHES_PER_PEER,
    MIN_STAGED_BYTES,
    MIN_UNREAD_BYTES,
    Limits,
    PeerCounts,
    UnreadBudget,
)


def chunk_sizes(cfg: SyncConfig, chunk_bytes: int) -> tuple[int, int, int]:
    """Values per message of at most about `chunk_bytes`: a push's (uplink codec), an update's (downlink
    codec) and a Fetch's (fp32) chunks."""
    return (
        chunk_values(cfg.uplink_codec, cfg.codec_block_size, chunk_bytes),
        chunk_values(cfg.downlink_codec, cfg.codec_block_size, chunk_bytes),
        chunk_values("fp32", cfg.codec_block_size, chunk_bytes),
    )


def unread_budget(cfg: SyncConfig, ranges: list[tuple[int, int]], limits: Limits) -> UnreadBudget:
    """What may wait for members to read it, over all sessions: --max-unread-bytes, or four rounds of every
    fragment's update (`ranges`: this shard's slices) and at least MIN_UNREAD_BYTES."""
    down = get_codec(cfg.downlink_codec)
    update_bytes = sum(down.encoded_nbytes(hi - lo, cfg.codec_block_size) for lo, hi in ranges)
    return UnreadBudget(limits.max_unread_bytes or max(MIN_UNREAD_BYTES, 4 * update_bytes))


def staged_budget(cfg: SyncConfig, ranges: list[tuple[int, int]], limits: Limits) -> int:
    """What the pushes whose chunks are arriving may reserve, over all sessions: --max-staged-bytes, or one
    push of the largest fragment (`ranges`: this shard's slices) for every one of --max-sessions (a worker
    stages one push at a time), and at least MIN_STAGED_BYTES."""
    up = get_codec(cfg.uplink_codec)
    largest = max(up.encoded_nbytes(hi - lo, cfg.codec_block_size) for lo, hi in ranges)
    return limits.max_staged_bytes or max(MIN_STAGED_BYTES, limits.max_sessions * largest)


def peer_counts(limits: Limits) -> tuple[PeerCounts, PeerCounts]:
    """The counts of sessions, and of Fetch calls, at once: in all and per peer address."""
    return (
        PeerCounts("sessions", limits.max_sessions, limits.max_sessions_per_peer),
        PeerCounts("Fetch calls", limits.max_sessions, FETCHES_PER_PEER),
    )
