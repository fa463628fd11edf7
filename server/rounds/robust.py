"""What a shard does not take on trust: the weight a worker reports with its push, the size of its outer
gradient, and how one round's pushes are combined. Pure: numbers and tensors in, decisions out; ShardState
applies them, on the shard and in the simulator alike.

A worker's weight is the tokens it trained on since its last sync of the fragment, and its push is the
outer gradient of those steps. Nothing stops a worker with the run's credentials from reporting 2^53 tokens
or pushing 1e30 (either alone took the model). So, per fragment slice and round:

- weights are cut to `max_weight` (the tokens one worker can process between two syncs, when the operator
  knows it: batch x context x H), and to `weight_cap` times the median of the weights of this round (and,
  when it has fewer than 3 pushes, of the `history_rounds` rounds before it), unless two or more pushes
  came and their weights are all alike (a cut would change no push's share). Honest workers of one run
  report the same weight, so this changes nothing for them; one attacker among M takes at most
  weight_cap / (weight_cap + M - 1) of the mean. The median of exactly two values is the lower one: one of
  two may be the liar, and their mean is half its own claim. With --trust-speed, under the adaptive
  schedule, each push's cap stretches by its own k, the inner steps per schedule step of a worker of its
  reported speed (server/rounds/defenses.py);
- each push's L2 norm (over the shard's slice, measured as its chunks arrive) is clipped to `clip_norm` times
  the median of the norms of this round's pushes and of the `history_rounds` rounds before (times its own k
  squared, at most max_steps_per_tick, with --trust-speed). Clipping scales the push down, direction kept:
  the worker stays a contributor and nothing is refused. A round with no history leans on its own median,
  which holds while honest pushes are the majority; the history covers rounds with one or two pushes. The
  history keeps of each round of two or more contributors only the lower half of its weights and norms (as
  used: clipped ones at their bound), and nothing of a round of one (nothing checked its values), so a liar
  cannot feed it: with two pushes a round, a norm kept at each round's bound would otherwise raise the next
  round's bound by itself, round after round. One round of history (the default) never clips honest pushes
  that grow from one round to the next, as they do under a learning-rate warm-up: the history's values all lie
  below this round's, so the median is at least this round's lower quartile, and twice it is at least the
  largest while this round's norms are within 2x of each other;
- the pushes are combined by the weighted mean (the default: streaming, folded block by block), or, as
  options, the coordinate-wise trimmed mean or centered clipping (Karimireddy, He, Jaggi 2021, "Learning
  from History for Byzantine Robust Optimization"), which need every push of the round at once.

With a sparse uplink codec (top-k: each push sends K of every C values, the rest zeros) the weight cap and
the norm clip keep their meaning (a push's weight is one number whatever its codec, and its norm is that of
the values it sent, codecs.sumsq), and so does the mean; centered clipping measures each push's distance
from a center that is the union of the pushes (about the push's own norm where their supports overlap
little), so it acts as a second norm clip. The trimmed mean does not: at a coordinate most pushes are
zeros, and trimming drops the one or two values sent, so a shard refuses that combination at its start
(RobustConfig.check_codec).

Medians are of a handful of scalars per round; the per-value work (norms, folds, the options' passes) is
vectorized and linear in the values.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from streamdiloco.common.codecspec import lookup_codec
from streamdiloco.common.progress import MAX_REPORTED_LOSS

# torch is imported where it is used: `streamdiloco SUB --help` reads RobustConfig without it
if TYPE_CHECKING:
    import torch

AGGREGATORS = ("mean", "trimmed", "centered-clip")
MIN_WEIGHT = 1.0  # a push stands for at least one token: below that it counts toward a quorum with nothing
# The reported training loss is a cross-entropy: a negative one, or one beyond this, is not a measurement
# (the one bound of a reported loss, common/progress.py's)
MAX_LOSS = MAX_REPORTED_LOSS


@dataclass(frozen=True)
class RobustConfig:
    """The shard's defenses against workers it cannot trust (the CLI's flags are made from these fields)."""

    aggregator: str = field(
        default="mean",
        metadata={
            "choices": AGGREGATORS,
            "help": "how a round's pushes are combined: the weighted mean (streaming, memory does not grow "
            "with the workers), the coordinate-wise trimmed mean, or centered clipping (both keep every "
            "push of a round until it closes)",
        },
    )
    weight_cap: float = field(
        default=1.0,
        metadata={
            "help": "a push's weight is cut to this multiple of the median weight of the round and the "
            "recent rounds (honest workers of one run report the same tokens: 1 counts a liar as one "
            "typical worker); 0: no cap",
        },
    )
    max_weight: float = field(
        default=0.0,
        metadata={
            "help": "tokens one worker can process between two syncs of a fragment (batch x context x H), "
            "if known: weights above it are cut to it; 0: unknown (`launch` sets it)",
        },
    )
    clip_norm: float = field(
        default=2.0,
        metadata={
            "help": "a push's norm (over this shard's slice) is clipped to this multiple of the median norm "
            "of the round's pushes and the recent rounds'; 0: no clipping",
        },
    )
    history_rounds: int = field(
        default=1,
        metadata={"help": "recent rounds of each fragment whose weights and norms join the medians"},
    )
    trust_speed: bool = field(
        default=False,
        metadata={
            "help": "--sync-schedule adaptive: stretch a push's weight cap by its site's speed over the pace "
            "(k, from the step time the worker reports) and its norm clip by k^2, as an honest site k times "
            "faster needs; a worker's word, so only for a run whose workers are all trusted (`launch` turns "
            "it on); off: every push is held to the same bounds",
        },
    )
    trim: float = field(
        default=0.25,
        metadata={
            "help": "--aggregator trimmed: the fraction of values cut at each end, per coordinate (at most "
            "what leaves one value)",
        },
    )
    center_iters: int = field(
        default=3, metadata={"help": "--aggregator centered-clip: clipping iterations around the mean"}
    )

    def __post_init__(self) -> None:
        if self.aggregator not in AGGREGATORS:
            choose = ", ".join(AGGREGATORS)
            raise ValueError(f"unknown --aggregator {self.aggregator!r}: choose one of {choose}")
        for name in ("weight_cap", "clip_norm"):
            v = getattr(self, name)
            if not (v == 0 or 1 <= v < math.inf):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be 0 (off) or a finite multiple of at least 1, got {v}")
        if not (self.max_weight == 0 or MIN_WEIGHT <= self.max_weight < math.inf):
            raise ValueError(f"--max-weight must be 0 (unknown) or at least 1 token, got {self.max_weight}")
        if not 0 <= self.history_rounds <= 1000:
            raise ValueError(f"--history-rounds must be 0..1000, got {self.history_rounds}")
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"--trim must be in [0, 0.5), got {self.trim}")
        if not 1 <= self.center_iters <= 100:
            raise ValueError(f"--center-iters must be 1..100, got {self.center_iters}")

    def check_codec(self, uplink_codec: str) -> None:
        """ValueError (one line) when the aggregator makes no sense with the uplink codec: the trimmed mean
        of sparse pushes (top-k) trims, at each coordinate, the one or two pushes that sent it among the
        zeros of all the others, and so drops the values the round has."""
        if self.aggregator == "trimmed" and lookup_codec(uplink_codec).sparse:
            raise ValueError(
                f"--aggregator trimmed does not go with the sparse uplink codec {uplink_codec}: a "
                "coordinate's trimmed mean over pushes that are mostly zeros drops the few values sent; "
                "use mean or centered-clip"
            )

    @classmethod
    def off(cls) -> RobustConfig:
        """No defenses: every push's weight and size taken as reported (the plain weighted mean)."""
        return cls(weight_cap=0.0, clip_norm=0.0)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def median(values: Sequence[float]) -> float | None:
    """The median (the mean of the middle two for an even count; of exactly two, the lower one: either may
    be a liar's, and their mean is half the liar's), or None for no values."""
    if len(values) == 2:
        return min(values)
    return statistics.median(values) if values else None


