"""Shard 0's Pieces calls, between the gRPC servicer and the data ledger (server/storage/ledger.py): a request
is checked (the caller has an open, active session with the id its Join gave, the data it names is the
run's, every id and list within bounds), handed to the ledger with what the shard knows of the caller (its
`Standing`: accepted pushes and the tokens they brought, from the contribution credits, and a piece's time
at its own speed), and the reply goes out once the ledger as it is then is on disk.

Durability without blocking the loop: the ledger counts its changes, an ask that changed nothing (a retried
or repeated call) writes nothing, and one that did awaits a coalesced write (server/storage/coalesced.py: one
write in flight, of the latest state, on the ledger's writer thread), so a piece leased or reported done is
never lost by a restart of the shard, and 263 unchanged asks a second cost no write at all.

The trust rules the desk feeds (stated in the ledger's docstring), and what it tells the ledger:
- a passive session holds no pieces: its ask is refused, retryably (UNAVAILABLE), until its Ready;
- what a worker's pushes cover: its credited tokens on this shard (the contribution credits: the bounded
  share of each accepted push, never a claim) times the largest speed-up the adaptive schedule gives an
  honest site (--max-steps-per-tick; 1 under the fixed schedule), whose share the caps hold to the median;
- a piece's time at the worker's own speed, for the "faster than a piece trains" rule: piece_tokens x its
  reported seconds per inner step / its reported tokens per inner step (from its latest accepted push: an
  honest worker's report is never too fast for it; a liar's report can only loosen this rule, and the cover
  bounds the liar);
- a lease lasts LEASE_PIECES times a piece's time at the run's pace (piece_tokens x the pace / the member's
  tokens per inner step, at most LEASE_SPREAD times the members' lower median, which one liar can only
  shorten; a member without a report: that median) plus LEASE_ROUNDS round timeouts (the time the rounds
  that credit a piece take to close).

What this module must not do: decide who holds which piece (the ledger does), or who is a member (the
roster does; it releases a member's pieces when it stops being one).
"""

from __future__ import annotations

import logging
import math
import statistics
from concurrent.futures import ThreadPoolExecutor

import grpc

from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.edge.admission import Refusal, check_name, short
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.storage.coalesced import CoalescedWrites
from streamdiloco.server.storage.credits import Credits, shown
from streamdiloco.server.storage.ledger import Dataset, Ledger, LedgerError, Standing
from streamdiloco.server.trust.roster import Roster

log = logging.getLogger("streamdiloco.shard")

LEASE_PIECES = 4.0  # a lease lasts this many pieces' expected time at the run's pace...
LEASE_ROUNDS = 2.0  # ...plus this many round timeouts (a piece is counted once its rounds credit it)
LEASE_SPREAD = 4.0  # a member's own piece time counts for a lease up to this multiple of the members' median
WARN_SECONDS = 60.0  # a worker's refused done reports are logged at most this often
DEFAULT_ROUND_SECONDS = 120.0  # a round timeout for the lease when the shard has none (tests)
LEDGER_WRITER = ThreadPoolExecutor(1, thread_name_prefix="ledger-write")  # not behind the rounds' jobs


def not_here(shard: int, num_shards: int) -> Refusal:
    """The refusal of a Pieces call to a shard other than 0."""
    return Refusal(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"the data ledger is on shard 0; this is shard {shard} of {num_shards}: call Pieces on shard 0",
    )


