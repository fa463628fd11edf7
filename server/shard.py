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
from collections import deque

import torch

from streamdiloco.common.chunks import MAX_ABS_VALUE, Assembly, ChunkError
from streamdiloco.common.codecs import Encoded, sumsq
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, slice_ranges
from streamdiloco.common.outer import OuterOptimizer
from streamdiloco.server.robust import (
    MAX_LOSS,
    MIN_WEIGHT,
    RobustConfig,
    cap_weights,
    clip_scales,
)
from streamdiloco.server.roundjobs import (
    ClosedRound,
    CloseJob,
    FoldJob,
    OpenRound,
    Push,
    Staged,
    checked_history,
    fold,
    ordered,
)

__all__ = ["MAX_ABS_VALUE", "MAX_WEIGHT", "ClosedRound", "CloseJob", "FoldJob", "PushRejected", "ShardState"]

# Bounds on what a push may carry, so that no accepted push can make the sum, the mean or the outer step
# overflow: values are bounded by the chunk assembler (MAX_ABS_VALUE); weights are token counts.
MAX_WEIGHT = float(2**53)


class PushRejected(ValueError):
    """A push that the shard refuses; nothing in the shard's state changed."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # short machine-readable cause: bad_fragment, late, duplicate, ...


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
        self.open = [OpenRound(0) for _ in range(layout.num_fragments)]
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
        self.staged: dict[tuple[str, int], Staged] = {}
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
        pushes = [p for g in rnd.groups for p in ordered(g)] + ordered(rnd.kept)
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
        history = checked_history(saved.get("history", {"weights": [], "norms": []}))
        if history is None:
            raise ValueError(f"checkpoint of fragment {fragment} has a malformed history of weights, norms")
        if fragment in self.busy:
            raise RuntimeError(f"fragment {fragment} is being closed: cannot load its state now")
        self.outer[fragment].load_state_dict(outer)
        self._masters[fragment] = self.outer[fragment].master
        self.open[fragment] = OpenRound(rnd)
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
            st = self.staged[key] = Staged(round, weight, loss, asm)
        if self.robust.clip_norm:
            st.sumsq += sumsq(part)  # the push's size, as it arrives (the chunk was checked: values bounded)
        if not last:
            return False
        del self.staged[key]
        rnd = self.open[fragment]
        if rnd.started_at is None:  # the round starts with its first whole push: who is expected is fixed now
            rnd.started_at = now
            rnd.expected = self._expected(fragment, rnd.number) | {worker}
        rnd.kept.append(Push(worker, st.weight, asm, math.sqrt(st.sumsq), loss=st.loss))
        rnd.weights.append(st.weight)
        rnd.norms.append(math.sqrt(st.sumsq))
        rnd.kept_bytes += asm.nbytes
        if rnd.kept_bytes >= self.fold_bytes[fragment] and self.robust.aggregator == "mean":
            # as big as an fp64 sum: settle them and fold them (memory bound); the other aggregators need
            # every push at the close
            group = ordered(rnd.kept)
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
        st: Staged | None,
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
        kept = ordered(rnd.kept)
        self._settle(fragment, rnd, kept)
        history = {"weights": rnd.weights, "norms": rnd.used_norms if self.robust.clip_norm else []}
        self._remember(fragment, history)
        self.open[fragment] = OpenRound(rnd.number + 1)
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

    def _settle(self, fragment: int, rnd: OpenRound, pushes: list[Push]) -> None:
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
                pushes.append(Push(str(p["worker"]), weight, asm, 0.0, share, scale, mult))
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
            history = checked_history(record.get("history", {"weights": [], "norms": []}), rounds=False)
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
        self.open[fragment] = OpenRound(rnd.number + 1)
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
