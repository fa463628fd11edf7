"""What shards and workers share about Prometheus metrics: the prefix and the histogram buckets.

Names follow Prometheus conventions: one prefix (`streamdiloco_`), base units (seconds, bytes), `_total`
on counters, and no label whose values grow with the run (no step, worker, parameter or round labels;
`fragment` has as many values as the run has fragments, a handful).
"""

from __future__ import annotations

from prometheus_client import disable_created_metrics

disable_created_metrics()  # no `_created` series beside every counter and histogram: they only add noise

PREFIX = "streamdiloco"


def push_outcome(reason: str | None) -> str:
    """A push's outcome from the shard's refusal reason (None: accepted): accepted, late (its round had
    closed: harmless, the update comes anyway), duplicate (a push resent after a reconnect that the shard
    already had) or refused (bad input)."""
    if reason is None:
        return "accepted"
    return reason if reason in ("late", "duplicate") else "refused"


PUSH_OUTCOMES = ("accepted", "late", "duplicate", "refused")

# Seconds, for things that cross a WAN: a push's transfer, a round, a wait for an update. From tens of
# milliseconds (a LAN) to ten minutes (a large fragment over a slow link, or a round that hit its deadline).
WAN_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Bytes of a push or an update: 4 KiB (a tiny model's 4-bit fragment) to 4 GiB (a large one's), by 4x.
PAYLOAD_BYTES = tuple(float(4**k * 1024) for k in range(1, 12))
