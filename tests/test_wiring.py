"""server/edge/wiring.py in closed form: the values per chunk in each direction, the budget of bytes queued
for members and not read, the budget of pushes arriving, and the counts of calls per peer, from the run's
settings and the shard's limits.

Codec sizes used below: int8 stores a byte a value and an fp32 scale per block of 128 values, e3m0 half a
byte a value and the same scales, fp32 four bytes a value.
"""

from __future__ import annotations

from streamdiloco.common.config import SyncConfig
from streamdiloco.server.edge.wiring import chunk_sizes, peer_counts, staged_budget, unread_budget
from streamdiloco.server.trust.bounds import FETCHES_PER_PEER, MIN_STAGED_BYTES, MIN_UNREAD_BYTES, Limits

CFG = SyncConfig(uplink_codec="e3m0", downlink_codec="int8", codec_block_size=128)


def test_chunks_hold_about_chunk_bytes_in_each_directions_codec():
    # 256 bytes: 512 e3m0 values up, 256 int8 values down, 64 fp32 values in a Fetch
    assert chunk_sizes(CFG, 256) == (512, 256, 64)
    assert chunk_sizes(SyncConfig(uplink_codec="fp32", downlink_codec="e3m0"), 1 << 20) == (
        1 << 18,
        1 << 21,
        1 << 18,
    )


def test_the_unread_budget_is_four_rounds_of_every_update_and_at_least_the_minimum():
    small = [(0, 1000), (1000, 3000)]  # 1000 + 8 * 4 and 2000 + 16 * 4 bytes of int8: far below the minimum
    assert unread_budget(CFG, small, Limits()).limit == MIN_UNREAD_BYTES
    large = [(0, 100_000_000)]  # 100M values: 100M bytes and 781,250 scales
    assert unread_budget(CFG, large, Limits()).limit == 4 * (100_000_000 + 4 * 781_250)
    assert unread_budget(CFG, large, Limits(max_unread_bytes=12345)).limit == 12345  # the flag's


def test_the_staged_budget_is_one_push_of_the_largest_fragment_per_session():
    small = [(0, 1000), (1000, 3000)]
    assert staged_budget(CFG, small, Limits()) == MIN_STAGED_BYTES  # 512 sessions x 1064 bytes: below
    big = [(0, 1000), (1000, 10_001_000)]  # e3m0: 5M bytes and 78,125 scales a push of the second
    assert staged_budget(CFG, big, Limits(max_sessions=512)) == 512 * (5_000_000 + 4 * 78_125)
    assert staged_budget(CFG, big, Limits(max_staged_bytes=999)) == 999


def test_sessions_and_fetches_are_counted_in_all_and_per_peer():
    sessions, fetches = peer_counts(Limits(max_sessions=10, max_sessions_per_peer=3))
    assert (sessions.what, sessions.total, sessions.per_peer) == ("sessions", 10, 3)
    assert (fetches.what, fetches.total, fetches.per_peer) == ("Fetch calls", 10, FETCHES_PER_PEER)
    assert [sessions.acquire("10.0.0.1") for _ in range(3)] == [None, None, None]
    assert sessions.acquire("10.0.0.1") == "sessions from 10.0.0.1 are at their limit of 3 per address"
