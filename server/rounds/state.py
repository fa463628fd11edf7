"""A shard's state and aggregation, as pure logic: no networking, no files, no clocks or threads of its own.

Shard s of S owns slice s of every fragment's flat vector. Per fragment it keeps the master slice, the
outer optimizer (Nesterov SGD plus the downlink's error-feedback residual) and the open round (one
`FragmentSlice` each).

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

Rounds close by server/rounds/rule.py's rule (every expected member pushed; or a quorum of the distinct
members and of the expected weight, counting only what has arrived, and a grace from the run's pace that
starts no earlier than a round's length after the round opened; deadlines counted from the round's
opening), which `due` applies; an expected member that a round closed without is dormant
(server/rounds/members.py) until an accepted push of its (or a late one, when it just missed one round).
The caller supplies the time (`now`), so tests drive the clock.

The arithmetic (folding, the outer step, encoding the update) is a job that `begin_close` / `begin_fold`
hand out and `end_close` / `end_fold` take back: in between, the job owns the fragment's optimizer and the
pushes it took, so the caller may run it on another thread while it goes on taking pushes; the fragment is
`busy` meanwhile (no second job, and it is not due). `close_round` does all three at once. A master tensor
is never changed in place (a close replaces it), so a reader may keep one while rounds go on.

ShardState composes its collaborators, each the one truth of its job: server/rounds/fragment.py (one
`FragmentSlice` per fragment: its slice, master, outer optimizer, open round and recent rounds),
server/rounds/staging.py (the pushes whose chunks are arriving, and their own checks),
server/rounds/defenses.py (weight caps and norm clips), server/rounds/members.py (who the rounds wait for),
server/rounds/records.py (what a checkpoint keeps of a fragment, and its checks), server/rounds/jobs.py (the
rounds' records and the fold and close jobs). The gRPC servicer and the in-process simulator both drive
this class; what it must not do: network, files, clocks or threads of its own.
"""

from __future__ import annotations

import math

import torch

from streamdiloco.common.chunks import MAX_ABS_VALUE
from streamdiloco.common.codecs import Encoded
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout
from streamdiloco.common.pace import valid_step_seconds
from streamdiloco.server.rounds.defenses import Defenses
from streamdiloco.server.rounds.fragment import FragmentSlice
from streamdiloco.server.rounds.jobs import ClosedRound, CloseJob, FoldJob, Push, ordered
from streamdiloco.server.rounds.members import RoundMembers
from streamdiloco.server.rounds.records import checked_fragment, checked_round, fragment_record
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.rule import RoundRule
from streamdiloco.server.rounds.staging import MAX_WEIGHT, Chunk, PushRejected, Staging

__all__ = ["MAX_ABS_VALUE", "MAX_WEIGHT", "ClosedRound", "CloseJob", "FoldJob", "PushRejected", "ShardState"]


