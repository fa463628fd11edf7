"""A shard's state and aggregation, as pure logic: no networking, no files, no clocks or threads of its own.

Shard s of S owns slice s of every fragment's flat vector. Per fragment it keeps the master slice, the
outer optimizer (Nesterov SGD plus the downlink's error-feedback residual) and the open round.

Pushes arrive in chunks, which one `common.chunks.Assembly` per push validates the moment they arrive and
keeps in their encoded form (4-bit for E3M0). A push that breaks off (its worker died, or a later chunk was
bad) leaves nothing half-applied, and a refused push changes nothing at all. A whole push stays encoded in
the round (a 4-bit push is 1/16 of an fp64 sum's size) until the round closes; then the round's pushes are
folded into the weighted mean block by block (`FOLD_VALUES` values at a time, so that the fp64 sum of a
block stays in cache while every push is added into it), in the order of the workers' names: the mean does
not depend on the order in which pushes arrived, and costs a read of each push's bytes instead of 16 bytes
of memory traffic per value and push. So that memory stays bounded with many workers, once the pushes kept
reach the size of an fp64 sum of the slice they become a group that is folded into the round's fp64 sum
(`partial`) ahead of the close (a fold job); groups are folded in the order they formed, so the result is
the same whenever a fold runs, and depends on arrival order only when there are that many pushes.

What a push's header claims is not taken on trust (server.robust): its weight is capped, its norm over
the slice (measured as its chunks arrive) is clipped against a median of the round's and the recent rounds'
norms, and both are settled when its pushes are handed to a fold: a group's when the group forms, the rest
at the close. The master must come out of every outer step finite: a step that does not is undone (the
round sends a zero update, why "nonfinite") and the outer optimizer starts again from the master before it.

Rounds close when every member that was present when the round started (its first whole push) has pushed,
with at least `min_workers` contributions; or when its deadline has passed with at least `min_workers` (or
with every member's push, when fewer members than `min_workers` are left); or when every expected member
has left. The caller supplies the time (`now`), so tests drive the clock.

The arithmetic (folding, the outer step, encoding the update) is a job that `begin_close` / `begin_fold`
hand out and `end_close` / `end_fold` take back: in between, the job owns the fragment's optimizer and the
pushes it took, so the caller may run it on another thread while it goes on taking pushes; the fragment is
`busy` meanwhile (no second job, and it is not due). `close_round` does all three at once. A master tensor
is never changed in place (a close replaces it), so a reader may keep one while rounds go on.

The gRPC servicer and the in-process simulator both drive this class.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from streamdiloco.common.chunks import MAX_ABS_VALUE, Assembly, ChunkError
from streamdiloco.common.codecs import Encoded, divide_into, encode, in_parallel, sumsq
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, slice_ranges
from streamdiloco.common.outer import OuterOptimizer
from streamdiloco.server.robust import (
    MAX_LOSS,
    MIN_WEIGHT,
    RobustConfig,
    cap_weights,
    centered_clip,
    clip_scales,
    trimmed_mean,
)

__all__ = ["MAX_ABS_VALUE", "MAX_WEIGHT", "ClosedRound", "CloseJob", "FoldJob", "PushRejected", "ShardState"]

# Bounds on what a push may carry, so that no accepted push can make the sum, the mean or the outer step
# overflow: values are bounded by the chunk assembler (MAX_ABS_VALUE); weights are token counts.
MAX_WEIGHT = float(2**53)
# Values per block when folding pushes into a mean: the block's fp64 sum (512 KiB) stays in a core's L2.
FOLD_VALUES = 1 << 16


class PushRejected(ValueError):
    """A push that the shard refuses; nothing in the shard's state changed."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # short machine-readable cause: bad_fragment, late, duplicate, ...


@dataclass
class _Push:
    """A whole push, still encoded."""

    worker: str
    weight: float  # as reported (cut to --max-weight)
    asm: Assembly
    norm: float = 0.0  # L2 norm of its values over the slice (measured when clipping is on)
    share: float = 0.0  # its weight in the mean, once settled (capped)
    scale: float = 1.0  # what clipping scales its values by
    mult: float = 0.0  # what its values are multiplied by in the sum: share * scale
    loss: float | None = None  # the training loss it reported

    def __post_init__(self) -> None:
        if not self.share:  # not settled yet: as reported
            self.share = self.mult = self.weight


