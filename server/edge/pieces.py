"""Shard 0's Pieces calls, between the gRPC servicer and the data ledger (server/storage/ledger.py): a request
is checked (the caller has an open, active session with the id its Join gave, the data it names is the
run's, every id and list within bounds), handed to the ledger with what the shard knows of the caller (its
`Standing`: accepted pushes and the tokens they brought, from the contribution credits, and a piece's
expected time at the run's pace), and the reply goes out once the ledger as it is then is on disk.

Durability without blocking the loop: the ledger counts its changes, an ask that changed nothing (a retried
or repeated call) writes nothing, and one that did awaits a coalesced write (server/storage/coalesced.py: one
write in flight, of the latest state, on the ledger's writer thread), so a piece leased or reported done is
never lost by a restart of the shard, and 263 unchanged asks a second cost no write at all.

The trust rules the desk feeds (stated in the ledger's docstring): a passive session holds no pieces (its
ask is refused, retryably: UNAVAILABLE, until its Ready); a lease lapses after LEASE_PIECES times a piece's
expected time at the run's pace plus LEASE_ROUNDS round timeouts (the time its rounds take to credit it).
A piece's expected time for a worker is piece_tokens x H x pace / (its credited tokens per accepted push):
under either schedule a worker pushes each fragment once per H schedule steps of the pace, so its tokens
per push over H x pace is its speed. A worker without credited rounds yet gets the median of those that
have; none yet: the round timeouts alone.

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
        roster.when_leaving(ledger.release)  # a member that goes gives its pieces back

    # --- what the shard knows of a worker ------------------------------------------------------------------
    def standing(self, worker: str) -> Standing:
        """The worker's accepted pushes, credited tokens and a piece's expected time for it (0: unknown)."""
        row = self.credits.rows.get(worker)
        if row is None:
            return Standing()
        pace, cfg = self.state.pace(), self.state.cfg
        seconds = 0.0
        if row.rounds > 0 and row.tokens > 0 and pace > 0:
            per_push = row.tokens * self.credits.num_fragments / row.rounds
            seconds = self.ledger.piece_tokens * cfg.sync_every * pace / per_push
        return Standing(row.pushes, row.tokens, seconds)

    def lease_of(self, worker: str, now: float = 0.0) -> float:
        """How long a lease of `worker` lasts (see the module's docstring)."""
        piece = self.standing(worker).piece_seconds or self._typical_piece_seconds(now)
        rt = self.state.round_timeout
        return LEASE_PIECES * piece + LEASE_ROUNDS * (rt if math.isfinite(rt) else DEFAULT_ROUND_SECONDS)

    def _typical_piece_seconds(self, now: float) -> float:
        """The median piece time of the members that have one (worked out at most once a second)."""
        when, seconds = self._typical
        if now - when >= 1.0:
            known = [s for m in self.roster.members() if (s := self.standing(m.name).piece_seconds) > 0]
            seconds = statistics.median(known) if known else 0.0
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
        self._said(request.worker, dataset, grant.binding, grant.refused)
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
    def _said(worker: str, dataset: Dataset, binding: str | None, refused: list[int]) -> None:
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
        if refused:
            log.warning(
                "%s reported pieces %s done that it does not hold (or faster than they train): not counted",
                name,
                short(str(refused[:8]), 80),
            )

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
