"""A shard's rounds as records, and the arithmetic jobs that fold and close them: split from
server/rounds/state.py (ShardState, which owns the rounds and hands these jobs out) by job. A `FoldJob` folds
a group of a round's pushes into its fp64 sum ahead of the close; a `CloseJob` folds the rest, takes the
outer step, and encodes the update. Both own what they were handed (the pushes, the fragment's optimizer)
until ShardState takes them back, so they may run on another thread (server/runner.py runs them on its
pool). Pure: no networking, no files, no clocks.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from streamdiloco.common.chunks import Assembly
from streamdiloco.common.codecs import Encoded, divide_into, encode, in_parallel
from streamdiloco.common.outer import OuterOptimizer
from streamdiloco.server.rounds.robust import centered_clip, trimmed_mean

# Values per block when folding pushes into a mean: the block's fp64 sum (512 KiB) stays in a core's L2.
FOLD_VALUES = 1 << 16


@dataclass
class Push:
    """A whole push, still encoded."""

    worker: str
    weight: float  # as reported (cut to --max-weight)
    asm: Assembly
    norm: float = 0.0  # L2 norm of its values over the slice (measured when clipping is on)
    share: float = 0.0  # its weight in the mean, once settled (capped)
    scale: float = 1.0  # what clipping scales its values by
    mult: float = 0.0  # what its values are multiplied by in the sum: share * scale
    loss: float | None = None  # the training loss it reported
    step_seconds: float | None = None  # the worker's seconds per inner step, as its header reported
    # once settled: what the contribution credits and later quorums count it with (capped like `share`, never
    # stretched; one token for a lone push nothing could check: server/rounds/defenses.py)
    credited: float = 0.0

    def __post_init__(self) -> None:
        if not self.share:  # not settled yet: as reported
            self.share = self.mult = self.weight


@dataclass
class OpenRound:
    number: int
    kept: list[Push] = field(default_factory=list)  # whole pushes, not yet folded
    kept_bytes: int = 0
    groups: list[list[Push]] = field(default_factory=list)  # to fold into `partial`, in this order
    partial: torch.Tensor | None = None  # fp64 sum of weight * delta of the groups folded so far
    weight: float = 0.0
    contributors: set[str] = field(default_factory=set)
    weights: list[float] = field(default_factory=list)  # every whole push's reported weight, and norm:
    norms: list[float] = field(default_factory=list)  # what caps and clips are relative to (and history)
    settled: float = 0.0  # the sum of the shares of the pushes settled so far (the mean's divisor)
    counted: float = 0.0  # and of what they count with in the quorum (Push.credited)
    used_norms: list[float] = field(default_factory=list)  # their norms as used (clipped ones at the bound)
    clipped: list[str] = field(default_factory=list)  # workers whose push was clipped, or weight capped
    capped: list[str] = field(default_factory=list)
    loss_sum: float = 0.0  # token-weighted (by share) sum of the inner losses of the pushes settled so far
    loss_weight: float = 0.0
    expected: frozenset[str] | None = None  # members present when the round's first push was complete
    started_at: float | None = None  # when that was (the round's duration, as the dashboard shows it)
    opened_at: float | None = (
        None  # when the round opened (the last one closed): its deadlines count from here
    )
    quorum_at: float | None = None  # when its pushes first held the quorum of the expected weight

    def add(self, push: Push, nbytes: int) -> None:
        """A whole push (of `nbytes` encoded) joins the round, kept until it is folded."""
        self.kept.append(push)
        self.kept_bytes += nbytes
        self.weights.append(push.weight)
        self.norms.append(push.norm)
        self.weight += push.weight
        self.contributors.add(push.worker)

    def start(self, now: float, expected: frozenset[str]) -> None:
        """The round starts with its first whole push (at `now`): who it expects is fixed now."""
        self.started_at = now
        if self.opened_at is None:  # open since the shard started (or was restored): its members may need H
            self.opened_at = now  # steps to their first push, so its deadlines count from that push
        self.expected = expected

    def group(self) -> list[Push]:
        """The kept pushes become a group to fold, in the order of the workers' names."""
        group = ordered(self.kept)
        self.groups.append(group)
        self.kept, self.kept_bytes = [], 0
        return group

    def closing(self, why: str, aggregator: tuple[str, float, int], history: dict) -> ClosingRound:
        """The round as it closes (its kept pushes settled): what its close job folds and steps with."""
        return ClosingRound(
            number=self.number,
            why=why,
            pushes=[p for g in self.groups for p in g] + ordered(self.kept),
            partial=self.partial,
            weight=self.settled,
            contributors=tuple(sorted(self.contributors)),
            mean_loss=self.loss_sum / self.loss_weight if self.loss_weight else None,
            aggregator=aggregator,
            history=history,
            clipped=tuple(sorted(self.clipped)),
            capped=tuple(sorted(self.capped)),
        )


