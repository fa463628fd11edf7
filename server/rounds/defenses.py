"""The robust checks of a shard's pushes, per fragment slice: the reported weight cut to --max-weight, and,
when a push is handed to a fold, its share (capped weight) and clipping scale settled against the medians
of the round's and the recent rounds' weights and norms (server/rounds/robust.py's rules). The recent rounds
are this module's one truth: checkpointed with the fragment and logged with each round, so that a restart goes
on bit for bit; a round leaves them only the lower half of its weights and norms (server/rounds/robust.py's
`lower_half`), which a liar can only tighten, and a round of one contributor leaves nothing (nothing
checked its values: a lone liar cannot seed them).

Each push settles with two numbers (issue 37): its `share` in the mean, and what it is `credited` with in
the contribution credits and counted with in later quorums: the same cap, never stretched. A lone push
with nothing to compare it with (no history yet) keeps its weight in the mean (a mean of one push is that
push, whatever its weight) and is credited --max-weight if set, else one token (MIN_WEIGHT): nothing
vouched for more.

Under the adaptive schedule a worker k times faster than the run's pace trains k inner steps per schedule
step (common/pace.py), and its push carries k times the tokens and a larger update. With --trust-speed
(`launch`'s runs, whose workers are the operator's own) each push's caps and clip stretch by its own k,
from the step time it reported and the pace when it is settled (the clip by k^2, at most
max_steps_per_tick: a faster site's update grows faster than its tokens). Off (the default, a shard facing
the internet), a step time is a worker's word and buys nothing: every push is held to the same bounds
(a liar claiming 1e-6 s got 4x the weight and 4x the norm).

Split from server/rounds/state.py (ShardState, which owns the rounds and asks this class) by job. Pure:
numbers in, decisions out; what it must not do: refuse a push (the header checks are
server/rounds/staging.py's), fold or step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.pace import steps_per_tick
from streamdiloco.server.rounds.jobs import OpenRound, Push
from streamdiloco.server.rounds.robust import MIN_WEIGHT, RobustConfig, clip_scales, lower_half, median


@dataclass
class RecentRounds:
    """One fragment's recent closed rounds, each the lower half of its weights and of its used norms: what the
    caps and clips of the fragment's next rounds are relative to. A checkpoint keeps them (`saved`), and a
    round's log its own (`Defenses.closing`), so that a restart goes on bit for bit."""

    weights: deque[list[float]]
    norms: deque[list[float]]

    def remember(self, history: dict) -> None:
        """A closed round's weights and used norms join what later rounds' caps and clips are relative to."""
        if history["weights"]:
            self.weights.append(list(history["weights"]))
        if history["norms"]:
            self.norms.append(list(history["norms"]))

    def saved(self) -> dict:
        """The recent rounds, as a checkpoint keeps them."""
        return {"weights": [list(ws) for ws in self.weights], "norms": [list(xs) for xs in self.norms]}


