"""Shard 0's Pieces calls, between the gRPC servicer and the data ledger (server/storage/ledger.py): a request
is
checked (the caller has an open session with the id its Join gave, the data it names is the run's, every
id and list within bounds), handed to the ledger, and the ledger is made durable in the shard's checkpoint
before the reply goes out: a piece leased or reported done is never lost by a restart of the shard.

What this module must not do: decide who holds which piece (the ledger does), or who is a member (the
roster does; it releases a member's pieces when it stops being one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.edge.admission import Refusal, check_name, short
from streamdiloco.server.storage.ledger import Dataset, Ledger, LedgerError
from streamdiloco.server.trust.roster import Roster

log = logging.getLogger("streamdiloco.shard")


def not_here(shard: int, num_shards: int) -> Refusal:
    """The refusal of a Pieces call to a shard other than 0."""
    return Refusal(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"the data ledger is on shard 0; this is shard {shard} of {num_shards}: call Pieces on shard 0",
    )


class PieceDesk:
    """Shard 0's answers to Pieces (see the module's docstring). `save(state)` writes the ledger's state to
    the checkpoint (False: it could not; the call is refused rather than answered with a lease that a
    restart would forget); None: no checkpoint."""

    def __init__(self, ledger: Ledger, roster: Roster, save: Callable[[dict], bool] | None = None):
        self.ledger, self.roster, self.save = ledger, roster, save
        self.saved_changes = ledger.changes
        roster.when_leaving(ledger.release)  # a member that goes gives its pieces back

    def answer(self, request: pb.PiecesRequest, now: float) -> pb.PiecesReply:
        """The reply to a Pieces call whose credentials were checked for `request.worker`; Refusal when the
        call is refused (nothing changed)."""
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
        try:
            dataset = Dataset(request.train_tokens, self.ledger.piece_tokens, request.data_sha256)
        except ValueError as e:
            raise Refusal(invalid, short(str(e))) from None
        try:
            self.ledger.bind(dataset)
            grant = self.ledger.ask(request.worker, list(request.done), list(request.held), request.want, now)
        except LedgerError as e:
            code = invalid if e.kind == "invalid" else grpc.StatusCode.FAILED_PRECONDITION
            raise Refusal(code, str(e)) from None
        if grant.refused:
            log.warning(
                "%s reported pieces %s done that it does not hold: not counted", request.worker, grant.refused
            )
        if not self.persist():
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

    def persist(self) -> bool:
        """Write the ledger to the checkpoint if it changed since it was last written."""
        if self.save is None or self.ledger.changes == self.saved_changes:
            return True
        changes = self.ledger.changes
        if not self.save(self.ledger.to_state()):
            return False
        self.saved_changes = changes
        return True

    def tick(self, now: float) -> None:
        """Each second: release the pieces of workers a restart is still waiting for, past their grace, and
        write what changed (releases of members that went)."""
        for name in self.ledger.expire(now):
            log.info("%s did not come back for its pieces: they go to others", name)
        self.persist()
