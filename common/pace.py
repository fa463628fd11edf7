"""Sites of unequal speed: how many inner steps a worker does per step of the schedule.

The schedule (common/schedule.py) counts *schedule steps*: H of them between two sends of a fragment, tau of
them from a send to its merge, --steps of them in a run. With `sync_schedule = "fixed"` every worker does
one inner step per schedule step, so a round closes at the pace of the slowest member and a site twice as
fast spends half its time waiting at merges. With `"adaptive"` each worker does k >= 1 inner steps per
schedule step, k = (the slowest member's seconds per inner step) / (its own), at most
`max_steps_per_tick`: every site reaches a fragment's send at about the same wall time, and the fast one
trains instead of waiting. Its push carries the tokens of all its steps, and the shards weight it by them
(the mean is token-weighted) where they trust reported speeds (--trust-speed, `launch`'s runs: its caps
stretch by its own k); a shard facing the internet holds every push to the same bounds, since a step time
is the worker's word.

Why this, and not rounds on a time budget: the schedule, the shards' round logic, the joining step and the
checkpoints all stay in schedule steps, unchanged; only the mapping from inner steps to schedule steps
moves (forgather's dynamic local updates, torchft's per-machine sync_every). A time budget would put wall
clocks into the rounds, which the shards, the simulator and a resumed worker would each have to agree on.

Speeds are measured, not declared: each worker reports the median of its recent seconds per inner step
(training, data and anything else between two steps, but not the time it waited for updates) with its
pushes; each shard answers every accepted push with the run's pace, the largest step time its members
with a recent accepted push reported, each clamped to within `max_steps_per_tick` of their upper median
(server/rounds/members.py). k depends only on step times, which do not depend on k, so there is no
feedback loop to drift; the slowest member (k = 1) sets the pace. A worker that lies about its speed can
make the others do at most `max_steps_per_tick` inner steps per schedule step, and moves the pace by at
most that factor of the others' median while it pushes (at M = 2, the upper median is its own word: a
round at most --round-timeout).

Pure: numbers in, numbers out; the engine, the shards and the simulator use these same functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streamdiloco.common.config import SyncConfig

# A worker that is at most this much faster than the pace keeps one inner step per schedule step: the
# slowest member's own measurement moves a little between its reports, and must not make it do 1.02 steps.
PACE_TOLERANCE = 0.05
# Seconds per inner step a worker may report (or a shard announce) at most: the same bound as --step-delay.
MAX_STEP_SECONDS = 3600.0


def valid_step_seconds(value: float) -> bool:
    """Whether a reported step time is one a worker can have: finite, positive, at most an hour."""
    return 0.0 < value <= MAX_STEP_SECONDS  # NaN fails both comparisons


def pace_seconds(reported: Iterable[float | None], spread: float = math.inf) -> float:
    """The run's pace from its members' reported seconds per inner step (0.0: none known): the slowest's,
    each report first clamped to within a factor `spread` of their upper median (`robust_pace`)."""
    known = sorted(s for s in reported if s is not None and valid_step_seconds(s))
    return robust_pace(known, spread)


def robust_pace(known: Sequence[float], spread: float) -> float:
    """The pace from valid reports sorted ascending: the largest, at most `spread` times their upper median
    (0.0 for none). A report is a worker's word: clamped to [median / spread, median x spread], one liar's
    cannot set the pace beyond a factor of the others' (of two, the upper median is the larger: a fast
    claim cannot lower the honest member's pace, and a slow one is one member's word against one)."""
    if not known:
        return 0.0
    return min(known[-1], spread * known[len(known) // 2])


def steps_per_tick(pace: float, own: float | None, cfg: SyncConfig) -> float:
    """Inner steps per schedule step for a worker whose step takes `own` seconds, in a run whose slowest
    member's takes `pace`: 1 with the fixed schedule or while either is unknown, else pace / own within
    [1, max_steps_per_tick] (1 for a worker within PACE_TOLERANCE of the pace)."""
    if cfg.sync_schedule != "adaptive" or not own or not pace or not math.isfinite(pace / own):
        return 1.0
    ratio = pace / own
    if ratio <= 1.0 + PACE_TOLERANCE:
        return 1.0
    return min(ratio, cfg.max_steps_per_tick)


@dataclass
class TickClock:
    """Counts a worker's inner steps into schedule steps: with k inner steps per schedule step, each inner
    step is 1/k of one, and a schedule step is complete when they add up to 1 (k may change between steps;
    with k = 1 every inner step completes one, as with the fixed schedule)."""

    credit: float = 0.0  # the part of the next schedule step done so far

    def inner_step(self, per_tick: float) -> bool:
        """Count one inner step; True when it completes a schedule step."""
        self.credit += 1.0 / max(1.0, per_tick)
        if self.credit >= 1.0 - 1e-9:
            self.credit = max(0.0, self.credit - 1.0)
            if self.credit < 1e-9:
                self.credit = 0.0
            return True
        return False