@dataclass
class _OpenRound:
    number: int
    kept: list[_Push] = field(default_factory=list)  # whole pushes, not yet folded
    kept_bytes: int = 0
    groups: list[list[_Push]] = field(default_factory=list)  # to fold into `partial`, in this order
    partial: torch.Tensor | None = None  # fp64 sum of weight * delta of the groups folded so far
    weight: float = 0.0
    contributors: set[str] = field(default_factory=set)
    weights: list[float] = field(default_factory=list)  # every whole push's reported weight, and norm:
    norms: list[float] = field(default_factory=list)  # what caps and clips are relative to (and history)
    settled: float = 0.0  # the sum of the shares of the pushes settled so far (the mean's divisor)
    used_norms: list[float] = field(default_factory=list)  # their norms as used (clipped ones at the bound)
    clipped: list[str] = field(default_factory=list)  # workers whose push was clipped, or weight capped
    capped: list[str] = field(default_factory=list)
    loss_sum: float = 0.0  # token-weighted (by share) sum of the inner losses of the pushes settled so far
    loss_weight: float = 0.0
    expected: frozenset[str] | None = None  # members present when the round's first push was complete
    started_at: float | None = None  # when that was: the deadline counts from here


@dataclass
class _Staged:
    """A push whose chunks are arriving: validated pieces, not yet in the round."""

    round: int
    weight: float
    loss: float | None
    asm: Assembly
    sumsq: float = 0.0  # of the values so far (when clipping is on)


@dataclass(frozen=True)
class ClosedRound:
    fragment: int
    round: int
    update: Encoded  # the quantized update u_hat, as it goes to every worker
    contributors: tuple[str, ...]
    weight: float
    mean_loss: float | None
    why: str = "all"  # all: every expected member pushed; deadline; empty: no expected member is left;
    # nonfinite: the step came out non-finite and was undone (a zero update)
    clipped: tuple[str, ...] = ()  # workers whose push was scaled down to the norm bound
    capped: tuple[str, ...] = ()  # workers whose weight was cut


def _ordered(pushes: list[_Push]) -> list[_Push]:
    return sorted(pushes, key=lambda p: p.worker)  # a worker pushes once per round: names are unique