@dataclass
class Staged:
    """A push whose chunks are arriving: validated pieces, not yet in the round."""

    round: int
    weight: float
    loss: float | None
    asm: Assembly
    sumsq: float = 0.0  # of the values so far (when clipping is on)
    step_seconds: float | None = None  # the worker's seconds per inner step, as the header reported


@dataclass(frozen=True)
class ClosedRound:
    fragment: int
    round: int
    update: Encoded  # the quantized update u_hat, as it goes to every worker
    contributors: tuple[str, ...]
    weight: float
    mean_loss: float | None
    why: str = "all"  # all: every expected member pushed; quorum: a quorum of the expected weight, and the
    # grace after it passed; deadline: a quorum, at --round-timeout after the round opened; overdue: without
    # a quorum, long after the pace says it should have had one; empty: no expected member is left;
    # nonfinite: the step came out non-finite and was undone (a zero update)
    clipped: tuple[str, ...] = ()  # workers whose push was scaled down to the norm bound
    capped: tuple[str, ...] = ()  # workers whose weight was cut


def ordered(pushes: list[Push]) -> list[Push]:
    return sorted(pushes, key=lambda p: p.worker)  # a worker pushes once per round: names are unique


def _fold_block(
    pushes: list[Push], start: torch.Tensor | None, divisor: float, lo: int, out: torch.Tensor
) -> None:
    """out = (start + sum of weight * values over `pushes`, in this order) / divisor for values [lo, lo +
    out.numel()), summed in fp64 (out: fp32 or fp64; the division is rounded once)."""
    acc = out if out.dtype == torch.float64 else _scratch(out.numel())
    if start is not None:
        acc.copy_(start[lo : lo + out.numel()])
    elif not pushes:
        acc.zero_()
    for i, p in enumerate(pushes):
        p.asm.accumulate_into(acc, p.mult, lo, overwrite=start is None and i == 0)  # 0 + w * x, no zeroing
    if divisor != 1.0 or acc is not out:
        divide_into(acc, divisor, out)  # x / 1 is x: the same values as a copy


def checked_history(saved: object, rounds: bool = True) -> dict | None:
    """Weights and norms as a checkpoint keeps them ({"weights": [...], "norms": [...]}: lists of rounds'
    lists when `rounds`, else one round's lists), checked: finite and not negative. None if malformed."""

    def ok(xs: object) -> bool:
        return isinstance(xs, list) and all(
            isinstance(x, float | int) and not isinstance(x, bool) and 0 <= x < math.inf for x in xs
        )

    if not isinstance(saved, dict) or set(saved) != {"weights", "norms"}:
        return None
    out = {}
    for key, value in saved.items():
        lists = value if rounds else [value]
        if not (isinstance(lists, list) and all(ok(xs) for xs in lists)):
            return None
        clean = [[float(x) for x in xs] for xs in lists]
        out[key] = clean if rounds else clean[0]
    return out


def _finite(t: torch.Tensor) -> bool:
    return t.numel() == 0 or all(bool(torch.isfinite(x)) for x in torch.aminmax(t))  # NaN propagates


