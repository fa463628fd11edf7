"""The Pieces RPC over a real gRPC channel (an in-thread shard): shard 0 answers it, bound to the caller's
session and credentials; every field is checked and a refused call changes nothing; a done report of a
piece the caller does not hold is refused; a member that goes gives its pieces back; the ledger is in the
shard's checkpoint (hashed, listed in meta.json) and a restarted shard keeps every assignment."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest

from streamdiloco.common.config import SyncConfig
from streamdiloco.server.trust.auth import Auth
from tests.support.inthread import InThreadShard
from tests.support.pieces import ask as pieces_ask
from tests.support.pieces import credit
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(60)

CFG = SyncConfig(sync_every=6, num_fragments=2)
SHA = "0f" * 32
TOKENS = 1050  # pieces of 100 tokens: 11, the last of 50
TOKEN = "sekrit"


def service(tmp_path, shard: int = 0, num_shards: int = 1):
    return shard_of(
        CFG,
        "nano",
        shard=shard,
        num_shards=num_shards,
        auth=Auth(token=TOKEN, names_per_token=4),  # several workers' names on the one run token
        checkpoint_dir=str(tmp_path / f"ckpt-{shard}"),
        piece_tokens=100,
    )


def fingerprint_json(svc) -> str:
    return json.dumps(svc.fingerprint)


@pytest.fixture
def shard(tmp_path, shards):
    svc = service(tmp_path)
    return shards.add(InThreadShard(svc, tmp_path, fingerprint_json(svc), token=TOKEN))


def ask(s: InThreadShard, w, done=(), held=(), want=1, sha=SHA, tokens=TOKENS, token=TOKEN, session=None):
    return pieces_ask(s, w, sha, tokens, token, done, held, want, session)


def ids(reply) -> list[int]:
    return [p.id for p in reply.held]


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_pieces_in_order_and_refusals_change_nothing(shard):
    a, b = shard.worker("a"), shard.worker("b")
    credit(shard, "a")  # a pushed: its ask binds the data for good (b's other data is refused)
    r = ask(shard, a, want=2)
    assert [(p.id, p.start, p.end) for p in r.held] == [(0, 0, 100), (1, 100, 200)]
    assert (r.epoch, r.pieces_done, r.pieces_total, r.piece_tokens) == (0, 0, 11, 100)
    before = shard.status()["data"]
    cases = [
        (dict(session="nope"), grpc.StatusCode.FAILED_PRECONDITION, "no open session"),
        (dict(token="wrong"), grpc.StatusCode.UNAUTHENTICATED, ""),
        (dict(sha="xyz"), grpc.StatusCode.INVALID_ARGUMENT, "sha256"),
        (dict(sha="1f" * 32), grpc.StatusCode.FAILED_PRECONDITION, "same data"),
        (dict(tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        (dict(done=[11]), grpc.StatusCode.INVALID_ARGUMENT, "piece 11"),
        (dict(held=[0, 0]), grpc.StatusCode.INVALID_ARGUMENT, "twice"),
        (dict(done=list(range(11)) * 6), grpc.StatusCode.INVALID_ARGUMENT, "at most 64"),
        (dict(want=9), grpc.StatusCode.INVALID_ARGUMENT, "want"),
    ]
    for kw, code, text in cases:
        e = refused(lambda kw=kw: ask(shard, b, **kw))
        assert e.code() == code and text in e.details(), (kw, e.details())
    assert shard.status()["data"] == before
    r = ask(shard, b, done=[0], want=1)  # b does not hold 0: refused, not counted
    assert list(r.refused) == [0] and r.pieces_done == 0 and ids(r) == [2]
    r = ask(shard, a, done=[0], held=[1], want=2)
    assert list(r.refused) == [] and r.pieces_done == 1 and ids(r) == [1, 3]
    data = shard.status()["data"]
    assert (data["pieces_done"], data["pieces_total"], data["epoch"]) == (1, 11, 0)
    assert data["held"] == {"a": [1, 3], "b": [2]}


def test_a_member_that_goes_gives_its_pieces_back(shard):
    a, b = shard.worker("a"), shard.worker("b")
    assert ids(ask(shard, a, want=2)) == [0, 1]
    a.session.close()
    shard.wait_for(lambda: "a" not in shard.service.roster.open, "a's session to end")
    assert shard.status()["data"]["held"] == {}
    assert ids(ask(shard, b, want=3)) == [0, 1, 2]
    e = refused(lambda: ask(shard, a))  # no session any more
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_only_shard_0_keeps_the_ledger(tmp_path):
    svc = service(tmp_path, shard=1, num_shards=2)
    s = InThreadShard(svc, tmp_path, fingerprint_json(svc), token=TOKEN)
    try:
        w = s.worker("a")
        e = refused(lambda: ask(s, w))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.details() == "the data ledger is on shard 0; this is shard 1 of 2: call Pieces on shard 0"
        assert s.status()["data"] is None
    finally:
        s.shutdown()


def test_ledger_survives_a_restart_in_the_checkpoint(tmp_path):
    svc = service(tmp_path)
    s = InThreadShard(svc, tmp_path, fingerprint_json(svc), token=TOKEN)
    a = s.worker("a")
    credit(s, "a")
    ask(s, a, want=2)
    ask(s, a, done=[0], held=[1], want=2)
    meta = json.loads((tmp_path / "ckpt-0" / "meta.json").read_text())
    assert "ledger.json" in meta["files"]  # written before the reply went out
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "ckpt-0", killed / "ckpt-0")  # the checkpoint as a kill -9 now leaves it
    s.shutdown()
    tmp_path = killed

    svc = service(tmp_path)
    s = InThreadShard(svc, tmp_path, fingerprint_json(svc), token=TOKEN)
    try:
        data = s.status()["data"]
        assert (data["pieces_done"], data["held"], data["waiting_for"]) == (1, {"a": [1, 2]}, ["a"])
        b = s.worker("b")
        assert ids(ask(s, b, want=1)) == [3]  # a's pieces wait for it
        a = s.worker("a")
        credit(s, "a")  # (the credits of the killed shard were not written yet)
        r = ask(s, a, done=[1], held=[2], want=1)  # back: it claims what it holds
        assert ids(r) == [2] and r.pieces_done == 2
    finally:
        s.shutdown()

    (tmp_path / "ckpt-0" / "ledger.json").write_text('{"format": 1}')
    with pytest.raises(ValueError, match="ledger.json is damaged"):
        service(tmp_path)