class PieceDesk:
    """Shard 0's answers to Pieces (see the module's docstring). `credits` and `state`: where a caller's
    accepted pushes, its credited tokens and the run's pace are read; `writes`: the ledger's coalesced
    writes to the checkpoint (None: no checkpoint)."""

    def __init__(
        self,
        ledger: Ledger,
        roster: Roster,
        credits: Credits,
        state: ShardState,
        writes: CoalescedWrites | None = None,
    ):
        self.ledger, self.roster, self.credits, self.state = ledger, roster, credits, state
        self.writes = writes
        self._typical: tuple[float, float] = (-math.inf, 0.0)  # (when, the median piece time then)
        self._warned: dict[str, tuple[float, int]] = {}  # worker -> (its last warning, reports refused since)
        roster.when_leaving(ledger.release)  # a member that goes gives its pieces back

    # --- what the shard knows of a worker ------------------------------------------------------------------
    def standing(self, worker: str) -> Standing:
        """The worker's accepted pushes, the tokens they stand for, and a piece's time at its own speed."""
        row = self.credits.rows.get(worker)
        if row is None:
            return Standing()
        cfg = self.state.cfg
        stretch = cfg.max_steps_per_tick if cfg.sync_schedule == "adaptive" else 1.0
        own = self._per_token(worker)
        seconds = self.ledger.piece_tokens * own[1] / own[0] if own else 0.0
        return Standing(row.pushes, row.tokens * stretch, seconds)

    def _per_token(self, worker: str) -> tuple[float, float] | None:
        """(tokens per inner step, seconds per inner step) the member's latest accepted push reported."""
        member = self.roster.open.get(worker)
        r = member.report if member is not None else None
        if r is None or not r.step or not r.tokens or not r.step_seconds:
            return None
        return r.tokens / r.step, r.step_seconds

    def _at_pace(self, worker: str) -> float:
        """A piece's time for the member at the run's pace (0: not known)."""
        own, pace = self._per_token(worker), self.state.pace()
        return self.ledger.piece_tokens * pace / own[0] if own and pace > 0 else 0.0

    def lease_of(self, worker: str, now: float = 0.0) -> float:
        """How long a lease of `worker` lasts (see the module's docstring)."""
        typical = self._typical_piece_seconds(now)
        piece = self._at_pace(worker) or typical
        if typical > 0:
            piece = min(piece, LEASE_SPREAD * typical)  # how much a slow claim lengthens its leases
        rt = self.state.round_timeout
        return LEASE_PIECES * piece + LEASE_ROUNDS * (rt if math.isfinite(rt) else DEFAULT_ROUND_SECONDS)

    def _typical_piece_seconds(self, now: float) -> float:
        """The lower median of the members' piece times at the pace (worked out at most once a second): one
        liar's claim can shorten it, never lengthen it."""
        when, seconds = self._typical
        if now - when >= 1.0:
            known = [s for m in self.roster.members() if (s := self._at_pace(m.name)) > 0]
            seconds = statistics.median_low(known) if known else 0.0
            self._typical = (now, seconds)
        return seconds

    # --- calls ---------------------------------------------------------------------------------------------
    async def answer(self, request: pb.PiecesRequest, now: float) -> pb.PiecesReply:
        """The reply to a Pieces call whose credentials were checked for `request.worker`, once what it
        changed is on disk; Refusal when the call is refused (nothing changed)."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if (why := check_name(request.worker)) is not None:
            raise Refusal(invalid, why)
        member = self.roster.open.get(request.worker)
        if member is None or member.dropped or not request.session or member.session != request.session:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {short(request.worker, 60)!r} has no open session with that id on shard 0: Join and "
                "open a Session first",
            )
        if not member.active:
            raise Refusal(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {short(request.worker, 60)!r}: a passive session holds no pieces; ask again once it "
                "sent Ready",
            )
        try:
            dataset = Dataset(request.train_tokens, self.ledger.piece_tokens, request.data_sha256)
        except ValueError as e:
            raise Refusal(invalid, short(str(e))) from None
        standing = self.standing(request.worker)
        try:
            grant = self.ledger.ask(
                request.worker, list(request.done), list(request.held), request.want, now, standing, dataset
            )
        except LedgerError as e:
            code = invalid if e.kind == "invalid" else grpc.StatusCode.FAILED_PRECONDITION
            raise Refusal(code, str(e)) from None
        self._said(request.worker, dataset, grant.binding)
        if grant.refused:
            self._refused(request.worker, grant.refused, now)
        if self.writes is not None and not await self.writes.durable():
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "the shard cannot write its checkpoint: try again")
        reply = pb.PiecesReply(
            epoch=grant.epoch,
            pieces_done=grant.done,
            pieces_total=grant.total,
            refused=grant.refused,
            repeated=grant.repeated,
            piece_tokens=self.ledger.piece_tokens,
        )
        reply.held.extend(pb.PieceRange(id=p, start=s, end=e) for p, s, e in grant.held)
        return reply

    @staticmethod
    def _said(worker: str, dataset: Dataset, binding: str | None) -> None:
        name = shown(worker)
        if binding == "bound":
            log.info(
                "data %s bound by %s, provisionally until a worker with a push asks", dataset.named(), name
            )
        elif binding == "confirmed":
            log.info("data %s confirmed by %s, a worker with an accepted push", dataset.named(), name)
        elif binding == "moved":
            log.warning(
                "%s names data %s: the provisional binding moves to it (its leases are dropped)",
                name,
                dataset.named(),
            )

    def _refused(self, worker: str, refused: list[int], now: float) -> None:
        """A warning for done reports refused, at most one a minute for each worker (a liar's thousands
        of reports are one line a minute, with their count)."""
        last, count = self._warned.get(worker, (-math.inf, 0))
        count += len(refused)
        if now - last < WARN_SECONDS:
            self._warned[worker] = (last, count)
            return
        log.warning(
            "%s reported %d pieces done that it did not hold (or sooner than they train), as %s: not counted",
            shown(worker),
            count,
            short(str(refused[:8]), 80),
        )
        if len(self._warned) >= 4096:  # bounded: forget those not warned of within the minute
            self._warned = {w: e for w, e in self._warned.items() if now - e[0] < WARN_SECONDS}
        self._warned[worker] = (now, 0)

    async def settled(self) -> None:
        """Until the ledger's write in flight is done (the last checkpoint writes the ledger after it)."""
        if self.writes is not None:
            await self.writes.settled()

    def tick(self, now: float) -> None:
        """Each second: release the pieces of workers a restart is still waiting for, past their grace; let
        lapsed leases go; count the deferred pieces the workers' pushes now cover; write what changed."""
        done = self.ledger.tick(now, self.standing, lambda w: self.lease_of(w, now))
        for name in done.gone:
            log.info("%s did not come back for its pieces: they go to others", shown(name))
        for name, pieces in done.lapsed.items():
            log.warning(
                "%s held pieces %s past their lease (%.0f s): they go to others",
                shown(name),
                short(str(pieces[:8]), 80),
                self.lease_of(name, now),
            )
        if self.writes is not None:
            self.writes.kick()