def cap_weights(
    weights: Sequence[float], pool: Sequence[float], factor: float, stretch: Sequence[float] | None = None
) -> list[float]:
    """Each weight cut to `factor` times the median of `pool` (the weights the cap is relative to), times
    its own `stretch` where given (a site k times as fast trains k times the tokens:
    server/rounds/defenses.py); unchanged when factor is 0 or the pool is empty."""
    ref = median(pool)
    if not factor or ref is None:
        return list(weights)
    cap = factor * ref
    k = stretch if stretch is not None else [1.0] * len(weights)
    return [min(w, cap * s) for w, s in zip(weights, k, strict=True)]


def clip_scales(
    norms: Sequence[float], pool: Sequence[float], factor: float, stretch: Sequence[float] | None = None
) -> tuple[list[float], float]:
    """The factor each push is scaled by so that its norm is at most `factor` times the median of `pool`
    (times its own `stretch` where given), and that bound before the stretch (inf when there is none: factor
    0 or an empty pool)."""
    ref = median(pool)
    if not factor or ref is None:
        return [1.0] * len(norms), math.inf
    bound = factor * ref
    k = stretch if stretch is not None else [1.0] * len(norms)
    return [bound * s / n if n > bound * s else 1.0 for n, s in zip(norms, k, strict=True)], bound


