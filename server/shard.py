"""A shard's state and aggregation, as pure logic: no networking, no files, no clocks.

Shard s of S owns slice s of every fragment's flat vector. Per fragment it keeps the master slice, the
outer optimizer (Nesterov SGD plus the downlink's error-feedback residual), the number of the round that is
open, and a streaming accumulator: each push is dequantized and added, weighted by its tokens, into an fp64
sum, so memory does not grow with the number of workers and the mean does not depend on arrival order
(to fp32 round-off: the sum is fp64, the mean is rounded once to fp32).

The gRPC servicer and the in-process simulator both drive this class; it validates what it is given and
refuses bad pushes without changing anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from streamdiloco.common.codecs import Encoded, decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, slice_ranges
from streamdiloco.common.outer import OuterOptimizer


class PushRejected(ValueError):
    """A push that the shard refuses; nothing in the shard's state changed."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # short machine-readable cause: bad_fragment, late, duplicate, ...


@dataclass
class _OpenRound:
    number: int
    total: torch.Tensor  # fp64 sum of weight * delta
    weight: float = 0.0
    contributors: set[str] = field(default_factory=set)
    loss_sum: float = 0.0  # token-weighted sum of the inner losses that came with the pushes
    loss_weight: float = 0.0


@dataclass(frozen=True)
class ClosedRound:
    fragment: int
    round: int
    update: Encoded  # the quantized update u_hat, as it goes to every worker
    contributors: tuple[str, ...]
    weight: float
    mean_loss: float | None


class ShardState:
    def __init__(
        self,
        shard: int,
        num_shards: int,
        layout: FragmentLayout,
        cfg: SyncConfig,
        initial: list[torch.Tensor],
        seed: int = 0,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard index {shard} is outside [0, {num_shards - 1}]")
        if len(initial) != layout.num_fragments:
            raise ValueError(f"need {layout.num_fragments} initial fragment vectors, got {len(initial)}")
        self.shard, self.num_shards, self.layout, self.cfg = shard, num_shards, layout, cfg
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
        self.open = [self._new_round(f, 0) for f in range(layout.num_fragments)]
        self.bytes_received = 0

    def _new_round(self, fragment: int, number: int) -> _OpenRound:
        lo, hi = self.ranges[fragment]
        return _OpenRound(number, torch.zeros(hi - lo, dtype=torch.float64))

    def master(self, fragment: int) -> torch.Tensor:
        return self.outer[fragment].master

    def round_of(self, fragment: int) -> int:
        """The number of the round that is open for this fragment."""
        return self.open[fragment].number

    def push(
        self, worker: str, fragment: int, round: int, enc: Encoded, weight: float, loss: float | None = None
    ) -> None:
        """Add one worker's outer gradient for this shard's slice of a fragment."""
        if not 0 <= fragment < self.layout.num_fragments:
            raise PushRejected(
                "bad_fragment",
                f"fragment {fragment} does not exist: this run has "
                f"fragments 0..{self.layout.num_fragments - 1}",
            )
        rnd = self.open[fragment]
        if round < rnd.number:
            raise PushRejected(
                "late",
                f"fragment {fragment} round {round} is closed (open round is "
                f"{rnd.number}): apply that round's update and go on",
            )
        if round > rnd.number:
            raise PushRejected(
                "bad_round", f"fragment {fragment} round {round} is ahead of the open round {rnd.number}"
            )
        if worker in rnd.contributors:
            raise PushRejected("duplicate", f"{worker} already pushed fragment {fragment} round {round}")
        lo, hi = self.ranges[fragment]
        if enc.numel != hi - lo:
            raise PushRejected(
                "bad_length",
                f"fragment {fragment} slice {self.shard} has {hi - lo} values, the push carries {enc.numel}",
            )
        if enc.codec != self.cfg.uplink_codec:
            raise PushRejected(
                "bad_codec", f"this run's uplink codec is {self.cfg.uplink_codec}, the push uses {enc.codec}"
            )
        if not (weight > 0 and weight < float("inf")):
            raise PushRejected("bad_weight", f"push weight must be a positive number of tokens, got {weight}")
        if enc.scales.numel() and not torch.isfinite(enc.scales).all():
            raise PushRejected("bad_scale", "the push has a non-finite scale")
        if loss is not None and not math.isfinite(loss):
            raise PushRejected("bad_loss", f"the reported training loss must be a finite number, got {loss}")
        values = decode(enc)
        if not torch.isfinite(values).all():
            raise PushRejected("bad_value", "the push decodes to non-finite values")
        # validated: only now change state
        rnd.total.add_(values.to(torch.float64), alpha=weight)
        rnd.weight += weight
        rnd.contributors.add(worker)
        if loss is not None:
            rnd.loss_sum += loss * weight
            rnd.loss_weight += weight
        self.bytes_received += enc.nbytes

    def contributors(self, fragment: int) -> set[str]:
        return set(self.open[fragment].contributors)

    def close_round(self, fragment: int) -> ClosedRound:
        """Close the open round: average, outer step, quantized update; opens the next round."""
        rnd = self.open[fragment]
        opt = self.outer[fragment]
        if rnd.weight > 0:
            mean = (rnd.total / rnd.weight).to(torch.float32)
            update, _ = opt.step(mean)
            mean_loss = rnd.loss_sum / rnd.loss_weight if rnd.loss_weight else None
        else:  # nobody pushed: a zero update, so that nobody waits forever
            update = encode(torch.zeros_like(opt.master), self.cfg.downlink_codec, self.cfg.codec_block_size)
            mean_loss = None
        self.open[fragment] = self._new_round(fragment, rnd.number + 1)
        return ClosedRound(
            fragment, rnd.number, update, tuple(sorted(rnd.contributors)), rnd.weight, mean_loss
        )
