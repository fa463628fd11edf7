"""The shard's status as JSON data (the /api/status page, `streamdiloco status`) and the dashboard's time
series: built from the shard's parts (`Observed`: the state, the roster, the counters, the bounds, the
checkpoint, ...), read on the event loop. The masters' hashes are cached per round (a hash reads the whole
slice) and may be computed ahead on the round runner's pool (`hash_masters`).

What it must not do: change anything it reads (it only counts the dashboard's samples).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from streamdiloco.common.fingerprint import tensor_digest
from streamdiloco.server.observe.dashboard import DashboardData, Sample
from streamdiloco.server.storage.credits import STATUS_ROWS
from streamdiloco.server.trust.roster import Member

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Executor

    from streamdiloco.server.edge.gates import Gates
    from streamdiloco.server.edge.pieces import PieceDesk
    from streamdiloco.server.observe.counters import Counters
    from streamdiloco.server.rounds.state import ShardState
    from streamdiloco.server.storage.checkpoint import ShardCheckpoint
    from streamdiloco.server.storage.credits import Credits
    from streamdiloco.server.trust.bounds import UnreadBudget
    from streamdiloco.server.trust.roster import Roster


@dataclass(frozen=True)
class Observed:
    """The parts of a shard that its status and its metrics read (server/shard.py's Shard builds them);
    `ready()`: serving, and not on its way down; `pool`: where a master's hash may be computed."""

    state: ShardState
    roster: Roster
    counters: Counters
    gates: Gates
    unread: UnreadBudget
    checkpoint: ShardCheckpoint | None
    credits: Credits
    pieces: PieceDesk | None
    dashboard: DashboardData
    pool: Executor
    clock: Callable[[], float]
    ready: Callable[[], bool]


class ShardStatus:
    """What a shard reports about itself (see the module's docstring)."""

    def __init__(self, parts: Observed):
        self.parts, self.dashboard = parts, parts.dashboard
        self.started = time.time()
        self.digests: dict[int, tuple[torch.Tensor, str]] = {}  # fragment -> (master, its hash)

    def sample_now(self) -> Sample:
        c = self.parts.counters
        n = len(self.parts.state.members)
        return time.time(), c.msg_in, c.msg_out + c.fetch_out, n, self.parts.roster.passive

    def sample(self) -> None:
        """One point of the dashboard's time series: cumulative bytes and the member count."""
        self.dashboard.samples.append(self.sample_now())

    def digest(self, fragment: int) -> str:
        """The master's hash, computed once per round: a master changes only when its round closes."""
        master = self.parts.state.master(fragment)
        cached = self.digests.get(fragment)
        if cached is None or cached[0] is not master:
            cached = self.digests[fragment] = (master, tensor_digest(master))
        return cached[1]

    async def hash_masters(self) -> None:
        """Compute on a pool thread the masters' hashes that status() would otherwise compute on the loop
        (a hash reads the whole slice)."""
        loop = asyncio.get_running_loop()
        for f in range(self.parts.state.layout.num_fragments):
            master = self.parts.state.master(f)
            cached = self.digests.get(f)
            if cached is None or cached[0] is not master:
                digest = await loop.run_in_executor(self.parts.pool, tensor_digest, master)
                self.digests[f] = (master, digest)

    def status(self, rounds: int = 20, hashes: bool = True, credits: int = STATUS_ROWS) -> dict:
        """`hashes`: each fragment's master hash too (a hash of the slice, once per round: the dashboard
        page, which polls, leaves it out); `credits`: rows of the contribution credits listed (the most
        tokens first; the rest summed)."""
        st = self.parts.state
        return {
            "shard": st.shard,
            "num_shards": st.num_shards,
            "uptime_seconds": round(time.time() - self.started, 1),
            "ready": self.parts.ready(),
            "config": st.cfg.to_dict(),
            "min_workers": st.min_workers,
            "returning": sorted(st.returning),  # after a restart: members not back yet, still waited for
            "round_timeout": st.round_timeout,
            "quorum": st.rule.quorum,  # of the expected weight, for a round to close on it after the grace
            "round_grace": st.rule.round_grace,
            "grace_seconds": st.grace(st.pace()),  # what that grace is now, at the run's pace
            "dormant": sorted(st.roll.dormant),  # a round closed without them: not waited for until they push
            "pace_seconds": self.parts.roster.pace(),  # the slowest member's step time (adaptive schedule)
            "data": self.data(),  # shard 0: progress through the dataset (its ledger of pieces); else None
            "members": [self.member(m) for m in self.parts.roster.sessions()],
            "fragments": [
                {
                    "fragment": f,
                    "round": st.round_of(f),
                    "slice": list(st.ranges[f]),
                    "master_hash": self.digest(f) if hashes else None,
                    "contributors": sorted(st.contributors(f)),
                }
                for f in range(st.layout.num_fragments)
            ],
            "rounds_closed": st.rounds_closed,
            "checkpoint": None
            if self.parts.checkpoint is None
            else {
                "dir": str(self.parts.checkpoint.dir),
                "writes": self.parts.checkpoint.writes,
                "errors": self.parts.checkpoint.errors,
                "last_error": self.parts.checkpoint.last_error,
            },
            "pushes_accepted": st.pushes_accepted,
            "pushes_refused": dict(st.pushes_refused),
            "robust": {
                **st.robust.to_dict(),
                "pushes_clipped": st.pushes_clipped,
                "weights_capped": st.weights_capped,
            },
            "bad_messages": self.parts.counters.bad_messages,
            "bounds": self.bounds(),  # what clients hold of what the shard's limits allow
            "bytes": {
                "codec_in": st.bytes_received,
                "codec_out": self.parts.counters.codec_out,
                "message_bytes_in": self.parts.counters.msg_in,
                "message_bytes_out": self.parts.counters.msg_out,
                "fetch_out": self.parts.counters.fetch_out,
            },
            "training_loss": self.dashboard.last_loss,
            "round_seconds": self.dashboard.round_seconds(),
            "recent_rounds": self.dashboard.recent_rounds(rounds),
            "credits": self.parts.credits.status(
                self.parts.clock(), credits
            ),  # who gave what (server/storage/credits.py)
        }

    def member(self, m: Member) -> dict:
        """A session, as status lists it."""
        st = self.parts.state
        return {
            "name": m.name,
            "state": "member" if m.active else "passive",
            "dormant": m.name in st.roll.dormant,  # not waited for until a push of its arrives
            "joined_at": m.joined_at,
            "pushes": m.pushes,
            "refused": m.refused,
            "last_loss": m.last_loss,
            "step": m.step,
            "blocked_seconds": m.blocked_seconds,
            **self.reported(m),
            "message_bytes_in": m.msg_in,
            "message_bytes_out": m.msg_out,
            "receiving": [  # pushes whose chunks are arriving
                {"fragment": f, "round": p.round, "values": p.asm.received, "of": p.asm.total}
                for (w, f), p in sorted(st.staged.items())
                if w == m.name
            ],
        }

    def bounds(self) -> dict:
        """What clients hold of what the shard's limits allow (server/trust/bounds.py)."""
        st, gates = self.parts.state, self.parts.gates
        return {
            "sessions": gates.sessions.held,
            "fetches": gates.fetches.held,
            "unread_bytes": self.parts.unread.held,
            "unread_limit": self.parts.unread.limit,
            "staged_bytes": st.staging.staged_bytes,  # reserved by pushes whose chunks are arriving
            "staged_limit": st.staging.limit,
            "pending_joins": len(self.parts.roster.joins.pending),
            "waiting_calls": gates.waiting.held,
            "refused": dict(gates.refused),
        }

    def data(self) -> dict | None:
        """Shard 0's ledger (server/storage/ledger.py's status) and the epoch's ETA: the tokens of the pieces
        not done, at the members' summed tokens/s (None until they tell)."""
        if self.parts.pieces is None:
            return None
        led = self.parts.pieces.ledger
        data = led.status()
        rates = [self.dashboard.rates(m.name)["tokens_per_second"] for m in self.parts.roster.members()]
        speed = sum(r for r in rates if r)
        left = max(0, data["train_tokens"] - data["pieces_done"] * led.piece_tokens)
        data["eta_seconds"] = left / speed if speed and data["bound"] else None
        return data

    def reported(self, m: Member) -> dict:
        """A member's latest report beyond step and blocked time, its pace and its ETA, for the page."""
        r = m.report
        rates = self.dashboard.rates(m.name)
        eta = None
        if r is not None and r.total_steps and rates["steps_per_second"]:
            eta = max(0, r.total_steps - r.step) / rates["steps_per_second"]
        return {
            "total_steps": r.total_steps if r is not None and r.total_steps else None,
            "tokens": r.tokens if r is not None else None,
            "compute_utilization": r.compute_utilization if r is not None else None,
            "eval_loss": r.eval_loss if r is not None else None,
            "eval_step": r.eval_step if r is not None and r.eval_loss is not None else None,
            "step_seconds": r.step_seconds if r is not None else None,  # its speed (sync_schedule adaptive)
            **rates,
            "eta_seconds": eta,
        }

    def series(self, since: float = 0.0) -> dict:
        """The dashboard's time series after `since` (a time.time()), with the values of this moment."""
        return self.dashboard.series(since, self.sample_now())