class Defenses:
    """Weight caps and norm clips of one shard's pushes (each fragment's recent rounds: `RecentRounds`)."""

    def __init__(self, robust: RobustConfig, cfg: SyncConfig):
        self.robust, self.cfg = robust, cfg
        self.pushes_clipped = 0  # pushes scaled down to the norm bound
        self.weights_capped = 0  # pushes whose weight was cut (to --max-weight or the median's multiple)

    def recent(self, history: dict | None = None) -> RecentRounds:
        """A fragment's recent rounds: none yet, or a checkpoint's (checked) history of them."""
        keep = self.robust.history_rounds
        if history is None:
            return RecentRounds(deque(maxlen=keep), deque(maxlen=keep))
        return RecentRounds(deque(history["weights"], maxlen=keep), deque(history["norms"], maxlen=keep))

    @property
    def measures_norms(self) -> bool:
        """Whether pushes' norms are measured as their chunks arrive (clipping is on)."""
        return bool(self.robust.clip_norm)

    @property
    def folds_early(self) -> bool:
        """Whether a round's pushes may be folded ahead of its close (the other aggregators need every push
        of a round at the close)."""
        return self.robust.aggregator == "mean"

    @property
    def aggregator(self) -> tuple[str, float, int]:
        rob = self.robust
        return (rob.aggregator, rob.trim, rob.center_iters)

    def stretch(self, pace: float, step_seconds: float | None) -> float:
        """How far a push's bounds stretch: with --trust-speed, the inner steps per schedule step of a worker
        that reported `step_seconds` in a run at `pace` (1 with the fixed schedule, or while either is
        unknown); without it, 1 (a step time is the worker's word)."""
        if not self.robust.trust_speed:
            return 1.0
        return steps_per_tick(pace, step_seconds, self.cfg)

    def reported(self, weight: float, stretch: float = 1.0) -> float:
        """A push's weight as the round takes it: cut to --max-weight (more tokens than one worker can train
        on between two syncs) times its `stretch`."""
        cap = self.robust.max_weight * stretch
        if cap and weight > cap:
            self.weights_capped += 1
            return cap
        return weight

    def reference(self, recent: RecentRounds, rnd: OpenRound) -> float | None:
        """The median the round's weights are capped relative to: of its reported weights, and the recent
        rounds' when it has fewer than 3 (of exactly two, the lower); None when there is nothing to compare
        with (a lone push, no history)."""
        pool = list(rnd.weights)
        if len(pool) < 3:  # too few for a median that one liar cannot move: the last rounds' too
            pool += [w for ws in recent.weights for w in ws]
        return median(pool) if len(pool) >= 2 else None

    def _alike(self, rnd: OpenRound) -> bool:
        """Whether two or more pushes came and their weights are all alike (honest workers' are, also when
        they have more tokens than the last round's): a cut would change no push's share."""
        return len(rnd.weights) >= 2 and len(set(rnd.weights)) == 1

    def shares(self, recent: RecentRounds, rnd: OpenRound, pushes: list[Push], pace: float) -> list[float]:
        """The weights these pushes of the round count with in the mean: each cut to --weight-cap times its
        stretch times the round's reference median (`reference`); a lone push with no reference keeps its
        weight (a mean of one push is that push whatever its weight)."""
        ref = self.reference(recent, rnd)
        if not self.robust.weight_cap or ref is None or self._alike(rnd):
            return [p.weight for p in pushes]
        cap = self.robust.weight_cap * ref
        return [min(p.weight, cap * self.stretch(pace, p.step_seconds)) for p in pushes]

    def counted(self, recent: RecentRounds, rnd: OpenRound, pushes: list[Push]) -> list[float]:
        """What these pushes are credited with and count with in quorums, never stretched: each cut to
        --weight-cap times the round's reference median, and to --max-weight; a push with no reference to
        --max-weight if set, else to one token (nothing vouched for more)."""
        rob, ref = self.robust, self.reference(recent, rnd)
        if not rob.weight_cap or self._alike(rnd):
            top = rob.max_weight  # the operator's bound only (0: none)
        elif ref is None:
            top = rob.max_weight or MIN_WEIGHT
        else:
            top = min(rob.max_weight, rob.weight_cap * ref) if rob.max_weight else rob.weight_cap * ref
        return [min(p.weight, top) if top else p.weight for p in pushes]

    def in_hand(self, recent: RecentRounds, rnd: OpenRound) -> tuple[float, float | None]:
        """What the round's pushes count with toward its quorum (those settled and those kept: bounded,
        never stretched), and what a waited-for member's last share counts for at most: --weight-cap times
        the round's reference median (None: no cap, or no reference)."""
        pushed = rnd.counted + sum(self.counted(recent, rnd, rnd.kept))
        ref = self.reference(recent, rnd)
        return pushed, self.robust.weight_cap * ref if self.robust.weight_cap and ref is not None else None

    def settle(self, recent: RecentRounds, rnd: OpenRound, pushes: list[Push], pace: float = 0.0) -> None:
        """Fix the share (capped weight), credit (`counted`) and clipping scale of pushes about to be folded,
        relative to the medians of the round's pushes so far and the recent rounds' (scalars: microseconds),
        each stretched by its own k at the run's `pace` (with --trust-speed)."""
        if not pushes:
            return
        shares = self.shares(recent, rnd, pushes, pace)
        credited = self.counted(recent, rnd, pushes)
        norms = rnd.norms + [x for xs in recent.norms for x in xs]
        # a site k times as fast pushes k times the tokens, but its update's norm grows faster than k (5x at
        # k = 2 on the simulator's embeddings): the clip stretches by k^2, at most max_steps_per_tick (what
        # the rule before this one gave every push)
        top = self.cfg.max_steps_per_tick
        stretch = [min(self.stretch(pace, p.step_seconds) ** 2, top) for p in pushes]
        scales, bound = clip_scales([p.norm for p in pushes], norms, self.robust.clip_norm, stretch)
        for p, share, credit, scale, k in zip(pushes, shares, credited, scales, stretch, strict=True):
            p.share, p.scale, p.mult, p.credited = share, scale, share * scale, credit
            rnd.settled += share
            rnd.counted += credit
            if p.loss is not None:
                rnd.loss_sum += p.loss * share
                rnd.loss_weight += share
            rnd.used_norms.append(min(p.norm, bound * k))
            if share < p.weight:
                rnd.capped.append(p.worker)
                self.weights_capped += 1
            if scale < 1.0:
                rnd.clipped.append(p.worker)
                self.pushes_clipped += 1

    def closing(self, rnd: OpenRound) -> dict:
        """What a closing round leaves to later rounds' caps and clips (its log's "history"): nothing from a
        round of one contributor (nothing but the history checked its values: a lone liar must not seed
        what the next rounds are relative to)."""
        if len(rnd.contributors) < 2:
            return {"weights": [], "norms": []}
        norms = rnd.used_norms if self.robust.clip_norm else []
        return {"weights": lower_half(rnd.weights), "norms": lower_half(norms)}
