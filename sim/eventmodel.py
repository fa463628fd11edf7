"""The event model of a Streaming DiLoCo run: compute utilization (compute time / wall time) predicted from
its links. sim/utilization.py is its command line, sim/plan.py compares codecs with it.

**The event model** (`RunModel`, `simulate`, `needed_bandwidth`) is this project's system: M workers, each
with its own uplink (worker -> shard) and downlink (shard -> worker), each a FIFO queue. A transfer holds
its link for bytes * 8 / bandwidth and lands one latency later (the next transfer may start as soon as the
previous one has left: latency is propagation, not occupancy). The bytes are the codecs' real sizes, each
direction its own codec's (common/codecspec.py's `encoded_nbytes`: the payload, top-k's positions included,
and the fp32 scales or codebooks). A round closes at the shard when all M pushes have landed, then takes
the shard's processing time (fixed + per value), then its update goes down every worker's downlink, behind
earlier updates. Which fragment is sent and merged after which step comes from
common/schedule.py's `events()`, the one definition of the schedule. Two merge policies:
- "fixed": a round sent after step t is merged after step t + tau; if its update has not arrived,
  training stalls until it does (what the worker does today).
- "adaptive": t + tau is the earliest merge; a late update is merged after the first later step by which it
  has arrived, and training stalls only if it is still missing when the fragment is next sent (t + H) or at
  the final sync. With tau = 0 it waits at once, as "fixed" does (blocking DiLoCo).
Step times are fixed, or jittered (seeded: the same seed gives the same answer). The steady state (12
periods of H steps, the first 2 not counted) counts a period as no shorter than its traffic takes on the
slower link (or the shard): below that rate a queue fills for as long as the run lasts, and the adaptive
policy would hide the filling from a window of 10 periods.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from streamdiloco.common.codecspec import lookup_codec
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import assign_blocks
from streamdiloco.common.schedule import Event, events, merge_deadline

POLICIES = ("fixed", "adaptive")

# --- the event model --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunModel:
    """Everything the event model needs, validated once. Bandwidths in bit/s, times in seconds."""

    fragment_values: tuple[int, ...]  # values in each fragment, in schedule order (P = len)
    step_time: float  # seconds of compute per inner step
    sync_every: int = 30  # H
    fragment_sync_delay: int = 1  # tau: the merge is due tau steps after the send
    policy: str = "fixed"  # fixed | adaptive (see the module docstring)
    workers: int = 2  # M
    uplink_bps: float = math.inf  # each worker's link to the shards
    downlink_bps: float = math.inf  # and back
    latency: float = 0.0  # one way
    uplink_codec: str = "e3m0"
    downlink_codec: str = "e3m0"
    codec_block_size: int = 128  # values per fp32 scale in the scaled codecs
    # The shard's work after a round closes (pushes are decoded as they arrive, under the transfer): the
    # fold, the outer step and the update's encoding. Measured: 90 ms for a 25M-value fragment on a 2-core
    # VM (BENCHMARKS.md, sync cost), i.e. ~4 ns per value of the shard's slice.
    round_fixed_s: float = 0.001
    round_per_value_s: float = 4e-9
    num_shards: int = 1  # shards work on their slices in parallel
    # Inner steps of the run, all counted (compare with a measured run of that length); 0: the steady state,
    # 12 periods of H simulated and the first 2 (queues filling) not counted.
    steps: int = 0
    # The real run's last step syncs every fragment (SyncConfig.final_sync). Off here by default so that the
    # answer is the steady state's; turn it on to compare with a finished run's wall time.
    final_sync: bool = False
    step_jitter: float = 0.0  # relative spread of step times (log-normal, mean step_time); 0: fixed
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.fragment_values:
            raise ValueError("fragment_values is empty: give the number of values in each fragment")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.fragment_values):
            raise ValueError(f"fragment_values must be non-negative integers, got {self.fragment_values}")
        if not self.step_time > 0 or not math.isfinite(self.step_time):
            raise ValueError(f"step_time must be a positive number of seconds, got {self.step_time}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: choose {' or '.join(POLICIES)}")
        if self.workers < 1:
            raise ValueError(f"workers (M) must be at least 1, got {self.workers}")
        for name in ("uplink_bps", "downlink_bps"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{name} must be positive (bit/s; math.inf for no limit), got {getattr(self, name)}"
                )
        for name in ("latency", "round_fixed_s", "round_per_value_s", "step_jitter"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {self.num_shards}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0 (0: the steady state), got {self.steps}")
        if self.final_sync and not self.steps:
            raise ValueError(
                "final_sync ends a run of given length: set steps too (the steady state has no end)"
            )
        cfg = self.sync_config()  # H, P, tau and the codecs are checked where the real run checks them
        object.__setattr__(self, "uplink_codec", cfg.uplink_codec)  # topk -> topk64_4096, as the run names it
        object.__setattr__(self, "downlink_codec", cfg.downlink_codec)

    @property
    def num_fragments(self) -> int:
        return len(self.fragment_values)

    @property
    def total_steps(self) -> int:
        return self.steps or 12 * self.sync_every

    @property
    def warmup_steps(self) -> int:
        return 0 if self.steps else 2 * self.sync_every

    def sync_config(self) -> SyncConfig:
        return SyncConfig(
            sync_every=self.sync_every,
            num_fragments=self.num_fragments,
            fragment_sync_delay=self.fragment_sync_delay,
            uplink_codec=self.uplink_codec,
            downlink_codec=self.downlink_codec,
            codec_block_size=self.codec_block_size,
            final_sync=self.final_sync,
        )

    def push_bytes(self, fragment: int) -> int:
        """Bytes of one worker's push of `fragment`: the uplink codec's encoded size (top-k: its chunk)."""
        return lookup_codec(self.uplink_codec).encoded_nbytes(
            self.fragment_values[fragment], self.codec_block_size
        )

    def update_bytes(self, fragment: int) -> int:
        """Bytes of the shard's update of `fragment` to one worker: the downlink codec's encoded size."""
        return lookup_codec(self.downlink_codec).encoded_nbytes(
            self.fragment_values[fragment], self.codec_block_size
        )

    def outer_step_bytes(self) -> tuple[int, int]:
        """(up, down): the bytes one worker sends and receives per H inner steps, every fragment once."""
        frags = range(self.num_fragments)
        return sum(self.push_bytes(f) for f in frags), sum(self.update_bytes(f) for f in frags)

    def average_bps(self) -> tuple[float, float]:
        """(up, down): each worker's traffic at full compute, bit/s averaged over the H steps of a period;
        a link slower than this cannot keep the workers computing all the time."""
        up, down = self.outer_step_bytes()
        period = self.sync_every * self.step_time
        return up * 8 / period, down * 8 / period


@dataclass(frozen=True)
class Prediction:
    utilization: float  # mean over workers of compute / wall
    per_worker: tuple[float, ...]
    compute_s: float  # per worker (mean), over the steps counted
    wall_s: float  # per worker (mean), over the steps counted
    # counts over the whole simulated run, warm-up included
    merges: int  # merges per worker
    merges_waited: int  # merges (over all workers) that stalled training
    merges_deferred: int  # adaptive: merges (over all workers) done after their earliest step


def _seconds(nbytes: int, bps: float) -> float:
    return nbytes * 8 / bps  # 0 on an unlimited link


@dataclass
class _Links:
    """Every worker's uplink and downlink (FIFO queues) and the shard between them: when each is next free."""

    up_s: list[float]  # seconds a push of each fragment holds an uplink
    down_s: list[float]  # seconds an update of each fragment holds a downlink
    proc_s: list[float]  # the shard's seconds for a round of each fragment
    latency: float
    up_free: list[float]  # per worker
    down_free: list[float]  # per worker
    shard_free: float = 0.0

    @classmethod
    def of(cls, m: RunModel) -> _Links:
        return cls(
            up_s=[_seconds(m.push_bytes(f), m.uplink_bps) for f in range(m.num_fragments)],
            down_s=[_seconds(m.update_bytes(f), m.downlink_bps) for f in range(m.num_fragments)],
            proc_s=[m.round_fixed_s + m.round_per_value_s * v / m.num_shards for v in m.fragment_values],
            latency=m.latency,
            up_free=[0.0] * m.workers,
            down_free=[0.0] * m.workers,
        )

    def round_trip(self, fragment: int, sent_at: list[float]) -> list[float]:
        """Every worker pushes `fragment` at its time in `sent_at`; the round closes when every push has
        landed, the shard processes it, and its update goes down every worker's downlink behind earlier
        ones. Returns when the update lands at each worker."""
        pushed = []
        for w in range(len(sent_at)):
            start = max(sent_at[w], self.up_free[w])
            self.up_free[w] = start + self.up_s[fragment]
            pushed.append(self.up_free[w] + self.latency)
        start = max(max(pushed), self.shard_free)  # the round closes when every push has landed
        self.shard_free = start + self.proc_s[fragment]
        landed = []
        for w in range(len(sent_at)):
            s = max(self.shard_free, self.down_free[w])
            self.down_free[w] = s + self.down_s[fragment]
            landed.append(self.down_free[w] + self.latency)
        return landed


