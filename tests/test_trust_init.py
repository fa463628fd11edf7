"""The bootstrap of a shard started with `--init from-worker`, as an attacker would use it (issue 26, items 1
and 2): a second upload after the first, an operator-pinned init hash, two shards from two uploaders, an
upload that holds the only slot, and an uploader that dies between shards. In-thread shards (tests/inthread.py)
on loopback, workers through connect() and the upload's own function."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from inthread import InThreadShard

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.wire import values_to_bytes
from streamdiloco.export import fetch_masters
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.initialize import PendingShard
from streamdiloco.server.main import build_service
from streamdiloco.worker.model import build_gpt

pytestmark = pytest.mark.timeout(120)

CFG = SyncConfig(sync_every=6, num_fragments=3)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_gpt("nano")


def _values(model: torch.nn.Module) -> tuple[str, list[torch.Tensor]]:
    """The model's fingerprint (JSON) and its fragments' flat vectors."""
    layout = build_layout(model, CFG.num_fragments)
    return json.dumps(model_fingerprint(layout, CFG)), [flatten(fragment_params(model, f)) for f in layout.fragments]


def _chunks(fp: str, vectors, worker: str = "up", start: threading.Event | None = None, **head):
    """An Initialize stream of a single shard's run: the fingerprint (and `head`), every fragment's values in
    pieces of 10,000, the last mark; with `start`, nothing is sent until it is set."""
    if start is not None:
        start.wait(30)
    yield pb.InitChunk(worker=worker, fingerprint_json=fp, **head)
    for f, vec in enumerate(vectors):
        for a in range(0, vec.numel(), 10_000):
            yield pb.InitChunk(fragment=f, offset=a, values=values_to_bytes(vec[a : a + 10_000]))
    yield pb.InitChunk(last=True)


def _pending(tmp_path: Path, name: str = "s", **kw) -> tuple[PendingShard, InThreadShard, list]:
    """A pending shard with a checkpoint directory, serving in a thread; `made` lists every ShardService
    it builds."""
    pending = build_service(CFG, None, 0, 1, init="from-worker", checkpoint_dir=str(tmp_path / name), **kw)
    assert isinstance(pending, PendingShard)
    made: list = []
    make = pending.make

    def counted(*args):
        service = make(*args)
        made.append(service)
        return service

    pending.make = counted
    return pending, InThreadShard(pending, tmp_path, ""), made  # type: ignore[arg-type]


def test_a_second_upload_opened_before_the_first_ended_gets_already_exists_and_changes_nothing(tmp_path):
    pending, shard, made = _pending(tmp_path)
    try:
        fp, honest = _values(_model(1))
        _, other = _values(_model(2))
        go = threading.Event()
        # opened now (the shard runs its handler), its first message only once the honest upload is in
        late = shard.stub.Initialize.future(_chunks(fp, other, worker="late", start=go), timeout=30)
        with grpc.insecure_channel(shard.target) as channel:  # its own channel: the late one's waits
            pb_grpc.ShardStub(channel).Initialize(_chunks(fp, honest, worker="honest"), timeout=30)
        meta = (tmp_path / "s" / "meta.json").read_bytes()
        go.set()
        with pytest.raises(grpc.RpcError) as e:
            late.result(30)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
        # and one opened after: the same
        with pytest.raises(grpc.RpcError) as e:
            shard.stub.Initialize(_chunks(fp, other, worker="later"), timeout=30)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
        assert len(made) == 1  # one ShardService, ever
        assert (tmp_path / "s" / "meta.json").read_bytes() == meta
        got = fetch_masters([shard.target])
        assert all(torch.equal(a, b) for a, b in zip(got, honest, strict=True))
    finally:
        shard.shutdown()