_SCRATCH = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """A thread's fp64 fold buffer of n values (kept: a fresh 512 KiB each block costs its page faults)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH.buf = torch.empty(max(n, FOLD_VALUES), dtype=torch.float64)
    return buf[:n]


def _fold_values(pushes: list[Push]) -> int:
    """Values per fold block: FOLD_VALUES, a multiple of every push's chunk alignment."""
    align = max([p.asm.align for p in pushes] + [1])
    return max(align, FOLD_VALUES // align * align)


def fold(
    n: int, pushes: list[Push], out: torch.Tensor, start: torch.Tensor | None, divisor: float = 1.0
) -> None:
    """out = (start + sum of weight * values over `pushes`, in this order) / divisor, computed in fp64 one
    block of values at a time (out may be start itself). Large slices are folded by the codec threads, each
    on its own range of blocks (the values do not depend on the split)."""
    step = _fold_values(pushes)

    def run(a: int, b: int) -> None:
        for lo in range(a, b, step):
            _fold_block(pushes, start, divisor, lo, out[lo : min(b, lo + step)])

    in_parallel(n, step, run)


@dataclass
class FoldJob:
    """Groups of a round's pushes to fold into its fp64 sum ahead of the close (memory bound)."""

    fragment: int
    round: int
    n: int
    groups: list[list[Push]]
    partial: torch.Tensor | None

    def run(self) -> FoldJob:
        if self.partial is None:
            self.partial = torch.zeros(self.n, dtype=torch.float64)
        for group in self.groups:
            fold(self.n, group, self.partial, self.partial)
        return self


@dataclass
class ClosingRound:
    """A round as it closes: the pushes its close folds (those not folded ahead) and what it steps with, as
    its log keeps them (CloseJob.record; server/rounds/records.py's `checked_round` reads a log back into
    one)."""

    number: int
    why: str  # ClosedRound.why; the close job may turn it into "nonfinite"
    pushes: list[Push]  # groups not folded yet, then the kept pushes, in folding order
    partial: torch.Tensor | None  # fp64 sum of the groups folded ahead of the close
    weight: float  # the sum of the pushes' shares: the mean's divisor
    contributors: tuple[str, ...]
    mean_loss: float | None
    aggregator: tuple[str, float, int] = ("mean", 0.0, 1)  # name, trim, centered-clip iterations
    history: dict = field(default_factory=dict)  # the round's weights and used norms (what medians keep)
    clipped: tuple[str, ...] = ()  # workers whose push was clipped, or weight capped (none in a replay)
    capped: tuple[str, ...] = ()


@dataclass
class CloseJob:
    """A closed round's arithmetic: the weighted mean of its pushes, the outer step, the encoded update.
    Holds everything it needs (the round, the fragment's optimizer): `run` may go on another thread while
    the shard takes other pushes."""

    fragment: int
    opt: OuterOptimizer  # the fragment's, the job's until ShardState takes it back
    saved: dict  # what a checkpoint keeps of the fragment, less the optimizer's state (after `run`)
    closing: ClosingRound
    # worker -> what its pushes in the round are credited with (Push.credited: the share, bounded, never
    # stretched), those folded ahead included (`credit`: the contribution credits' tokens, logged with the
    # round)
    tokens: dict[str, float] = field(default_factory=dict)
    update: Encoded | None = None

    def credit(self, folded: dict[str, float]) -> None:
        """The tokens the round credits per worker: the credits of its pushes that fold jobs took out of it
        while it was open (`folded`), and those of the pushes it closes with (settled now)."""
        self.tokens = dict(folded)
        for p in self.pushes:
            self.tokens[p.worker] = self.tokens.get(p.worker, 0.0) + p.credited

    @property
    def round(self) -> int:
        return self.closing.number

    @property
    def pushes(self) -> list[Push]:
        return self.closing.pushes

    def run(self) -> CloseJob:
        c, opt = self.closing, self.opt
        old = opt.master
        if (
            c.weight > 0
            and c.partial is not None
            and not all(torch.isfinite(x) for x in torch.aminmax(c.partial))
        ):
            # cannot happen: validated pushes (bounded values and weights) have a finite fp64 sum, and so a
            # finite mean; the caller logs it
            c.why = "nonfinite"
        elif c.weight > 0:
            try:
                self.update = self._step(c)
            except ValueError:  # the step met non-finite values (it may have written part of its state)
                self.update = None
            if self.update is None or not _finite(opt.master):
                # no NaN or inf may reach a worker: the round's update is not applied, and the optimizer
                # starts again from the master before it (the caller logs it loudly)
                opt.restart(old)
                self.update, c.why = None, "nonfinite"
        if self.update is None:  # nobody pushed (or the step was not finite): a zero update; nobody waits
            c.mean_loss = None
            self.update = encode(torch.zeros_like(opt.master), opt.codec, opt.block_size)
        c.pushes, c.partial = [], None  # let the pushes' bytes go
        return self

    def _step(self, c: ClosingRound) -> Encoded:
        pushes, partial, weight, n = c.pushes, c.partial, c.weight, self.opt.master.numel()
        name, trim, iters = c.aggregator
        if name == "mean":
            # the mean is folded block by block and each block stepped while it is in cache (on the CPU)
            def fill(lo: int, hi: int, out: torch.Tensor) -> None:
                _fold_block(pushes, partial, weight, lo, out)

            return self.opt.step_from(fill, _fold_values(pushes))

        def read(i: int, lo: int, hi: int, out: torch.Tensor) -> None:
            p = pushes[i]
            p.asm.decode_into(out, lo)
            if p.scale != 1.0:
                out.mul_(p.scale)

        # the options need every push at once (no groups were folded ahead): the whole gradient is built
        g, step = self.opt.gradient_buffer(), _fold_values(pushes)
        if name == "trimmed":
            trimmed_mean(n, len(pushes), read, trim, g, step)
        else:  # centered clipping, from the clipped weighted mean
            fold(n, pushes, g, None, weight)
            centered_clip(n, len(pushes), read, [p.share for p in pushes], iters, g, step)
        return self.opt.step(g)[0]

    def closed(self) -> ClosedRound:
        """The round as it closed (call after `run`)."""
        assert self.update is not None, "the close job has not run"
        c = self.closing
        return ClosedRound(
            fragment=self.fragment,
            round=c.number,
            update=self.update,
            contributors=c.contributors,
            weight=c.weight,
            mean_loss=c.mean_loss,
            why=c.why,
            clipped=c.clipped,
            capped=c.capped,
        )

    def fragment_state(self) -> dict:
        """The fragment as a checkpoint keeps it once the round has closed (call after `run`)."""
        return {**self.saved, "outer": self.opt.state_dict()}

    def record(self) -> dict:
        """The round's inputs, as a checkpoint logs them (call before `run`, which lets the pushes go):
        replayed on the fragment's state before the round (ShardState.replay_round) they give the state
        after it bit for bit. The pushes stay encoded: about 0.53 bytes per value and push for E3M0."""
        c = self.closing
        return {
            "round": c.number,
            "why": c.why,
            "weight": c.weight,
            "contributors": list(c.contributors),
            "mean_loss": c.mean_loss,
            "partial": c.partial,
            "aggregator": list(c.aggregator),
            "history": c.history,
            "credit": {"tokens": self.tokens, "clipped": list(c.clipped), "capped": list(c.capped)},
            "pushes": [
                {
                    "worker": p.worker,
                    "weight": p.weight,
                    "share": p.share,
                    "scale": p.scale,
                    "mult": p.mult,
                    "parts": [
                        {
                            "offset": offset,
                            "codec": e.codec,
                            "numel": e.numel,
                            "block_size": e.block_size,
                            "payload": e.payload,
                            "scales": e.scales,
                        }
                        for offset, e in p.asm.parts
                    ],
                }
                for p in c.pushes
            ],
        }