def lower_half(values: Sequence[float]) -> list[float]:
    """The values at or below their median, in their order: what a round leaves to the next rounds' medians.
    A push can only add to it by being no larger than the round's median, so it can tighten the next rounds'
    bounds but never loosen them (with the values above the median kept, a liar whose norm sits at each
    round's bound raises the next round's bound by its own clipped norm: the clip ratchets up)."""
    ref = median(values)
    return [] if ref is None else [v for v in values if v <= ref]


def trim_count(k: int, trim: float) -> int:
    """Values cut at each end of a coordinate's k values: floor(trim * k), leaving at least one."""
    return min(int(trim * k), (k - 1) // 2)


# read(i, lo, hi, out): out (fp32, hi - lo values) = push i's values [lo, hi), as scaled by its clipping
Reader = Callable[[int, int, int, "torch.Tensor"], None]


def trimmed_mean(n: int, k: int, read: Reader, trim: float, out: torch.Tensor, step: int) -> None:
    """out = the coordinate-wise trimmed mean of k pushes of n values: per value, the trim_count largest and
    smallest are dropped and the rest averaged (in fp64, rounded once; every push counts the same). Blocks of
    `step` values, so that the k x step block stays in cache."""
    import torch

    b = trim_count(k, trim)
    block = torch.empty(k, min(step, n), dtype=torch.float32)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        x = block[:, : hi - lo]
        for i in range(k):
            read(i, lo, hi, x[i])
        xd = x.to(torch.float64)
        total = xd.sum(dim=0)
        if b:  # the sum less the b largest and the b smallest: O(k b) per value, no sort
            total -= xd.topk(b, dim=0).values.sum(dim=0)
            total += xd.neg_().topk(b, dim=0).values.sum(dim=0)
        out[lo:hi].copy_(total.div_(k - 2 * b))


def centered_clip(
    n: int, k: int, read: Reader, weights: Sequence[float], iters: int, v: torch.Tensor, step: int
) -> list[float]:
    """Centered clipping, in place on v (fp32, n values: the starting point, say the clipped weighted mean):
    `iters` times, v <- v + sum_i w_i c_i (x_i - v) / sum_i w_i with c_i = min(1, tau / ||x_i - v||) and tau
    the median of those distances, so a push far from the center pulls on it no harder than a typical one.
    Returns the last iteration's distances."""
    import torch

    total = float(sum(weights))
    block = torch.empty(min(step, n), dtype=torch.float32)
    dist: list[float] = [0.0] * k
    for _ in range(iters):
        sq = [0.0] * k
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            x, c = block[: hi - lo], v[lo:hi]
            for i in range(k):
                read(i, lo, hi, x)
                sq[i] += float(torch.sub(x, c).to(torch.float64).square().sum())
        dist = [math.sqrt(s) for s in sq]
        tau = median(dist) or 0.0
        coef = [w * (min(1.0, tau / d) if d > 0 else 1.0) / total for w, d in zip(weights, dist, strict=True)]
        keep = 1.0 - sum(coef)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            x, c = block[: hi - lo], v[lo:hi]
            acc = c.to(torch.float64).mul_(keep)
            for i in range(k):
                read(i, lo, hi, x)
                acc.add_(x.to(torch.float64), alpha=coef[i])
            c.copy_(acc)
    return dist
