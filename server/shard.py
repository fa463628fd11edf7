"""A shard's state and aggregation, as pure logic: no networking, no files, no clocks of its own.

Shard s of S owns slice s of every fragment's flat vector. Per fragment it keeps the master slice, the
outer optimizer (Nesterov SGD plus the downlink's error-feedback residual), the open round and its
accumulator: every accepted push is dequantized and added, weighted by its tokens, into an fp64 sum, so
memory does not grow with the number of workers and the mean does not depend on arrival order (the sum is
fp64, the mean is rounded once to fp32).

Pushes arrive in chunks. Each chunk is validated the moment it arrives and kept in its encoded form (4-bit
for E3M0); when the push's last chunk has arrived, the chunks are dequantized and added to the round's sum.
A push that breaks off (its worker died, or a later chunk was bad) therefore leaves nothing half-applied,
and a refused push changes nothing at all.

Rounds close when every member that was present when the round started (its first whole push) has pushed,
with at least `min_workers` contributions; or when its deadline has passed with at least `min_workers` (or
with every member's push, when fewer members than `min_workers` are left); or when every expected member
has left. The caller supplies the time (`now`), so tests drive the clock.

The gRPC servicer and the in-process simulator both drive this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from streamdiloco.common.codecs import (
    Encoded,
    chunk_alignment,
    decode,
    encode,
    expected_sizes,
    get_codec,
)
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, slice_ranges
from streamdiloco.common.outer import OuterOptimizer

# Bounds on what a push may carry, so that no accepted push can make the sum, the mean or the outer step
# overflow: outer gradients are parameter differences, far below 1e30; weights are token counts.
MAX_ABS_VALUE = 1e30
MAX_WEIGHT = float(2**53)


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
    expected: frozenset[str] | None = None  # members present when the round's first push was complete
    started_at: float | None = None  # when that was: the deadline counts from here


@dataclass
class _Staged:
    """A push whose chunks are arriving: validated pieces, not yet in the round's sum."""

    round: int
    total: int
    weight: float
    loss: float | None
    parts: list[Encoded] = field(default_factory=list)
    next_seq: int = 0
    next_offset: int = 0


