"""A transport with no shard behind it, for engine tests that never push (no send is due in their steps):
what worker.engine.Transport declares and such a test reaches."""

from __future__ import annotations


class NoWire:
    num_shards, pace_seconds = 1, 0.0

    def skip_to(self, next_rounds) -> None:
        return None  # never behind

    def close(self) -> None:
        pass