@dataclass
class _Run:
    """The event model's workers as it runs: their clocks, compute, put-off merges and the counts."""

    model: RunModel
    cfg: SyncConfig
    links: _Links
    rngs: list[random.Random]  # each worker's step times
    adaptive: bool  # put off a late merge (the adaptive policy with tau > 0)
    end: int | None  # the engine's deadline for a put-off merge; the steady state has no end to force it at
    now: list[float]  # each worker's clock
    compute: list[float]
    # per (fragment, round): the update's arrival at each worker
    arrival: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    late: list[dict[int, int]] = field(default_factory=list)  # adaptive: fragment -> round whose merge waits
    merges: int = 0  # over all workers
    waited: int = 0
    deferred: int = 0
    origin: list[float] = field(default_factory=list)  # where the counted steps begin
    origin_compute: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, m: RunModel) -> _Run:
        nw = m.workers
        return cls(
            model=m,
            cfg=m.sync_config(),
            links=_Links.of(m),
            rngs=[random.Random(m.seed * 7919 + w) for w in range(nw)],
            adaptive=m.policy == "adaptive" and m.fragment_sync_delay > 0,  # tau = 0 is blocking: it waits
            end=m.total_steps if m.final_sync else None,
            now=[0.0] * nw,
            compute=[0.0] * nw,
            late=[{} for _ in range(nw)],
            origin=[0.0] * nw,
            origin_compute=[0.0] * nw,
        )

    def wait_for(self, w: int, key: tuple[int, int]) -> None:
        if self.arrival[key][w] > self.now[w]:
            self.waited += 1
            self.now[w] = self.arrival[key][w]

    def merge_late(self, w: int, step: int, waiting: bool) -> None:
        """Put-off merges whose update is in (done without a wait), or, with `waiting`, those at their
        deadline (waited for)."""
        late = self.late[w]
        for f, r in list(late.items()):
            if self.arrival[(f, r)][w] <= self.now[w] or (
                waiting and step >= merge_deadline(f, r, self.cfg, self.end)
            ):
                self.wait_for(w, (f, r))
                del late[f]
                self.merges += 1

    def compute_step(self, step: int, sending: set[int]) -> None:
        """Every worker's inner step, then the put-off merges due before this step's sends."""
        m, sigma = self.model, self.model.step_jitter
        for w in range(m.workers):
            # log-normal with mean step_time: never negative, and a few slow steps as on real machines
            rng = self.rngs[w]
            d = m.step_time * (math.exp(sigma * rng.gauss(0.0, 1.0) - sigma**2 / 2) if sigma else 1.0)
            self.now[w] += d
            self.compute[w] += d
            # as the engine orders a step (schedule.sends_early): a put-off merge of a fragment that sends
            # now is waited for before that send; the other sends start before any other wait
            late = self.late[w]
            for f in sending & set(late):
                if step >= merge_deadline(f, late[f], self.cfg, self.end):
                    self.wait_for(w, (f, late.pop(f)))
                    self.merges += 1
            self.merge_late(w, step, waiting=False)

    def sync(self, step: int, evs: Sequence[Event]) -> None:
        """The step's sends and merges, in schedule order. The workers share the schedule, so each event is
        done by every worker before the next one: a round's update is known once every worker pushed it."""
        early = next((i for i, ev in enumerate(evs) if ev.kind == "merge"), len(evs))
        for i, ev in enumerate(evs):
            if i == early:  # the sends that go first are out: now the other put-off merges' waits
                self.merge_all_late(step)
            if ev.kind == "send":
                self.arrival[(ev.fragment, ev.round)] = self.links.round_trip(ev.fragment, self.now)
            else:
                self.merge(step, ev.fragment, ev.round)
        if early == len(evs):  # a step of sends only
            self.merge_all_late(step)

    def merge_all_late(self, step: int) -> None:
        for w in range(self.model.workers):
            self.merge_late(w, step, waiting=True)

    def merge(self, step: int, fragment: int, round_: int) -> None:
        """Every worker merges the round's update, waiting for it, or (adaptive) puts a late one off."""
        key = (fragment, round_)
        for w in range(self.model.workers):
            deadline = merge_deadline(fragment, round_, self.cfg, self.end)
            if self.adaptive and step < deadline and self.arrival[key][w] > self.now[w]:
                self.late[w][fragment] = round_
                self.deferred += 1
                continue
            self.wait_for(w, key)
            self.merges += 1

    def start_counting(self) -> None:
        self.origin, self.origin_compute = self.now[:], self.compute[:]

    def prediction(self) -> Prediction:
        m, nw = self.model, self.model.workers
        compute = [c - c0 for c, c0 in zip(self.compute, self.origin_compute, strict=True)]
        wall = [t - t0 for t, t0 in zip(self.now, self.origin, strict=True)]
        if not m.steps:
            # The steady state: a link (or shard) slower than the traffic fills its queue for as long as the
            # run lasts, and under the adaptive policy the ten periods counted would still be filling it. In
            # the long run a worker's period takes at least what its links and the shard take to carry it.
            periods = (m.total_steps - m.warmup_steps) // m.sync_every  # each fragment sent once a period
            busy = periods * max(sum(self.links.up_s), sum(self.links.down_s), sum(self.links.proc_s))
            wall = [max(t, busy) for t in wall]
        per_worker = tuple(c / t for c, t in zip(compute, wall, strict=True))
        return Prediction(
            utilization=sum(per_worker) / nw,
            per_worker=per_worker,
            compute_s=sum(compute) / nw,
            wall_s=sum(wall) / nw,
            merges=self.merges // nw,
            merges_waited=self.waited,
            merges_deferred=self.deferred,
        )


