"""The dashboard's data: what a shard shows over time, bounded. Closed rounds (for /api/status and the
page's round markers), one sample a second of the shard's counters (bytes in and out, members, passive
sessions), and each worker's reported progress (step, loss, blocked time, tokens, compute utilization: one
point per push; its eval losses: one point per evaluation). The servicer records into it on its event loop;
/api/status, /api/series and the metrics read it there. Everything here came from workers, checked by the
servicer (finite, in range); what a worker can make it hold is bounded: points per worker, workers kept."""

from __future__ import annotations

import time
from collections import deque

from streamdiloco.common.progress import Progress

HISTORY = 500  # closed rounds kept for /api/status
SAMPLES = 900  # the shard's samples, one a second: the last 15 minutes
PROGRESS_POINTS = 600  # per worker: its latest reports (step, loss, blocked time), one per push
EVAL_POINTS = 200  # per worker: its latest eval losses, one per evaluation it reported
PROGRESS_WORKERS = 64  # workers whose reports are kept; the longest silent is forgotten first
RATE_SECONDS = 60.0  # tokens/s, steps/s and the ETA: over a worker's reports of the last minute

Sample = tuple[float, int, int, int, int]  # time.time(), bytes in, bytes out, members, passive sessions
# time.time(), step, training loss, blocked seconds, tokens, compute utilization
Point = tuple[float, int, float | None, float, int, float | None]
EvalPoint = tuple[float, int, int, float]  # time.time() it was reported, step, tokens (estimated), eval loss


class DashboardData:
    def __init__(self) -> None:
        self.history: deque[dict] = deque(maxlen=HISTORY)  # recent closed rounds
        self.samples: deque[Sample] = deque(maxlen=SAMPLES)
        self.progress: dict[str, deque[Point]] = {}
        self.evals: dict[str, deque[EvalPoint]] = {}  # only for workers in `progress`
        self.last_loss: float | None = None  # mean training loss of the latest round closed with losses

    def record_round(self, record: dict) -> None:
        """A closed round: closed_at, fragment, round, seconds, mean_loss, why, contributors (and more)."""
        if record.get("mean_loss") is not None:
            self.last_loss = record["mean_loss"]
        self.history.append(record)

    def record_progress(
        self, name: str, step: int, loss: float | None, blocked: float, report: Progress | None = None
    ) -> None:
        """An accepted push's report: its step, mean training loss and blocked seconds, and all of the
        progress it reported (common/progress.py) when given."""
        r = report or Progress(step=step, blocked_seconds=blocked)
        now = time.time()
        # the dict is kept in the order of the workers' last reports (each report moves its worker to the
        # end), so the worker silent the longest is the first: O(1) per push with any number of members
        series = self.progress.pop(name, None)
        if series is None:
            if len(self.progress) >= PROGRESS_WORKERS:  # forget the worker silent the longest
                gone = next(iter(self.progress))
                del self.progress[gone]
                self.evals.pop(gone, None)
            series = deque(maxlen=PROGRESS_POINTS)
        self.progress[name] = series
        series.append((now, r.step, loss, r.blocked_seconds, r.tokens, r.compute_utilization))
        if r.eval_loss is not None:
            evals = self.evals.setdefault(name, deque(maxlen=EVAL_POINTS))
            if not evals or evals[-1][1] != r.eval_step:  # one point per evaluation, not per push
                # the tokens it had at the eval's step, from its tokens per step until now
                tokens = round(r.tokens * r.eval_step / r.step) if 0 <= r.eval_step < r.step else r.tokens
                evals.append((now, r.eval_step, tokens, r.eval_loss))

    def rates(self, name: str) -> dict:
        """A worker's steps/s and tokens/s over its reports of the last RATE_SECONDS (None where its reports
        do not tell: fewer than two, or no step between them)."""
        out: dict = {"steps_per_second": None, "tokens_per_second": None}
        points = self.progress.get(name)
        if not points:
            return out
        last = points[-1]
        first = next((p for p in points if p[0] >= last[0] - RATE_SECONDS), last)
        dt = last[0] - first[0]
        if dt > 0 and last[1] > first[1]:
            out["steps_per_second"] = (last[1] - first[1]) / dt
            if last[4] >= first[4]:
                out["tokens_per_second"] = (last[4] - first[4]) / dt
        return out

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
        rounds, and each worker's reported progress and evaluations. The page asks for what is new since its
        last poll."""
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
                    {
                        "t": t,
                        "step": step,
                        "loss": loss,
                        "blocked_seconds": blocked,
                        "tokens": tokens,
                        "utilization": utilization,
                    }
                    for t, step, loss, blocked, tokens, utilization in points
                    if t > since
                ]
                for name, points in self.progress.items()
            },
            "evals": {
                name: [
                    {"t": t, "step": step, "tokens": tokens, "eval_loss": loss}
                    for t, step, tokens, loss in points
                    if t > since
                ]
                for name, points in self.evals.items()
            },
        }