@dataclass(frozen=True)
class ClosedRound:
    fragment: int
    round: int
    update: Encoded  # the quantized update u_hat, as it goes to every worker
    contributors: tuple[str, ...]
    weight: float
    mean_loss: float | None
    why: str = "all"  # all: every expected member pushed; deadline; empty: no expected member is left


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

    def _new_round(self, fragment: int, number: int) -> _OpenRound:
        lo, hi = self.ranges[fragment]
        return _OpenRound(number, torch.zeros(hi - lo, dtype=torch.float64))

    def master(self, fragment: int) -> torch.Tensor:
        return self.outer[fragment].master

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
        return {
            "fragment": fragment,
            "slice": list(self.ranges[fragment]),
            "round": self.open[fragment].number,
            "outer": self.outer[fragment].state_dict(),
            "members": sorted(self.members | self.returning),
        }

    def load_fragment_state(self, fragment: int, saved: dict) -> None:
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
        self.outer[fragment].load_state_dict(outer)
        self.open[fragment] = self._new_round(fragment, rnd)
        self.restored_members.update(members)

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
        try:
            self._check_chunk(worker, fragment, round, seq, offset, total, part, last, weight, loss)
        except PushRejected as e:
            self._drop(key, round, last, e.reason)
            raise
        self.discarding.pop(key, None)
        rnd = self.open[fragment]
        st = self.staged.get(key)
        if st is None:
            assert weight is not None
            st = self.staged[key] = _Staged(round, total, weight, loss)
        st.parts.append(part)
        st.next_seq += 1
        st.next_offset += part.numel
        if not last:
            return False
        del self.staged[key]
        if rnd.started_at is None:  # the round starts with its first whole push: who is expected is fixed now
            rnd.started_at = now
            rnd.expected = self._expected(fragment, rnd.number) | {worker}
        for p, piece in zip(_offsets(st.parts), st.parts, strict=True):
            rnd.total[p : p + piece.numel].add_(decode(piece).to(torch.float64), alpha=st.weight)
        rnd.weight += st.weight
        rnd.contributors.add(worker)
        if st.loss is not None:
            rnd.loss_sum += st.loss * st.weight
            rnd.loss_weight += st.weight
        self.bytes_received += sum(p.nbytes for p in st.parts)
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

    def _check_chunk(self, worker, fragment, round, seq, offset, total, part, last, weight, loss) -> None:
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
        st = self.staged.get((worker, fragment))
        if st is None:
            if seq != 0 or offset != 0:
                raise refuse(
                    "bad_chunk", f"a push starts with chunk 0 at offset 0, got chunk {seq} at {offset}"
                )
            if weight is None or not (0 < weight <= MAX_WEIGHT):
                raise refuse(
                    "bad_weight",
                    f"push weight must be a positive number of tokens, at most 2^53, got {weight}",
                )
            if loss is not None and not (math.isfinite(loss) and abs(loss) <= MAX_ABS_VALUE):
                # bounded, so that the round's token-weighted sum of losses cannot overflow
                raise refuse(
                    "bad_loss",
                    f"the reported training loss must be a finite number of magnitude at most "
                    f"{MAX_ABS_VALUE:g}, got {loss}",
                )
        else:  # st.round == round: closing a round drops the pushes still arriving for it
            if seq < st.next_seq:
                raise refuse("bad_chunk", f"chunk {seq} repeated (next expected is {st.next_seq})")
            if seq != st.next_seq:
                raise refuse("bad_chunk", f"chunk out of order: expected chunk {st.next_seq}")
            if offset != st.next_offset:
                raise refuse("bad_offset", f"offset {offset}, expected {st.next_offset}")
        lo, hi = self.ranges[fragment]
        if total != hi - lo:
            raise refuse("bad_length", f"slice {self.shard} has {hi - lo} values, the push says {total}")
        if part.codec != self.cfg.uplink_codec:
            raise refuse(
                "bad_codec", f"this run's uplink codec is {self.cfg.uplink_codec}, got {part.codec!r}"
            )
        spec = get_codec(part.codec)
        bs = self.cfg.codec_block_size if spec.scaled else 0
        if part.block_size != bs:
            raise refuse("bad_codec", f"block size must be {bs}, got {part.block_size}")
        if part.numel < 1 or offset + part.numel > total:
            raise refuse(
                "bad_length", f"values [{offset}, {offset + part.numel}) do not fit a {total}-value slice"
            )
        if last != (offset + part.numel == total):
            raise refuse(
                "bad_length",
                f"chunk ends at {offset + part.numel} of {total} but last is {str(last).lower()}",
            )
        if not last and part.numel % chunk_alignment(part.codec, self.cfg.codec_block_size):
            raise refuse(
                "bad_length",
                f"a chunk other than the last must hold a multiple of "
                f"{chunk_alignment(part.codec, self.cfg.codec_block_size)} values, got {part.numel}",
            )
        want_payload, want_scales = expected_sizes(part.codec, part.numel, self.cfg.codec_block_size)
        if part.payload.numel() != want_payload or part.scales.numel() != want_scales:
            raise refuse(
                "bad_length",
                f"{part.numel} {part.codec} values need {want_payload} payload bytes and {want_scales} "
                f"scales, got {part.payload.numel()} and {part.scales.numel()}",
            )
        if spec.scaled:
            if not torch.isfinite(part.scales).all():
                raise refuse("bad_scale", "the chunk has a non-finite scale")
            # a value is at most |scale| times the codec's largest level (e3m0: 1, int8: 127)
            top = (
                float(part.scales.abs().max()) * (127.0 if part.codec == "int8" else 1.0)
                if part.scales.numel()
                else 0.0
            )
            if top > MAX_ABS_VALUE:
                raise refuse(
                    "bad_scale", f"the chunk's scales allow values up to {top:.3g}, above {MAX_ABS_VALUE:g}"
                )
        else:
            values = decode(part)
            if not torch.isfinite(values).all():
                raise refuse("bad_value", "the chunk holds non-finite values")
            if values.numel() and float(values.abs().max()) > MAX_ABS_VALUE:
                raise refuse("bad_value", f"the chunk holds values above {MAX_ABS_VALUE:g} in magnitude")

    # --- closing rounds --------------------------------------------------------------------------------
    def due(self, now: float) -> list[tuple[int, str]]:
        """(fragment, why) of every open round that should close now."""
        out = []
        if self.returning_until is not None and now >= self.returning_until:
            self.returning.clear()  # those who did not come back in time have left
            self.returning_until = None
        present = self.members | self.returning
        for f, rnd in enumerate(self.open):
            if rnd.expected is None:
                continue  # not started: nobody has pushed yet
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
        rnd = self.open[fragment]
        opt = self.outer[fragment]
        mean = (rnd.total / rnd.weight).to(torch.float32) if rnd.weight > 0 else None
        if mean is not None and torch.isfinite(mean).all():
            update, _ = opt.step(mean)
            mean_loss = rnd.loss_sum / rnd.loss_weight if rnd.loss_weight else None
        else:  # nobody pushed (or, defensively, the mean is not finite): a zero update; nobody waits forever
            if mean is not None:
                why = "nonfinite"  # cannot happen with validated pushes; the caller logs it
            update = encode(torch.zeros_like(opt.master), self.cfg.downlink_codec, self.cfg.codec_block_size)
            mean_loss = None
        for key in [k for k in self.staged if k[1] == fragment]:
            del self.staged[key]
        self.open[fragment] = self._new_round(fragment, rnd.number + 1)
        self.rounds_closed += 1
        return ClosedRound(
            fragment, rnd.number, update, tuple(sorted(rnd.contributors)), rnd.weight, mean_loss, why
        )


def _offsets(parts: list[Encoded]) -> list[int]:
    out, at = [], 0
    for p in parts:
        out.append(at)
        at += p.numel
    return out
