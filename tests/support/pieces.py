"""Shard 0's Pieces calls as tests make them (tests/test_pieces_rpc.py, tests/test_trust_ledger.py): an ask
over gRPC from a worker with an open session, and a member credited as if its pushes had been accepted (what
the data ledger's trust rules read: server/edge/pieces.py)."""

from __future__ import annotations

from collections.abc import Iterable

from streamdiloco.protos import streamdiloco_pb2 as pb
from tests.support.inthread import RPC_TIMEOUT, InThreadShard


def ask(
    s: InThreadShard,
    w,
    sha: str,
    tokens: int,
    token: str,
    done: Iterable[int] = (),
    held: Iterable[int] = (),
    want: int = 1,
    session: str | None = None,
) -> pb.PiecesReply:
    """Worker `w`'s Pieces call (its Join's session unless `session`): data `sha` of `tokens` train tokens."""
    request = pb.PiecesRequest(
        worker=w.name,
        session=w.join.session if session is None else session,
        token=token,
        train_tokens=tokens,
        data_sha256=sha,
        done=list(done),
        held=list(held),
        want=want,
    )
    return s.stub.Pieces(request, timeout=RPC_TIMEOUT)


def credit(s: InThreadShard, name: str, tokens: float = 1e6) -> None:
    """As if `name` had an accepted push whose round brought `tokens` into the model (the credits): its
    asks confirm the run's data and its done reports are covered."""

    def give() -> None:
        row = s.service.credits.row(name)
        row.pushes, row.rounds, row.tokens = row.pushes + 1, row.rounds + 1, row.tokens + tokens

    s.on_loop(give)
