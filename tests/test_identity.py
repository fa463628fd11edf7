"""Names bound to credentials, over a real gRPC channel (a shard in the test's process, on loopback): with
per-worker tokens (--workers-file) nobody takes another worker's name (after its link broke, after a shard
restart while it is `returning`, or a made-up name to fill --min-workers), a sniffed session id is
refused without its credential, and a worker removed from the workers file is cut off at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from streamdiloco.common.wire import PROTOCOL, auth_metadata, make_channel
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.trust.auth import Auth, WorkersFile, token_hash
from tests.support.inthread import RPC_TIMEOUT, InThreadShard, Session, refused
from tests.support.nano_shard import CFG, CHUNK_BYTES, GOOD_FP
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(60)

TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token"}


def write_workers(path: Path, tokens: dict[str, str]) -> None:
    """As an operator's editor does: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("".join(f"{name} {token_hash(t)}\n" for name, t in tokens.items()))
    os.replace(tmp, path)


class Shard(InThreadShard):
    def __init__(self, tmp: Path, min_workers: int = 2, checkpoint: bool = False):
        workers = WorkersFile(str(tmp / "workers.txt"))
        service = shard_of(
            CFG,
            "nano",
            shard=0,
            num_shards=2,
            min_workers=min_workers,
            chunk_bytes=CHUNK_BYTES,
            checkpoint_dir=str(tmp / "checkpoint") if checkpoint else None,
            auth=Auth(workers=workers.load()),
            workers_file=workers,
        )
        super().__init__(service, tmp, GOOD_FP)

    def members(self) -> list[str]:
        return self.on_loop(lambda: sorted(self.service.state.members))


@pytest.fixture
def workers_file(tmp_path) -> Path:
    path = tmp_path / "workers.txt"
    write_workers(path, TOKENS)
    return path


@pytest.fixture
def shard(tmp_path, workers_file):
    s = Shard(tmp_path)
    yield s
    s.shutdown()


def hello(name: str, session: str) -> pb.WorkerMessage:
    return pb.WorkerMessage(hello=pb.Hello(worker=name, session=session))


def test_a_name_cannot_be_taken_by_another_credential_even_after_its_owner_left(shard):
    e = refused(shard.join, "alice", token=TOKENS["bob"])
    assert (
        e.code() == grpc.StatusCode.PERMISSION_DENIED and "'bob''s: it cannot act as 'alice'" in e.details()
    )
    assert refused(shard.join, "alice", token="").code() == grpc.StatusCode.UNAUTHENTICATED
    alice = shard.worker("alice", token=TOKENS["alice"])
    assert shard.members() == ["alice"]
    alice.session.cancel()  # its link breaks
    shard.wait_for(lambda: not shard.service.roster.open, "alice to leave")
    e = refused(shard.join, "alice", token=TOKENS["bob"])  # the name is free, but not for bob
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused(shard.join, "alice", token="alice-secret-tokeN").code() == grpc.StatusCode.UNAUTHENTICATED
    assert shard.worker("alice", token=TOKENS["alice"]).welcome.member  # its owner comes back
    assert shard.members() == ["alice"]


def test_made_up_names_cannot_fill_min_workers(tmp_path, workers_file):
    s = Shard(tmp_path, min_workers=3)
    try:
        bob = s.worker("bob", token=TOKENS["bob"])
        for made_up in ("worker-x", "worker-y", "worker-z"):
            for token in ("", "guess", TOKENS["bob"]):
                code = refused(s.join, made_up, token=token).code()
                assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        assert s.members() == ["bob"]
        assert s.status()["min_workers"] == 3 and bob.welcome.member
    finally:
        s.shutdown()