def simulate(model: RunModel) -> Prediction:
    """Run the event model and return the compute utilization it predicts."""
    run, total = _Run.of(model), model.total_steps
    for step in range(1, total + 1):
        evs = events(step, run.cfg, total)
        run.compute_step(step, {ev.fragment for ev in evs if ev.kind == "send"})
        run.sync(step, evs)
        if step == model.warmup_steps:
            run.start_counting()
    return run.prediction()


def needed_bandwidth(model: RunModel, target: float, rel_tol: float = 1e-3) -> float:
    """The smallest bandwidth (bit/s, the same each way) at which `model` reaches `target` utilization.

    math.inf when no bandwidth does: latency, the shard's processing or a fixed tau too small for the round
    trip then cap the utilization below the target (see `simulate` with unlimited links)."""
    if not 0 < target < 1:
        raise ValueError(f"target utilization must be in (0, 1), got {target}")

    def util(bps: float) -> float:
        return simulate(replace(model, uplink_bps=bps, downlink_bps=bps)).utilization

    return _smallest(util, target, rel_tol, lo=1.0, hi=1e9)


def needed_links(model: RunModel, target: float, rel_tol: float = 1e-3) -> tuple[float, float]:
    """The smallest (uplink, downlink) bandwidths in bit/s at which `model` reaches `target` utilization,
    each in proportion to its direction's traffic (`RunModel.average_bps`): the link a pair of codecs needs
    each way, where `needed_bandwidth` asks for the same rate both ways. (math.inf, math.inf) when no link
    reaches the target."""
    if not 0 < target < 1:
        raise ValueError(f"target utilization must be in (0, 1), got {target}")
    avg_up, avg_down = model.average_bps()

    def links(k: float) -> tuple[float, float]:  # k times the traffic; a direction without bytes: no limit
        return (k * avg_up if avg_up else math.inf), (k * avg_down if avg_down else math.inf)

    def util(k: float) -> float:
        up, down = links(k)
        return simulate(replace(model, uplink_bps=up, downlink_bps=down)).utilization

    k = _smallest(util, target, rel_tol, lo=0.01, hi=1.0)
    return links(k)


