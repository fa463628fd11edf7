"""The worker's Prometheus metrics: `streamdiloco worker --metrics-port PORT` serves them at /metrics.

Counters and gauges are read from the training loop's own counters when Prometheus scrapes (the same
numbers as the progress lines and the summary); the merge-wait histogram is observed as merges happen.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from streamdiloco import __version__
from streamdiloco.common.metrics import PREFIX, PUSH_OUTCOMES, WAN_SECONDS
from streamdiloco.common.ports import bind_error

log = logging.getLogger("streamdiloco.worker")

P = f"{PREFIX}_worker"
UTILIZATION_WINDOW = 60.0  # seconds: compute utilization is that of the last minute, not of the whole run


class WorkerMetrics:
    """The worker's Prometheus metrics. The run tells it what happens (`joined`, `training`, `stepped`,
    `evaluated`, `to`); until the engine exists the run's counters read 0."""

    def __init__(self, name: str, model: str, device: str, steps: int):
        self.labels = {"worker": name, "model": model, "device": device, "version": __version__}
        self.steps = steps
        self.engine: Any = None
        self.transport: Any = None
        self.stats: Any = None  # the training loop's (worker/run.py TrainStats): compute_seconds, ...
        # (time.perf_counter(), compute seconds so far) at steps: the oldest is at least a window ago
        self._marks: deque[tuple[float, float]] = deque()
        self.step = 0
        self.loss: float | None = None  # the latest inner step's
        self.eval_loss: float | None = None
        self.phase = "joining"
        self.registry = CollectorRegistry(auto_describe=True)
        self.merge_wait = Histogram(
            f"{P}_merge_wait_seconds",
            "Seconds each merge waited for its fragment's update (0 when it had arrived: the overlap worked)",
            buckets=WAN_SECONDS,
            registry=self.registry,
        )
        self.push_answer = Histogram(
            f"{P}_push_seconds",
            "Seconds from sending a push to a shard to its acceptance (upload, queueing, the shard's check)",
            buckets=WAN_SECONDS,
            registry=self.registry,
        )
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)  # the standard process_* names
        self.server: WSGIServer | None = None

    def joined(self, engine: Any, transport: Any) -> None:
        """The engine and its transport, whose counters are read at scrape time."""
        self.engine, self.transport = engine, transport

    def training(self, stats: Any, step: int) -> None:
        """Training starts (or resumes) at `step`; `stats`: the loop's statistics (worker/run.py)."""
        self.stats, self.step, self.phase = stats, step, "training"

    def stepped(self, step: int, loss: float | None) -> None:
        """An inner step done, with its training loss."""
        self.step, self.loss = step, loss

    def evaluated(self, eval_loss: float | None) -> None:
        """The latest eval loss of the global parameters."""
        self.eval_loss = eval_loss

    def to(self, phase: str) -> None:
        """The worker's phase: joining, training, stopped, finished."""
        self.phase = phase

    def mark(self, compute_seconds: float) -> None:
        """The training loop's compute seconds so far, at the start and after every step."""
        now = time.perf_counter()
        self._marks.append((now, compute_seconds))
        while len(self._marks) > 1 and self._marks[1][0] <= now - UTILIZATION_WINDOW:
            self._marks.popleft()

    def utilization(self) -> float:
        """Share of the last minute (since the start, if younger) spent computing."""
        if not self._marks:
            return 0.0
        (t0, c0), (_, c1) = self._marks[0], self._marks[-1]
        wall = time.perf_counter() - t0
        return min(1.0, (c1 - c0) / wall) if wall > 0 else 0.0

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics in a background thread; returns the bound port (port 0 picks one)."""
        try:
            self.server, _ = start_http_server(port, host, registry=self.registry)
        except OSError as e:
            raise bind_error("--metrics-port", host, port, e, "another worker") from None
        bound = self.server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, m: WorkerMetrics):
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        eng, tr, stats = m.engine, m.transport, m.stats
        info = InfoMetricFamily(P, "This worker")
        info.add_metric([], m.labels)
        yield info
        phase = GaugeMetricFamily(
            f"{P}_phase", "1 for the phase the worker is in", labels=["phase"]
        )  # a state set: a handful of values
        for p in ("joining", "training", "finished", "stopped"):
            phase.add_metric([p], float(p == m.phase))
        yield phase
        yield GaugeMetricFamily(f"{P}_step", "Inner steps done (counting from the run's start)", value=m.step)
        yield GaugeMetricFamily(f"{P}_steps", "Inner steps this worker is to do in all", value=m.steps)
        yield CounterMetricFamily(
            f"{P}_inner_steps",
            "Inner steps this worker has trained (from 0 for a joiner, whose _step starts at the run's step)",
            value=eng.counters.inner_steps if eng is not None else 0,
        )
        yield CounterMetricFamily(f"{P}_tokens", "Tokens trained on", value=eng.counters.tokens if eng else 0)
        if m.loss is not None:
            yield GaugeMetricFamily(
                f"{P}_training_loss", "The latest inner step's training loss", value=m.loss
            )
        if m.eval_loss is not None:
            yield GaugeMetricFamily(
                f"{P}_eval_loss",
                "The latest evaluation's loss (at the start, and of the global parameters at the end)",
                value=m.eval_loss,
            )
        compute = stats.compute_seconds if stats is not None else 0.0
        yield CounterMetricFamily(
            f"{P}_compute_seconds", "Seconds spent in forward, backward and the optimizer step", value=compute
        )
        yield GaugeMetricFamily(
            f"{P}_compute_utilization",
            "Share of the last minute spent computing (the rest: blocked on updates, syncing, logging)",
            value=m.utilization(),
        )
        yield CounterMetricFamily(
            f"{P}_blocked_seconds",
            "Seconds the training loop waited for updates to merge",
            value=eng.blocked_seconds if eng is not None else 0.0,
        )
        yield CounterMetricFamily(f"{P}_merges", "Fragment updates merged", value=eng.merges if eng else 0)
        sent, received = tr.message_bytes if tr is not None else (0, 0)
        yield CounterMetricFamily(
            f"{P}_sent_bytes", "Bytes of protobuf messages sent to the shards", value=sent
        )
        yield CounterMetricFamily(
            f"{P}_received_bytes",
            "Bytes of protobuf messages received from the shards (updates and the fetched masters)",
            value=received,
        )
        yield CounterMetricFamily(
            f"{P}_payload_sent_bytes",
            "Encoded bytes (payload and scales) of the pushes",
            value=eng.bytes_sent if eng is not None else 0,
        )
        pushes = CounterMetricFamily(
            f"{P}_pushes",
            "Answers to this worker's pushes, summed over shards: accepted, late, duplicate, refused",
            labels=["outcome"],
        )
        results = tr.results if tr is not None else dict.fromkeys(PUSH_OUTCOMES, 0)
        for outcome in PUSH_OUTCOMES:
            pushes.add_metric([outcome], results[outcome])
        yield pushes
        yield CounterMetricFamily(
            f"{P}_reconnects", "Sessions with a shard re-established", value=tr.reconnects if tr else 0
        )
        yield CounterMetricFamily(
            f"{P}_pushes_resent", "Pushes sent again after a reconnect", value=tr.resent if tr else 0
        )