class ShardState:
    """One shard's rounds: per fragment a `FragmentSlice` (its outer optimizer, the open round, whether a
    job is out), and who the rounds wait for."""

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
        quorum: float = 0.5,
        round_grace: float = 1.0,
        staged_limit: int | None = None,
    ):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard index {shard} is outside [0, {num_shards - 1}]")
        if len(initial) != layout.num_fragments:
            raise ValueError(f"need {layout.num_fragments} initial fragment vectors, got {len(initial)}")
        self.shard, self.num_shards, self.layout, self.cfg = shard, num_shards, layout, cfg
        self.rule = RoundRule(min_workers, round_timeout, quorum, round_grace, cfg.sync_every)  # checks them
        self.robust = robust if robust is not None else RobustConfig()
        self.defenses = Defenses(self.robust, cfg)
        self.fragments = [
            FragmentSlice.start(
                f, (shard, num_shards), vec, layout.fragments[f].numel, cfg, seed, self.defenses.recent()
            )
            for f, vec in enumerate(initial)
        ]
        self.roll = RoundMembers(layout.num_fragments, spread=cfg.max_steps_per_tick)
        self.staging = Staging(shard, self.fragments, cfg, staged_limit)  # staged_limit: bytes arriving
        self.bytes_received = 0  # codec bytes (payload + scales) of accepted pushes
        self.pushes_accepted = 0
        self.rounds_closed = 0

    # --- what the collaborators own, as callers read it ---------------------------------------------------
    min_workers = property(lambda self: self.rule.min_workers)
    round_timeout = property(lambda self: self.rule.round_timeout)
    ranges = property(lambda self: [fr.slice for fr in self.fragments], doc="this shard's slice of each")
    open = property(lambda self: [fr.open for fr in self.fragments], doc="each fragment's open round")
    members = property(lambda self: self.roll.members, doc="who the rounds that start from now wait for")
    member_from = property(lambda self: self.roll.member_from)
    restored_members = property(lambda self: self.roll.restored)
    returning = property(lambda self: self.roll.returning)
    staged = property(lambda self: self.staging.staged)
    discarding = property(lambda self: self.staging.discarding)
    pushes_refused = property(lambda self: self.staging.pushes_refused)
    weight_history = property(lambda self: [fr.recent.weights for fr in self.fragments])
    norm_history = property(lambda self: [fr.recent.norms for fr in self.fragments])
    pushes_clipped = property(lambda self: self.defenses.pushes_clipped)
    weights_capped = property(lambda self: self.defenses.weights_capped)

    def master(self, fragment: int) -> torch.Tensor:
        """The fragment's master slice as of its last closed round (a tensor never changed in place)."""
        return self.fragments[fragment].master

    def sum(self, fragment: int) -> torch.Tensor:
        """The open round's fp64 sum of weight * delta over its whole pushes so far (for tests and checks:
        the round itself keeps the pushes encoded until it closes)."""
        return self.fragments[fragment].sum()

    def round_of(self, fragment: int) -> int:
        """The number of the round that is open for this fragment."""
        return self.fragments[fragment].open.number

    def contributors(self, fragment: int) -> set[str]:
        return set(self.fragments[fragment].open.contributors)

    def started(self, fragment: int) -> bool:
        """Whether the open round has had a whole push (it is in progress)."""
        return self.fragments[fragment].open.started_at is not None

    # --- checkpoints (their format: server/rounds/records.py) -----------------------------------------------
    def fragment_state(self, fragment: int) -> dict:
        """What a checkpoint keeps of a fragment: the open round's number and the outer optimizer (master,
        momentum, error-feedback residual, rounding generator). The open round's pushes are not kept."""
        fr = self.fragments[fragment]
        return {**self._saved(fr), "outer": fr.outer_state()}

    def _saved(self, fr: FragmentSlice) -> dict:
        """The fragment's checkpointed state but its optimizer's, with its open round's number."""
        return fragment_record(fr.index, fr.slice, fr.open.number, self.roll.saved(), fr.recent.saved())

    def load_fragment_state(self, fragment: int, saved: object) -> None:
        """Restore a fragment from `fragment_state`'s dict; ValueError, with nothing changed, if it does not
        fit this shard's slice of the fragment."""
        fr = self.fragments[fragment]
        outer, rnd, members, history = checked_fragment(fragment, saved, fr.slice)
        fr.load(outer, rnd, self.defenses.recent(history))
        self.roll.restore(members)

    def expect_back(self, until: float) -> None:
        """After a restart: wait for the checkpoint's members as if they were here, until `until`."""
        self.roll.expect_back(until)

    # --- members (server/rounds/members.py) ----------------------------------------------------------------
    def add_member(self, worker: str, from_rounds: list[int] | None = None) -> None:
        """Rounds that start from now on wait for this worker; with `from_rounds`, only rounds
        >= from_rounds[fragment] (a worker that joins a run in progress skips the rounds before)."""
        self.roll.add(worker, from_rounds)

    def remove_member(self, worker: str) -> None:
        """The worker's session ended: it leaves, and any push it had half-sent is dropped."""
        self.roll.remove(worker)
        self.staging.forget_worker(worker)

    # --- pushes (their chunks: server/rounds/staging.py) ----------------------------------------------------
    def push(
        self,
        worker: str,
        fragment: int,
        round: int,
        enc: Encoded,
        weight: float,
        loss: float | None = None,
        now: float = 0.0,
        step_seconds: float | None = None,
    ) -> None:
        """Add one worker's whole outer gradient for this shard's slice of a fragment (one chunk)."""
        self.push_chunk(worker, fragment, round, 0, 0, enc.numel, enc, True, weight, loss, now, step_seconds)

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
        step_seconds: float | None = None,
    ) -> bool | None:
        """One chunk of a push (`weight`, `loss`, `step_seconds`: its header, with the first chunk). True:
        that was the last chunk and the push is now in the round's sum; False: kept, waiting for more; None:
        silently dropped (the rest of a push already refused). Raises PushRejected, without changing
        anything, when the chunk is bad; the push is then dropped."""
        if self.staging.swallow(worker, fragment, round, seq, last):
            return None
        if step_seconds is not None and not valid_step_seconds(step_seconds):
            step_seconds = None  # not measured (the servicer refuses one no worker can have)
        stretch = self.defenses.stretch(self.pace(), step_seconds)
        chunk = Chunk(
            worker, fragment, round, seq, offset, total, part, last, weight, loss, step_seconds, stretch
        )
        try:
            st = self.staging.chunk(self.defenses, chunk)
        except PushRejected as e:
            if e.reason == "late":  # just behind (one round missed): waited for again, it catches up; further
                # behind, the worker skips ahead, and late chunks keep no liar expected (members.py)
                self.roll.late(worker, fragment, self.fragments[fragment].open.number)
            raise
        if st is None:
            return False
        fr = self.fragments[fragment]
        rnd = fr.open
        if rnd.started_at is None:  # the round starts with its first whole push: who is expected is fixed now
            rnd.start(now, self.roll.expected(fragment, rnd.number) | {worker})
        self.roll.heard(worker, st.step_seconds, fragment, round)
        push = Push(
            worker, st.weight, st.asm, math.sqrt(st.sumsq), loss=st.loss, step_seconds=st.step_seconds
        )
        rnd.add(push, st.asm.nbytes)
        if rnd.kept_bytes >= fr.fold_bytes and self.defenses.folds_early:
            # as big as an fp64 sum: settle them and fold them (memory bound)
            self._settle(fr, rnd.group())
        self.bytes_received += st.asm.nbytes
        self.pushes_accepted += 1
        return True

    def refuse_chunk(self, worker: str, fragment: int, round: int, seq: int, last: bool, reason: str) -> bool:
        """A chunk the caller refused before push_chunk could see it (say, its bytes do not decode): the push
        it belongs to is dropped, as for a chunk push_chunk refuses. False: the chunk belonged to a push that
        was already refused, so nothing more needs saying."""
        return self.staging.refuse(worker, fragment, round, seq, last, reason)

    # --- closing rounds --------------------------------------------------------------------------------
    def pace(self) -> float:
        """The run's pace as this shard sees it (server/rounds/members.py: a liar's claim clamped)."""
        return self.roll.pace()

    def grace(self, pace: float) -> float:
        """How long a round that holds a quorum waits for the rest (server/rounds/rule.py)."""
        return self.rule.grace(pace)

    def due(self, now: float, fragment: int | None = None) -> list[tuple[int, str]]:
        """(fragment, why) of every open round that should close now (the rule: this module's docstring);
        with `fragment`, of that one's only (after a push of it: a push moves no other round closer)."""
        out = []
        looked: tuple[set[str], float] | None = None  # the members present and the pace, once (O(members))
        for fr in self.fragments if fragment is None else (self.fragments[fragment],):
            rnd = fr.open
            if fr.busy:
                continue  # its fold or close job is out: due when it is back
            if rnd.expected is None:
                continue  # not started: nobody has pushed yet
            if looked is None:
                looked = (self.roll.present(now), self.pace())
            why = self._why_close(fr, now, *looked)
            if why is not None:
                out.append((fr.index, why))
        return out

    def _why_close(self, fr: FragmentSlice, now: float, present: set[str], pace: float) -> str | None:
        rnd = fr.open
        assert rnd.expected is not None and rnd.opened_at is not None and rnd.started_at is not None
        waited = (rnd.expected & present) - self.roll.dormant  # whom the round still counts on
        pending = waited - rnd.contributors
        n = len(rnd.contributors)
        if (
            (pending or n < self.min_workers)
            and not (rnd.expected & present)
            and not self.staging.arriving(fr.index)
        ):
            return "empty"  # everyone expected has left: close with what there is
        shares = [self.roll.share(m) for m in pending]  # each one's last share (None: none settled yet)
        if rnd.quorum_at is None:  # what has arrived (bounded, never stretched) against the pending's shares
            if self.rule.holds_quorum(*self.defenses.in_hand(fr.recent, rnd), n, shares):
                rnd.quorum_at = now
        can = n + sum(1 for w in shares if w is not None)  # members that never pushed cannot
        # at a run's start (no round of the fragment closed with two contributors yet) a pending member that
        # never had an accepted push holds quorum closes back: the pace cannot say when its first push comes
        unknown = not fr.recent.weights and any(m not in self.roll.known for m in pending)
        times = (rnd.opened_at, rnd.started_at, rnd.quorum_at, now, pace)
        return self.rule.why(n, len(pending), can, unknown, *times)

    def close_round(self, fragment: int, why: str = "all", now: float | None = None) -> ClosedRound:
        """Close the open round: average, outer step, quantized update; opens the next round (at `now`).
        Pushes still arriving for the closed round are dropped (their senders get `late`)."""
        return self.end_close(self.begin_close(fragment, why, now).run())

    def begin_close(self, fragment: int, why: str = "all", now: float | None = None) -> CloseJob:
        """Close the open round and open the next one (at `now`: its deadlines count from there; pushes for
        the closed round are `late` from now on); the returned job computes the update. Until `end_close`
        takes it back, the job owns the fragment's optimizer: the fragment is busy, `master` is the one
        before the round. Expected members that did not push are dormant from now on."""
        fr = self.fragments[fragment]
        fr.take_out()
        self.staging.forget_fragment(fragment)
        self._settle(fr, ordered(fr.open.kept))
        rnd = fr.next_round(opened_at=now)
        history = self.defenses.closing(rnd)
        fr.recent.remember(history)
        if rnd.expected is not None:  # who it waited for and closed without (none with "all" or "empty")
            self.roll.missed(set(rnd.expected) - rnd.contributors - self.roll.returning)
        closing = rnd.closing(why, self.defenses.aggregator, history)
        return CloseJob(fragment, fr.outer, saved=self._saved(fr), closing=closing)

    def end_close(self, job: CloseJob) -> ClosedRound:
        """Take back a close job that has run: the fragment's master is the new one."""
        closed = job.closed()
        self.fragments[job.fragment].end_close(job)
        self.rounds_closed += 1
        return closed

    def replay_round(self, fragment: int, record: object) -> ClosedRound:
        """Close the open round again from a checkpoint's log of it (CloseJob.record): the same pushes,
        checked again, folded in the same order into the same step. ValueError, with nothing changed, when
        the record is damaged or is not of the open round."""
        fr = self.fragments[fragment]
        log = checked_round(
            record, fragment, fr.open.number, fr.numel, lambda: self.staging.assembly(fragment)
        )
        fr.take_out()
        fr.recent.remember(log.history)
        fr.next_round(opened_at=None)  # the next round counts from its first push (a restart's rounds)
        return self.end_close(CloseJob(fragment, fr.outer, saved=self._saved(fr), closing=log).run())

    def _settle(self, fr: FragmentSlice, pushes: list[Push]) -> None:
        """Settle pushes of the fragment's round about to be folded (server/rounds/defenses.py); what they
        are credited with (bounded, never stretched) is what later rounds count on from their workers."""
        self.defenses.settle(fr.recent, fr.open, pushes, self.pace())
        self.roll.pushed({p.worker: p.credited for p in pushes})

    def hold(self, fragment: int) -> None:
        """Keep the fragment's state still (no close or fold) until `release`: a checkpoint is reading it."""
        self.fragments[fragment].take_out()

    def release(self, fragment: int) -> None:
        self.fragments[fragment].release()

    def fold_due(self) -> list[int]:
        """Fragments whose open round has groups of pushes to fold (and no job out)."""
        return [fr.index for fr in self.fragments if fr.open.groups and not fr.busy]

    def begin_fold(self, fragment: int) -> FoldJob:
        """Hand out the open round's groups of pushes to fold into its fp64 sum; the fragment is busy (its
        round does not close) until `end_fold`. Pushes go on arriving meanwhile."""
        return self.fragments[fragment].begin_fold()

    def end_fold(self, job: FoldJob) -> None:
        self.fragments[job.fragment].end_fold(job)
