"""The shard's Prometheus metrics, served at /metrics.

Counters and gauges are read from the shard's own bookkeeping when Prometheus scrapes (one source of
truth: the same numbers as /api/status); histograms are observed as rounds close and pushes arrive. Each
shard has its own registry, so that several shards in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from streamdiloco import __version__
from streamdiloco.common.metrics import PAYLOAD_BYTES, PREFIX, PUSH_OUTCOMES, WAN_SECONDS, push_outcome
from streamdiloco.common.wire import PROTOCOL

if TYPE_CHECKING:
    from streamdiloco.server.observe.status import Observed

P = f"{PREFIX}_shard"

# Identities of the contribution credits with series of their own (the most tokens); the rest share one series
# whose worker label is empty (no worker name is): labels stay bounded however many workers come
CREDIT_LABELS = 10

# How a round closed (ShardState.due's reasons, named for a dashboard's legend)
ROUND_OUTCOMES = {
    "all": "complete",
    "quorum": "quorum",
    "deadline": "deadline",
    "overdue": "overdue",
    "empty": "empty",
    "nonfinite": "nonfinite",
}


class ShardMetrics:
    def __init__(self, parts: Observed):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.round_duration = Histogram(
            f"{P}_round_duration_seconds",
            "Seconds from a round's first whole push to its close",
            buckets=WAN_SECONDS,
            registry=r,
        )
        self.push_transfer = Histogram(
            f"{P}_push_transfer_seconds",
            "Seconds from a push's first chunk to its last, as the shard received them",
            buckets=WAN_SECONDS,
            registry=r,
        )
        self.push_size = Histogram(
            f"{P}_push_size_bytes",
            "Encoded bytes (payload and scales) of each accepted push",
            buckets=PAYLOAD_BYTES,
            registry=r,
        )
        self.update_size = Histogram(
            f"{P}_update_size_bytes",
            "Encoded bytes of each round's update, as broadcast to every member",
            buckets=PAYLOAD_BYTES,
            registry=r,
        )
        self.checkpoint_write = Histogram(
            f"{P}_checkpoint_write_seconds",
            "Seconds to write one fragment's checkpoint when its round closes",
            buckets=WAN_SECONDS,
            registry=r,
        )
        self.rounds: dict[str, int] = dict.fromkeys(ROUND_OUTCOMES.values(), 0)
        r.register(_Collector(parts, self))
        ProcessCollector(registry=r)  # the standard process_* names

    def round_closed(self, why: str, seconds: float | None, update_bytes: int) -> None:
        self.rounds[ROUND_OUTCOMES.get(why, why)] += 1
        if seconds is not None:
            self.round_duration.observe(seconds)
        self.update_size.observe(update_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def ready_gauge(ready: bool) -> GaugeMetricFamily:
    return GaugeMetricFamily(
        f"{P}_ready", "1 while the shard takes workers (0 while loading or stopping)", value=float(ready)
    )


def loading_metrics() -> bytes:
    """/metrics while the model and the checkpoint load: the shard is up, and not ready."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Static([ready_gauge(False)]))
    return generate_latest(registry)


class _Static:
    def __init__(self, families: list):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