def _fold_block(
    pushes: list[_Push], start: torch.Tensor | None, divisor: float, lo: int, out: torch.Tensor
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


def _history(saved: object, rounds: bool = True) -> dict | None:
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


def _fold_values(pushes: list[_Push]) -> int:
    """Values per fold block: FOLD_VALUES, a multiple of every push's chunk alignment."""
    align = max([p.asm.align for p in pushes] + [1])
    return max(align, FOLD_VALUES // align * align)


def fold(
    n: int, pushes: list[_Push], out: torch.Tensor, start: torch.Tensor | None, divisor: float = 1.0
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
    groups: list[list[_Push]]
    partial: torch.Tensor | None

    def run(self) -> FoldJob:
        if self.partial is None:
            self.partial = torch.zeros(self.n, dtype=torch.float64)
        for group in self.groups:
            fold(self.n, group, self.partial, self.partial)
        return self


@dataclass
class CloseJob:
    """A closed round's arithmetic: the weighted mean of its pushes, the outer step, the encoded update.
    Holds everything it needs: `run` may go on another thread while the shard takes other pushes."""

    fragment: int
    round: int
    why: str
    n: int
    pushes: list[_Push]  # groups not folded yet, then the kept pushes, in folding order
    partial: torch.Tensor | None
    weight: float
    contributors: tuple[str, ...]
    mean_loss: float | None
    opt: OuterOptimizer
    downlink: tuple[str, int]  # codec, block size: the zero update's
    saved: dict  # what a checkpoint keeps of the fragment, less the optimizer's state (after `run`)
    aggregator: tuple[str, float, int] = ("mean", 0.0, 1)  # name, trim, centered-clip iterations
    clipped: tuple[str, ...] = ()
    capped: tuple[str, ...] = ()
    history: dict = field(default_factory=dict)  # the round's weights and used norms (what medians keep)
    update: Encoded | None = None

    def run(self) -> CloseJob:
        partial = self.partial
        old = self.opt.master
        if (
            self.weight > 0
            and partial is not None
            and not all(torch.isfinite(x) for x in torch.aminmax(partial))
        ):
            # cannot happen: validated pushes (bounded values and weights) have a finite fp64 sum, and so a
            # finite mean; the caller logs it
            self.why = "nonfinite"
        elif self.weight > 0:
            try:
                self.update = self._step(partial)
            except ValueError:  # the step met non-finite values (it may have written part of its state)
                self.update = None
            if self.update is None or not _finite(self.opt.master):
                # no NaN or inf may reach a worker: the round's update is not applied, and the optimizer
                # starts again from the master before it (the caller logs it loudly)
                self.opt.restart(old)
                self.update, self.why = None, "nonfinite"
        if self.update is None:  # nobody pushed (or the step was not finite): a zero update; nobody waits
            self.mean_loss = None
            codec, block_size = self.downlink
            self.update = encode(torch.zeros_like(self.opt.master), codec, block_size)
        self.pushes, self.partial = [], None  # let the pushes' bytes go
        return self

    def _step(self, partial: torch.Tensor | None) -> Encoded:
        pushes, weight = self.pushes, self.weight
        name, trim, iters = self.aggregator
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
            trimmed_mean(self.n, len(pushes), read, trim, g, step)
        else:  # centered clipping, from the clipped weighted mean
            fold(self.n, pushes, g, None, weight)
            centered_clip(self.n, len(pushes), read, [p.share for p in pushes], iters, g, step)
        return self.opt.step(g)[0]

    def fragment_state(self) -> dict:
        """The fragment as a checkpoint keeps it once the round has closed (call after `run`)."""
        return {**self.saved, "outer": self.opt.state_dict()}

    def record(self) -> dict:
        """The round's inputs, as a checkpoint logs them (call before `run`, which lets the pushes go):
        replayed on the fragment's state before the round (ShardState.replay_round) they give the state
        after it bit for bit. The pushes stay encoded: about 0.53 bytes per value and push for E3M0."""
        return {
            "round": self.round,
            "why": self.why,
            "weight": self.weight,
            "contributors": list(self.contributors),
            "mean_loss": self.mean_loss,
            "partial": self.partial,
            "aggregator": list(self.aggregator),
            "history": self.history,
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
                for p in self.pushes
            ],
        }


class ShardState:
    def __init__(
        self,
        shard: int,
        num_shards: int,
        layout: FragmentLayout,
        cfg: SyncConfig,
        initial: list[torch.Tensor],
        seed: int = 0,
        min_workers: int = 1,
        round_timeout: float = float("inf"),
        robust: RobustConfig | None = None,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard index {shard} is outside [0, {num_shards - 1}]")
        if len(initial) != layout.num_fragments:
            raise ValueError(f"need {layout.num_fragments} initial fragment vectors, got {len(initial)}")
        if min_workers < 1:
            raise ValueError(f"--min-workers must be at least 1, got {min_workers}")
        if not round_timeout > 0:
            raise ValueError(f"--round-timeout must be positive seconds, got {round_timeout}")
        self.shard, self.num_shards, self.layout, self.cfg = shard, num_shards, layout, cfg
        self.min_workers, self.round_timeout = min_workers, round_timeout
        self.robust = robust if robust is not None else RobustConfig()
        self.ranges = [slice_ranges(f.numel, num_shards)[shard] for f in layout.fragments]
        self.outer: list[OuterOptimizer] = []
        for f, (vec, (lo, hi)) in enumerate(zip(initial, self.ranges, strict=True)):
            if vec.numel() != layout.fragments[f].numel:
                raise ValueError(
                    f"fragment {f}: initial vector has {vec.numel()} values, "
                    f"layout says {layout.fragments[f].numel}"
                )
            self.outer.append(
                OuterOptimizer(
                    vec[lo:hi].to(torch.float32).clone(),
                    lr=cfg.outer_lr,
                    momentum=cfg.outer_momentum,
                    nesterov=cfg.outer_nesterov,
                    downlink_codec=cfg.downlink_codec,
                    block_size=cfg.codec_block_size,
                    rounding=cfg.downlink_rounding,
                    seed=seed * 1_000_003 + shard * 1009 + f,
                )
            )
        self.open = [_OpenRound(0) for _ in range(layout.num_fragments)]
        self.busy: set[int] = set()  # fragments whose fold or close job is out (see begin_close)
        self._masters = [opt.master for opt in self.outer]  # as of the last round closed (never changed)
        self.fold_bytes = [8 * (hi - lo) for lo, hi in self.ranges]  # kept pushes beyond an fp64 sum: fold
        self.members: set[str] = set()
        self.member_from: dict[str, list[int]] = {}  # member -> first round of each fragment it pushes
        # after a restart: the members the checkpoint names, waited for as members until they are back or
        # `returning_until` passes (without them a round could close without a push it had acknowledged)
        self.restored_members: set[str] = set()
        self.returning: set[str] = set()
        self.returning_until: float | None = None
        self.staged: dict[tuple[str, int], _Staged] = {}
        # (worker, fragment or -1) -> (fragment, round) of a push refused before its last chunk
        self.discarding: dict[tuple[str, int], tuple[int, int]] = {}
        self.bytes_received = 0  # codec bytes (payload + scales) of accepted pushes
        self.pushes_accepted = 0
        self.pushes_refused: dict[str, int] = {}  # reason -> count
        self.rounds_closed = 0
        # per fragment, the recent rounds' reported weights and used norms (what caps and clips are relative
        # to); checkpointed with the fragment, and logged with each round, so that a restart goes on the same
        keep = self.robust.history_rounds
        self.weight_history: list[deque[list[float]]] = [deque(maxlen=keep) for _ in self.ranges]
        self.norm_history: list[deque[list[float]]] = [deque(maxlen=keep) for _ in self.ranges]
        self.pushes_clipped = 0  # pushes scaled down to the norm bound
        self.weights_capped = 0  # pushes whose weight was cut (to --max-weight or the median's multiple)

    def master(self, fragment: int) -> torch.Tensor:
        """The fragment's master slice as of its last closed round (a tensor never changed in place)."""
        return self._masters[fragment]

    def sum(self, fragment: int) -> torch.Tensor:
        """The open round's fp64 sum of weight * delta over its whole pushes so far (for tests and checks:
        the round itself keeps the pushes encoded until it closes)."""
        rnd = self.open[fragment]
        lo, hi = self.ranges[fragment]
        out = torch.zeros(hi - lo, dtype=torch.float64)
        pushes = [p for g in rnd.groups for p in _ordered(g)] + _ordered(rnd.kept)
        fold(hi - lo, pushes, out, rnd.partial)
        return out

    def round_of(self, fragment: int) -> int:
        """The number of the round that is open for this fragment."""
        return self.open[fragment].number

    def contributors(self, fragment: int) -> set[str]:
        return set(self.open[fragment].contributors)

    def started(self, fragment: int) -> bool:
        """Whether the open round has had a whole push (it is in progress)."""
        return self.open[fragment].started_at is not None

    # --- checkpoints -----------------------------------------------------------------------------------
    def fragment_state(self, fragment: int) -> dict:
        """What a checkpoint keeps of a fragment: the open round's number and the outer optimizer (master,
        momentum, error-feedback residual, rounding generator). The open round's pushes are not kept."""
        if fragment in self.busy:
            raise RuntimeError(f"fragment {fragment} is being closed: its state is the close job's")
        return {
            **self._saved(fragment, self.open[fragment].number),
            "outer": self.outer[fragment].state_dict(),
        }

    def _saved(self, fragment: int, round: int) -> dict:
        return {
            "fragment": fragment,
            "slice": list(self.ranges[fragment]),
            "round": round,
            "members": sorted(self.members | self.returning),
            # what the caps and clips of the next rounds are relative to: a restart goes on bit for bit
            "history": {
                "weights": [list(ws) for ws in self.weight_history[fragment]],
                "norms": [list(xs) for xs in self.norm_history[fragment]],
            },
        }

    def load_fragment_state(self, fragment: int, saved: object) -> None:
        """Restore a fragment from `fragment_state`'s dict; ValueError, with nothing changed, if it does not
        fit this shard's slice of the fragment."""
        if not isinstance(saved, dict) or not isinstance(saved.get("outer"), dict):
            raise ValueError(f"checkpoint of fragment {fragment} is not a fragment's state")
        if saved.get("fragment") != fragment or list(saved.get("slice", [])) != list(self.ranges[fragment]):
            raise ValueError(
                f"checkpoint of fragment {saved.get('fragment')} slice {saved.get('slice')} does not fit "
                f"fragment {fragment} slice {list(self.ranges[fragment])}"
            )
        lo, hi = self.ranges[fragment]
        outer = saved["outer"]
        try:
            tensors = [("master", outer["master"]), ("residual", outer["residual"])]
            for s in outer["sgd"]["state"].values():
                if s.get("momentum_buffer") is not None:
                    tensors.append(("momentum", s["momentum_buffer"]))
            rnd = int(saved["round"])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(
                f"checkpoint of fragment {fragment} is incomplete ({type(e).__name__}: {e})"
            ) from None
        for name, t in tensors:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (hi - lo,):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"checkpoint of fragment {fragment} holds a {name} of {got}, want ({hi - lo},)"
                )
        if rnd < 0:
            raise ValueError(f"checkpoint of fragment {fragment} has round {rnd}")
        members = saved.get("members", [])
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ValueError(f"checkpoint of fragment {fragment} has a malformed member list")
        history = _history(saved.get("history", {"weights": [], "norms": []}))
        if history is None:
            raise ValueError(f"checkpoint of fragment {fragment} has a malformed history of weights, norms")
        if fragment in self.busy:
            raise RuntimeError(f"fragment {fragment} is being closed: cannot load its state now")
        self.outer[fragment].load_state_dict(outer)
        self._masters[fragment] = self.outer[fragment].master
        self.open[fragment] = _OpenRound(rnd)
        self.restored_members.update(members)
        keep = self.robust.history_rounds
        self.weight_history[fragment] = deque(history["weights"], maxlen=keep)
        self.norm_history[fragment] = deque(history["norms"], maxlen=keep)

    def expect_back(self, until: float) -> None:
        """After a restart: wait for the checkpoint's members as if they were here, until `until`."""
        self.returning = set(self.restored_members) - self.members
        self.returning_until = until if self.returning else None

    # --- members ---------------------------------------------------------------------------------------
    def add_member(self, worker: str, from_rounds: list[int] | None = None) -> None:
        """Rounds that start from now on wait for this worker; with `from_rounds`, only rounds
        >= from_rounds[fragment] (a worker that joins a run in progress skips the rounds before)."""
        if from_rounds is not None and len(from_rounds) != self.layout.num_fragments:
            raise ValueError(
                f"from_rounds has {len(from_rounds)} entries, this run {self.layout.num_fragments}"
            )
        self.members.add(worker)
        self.returning.discard(worker)
        if from_rounds is not None:
            self.member_from[worker] = list(from_rounds)
        else:
            self.member_from.pop(worker, None)

    def _expected(self, fragment: int, number: int) -> frozenset[str]:
        here = frozenset(
            m for m in self.members if m not in self.member_from or self.member_from[m][fragment] <= number
        )
        return here | self.returning

    def remove_member(self, worker: str) -> None:
        """The worker's session ended: it leaves, and any push it had half-sent is dropped."""
        self.members.discard(worker)
        self.member_from.pop(worker, None)
        for key in [k for k in self.staged if k[0] == worker]:
            del self.staged[key]
        for key in [k for k in self.discarding if k[0] == worker]:
            del self.discarding[key]

    # --- pushes ----------------------------------------------------------------------------------------
    def push(
        self, worker: str, fragment: int, round: int, enc: Encoded, weight: float, loss: float | None = None
    ) -> None:
        """Add one worker's whole outer gradient for this shard's slice of a fragment (one chunk)."""
        self.push_chunk(worker, fragment, round, 0, 0, enc.numel, enc, True, weight, loss)

    def push_chunk(
        self,
        worker: str,
        fragment: int,
        round: int,
        seq: int,
        offset: int,
        total: int,
        part: Encoded,
        last: bool,
        weight: float | None = None,
        loss: float | None = None,
        now: float = 0.0,
    ) -> bool | None:
        """One chunk of a push. True: that was the last chunk and the push is now in the round's sum;
        False: kept, waiting for more; None: silently dropped (the rest of a push already refused).
        Raises PushRejected, without changing anything, when the chunk is bad; the push is then dropped."""
        key = (worker, fragment)
        if self._swallow(worker, fragment, round, seq, last):
            return None
        st = self.staged.get(key)
        try:
            asm = self._check(worker, fragment, round, seq, offset, st, weight, loss)
            asm.add(seq, offset, total, part, last)
        except ChunkError as e:
            self._drop(key, round, last, e.reason)
            raise PushRejected(e.reason, f"fragment {fragment} round {round} chunk {seq}: {e}") from None
        except PushRejected as e:
            self._drop(key, round, last, e.reason)
            raise
        self.discarding.pop(key, None)
        if st is None:
            assert weight is not None
            cap = self.robust.max_weight * self._speed_spread
            if cap and weight > cap:  # more tokens than one worker can train on between two syncs
                weight = cap
                self.weights_capped += 1
            st = self.staged[key] = _Staged(round, weight, loss, asm)
        if self.robust.clip_norm:
            st.sumsq += sumsq(part)  # the push's size, as it arrives (the chunk was checked: values bounded)
        if not last:
            return False
        del self.staged[key]
        rnd = self.open[fragment]
        if rnd.started_at is None:  # the round starts with its first whole push: who is expected is fixed now
            rnd.started_at = now
            rnd.expected = self._expected(fragment, rnd.number) | {worker}
        rnd.kept.append(_Push(worker, st.weight, asm, math.sqrt(st.sumsq), loss=st.loss))
        rnd.weights.append(st.weight)
        rnd.norms.append(math.sqrt(st.sumsq))
        rnd.kept_bytes += asm.nbytes
        if rnd.kept_bytes >= self.fold_bytes[fragment] and self.robust.aggregator == "mean":
            # as big as an fp64 sum: settle them and fold them (memory bound); the other aggregators need
            # every push at the close
            group = _ordered(rnd.kept)
            self._settle(fragment, rnd, group)
            rnd.groups.append(group)
            rnd.kept, rnd.kept_bytes = [], 0
        rnd.weight += st.weight
        rnd.contributors.add(worker)
        self.bytes_received += asm.nbytes
        self.pushes_accepted += 1
        return True

    def refuse_chunk(self, worker: str, fragment: int, round: int, seq: int, last: bool, reason: str) -> bool:
        """A chunk the caller refused before push_chunk could see it (say, its bytes do not decode): the push
        it belongs to is dropped, as for a chunk push_chunk refuses. False: the chunk belonged to a push that
        was already refused, so nothing more needs saying."""
        if self._swallow(worker, fragment, round, seq, last):
            return False
        self._drop((worker, fragment), round, last, reason)
        return True

    @property
    def _speed_spread(self) -> float:
        """How far honest workers' weights may differ: with sync_schedule "adaptive" a faster worker trains
        up to max_steps_per_tick inner steps per schedule step (common/pace.py), and its push carries those
        tokens, so the weight caps stretch that far; 1 with the fixed schedule."""
        return self.cfg.max_steps_per_tick if self.cfg.sync_schedule == "adaptive" else 1.0

    def _discard_key(self, worker: str, fragment: int) -> tuple[str, int]:
        # every fragment id that does not exist shares one entry: at most P + 1 entries per worker
        return (worker, fragment if 0 <= fragment < self.layout.num_fragments else -1)

    def _swallow(self, worker: str, fragment: int, round: int, seq: int, last: bool) -> bool:
        """True for a later chunk of a push already refused: it is dropped without a word."""
        dkey = self._discard_key(worker, fragment)
        if seq > 0 and self.discarding.get(dkey) == (fragment, round):
            if last:
                del self.discarding[dkey]
            return True
        return False

    def _drop(self, key: tuple[str, int], round: int, last: bool, reason: str) -> None:
        self.staged.pop(key, None)
        if not last:  # the push's later chunks are dropped without a word
            self.discarding[self._discard_key(*key)] = (key[1], round)
        self.pushes_refused[reason] = self.pushes_refused.get(reason, 0) + 1

    def _check(
        self,
        worker: str,
        fragment: int,
        round: int,
        seq: int,
        offset: int,
        st: _Staged | None,
        weight: float | None,
        loss: float | None,
    ) -> Assembly:
        """The push's own checks (fragment, round, worker, header); the assembly that checks the chunk."""

        def refuse(reason: str, message: str) -> PushRejected:
            return PushRejected(reason, f"fragment {fragment} round {round} chunk {seq}: {message}")

        if not 0 <= fragment < self.layout.num_fragments:
            raise PushRejected(
                "bad_fragment",
                f"fragment {fragment} does not exist: this run has "
                f"fragments 0..{self.layout.num_fragments - 1}",
            )
        rnd = self.open[fragment]
        if round < rnd.number:
            raise refuse("late", f"the round is closed (open round is {rnd.number}): apply its update, go on")
        if round > rnd.number:
            raise refuse("bad_round", f"the round is ahead of the open round {rnd.number}")
        if worker in rnd.contributors:
            raise refuse("duplicate", f"{worker} already pushed this round")
        if st is not None:  # st.round == round: closing a round drops the pushes still arriving for it
            return st.asm
        if seq == 0 and offset == 0:  # a push's first chunk carries its header (else: refused as bad_chunk)
            if weight is None or not (MIN_WEIGHT <= weight <= MAX_WEIGHT):
                # below one token a push would count toward --min-workers while adding nothing
                raise refuse(
                    "bad_weight",
                    f"push weight must be a number of tokens, at least 1 and at most 2^53, got {weight}",
                )
            if loss is not None and not (0 <= loss <= MAX_LOSS):  # NaN fails both comparisons
                # a cross-entropy: never negative, and beyond 1e4 not a measurement (it is shown and averaged)
                raise refuse(
                    "bad_loss",
                    f"the reported training loss must be a cross-entropy in [0, {MAX_LOSS:g}], got {loss}",
                )
        lo, hi = self.ranges[fragment]
        cfg = self.cfg
        return Assembly(hi - lo, cfg.uplink_codec, cfg.codec_block_size, where=f"slice {self.shard}")

    # --- closing rounds --------------------------------------------------------------------------------
    def due(self, now: float) -> list[tuple[int, str]]:
        """(fragment, why) of every open round that should close now."""
        out = []
        if self.returning_until is not None and now >= self.returning_until:
            self.returning.clear()  # those who did not come back in time have left
            self.returning_until = None
        present = self.members | self.returning
        for f, rnd in enumerate(self.open):
            if rnd.expected is None or f in self.busy:
                continue  # not started (nobody has pushed yet), or its fold job is out: due when it is back
            n = len(rnd.contributors)
            pending = (rnd.expected & present) - rnd.contributors
            if not pending and n >= self.min_workers:
                out.append((f, "all"))
            elif not (rnd.expected & present) and not any(k[1] == f for k in self.staged):
                out.append((f, "empty"))  # everyone expected has left: close with what there is
            elif (
                n >= min(self.min_workers, len(self._expected(f, rnd.number)))
                and now >= rnd.started_at + self.round_timeout  # type: ignore[operator]
            ):  # the quorum, or all who may still push if fewer are left than the quorum (members that
                # joined for later rounds cannot help): nobody waits forever
                out.append((f, "deadline"))
        return out

    def close_round(self, fragment: int, why: str = "all") -> ClosedRound:
        """Close the open round: average, outer step, quantized update; opens the next round.
        Pushes still arriving for the closed round are dropped (their senders get `late`)."""
        return self.end_close(self.begin_close(fragment, why).run())

    def begin_close(self, fragment: int, why: str = "all") -> CloseJob:
        """Close the open round and open the next one (pushes for the closed round are `late` from now on);
        the returned job computes the update. Until `end_close` takes it back, the job owns the fragment's
        optimizer: the fragment is busy, `master` is the one before the round."""
        if fragment in self.busy:
            raise RuntimeError(f"fragment {fragment} already has a job out")
        rnd = self.open[fragment]
        lo, hi = self.ranges[fragment]
        for key in [k for k in self.staged if k[1] == fragment]:
            del self.staged[key]
        kept = _ordered(rnd.kept)
        self._settle(fragment, rnd, kept)
        history = {"weights": rnd.weights, "norms": rnd.used_norms if self.robust.clip_norm else []}
        self._remember(fragment, history)
        self.open[fragment] = _OpenRound(rnd.number + 1)
        self.busy.add(fragment)
        rob = self.robust
        return CloseJob(
            fragment,
            rnd.number,
            why,
            hi - lo,
            [p for g in rnd.groups for p in g] + kept,
            rnd.partial,
            rnd.settled,
            tuple(sorted(rnd.contributors)),
            rnd.loss_sum / rnd.loss_weight if rnd.loss_weight else None,
            self.outer[fragment],
            (self.cfg.downlink_codec, self.cfg.codec_block_size),
            self._saved(fragment, rnd.number + 1),
            (rob.aggregator, rob.trim, rob.center_iters),
            tuple(sorted(rnd.clipped)),
            tuple(sorted(rnd.capped)),
            history,
        )

    def _remember(self, fragment: int, history: dict) -> None:
        """A closed round's weights and used norms join what later rounds' caps and clips are relative to."""
        if history["weights"]:
            self.weight_history[fragment].append(list(history["weights"]))
        if history["norms"]:
            self.norm_history[fragment].append(list(history["norms"]))

    def _settle(self, fragment: int, rnd: _OpenRound, pushes: list[_Push]) -> None:
        """Fix the share (capped weight) and clipping scale of pushes about to be folded, relative to the
        medians of the round's pushes so far and the recent rounds' (scalars: microseconds)."""
        if not pushes:
            return
        rob = self.robust
        weights = list(rnd.weights)
        if len(weights) < 3:  # too few for a median that one liar cannot move: the last rounds' too
            weights += [w for ws in self.weight_history[fragment] for w in ws]
        if len(set(rnd.weights)) == 1:  # the round's weights are all alike (honest workers' are, also when
            shares = [p.weight for p in pushes]  # they have more tokens than the last round's): a cut would
        else:  # change no push's share of the mean
            shares = cap_weights([p.weight for p in pushes], weights, rob.weight_cap * self._speed_spread)
        norms = rnd.norms + [x for xs in self.norm_history[fragment] for x in xs]
        # a site that does k inner steps per schedule step (sync_schedule adaptive) pushes a k-times larger
        # update: the clip bound stretches as the weight caps do
        scales, bound = clip_scales([p.norm for p in pushes], norms, rob.clip_norm * self._speed_spread)
        for p, share, scale in zip(pushes, shares, scales, strict=True):
            p.share, p.scale, p.mult = share, scale, share * scale
            rnd.settled += share
            if p.loss is not None:
                rnd.loss_sum += p.loss * share
                rnd.loss_weight += share
            rnd.used_norms.append(min(p.norm, bound))
            if share < p.weight:
                rnd.capped.append(p.worker)
                self.weights_capped += 1
            if scale < 1.0:
                rnd.clipped.append(p.worker)
                self.pushes_clipped += 1

    def end_close(self, job: CloseJob) -> ClosedRound:
        """Take back a close job that has run: the fragment's master is the new one."""
        assert job.update is not None, "end_close needs a job that has run"
        self.busy.discard(job.fragment)
        self._masters[job.fragment] = job.opt.master
        self.rounds_closed += 1
        return ClosedRound(
            job.fragment, job.round, job.update, job.contributors, job.weight, job.mean_loss, job.why,
            job.clipped, job.capped,
        )  # fmt: skip

    def replay_round(self, fragment: int, record: object) -> ClosedRound:
        """Close the open round again from a checkpoint's log of it (CloseJob.record): the same pushes,
        checked again, folded in the same order into the same step. ValueError, with nothing changed, when
        the record is damaged or is not of the open round."""
        if not isinstance(record, dict):
            raise ValueError(f"it is a {type(record).__name__}, not a round's record")
        rnd = self.open[fragment]
        lo, hi = self.ranges[fragment]
        try:
            if int(record["round"]) != rnd.number:
                raise ValueError(f"it is of round {record['round']}, the open round is {rnd.number}")
            pushes = []
            for p in record["pushes"]:
                asm = Assembly(
                    hi - lo, self.cfg.uplink_codec, self.cfg.codec_block_size, where=f"slice {self.shard}"
                )
                parts = p["parts"]
                for seq, part in enumerate(parts):
                    enc = Encoded(
                        str(part["codec"]),
                        int(part["numel"]),
                        part["payload"],
                        part["scales"],
                        int(part["block_size"]),
                    )
                    asm.add(seq, int(part["offset"]), hi - lo, enc, seq == len(parts) - 1)
                if not asm.done:
                    raise ValueError(f"the push of {p['worker']} is incomplete")
                weight = float(p["weight"])
                if not 0 < weight <= MAX_WEIGHT:
                    raise ValueError(f"a push's weight is {weight}")
                # rounds logged before the defenses: taken as reported, unclipped
                share, scale = float(p.get("share", weight)), float(p.get("scale", 1.0))
                mult = float(p.get("mult", share * scale))
                if not (0 < share <= weight and 0 <= scale <= 1 and 0 <= mult <= share):
                    raise ValueError(f"a push's share {share}, scale {scale} or mult {mult} is out of range")
                pushes.append(_Push(str(p["worker"]), weight, asm, 0.0, share, scale, mult))
            partial = record["partial"]
            if partial is not None and not (
                isinstance(partial, torch.Tensor)
                and partial.dtype == torch.float64
                and partial.shape == (hi - lo,)
            ):
                raise ValueError("its partial sum is not an fp64 tensor of the slice's length")
            weight = float(record["weight"])
            contributors = tuple(str(c) for c in record["contributors"])
            mean_loss = None if record["mean_loss"] is None else float(record["mean_loss"])
            why = str(record["why"])
            history = _history(record.get("history", {"weights": [], "norms": []}), rounds=False)
            if history is None:
                raise ValueError("its weights and norms are malformed")
            name, trim, iters = record.get("aggregator", ("mean", 0.0, 1))
            aggregator = (str(name), float(trim), int(iters))
            RobustConfig(aggregator=aggregator[0], trim=aggregator[1], center_iters=aggregator[2])  # checks
        except (KeyError, TypeError, AttributeError, ValueError, ChunkError) as e:
            raise ValueError(
                f"the log of fragment {fragment} round {rnd.number} is damaged ({type(e).__name__}: {e})"
            ) from None
        if fragment in self.busy:
            raise RuntimeError(f"fragment {fragment} already has a job out")
        downlink = (self.cfg.downlink_codec, self.cfg.codec_block_size)
        self._remember(fragment, history)
        saved = self._saved(fragment, rnd.number + 1)
        job = CloseJob(fragment, rnd.number, why, hi - lo, pushes, partial, weight, contributors, mean_loss,
                       self.outer[fragment], downlink, saved, aggregator, history=history)  # fmt: skip
        self.open[fragment] = _OpenRound(rnd.number + 1)
        self.busy.add(fragment)
        return self.end_close(job.run())

    def hold(self, fragment: int) -> None:
        """Keep the fragment's state still (no close or fold) until `release`: a checkpoint is reading it."""
        if fragment in self.busy:
            raise RuntimeError(f"fragment {fragment} already has a job out")
        self.busy.add(fragment)

    def release(self, fragment: int) -> None:
        self.busy.discard(fragment)

    def fold_due(self) -> list[int]:
        """Fragments whose open round has groups of pushes to fold (and no job out)."""
        return [f for f, rnd in enumerate(self.open) if rnd.groups and f not in self.busy]

    def begin_fold(self, fragment: int) -> FoldJob:
        """Hand out the open round's groups of pushes to fold into its fp64 sum; the fragment is busy (its
        round does not close) until `end_fold`. Pushes go on arriving meanwhile."""
        if fragment in self.busy:
            raise RuntimeError(f"fragment {fragment} already has a job out")
        rnd = self.open[fragment]
        lo, hi = self.ranges[fragment]
        job = FoldJob(fragment, rnd.number, hi - lo, rnd.groups, rnd.partial)
        rnd.groups, rnd.partial = [], None
        self.busy.add(fragment)
        return job

    def end_fold(self, job: FoldJob) -> None:
        rnd = self.open[job.fragment]
        assert rnd.number == job.round and rnd.partial is None and job.partial is not None
        rnd.partial = job.partial
        self.busy.discard(job.fragment)
