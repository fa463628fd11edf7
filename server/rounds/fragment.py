"""One fragment as a shard keeps it: this shard's slice of the fragment's flat vector, its master (as of the
last closed round), its outer optimizer (Nesterov SGD plus the downlink's error-feedback residual), its open
round, its recent rounds (what caps and clips are relative to), and whether a fold or close job has it.

Split from server/rounds/state.py (ShardState, which holds one `FragmentSlice` per fragment and decides
what happens to them: pushes, closes, checkpoints) so that a fragment's state is one object rather than
a slot in five parallel lists. Pure: no networking, no files, no clocks; what it must not do: decide when a
round closes, settle pushes, or check what a checkpoint holds (server/rounds/records.py does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import slice_ranges
from streamdiloco.common.outer import OuterOptimizer, outer_momentum
from streamdiloco.server.rounds.defenses import RecentRounds
from streamdiloco.server.rounds.jobs import CloseJob, FoldJob, OpenRound, fold, ordered


@dataclass(eq=False)
class FragmentSlice:
    """A shard's slice [lo, hi) of fragment `index`, its master, optimizer and rounds."""

    index: int
    slice: tuple[int, int]  # [lo, hi) of the fragment's flat vector
    outer: OuterOptimizer  # while a close job is out, the job's (see `busy`)
    recent: RecentRounds
    open: OpenRound = field(default_factory=lambda: OpenRound(0))
    fold_bytes: int = 0  # the open round's kept pushes, once this many bytes, are folded ahead of the close
    busy: bool = False  # a fold or close job is out, or a checkpoint is reading it (ShardState.hold)
    master: torch.Tensor = field(init=False)  # as of the last closed round: a tensor never changed in place

    def __post_init__(self) -> None:
        self.master = self.outer.master

    @classmethod
    def start(
        cls,
        index: int,
        shard: tuple[int, int],
        initial: torch.Tensor,
        numel: int,
        cfg: SyncConfig,
        seed: int,
        recent: RecentRounds,
    ) -> FragmentSlice:
        """Shard s of S's (`shard`) slice of the fragment's `initial` vector of `numel` values (the layout's:
        ValueError if it has another length), round 0 open; `seed`: the run's."""
        if initial.numel() != numel:
            raise ValueError(
                f"fragment {index}: initial vector has {initial.numel()} values, layout says {numel}"
            )
        s, num_shards = shard
        lo, hi = slice_ranges(numel, num_shards)[s]
        momentum, nesterov = outer_momentum(cfg)  # none with --outer-variant sparseloco
        outer = OuterOptimizer(
            initial[lo:hi].to(torch.float32).clone(),
            lr=cfg.outer_lr,
            momentum=momentum,
            nesterov=nesterov,
            downlink_codec=cfg.downlink_codec,
            block_size=cfg.codec_block_size,
            rounding=cfg.downlink_rounding,
            seed=seed * 1_000_003 + s * 1009 + index,  # the downlink's stochastic rounding: its own stream
        )
        # kept pushes as big as an fp64 sum of the slice are folded into one (memory bound)
        return cls(index, (lo, hi), outer, recent, fold_bytes=8 * (hi - lo))

    @property
    def numel(self) -> int:
        lo, hi = self.slice
        return hi - lo

    def sum(self) -> torch.Tensor:
        """The open round's fp64 sum of weight * delta over its whole pushes so far (for tests and checks:
        the round itself keeps the pushes encoded until it closes)."""
        rnd = self.open
        out = torch.zeros(self.numel, dtype=torch.float64)
        pushes = [p for g in rnd.groups for p in ordered(g)] + ordered(rnd.kept)
        fold(self.numel, pushes, out, rnd.partial)
        return out

    def take_out(self) -> None:
        """A job (or a reader) takes the fragment: busy until it is back."""
        if self.busy:
            raise RuntimeError(f"fragment {self.index} already has a job out")
        self.busy = True

    def release(self) -> None:
        self.busy = False

    def next_round(self, opened_at: float | None) -> OpenRound:
        """Open the round after the open one (its deadlines count from `opened_at`; None: from its first
        push); the round it replaces is returned."""
        rnd, self.open = self.open, OpenRound(self.open.number + 1, opened_at=opened_at)
        return rnd

    def begin_fold(self) -> FoldJob:
        """Hand out the open round's groups of pushes to fold into its fp64 sum (the fragment is busy)."""
        self.take_out()
        rnd = self.open
        job = FoldJob(self.index, rnd.number, self.numel, rnd.groups, rnd.partial)
        rnd.groups, rnd.partial = [], None
        return job

    def end_fold(self, job: FoldJob) -> None:
        rnd = self.open
        assert rnd.number == job.round and rnd.partial is None and job.partial is not None
        rnd.partial = job.partial
        self.busy = False

    def end_close(self, job: CloseJob) -> None:
        """Take back a close job that has run: the master is the new one."""
        self.busy = False
        self.master = job.opt.master

    def outer_state(self) -> dict:
        """The outer optimizer's state, as a checkpoint keeps it (not while a close job has it)."""
        if self.busy:
            raise RuntimeError(f"fragment {self.index} is being closed: its state is the close job's")
        return self.outer.state_dict()

    def load(self, outer: dict, round: int, recent: RecentRounds) -> None:
        """Restore from a checkpoint's (checked) state: the optimizer's, the open round's number, the recent
        rounds."""
        if self.busy:
            raise RuntimeError(f"fragment {self.index} is being closed: cannot load its state now")
        self.outer.load_state_dict(outer)
        self.master = self.outer.master
        self.open = OpenRound(round)
        self.recent = recent