def _smallest(util: Callable[[float], float], target: float, rel_tol: float, lo: float, hi: float) -> float:
    """The smallest x (to rel_tol) with util(x) >= target, util growing with x (the event model is a
    max-plus system: a faster link never delays anything); math.inf when even util(math.inf) is short."""
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    if util(math.inf) < target:
        return math.inf
    while util(hi) < target:
        lo, hi = hi, hi * 1e3
    while util(lo) >= target:
        if lo < 1e-30:  # no link at all would do: nothing is sent
            return 0.0
        lo, hi = lo / 1e3, lo
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if util(mid) < target else (lo, mid)
    return hi


def fragment_values_for(
    params: float, num_fragments: int, layers: int = 0, embedding_params: float = 0, pattern: str = "strided"
) -> tuple[int, ...]:
    """Values per fragment of a model known only by its sizes, split as common/fragments.py splits a real
    one: with layers and P >= 2, P-1 fragments of blocks (layers assigned by `assign_blocks`, each layer
    (params - embedding_params) / layers) and a last fragment of everything else; without layers, P equal
    fragments."""
    if not params > 0:
        raise ValueError(f"params must be positive, got {params}")
    if num_fragments < 1:
        raise ValueError(f"num_fragments (P) must be at least 1, got {num_fragments}")
    if not 0 <= embedding_params < params:
        raise ValueError(f"embedding_params must be in [0, params), got {embedding_params}")
    if layers < 0:
        raise ValueError(f"layers must be >= 0 (0: equal fragments), got {layers}")
    if not layers or num_fragments == 1:
        return tuple(round(params / num_fragments) for _ in range(num_fragments))
    per_layer = (params - embedding_params) / layers
    groups = assign_blocks(layers, num_fragments - 1, pattern)
    return tuple(round(per_layer * len(g)) for g in groups) + (round(embedding_params),)
