"""The dashboard's data: what a shard shows over time, bounded. Closed rounds (for /api/status and the
page's round markers), one sample a second of the shard's counters (bytes in and out, members, passive
sessions), and each worker's reported progress (step, loss, blocked time: one point per push). The
servicer records into it on its event loop; /api/status, /api/series and the metrics read it there."""

from __future__ import annotations

import time
from collections import deque

HISTORY = 500  # closed rounds kept for /api/status
SAMPLES = 900  # the shard's samples, one a second: the last 15 minutes
PROGRESS_POINTS = 600  # per worker: its latest reports (step, loss, blocked time), one per push
PROGRESS_WORKERS = 64  # workers whose reports are kept; the longest silent is forgotten first

Sample = tuple[float, int, int, int, int]  # time.time(), bytes in, bytes out, members, passive sessions


class DashboardData:
    def __init__(self) -> None:
        self.history: deque[dict] = deque(maxlen=HISTORY)  # recent closed rounds
        self.samples: deque[Sample] = deque(maxlen=SAMPLES)
        self.progress: dict[str, deque[tuple[float, int, float | None, float]]] = {}
        self.last_loss: float | None = None  # mean training loss of the latest round closed with losses

    def record_round(self, record: dict) -> None:
        """A closed round: closed_at, fragment, round, seconds, mean_loss, why, contributors (and more)."""
        if record.get("mean_loss") is not None:
            self.last_loss = record["mean_loss"]
        self.history.append(record)

    def record_progress(self, name: str, step: int, loss: float | None, blocked: float) -> None:
        series = self.progress.get(name)
        if series is None:
            if len(self.progress) >= PROGRESS_WORKERS:  # forget the worker silent the longest
                del self.progress[min(self.progress, key=lambda w: self.progress[w][-1][0])]
            series = self.progress[name] = deque(maxlen=PROGRESS_POINTS)
        series.append((time.time(), step, loss, blocked))

    def round_seconds(self) -> dict:
        """Median and max of the recent rounds' durations (first whole push to close)."""
        ys = sorted(r["seconds"] for r in self.history if r["seconds"] is not None)
        if not ys:
            return {"rounds": 0, "median": None, "max": None}
        return {"rounds": len(ys), "median": ys[len(ys) // 2], "max": ys[-1]}

    def recent_rounds(self, rounds: int) -> list[dict]:
        return list(self.history)[-rounds:] if rounds else []

    def series(self, since: float, now: Sample) -> dict:
        """The time series after `since` (a time.time()): the samples (and `now`, this moment's), the closed
        rounds, and each worker's reported progress. The page asks for what is new since its last poll."""
        return {
            "now": time.time(),
            "samples": [
                {"t": t, "bytes_in": bi, "bytes_out": bo, "members": m, "passive": p}
                for t, bi, bo, m, p in [*self.samples, now]
                if t > since
            ],
            "rounds": [
                {k: r[k] for k in ("closed_at", "fragment", "round", "seconds", "mean_loss", "why")}
                | {"contributors": len(r["contributors"])}
                for r in self.history
                if r["closed_at"] > since
            ],
            "workers": {
                name: [
                    {"t": t, "step": step, "loss": loss, "blocked_seconds": blocked}
                    for t, step, loss, blocked in points
                    if t > since
                ]
                for name, points in self.progress.items()
            },
        }