class _Collector:
    """Reads the shard's counters at scrape time."""

    def __init__(self, parts: Observed, metrics: ShardMetrics):
        self.parts, self.metrics = parts, metrics

    def collect(self) -> Iterator[Metric]:
        parts, st = self.parts, self.parts.state
        info = InfoMetricFamily(P, "This shard and the run it serves")
        info.add_metric(
            [],
            {
                "shard": str(st.shard),
                "num_shards": str(st.num_shards),
                "fragments": str(st.layout.num_fragments),
                "protocol": str(PROTOCOL),
                "version": __version__,
            },
        )
        yield info
        yield ready_gauge(parts.ready())
        yield from self._members()
        yield from self._rounds()
        yield from self._traffic()
        yield from credit_metrics(parts)
        ckpt = parts.checkpoint
        yield CounterMetricFamily(
            f"{P}_checkpoint_writes", "Checkpoint files written", value=ckpt.writes if ckpt else 0
        )
        yield CounterMetricFamily(
            f"{P}_checkpoint_errors", "Checkpoint writes that failed", value=ckpt.errors if ckpt else 0
        )

    def _members(self) -> Iterator[Metric]:
        """Who is here: members, passive sessions, members a restart still waits for."""
        parts, st = self.parts, self.parts.state
        yield GaugeMetricFamily(
            f"{P}_members", "Workers in the member set (rounds wait for them)", value=len(st.members)
        )
        yield GaugeMetricFamily(
            f"{P}_passive_sessions",
            "Connected workers that receive updates but are not members yet (joining)",
            value=parts.roster.passive,
        )
        yield GaugeMetricFamily(
            f"{P}_returning_members",
            "After a restart: members named by the checkpoint that are not back yet",
            value=len(st.returning),
        )

    def _rounds(self) -> Iterator[Metric]:
        """Each fragment's open round, the rounds closed by outcome, the pushes by outcome."""
        st = self.parts.state
        rnd = GaugeMetricFamily(f"{P}_fragment_round", "The open round of each fragment", labels=["fragment"])
        for f in range(st.layout.num_fragments):
            rnd.add_metric([str(f)], st.round_of(f))
        yield rnd
        rounds = CounterMetricFamily(f"{P}_rounds", "Rounds closed, by how they closed", labels=["outcome"])
        for outcome, n in self.metrics.rounds.items():
            rounds.add_metric([outcome], n)
        yield rounds
        pushes = CounterMetricFamily(
            f"{P}_pushes",
            "Pushes by outcome: accepted, late (round closed), duplicate (resent), refused (bad input)",
            labels=["outcome"],
        )
        counts = dict.fromkeys(PUSH_OUTCOMES, 0)
        counts["accepted"] = st.pushes_accepted
        for reason, n in st.pushes_refused.items():
            counts[push_outcome(reason)] += n
        for outcome, n in counts.items():
            pushes.add_metric([outcome], n)
        yield pushes

    def _traffic(self) -> Iterator[Metric]:
        """Bytes in and out (messages and encoded payloads), messages that did not parse, the last loss."""
        parts, st = self.parts, self.parts.state
        yield CounterMetricFamily(
            f"{P}_bad_messages",
            "Session messages that were neither pushes nor Ready",
            value=parts.counters.bad_messages,
        )
        c = parts.counters
        yield CounterMetricFamily(
            f"{P}_received_bytes", "Bytes of protobuf messages received from workers", value=c.msg_in
        )
        sent = CounterMetricFamily(
            f"{P}_sent_bytes",
            "Bytes of protobuf messages sent to workers: session (updates, results) and fetch (masters)",
            labels=["stream"],
        )
        sent.add_metric(["session"], c.msg_out)
        sent.add_metric(["fetch"], c.fetch_out)
        yield sent
        yield CounterMetricFamily(
            f"{P}_payload_received_bytes",
            "Encoded push bytes (payload and scales) accepted",
            value=st.bytes_received,
        )
        yield CounterMetricFamily(
            f"{P}_payload_sent_bytes", "Encoded update bytes sent, summed over members", value=c.codec_out
        )
        if parts.dashboard.last_loss is not None:
            yield GaugeMetricFamily(
                f"{P}_training_loss",
                "Token-weighted mean training loss reported with the pushes of the latest closed round",
                value=parts.dashboard.last_loss,
            )


def credit_metrics(parts: Observed) -> Iterator[Metric]:
    """The contribution credits (server/storage/credits.py): the CREDIT_LABELS identities with the most tokens
    by `worker`, the rest under worker="". Gauges: a worker's series moves to the rest when others pass it."""
    tops, rest = parts.credits.top(CREDIT_LABELS, parts.clock())
    rows = [*tops, ("", rest, 0.0)]
    families = {
        "tokens": GaugeMetricFamily(
            f"{P}_credit_tokens",
            "Tokens of a worker's training that reached the model: its pushes' weights after the caps, "
            "folded into closed rounds, over the fragments",
            labels=["worker"],
        ),
        "rounds": GaugeMetricFamily(
            f"{P}_credit_rounds", "Closed rounds that folded a push of the worker", labels=["worker"]
        ),
        "connected": GaugeMetricFamily(
            f"{P}_credit_connected_seconds", "Seconds the worker's sessions were open", labels=["worker"]
        ),
    }
    pushes = GaugeMetricFamily(
        f"{P}_credit_pushes",
        "A worker's pushes: accepted, clipped and capped (of the accepted), late, refused (bad input)",
        labels=["worker", "outcome"],
    )
    for name, row, open_seconds in rows:
        families["tokens"].add_metric([name], row.tokens)
        families["rounds"].add_metric([name], row.rounds)
        families["connected"].add_metric([name], row.connected_seconds + open_seconds)
        counts = (row.pushes, row.clipped, row.capped, row.late, sum(row.refused.values()))
        for outcome, n in zip(("accepted", "clipped", "capped", "late", "refused"), counts, strict=True):
            pushes.add_metric([name, outcome], n)
    yield from families.values()
    yield pushes
    yield GaugeMetricFamily(
        f"{P}_credit_identities",
        "Worker identities the contribution credits counted (those folded into its others too)",
        value=parts.credits.identities,
    )