def test_a_sniffed_session_id_is_refused_without_its_credential(shard):
    reply = shard.join("alice", token=TOKENS["alice"])
    for token, code in (
        ("", grpc.StatusCode.UNAUTHENTICATED),
        (TOKENS["bob"], grpc.StatusCode.PERMISSION_DENIED),
    ):
        err = shard.open_session(hello("alice", reply.session), token=token).error()
        assert err.code() == code, (token, err)
    assert shard.on_loop(lambda: dict(shard.service.roster.open)) == {}
    # the session id is still good for its owner: the refusals did not use it up
    s = shard.open_session(hello("alice", reply.session), token=TOKENS["alice"])
    assert s.next_message("welcome").welcome.member


def test_with_the_run_token_a_session_needs_it_too(tmp_path):
    service = shard_of(CFG, "nano", shard=0, num_shards=2, chunk_bytes=CHUNK_BYTES, token="run-token")
    s = InThreadShard(service, tmp_path, GOOD_FP, token="run-token")
    try:
        reply = s.join("w0")
        err = s.open_session(hello("w0", reply.session), token="").error()  # sniffed, without the token
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "run token" in err.details()
        assert s.open_session(hello("w0", reply.session)).next_message("welcome")
    finally:
        s.shutdown()


def test_a_revoked_worker_is_cut_off_and_refused_at_its_next_join(shard, workers_file):
    alice = shard.worker("alice", token=TOKENS["alice"])
    pending = shard.join("bob", token=TOKENS["bob"]).session  # a Join of bob's not yet followed by a Session
    bob = shard.worker("bob", token=TOKENS["bob"])
    assert shard.members() == ["alice", "bob"]
    write_workers(workers_file, {"alice": TOKENS["alice"]})  # bob's line removed: no restart
    err = bob.session.error()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "bob was revoked" in err.details()
    assert shard.members() == ["alice"]
    assert refused(shard.join, "bob", token=TOKENS["bob"]).code() == grpc.StatusCode.UNAUTHENTICATED
    err = shard.open_session(hello("bob", pending), token=TOKENS["bob"]).error()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    # a changed token revokes too; alice's session was never touched until then
    assert shard.on_loop(lambda: shard.service.roster.open["alice"].revoked) is False
    write_workers(workers_file, {"alice": "alice-new-token"})
    assert alice.session.error().code() == grpc.StatusCode.UNAUTHENTICATED
    assert shard.worker("alice", token="alice-new-token").welcome.member


def test_a_workers_file_that_does_not_parse_changes_nothing(shard, workers_file):
    shard.worker("alice", token=TOKENS["alice"])
    workers_file.write_text("alice not-a-hash\n")
    shard.wait_for(lambda: not shard.service.config.workers_file.changed(), "the shard to read the file")
    assert shard.members() == ["alice"]
    assert shard.join("bob", token=TOKENS["bob"]).session  # the old table is still in force


def test_a_returning_name_after_a_restart_is_bound_to_its_credential(tmp_path, workers_file):
    first = Shard(tmp_path, checkpoint=True)
    with make_channel(first.target) as channel:  # not the test's channel, which shutdown() closes first
        stub = pb_grpc.ShardStub(channel)
        request = pb.JoinRequest(worker="alice", fingerprint_json=GOOD_FP, protocol=PROTOCOL)
        reply = stub.Join(request, metadata=auth_metadata(TOKENS["alice"]), timeout=RPC_TIMEOUT)
        alice = Session(stub, hello("alice", reply.session), auth_metadata(TOKENS["alice"]))
        assert alice.next_message("welcome").welcome.member
        first.shutdown(stop_first=True)  # as a killed shard: its checkpoint names alice as a member
        alice.cancel()
    again = Shard(tmp_path, checkpoint=True)
    try:
        assert again.status()["returning"] == ["alice"]
        for token in ("", TOKENS["bob"]):
            assert refused(again.join, "alice", token=token).code() in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            )
        assert again.status()["returning"] == ["alice"]  # still waited for: nobody took its place
        again.worker("alice", token=TOKENS["alice"])
        assert again.status()["returning"] == [] and again.members() == ["alice"]
    finally:
        again.shutdown()
