"""Admission in one place (server/edge/admission.py): the pure decision, and that the pending shard of `--init
from-worker` admits as the running shard does, before any upload (a real in-process gRPC server)."""

from __future__ import annotations

import json

import grpc
import pytest
import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.inithash import init_hash
from streamdiloco.common.wire import PROTOCOL, values_to_bytes
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.edge.admission import Credentials, Refusal, admit
from streamdiloco.server.edge.initialize import PendingShard
from streamdiloco.server.trust.auth import Auth
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import InThreadShard
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(60)

CFG = SyncConfig(sync_every=6, num_fragments=3)


def _fingerprint() -> dict:
    return model_fingerprint(build_layout(build_gpt("nano"), CFG.num_fragments), CFG)


def _refusal(*args, **kw) -> Refusal:
    with pytest.raises(Refusal) as e:
        admit(*args, **kw)
    return e.value


def test_admit_refuses_what_join_refuses_in_its_order():
    fp = _fingerprint()
    good = json.dumps(fp)
    checks = Auth(token="t")
    assert admit(checks, Credentials("t"), "w0", PROTOCOL, good, fp).via == "run token"
    r = _refusal(checks, Credentials("x"), "w0", PROTOCOL, good, fp)
    assert r.code == grpc.StatusCode.UNAUTHENTICATED
    r = _refusal(checks, Credentials("t"), "w0", PROTOCOL + 1, good, fp)
    assert r.code == grpc.StatusCode.FAILED_PRECONDITION and "upgrade the older side" in r.message
    r = _refusal(checks, Credentials("t"), " w0", PROTOCOL, good, fp)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT and "worker name" in r.message
    r = _refusal(Auth(), Credentials("t"), "w0", PROTOCOL, good, fp)
    assert r.code == grpc.StatusCode.FAILED_PRECONDITION and r.kind == "unchecked-token"
    assert "checks none" in r.message
    r = _refusal(checks, Credentials("t"), "w0", PROTOCOL, "[1]", fp)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT and "not valid JSON" in r.message
    other = json.dumps(
        model_fingerprint(build_layout(build_gpt("nano"), 3), SyncConfig(sync_every=9, num_fragments=3))
    )
    r = _refusal(checks, Credentials("t"), "w0", PROTOCOL, other, fp)
    assert r.code == grpc.StatusCode.FAILED_PRECONDITION and r.kind == "fingerprint"
    assert "sync_every is 9 on the worker, 6 on the shard" in r.message
    # no fingerprint to compare with (the pending shard, a config-only Join): the rest is checked alike
    assert admit(checks, Credentials("t"), "w0", PROTOCOL, "not json").via == "run token"
    assert _refusal(Auth(), Credentials("t"), "w0", None).kind == "unchecked-token"


def test_the_pending_shard_refuses_a_token_it_would_not_check_before_any_upload(tmp_path):
    """A token offered to a shard that checks none is refused at the pending shard's Join, as at the running
    shard's, and an upload that offers one is refused before its values are taken."""
    pending = shard_of(CFG, None, 0, 1, init="from-worker")
    assert isinstance(pending, PendingShard)
    torch.manual_seed(0)
    model = build_gpt("nano")
    layout = build_layout(model, CFG.num_fragments)
    fp = json.dumps(model_fingerprint(layout, CFG))
    vectors = [flatten(fragment_params(model, f)) for f in layout.fragments]
    shard = InThreadShard(pending, tmp_path, fp)  # type: ignore[arg-type]
    try:
        with pytest.raises(grpc.RpcError) as e:
            shard.stub.Join(pb.JoinRequest(worker="w0", token="t", protocol=PROTOCOL), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "checks none" in e.value.details()

        h, digests = init_hash(layout, vectors, 1)

        def upload(token: str):
            yield pb.InitChunk(
                worker="w0", token=token, fingerprint_json=fp, init_hash=h, slice_hashes=digests
            )
            for f, vec in enumerate(vectors):
                for a in range(0, vec.numel(), 100_000):
                    yield pb.InitChunk(fragment=f, offset=a, values=values_to_bytes(vec[a : a + 100_000]))
            yield pb.InitChunk(last=True)

        with pytest.raises(grpc.RpcError) as e:
            shard.stub.Initialize(upload("t"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "checks none" in e.value.details()
        assert shard.on_loop(lambda: pending.running) is None  # nothing taken
        # without the token both are admitted: the shard waits for the parameters, then takes them
        reply = shard.stub.Join(pb.JoinRequest(worker="w0", protocol=PROTOCOL), timeout=10)
        assert reply.uninitialized
        shard.stub.Initialize(upload(""), timeout=30)
        assert shard.on_loop(lambda: pending.running) is not None
    finally:
        shard.shutdown()
