"""The bootstrap of a shard started with `--init from-worker`, as an attacker would use it (issue 26, items
1 and 2): a second upload after the first, an operator-pinned init hash, two shards from two uploaders, an
upload that holds the only slot, and an uploader that dies between shards. In-thread shards
(tests/support/inthread.py) on loopback, workers through connect() and the upload's own function."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import layout_from_fingerprint, model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params, slice_ranges
from streamdiloco.common.inithash import init_hash
from streamdiloco.common.wire import values_to_bytes
from streamdiloco.export import fetch_masters
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.edge.initialize import Pace, PendingShard, UploadSlot
from streamdiloco.server.trust.bounds import Limits
from streamdiloco.worker.bootstrap import ShardInfo, initialize_shard, probe_shard
from streamdiloco.worker.join import SyncError, connect
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import InThreadShard
from tests.support.procs import Cluster, streamdiloco, wait_until
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(120)

CFG = SyncConfig(sync_every=6, num_fragments=3)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_gpt("nano")


def _values(model: torch.nn.Module) -> tuple[str, list[torch.Tensor]]:
    """The model's fingerprint (JSON) and its fragments' flat vectors."""
    layout = build_layout(model, CFG.num_fragments)
    vectors = [flatten(fragment_params(model, f)) for f in layout.fragments]
    return json.dumps(model_fingerprint(layout, CFG)), vectors


def _claim(fp: str, vectors, num_shards: int = 1) -> dict:
    """What a worker's first message says of its values: their init hash and every slice's hash."""
    h, digests = init_hash(layout_from_fingerprint(json.loads(fp)), vectors, num_shards)
    return {"init_hash": h, "slice_hashes": digests}


def _chunks(
    fp: str,
    vectors,
    worker: str = "up",
    start: threading.Event | None = None,
    claim: dict | None = None,
    shard: tuple[int, int] = (0, 1),
    gaps: threading.Event | None = None,
):
    """An Initialize stream: the fingerprint and the claim (default: the values' own), shard s of S's slice
    of every fragment in pieces of 10,000, the last mark; with `start`, nothing is sent until it is set;
    with `gaps`, an empty message every 0.1 s after the first until it is set."""
    if start is not None:
        start.wait(30)
    s, n = shard
    yield pb.InitChunk(worker=worker, fingerprint_json=fp, **(claim or _claim(fp, vectors, n)))
    while gaps is not None and not gaps.wait(0.1):
        yield pb.InitChunk()
    for f, vec in enumerate(vectors):
        lo, hi = slice_ranges(vec.numel(), n)[s]
        for a in range(lo, hi, 10_000):
            yield pb.InitChunk(
                fragment=f, offset=a - lo, values=values_to_bytes(vec[a : min(hi, a + 10_000)])
            )
    yield pb.InitChunk(last=True)


def _pending(
    tmp_path: Path, name: str = "s", shard: tuple[int, int] = (0, 1), **kw
) -> tuple[PendingShard, InThreadShard, list]:
    """A pending shard (shard s of S) with a checkpoint directory, serving in a thread; `made` lists every
    ShardService it builds."""
    where = str(tmp_path / name)
    pending = shard_of(CFG, None, *shard, init="from-worker", checkpoint_dir=where, **kw)
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
    # the late call waits for its first message while the honest upload runs: time enough on a busy machine
    pending, shard, made = _pending(tmp_path, limits=Limits(hello_timeout=60))
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


def _refused(stub, chunks, timeout: float = 30) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        stub.Initialize(chunks, timeout=timeout)
    return e.value


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_pinned_shard_takes_the_pinned_values_alone_and_no_other_layout(tmp_path):
    fp, honest = _values(_model(1))
    pin = _claim(fp, honest)["init_hash"]
    pending, shard, made = _pending(tmp_path, init_expect=pin.upper())  # either case, as pasted
    try:
        stub = shard.stub
        _, other = _values(_model(2))
        # other values, their own hash said truthfully: refused at the first message
        e = _refused(stub, _chunks(fp, other))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "--init-expect" in e.details(), e.details()
        # other values that claim the pinned hashes: refused at the first slice that is not what it claims
        e = _refused(stub, _chunks(fp, other, claim=_claim(fp, honest)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not hash" in e.details(), e.details()
        # the pinned hash named, with slice hashes that do not make it
        claim = _claim(fp, other)
        e = _refused(stub, _chunks(fp, other, claim={**claim, "init_hash": pin}))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "make init hash" in e.details(), e.details()
        # a bigger model (another layout): refused before any value, whatever it sends; so a pinned shard
        # holds no more values than the pinned model's
        torch.manual_seed(1)
        big = build_gpt("nano", n_embd=256)
        big_fp, big_values = _values(big)
        e = _refused(stub, _chunks(big_fp, big_values))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "--init-expect" in e.details(), e.details()
        # no init hash at all (an older worker)
        e = _refused(stub, _chunks(fp, honest, claim={"init_hash": ""}))
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "no init hash" in e.details(), e.details()
        assert not made and not (tmp_path / "s" / "meta.json").exists()  # nothing changed
        stub.Initialize(_chunks(fp, honest), timeout=30)
        assert len(made) == 1 and _same(fetch_masters([shard.target]), honest)
        assert json.loads((tmp_path / "s" / "meta.json").read_text())["init_hash"] == pin
        assert shard.join("w", fp).init_hash == pin  # said at Join, for workers to compare
    finally:
        shard.shutdown()
    # restarted from its checkpoint: the same init hash at Join
    again = shard_of(CFG, None, 0, 1, init="from-worker", checkpoint_dir=str(tmp_path / "s"))
    shard = InThreadShard(again, tmp_path, fp)  # type: ignore[arg-type]
    try:
        assert shard.join("w").init_hash == pin
    finally:
        shard.shutdown()


def test_init_hash_prints_what_a_worker_with_that_model_and_seed_uploads():
    fp, values = _values(_model(1))
    r = streamdiloco(
        "init-hash",
        "--model",
        "nano",
        "--seed",
        "1",
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == _claim(fp, values)["init_hash"]
    r = streamdiloco("init-hash", "--model", "nano", "--num-fragments", "3", "--num-shards", "2", timeout=120)
    assert (
        r.stdout.strip().splitlines()[-1]
        == _claim(_values(_model(0))[0], _values(_model(0))[1], 2)["init_hash"]
    )


def test_two_shards_started_from_two_uploads_are_refused_by_every_worker(tmp_path):
    shards = [_pending(tmp_path, f"s{i}", (i, 2)) for i in range(2)]
    try:
        fp, a = _values(_model(1))
        _, b = _values(_model(2))
        shards[0][1].stub.Initialize(_chunks(fp, a, shard=(0, 2)), timeout=30)
        shards[1][1].stub.Initialize(_chunks(fp, b, shard=(1, 2)), timeout=30)
        targets = [s.target for _, s, _ in shards]
        for seed in (1, 2, 3):  # either uploader's values, or others
            with pytest.raises(SyncError, match="the shards started from different parameters") as e:
                connect(_model(seed), targets, CFG, name=f"w{seed}", join_timeout=10)
            assert "\n" not in str(e.value) and "--fresh" in str(e.value)
    finally:
        for _, s, _ in shards:
            s.shutdown()


def test_an_upload_that_sends_no_values_loses_the_slot_at_its_deadline(tmp_path):
    pending, shard, made = _pending(tmp_path, init_timeout=0.5)
    fp, values = _values(_model(1))
    gaps = threading.Event()
    try:
        e = _refused(shard.stub, _chunks(fp, values, gaps=gaps), timeout=15)  # an empty message every 0.1 s
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "--init-timeout" in e.details(), e.details()
        assert not made
        shard.stub.Initialize(_chunks(fp, values), timeout=30)  # the slot is free
        assert len(made) == 1
    finally:
        gaps.set()
        shard.shutdown()


def test_an_uploader_that_dies_between_shards_leaves_a_run_that_a_worker_with_its_seed_completes(tmp_path):
    shards = [_pending(tmp_path, f"s{i}", (i, 2)) for i in range(2)]
    targets = [s.target for _, s, _ in shards]
    gaps = threading.Event()
    try:
        model = _model(1)
        layout = build_layout(model, CFG.num_fragments)
        fp, values = _values(model)
        # the first worker's upload reached shard 0; it died before shard 1 (and mid-upload on shard 1)
        shards[0][1].stub.Initialize(_chunks(fp, values, "first", shard=(0, 2)), timeout=30)
        dying = shards[1][1].stub.Initialize.future(_chunks(fp, values, shard=(1, 2), gaps=gaps), timeout=30)
        shards[1][1].wait_for(lambda: shards[1][0].uploader is not None, "the upload to shard 1 to begin")
        dying.cancel()
        shards[1][1].wait_for(lambda: shards[1][0].uploader is None, "the broken upload to end")
        # a worker with other values never uploads: it waits, then says whose start the run needs
        with pytest.raises(SyncError, match="start a worker with the run's model and seed") as e:
            connect(_model(2), targets, CFG, name="other", join_timeout=1.5)
        assert "\n" not in str(e.value)
        assert not shards[1][2]
        # one with the first worker's model and seed completes shard 1, and the run starts from its values
        engine = connect(_model(1), targets, CFG, name="same", join_timeout=10)
        try:
            assert _same(engine.mirrors, values)
        finally:
            engine.close()
        assert len(shards[1][2]) == 1 and len(shards[0][2]) == 1
        run = init_hash(layout, values, 2)[0]
        assert [s.join("w", fp).init_hash for _, s, _ in shards] == [run, run]
        # and a worker with other values joins it, taking the run's values
        engine = connect(_model(3), targets, CFG, name="later", join_timeout=10)
        try:
            assert _same(engine.mirrors, values)
        finally:
            engine.close()
    finally:
        gaps.set()
        for _, s, _ in shards:
            s.shutdown()


def test_the_init_flags_are_one_line_errors_before_anything_starts():
    r = streamdiloco("server", "--init", "from-worker", "--init-expect", "abc", "--port", "0", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "64 hex digits" in lines[0], r.stderr
    r = streamdiloco("server", "--model", "nano", "--init-expect", "a" * 64, "--port", "0", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "goes with --init from-worker" in lines[0], r.stderr
    r = streamdiloco("server", "--init", "from-worker", "--init-timeout", "0", "--port", "0", timeout=60)
    assert r.returncode == 2 and "--init-timeout must be a positive" in r.stderr, r.stderr


# in `make test-slow`; covered by test_a_pinned_shard_takes_the_pinned_values_alone_and_no_other_layout
# (the same checks, on an in-thread shard) and test_init_hash_prints_what_a_worker_with_that_model_and_seed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pinned_shard_process_takes_the_worker_cli_of_the_pinned_seed_alone(tmp_path):
    sync = ["--sync-every", "6", "--num-fragments", "3"]
    r = streamdiloco("init-hash", "--model", "nano", "--seed", "0", *sync, timeout=120)
    pin = r.stdout.strip().splitlines()[-1]
    with Cluster(tmp_path) as c:
        target, _ = c.shard("s", "--init", "from-worker", "--init-expect", pin, "--init-timeout", "5", *sync)
        worker = ["--model", "nano", "--steps", "6", "--batch-size", "2", "--eval-batches", "1"]
        c.worker("other", [target], *worker, "--seed", "1")
        assert c.procs["other"].wait(180) == 1, c.log("other")[-3000:]
        assert "FAILED_PRECONDITION" in c.log("other") and "--init-expect" in c.log("other")
        assert not (tmp_path / "s-checkpoint" / "meta.json").exists()
        c.worker("pinned", [target], *worker)
        assert c.procs["pinned"].wait(180) == 0, c.log("pinned")[-3000:]
        assert f"init hash {pin}" in c.log("s")
        assert json.loads((tmp_path / "s-checkpoint" / "meta.json").read_text())["init_hash"] == pin


# --- the slot's pace (issue 37, item 6): real shard processes, uploads through the stub and the worker's own
# function; and the worker's checks of what a shard says during the bootstrap


def _trickle(fp: str, vectors, claim: dict, stop: threading.Event, every: float = 1.0):
    """What issue 37 found holding the slot: the first message, then one value of fragment 0 every `every`
    seconds (below --init-timeout, so each one reset the old timer) until `stop` is set."""
    yield pb.InitChunk(worker="trickler", fingerprint_json=fp, **claim)
    for i in range(vectors[0].numel()):
        if stop.wait(every):
            return
        yield pb.InitChunk(fragment=0, offset=i, values=values_to_bytes(vectors[0][i : i + 1]))


def _holding(c: Cluster, stub, start, other: pb.InitChunk):
    """The call `start()` opens, once its upload holds the shard's slot: the shard's log says so (or, before
    that line existed, an upload of `other`'s first message alone is told ABORTED). If that probe took the
    slot as the trickle came (it then ends at once), the trickle is refused: it starts again."""
    call = start()

    def held():
        nonlocal call
        if call.done():
            call = start()
            return None
        if "trickler is sending the starting parameters" in c.log("s"):
            return call
        try:
            stub.Initialize(iter([other]), timeout=10)
        except grpc.RpcError as e:
            return call if e.code() == grpc.StatusCode.ABORTED and not call.done() else None
        return None

    return wait_until("the trickle to hold the upload slot", held)


SYNC = ("--sync-every", "6", "--num-fragments", "3")


def test_a_trickled_upload_loses_the_slot_and_the_honest_worker_then_uploads(tmp_path):
    fp, honest = _values(_model(1))
    layout = build_layout(_model(1), CFG.num_fragments)
    stop = threading.Event()
    with Cluster(tmp_path) as c:
        target, _ = c.shard("s", "--init", "from-worker", "--init-timeout", "3", *SYNC)
        channel = grpc.insecure_channel(target)
        try:
            stub = pb_grpc.ShardStub(channel)
            alone = pb.InitChunk(worker="probe", fingerprint_json=fp, **_claim(fp, honest))
            trickle = _holding(
                c, stub, lambda: stub.Initialize.future(_trickle(fp, honest, _claim(fp, honest), stop)), alone
            )
            # the honest worker's own upload: told that another holds the slot, it tries again until it is in
            info = probe_shard(target, "honest", timeout=10)
            init = init_hash(layout, honest, 1)
            assert initialize_shard(target, "honest", json.loads(fp), honest, info, init, timeout=30)
            with pytest.raises(grpc.RpcError) as e:
                trickle.result(30)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
            assert "fell behind --init-min-rate" in e.value.details()
            assert "starting parameters from honest" in c.log("s")
            assert _same(fetch_masters([target]), honest)
        finally:
            stop.set()
            channel.close()


def test_a_pinned_shard_gives_a_trickled_slot_to_the_honest_upload_waiting_in_line(tmp_path):
    fp, honest = _values(_model(1))
    _, other = _values(_model(2))
    pin = _claim(fp, honest)["init_hash"]
    stop = threading.Event()
    with Cluster(tmp_path) as c:
        target, _ = c.shard("s", "--init", "from-worker", "--init-expect", pin, "--init-timeout", "6", *SYNC)
        channel = grpc.insecure_channel(target)
        try:
            stub = pb_grpc.ShardStub(channel)
            not_pinned = pb.InitChunk(worker="probe", fingerprint_json=fp, **_claim(fp, other))
            trickle = _holding(
                c,
                stub,
                lambda: stub.Initialize.future(_trickle(fp, honest, _claim(fp, honest), stop)),
                not_pinned,
            )
            # one call, no retry: it waits in line and takes the slot once the trickle falls behind
            stub.Initialize(_chunks(fp, honest, worker="honest"), timeout=60)
            with pytest.raises(grpc.RpcError) as e:
                trickle.result(30)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
            assert "goes to the next upload in line" in e.value.details()
            assert "starting parameters from honest" in c.log("s")
            assert json.loads((tmp_path / "s-checkpoint" / "meta.json").read_text())["init_hash"] == pin
        finally:
            stop.set()
            channel.close()


def test_the_pace_and_the_line_in_closed_form():
    pace = Pace(grace=30, rate=16384)
    assert pace.due(0, 0, 0) == 30  # nothing sent: the first --init-timeout seconds, no more
    assert pace.due(0, 29, 4) == pytest.approx(30 + 4 / 16384)  # one value per 29 s: behind at 30 s
    assert pace.due(0, 100, 16384 * 100) == 130  # at the rate, the gap rule bounds it
    assert pace.due(0, 10, 1 << 30) == 40  # far ahead of the rate: still values every 30 s
    assert "--init-timeout" in pace.fault(0, 0, 0, 30) and "--init-min-rate" in pace.fault(0, 29, 4, 30.1)

    async def line() -> None:
        slot = UploadSlot(room=2)
        first = slot.take("a")
        assert first is not None and slot.take("b") is None and slot.holder == "a"
        b = asyncio.ensure_future(slot.wait("b", 10))
        c = asyncio.ensure_future(slot.wait("c", 10))
        await asyncio.sleep(0)
        assert await slot.wait("d", 10) is None  # the line is full
        slot.release(first)  # to the first in line
        second = await b
        assert second is not None and slot.holder == "b" and not c.done()
        slot.release(first)  # an old ticket changes nothing
        assert slot.holder == "b"
        c.cancel()  # c's call ended: out of the line
        await asyncio.gather(c, return_exceptions=True)
        slot.release(second)
        assert slot.holder is None and slot.take("e") is not None
        assert await slot.wait("f", 0.05) is None  # the holder kept it: a bounded wait

    asyncio.run(line())


class _LyingShard(pb_grpc.ShardServicer):
    """A shard without parameters that says what the test scripts at Join and refuses every upload with
    `refusal`, counting them."""

    def __init__(self, shard=0, num_shards=1, init_hash="", refusal=(grpc.StatusCode.ABORTED, "busy")):
        self.reply = pb.JoinReply(
            config_json=json.dumps(CFG.to_dict()),
            shard=shard,
            num_shards=num_shards,
            uninitialized=True,
            init_hash=init_hash,
        )
        self.refusal, self.uploads = refusal, 0
        self.messages: list[pb.InitChunk] = []  # the last upload's

    def Join(self, request, context):
        return self.reply

    def Initialize(self, request_iterator, context):
        self.uploads += 1
        self.messages = list(request_iterator)
        context.abort(*self.refusal)


@pytest.fixture
def liar():
    servers = []

    def start(shard: _LyingShard) -> str:
        server = grpc.server(ThreadPoolExecutor(4))
        pb_grpc.add_ShardServicer_to_server(shard, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


FORGED = "busy\n2026-01-01T00:00:00.000+00:00 ERROR streamdiloco.worker: forged\x1b[31m"


def test_a_shard_that_lies_at_the_probe_is_refused_in_one_line(liar):
    for lie, words in [
        (_LyingShard(shard=3, num_shards=2), "unusable Join reply"),
        (_LyingShard(num_shards=1 << 20), "must list each of the run's shards once"),  # 2^20 slices to hash
        (_LyingShard(init_hash="0" * 63 + "\n"), "is not 64 hex digits"),
    ]:
        started = time.monotonic()
        with pytest.raises(SyncError, match=words) as e:
            connect(_model(1), [liar(lie)], CFG, name="w", join_timeout=10)
        assert "\n" not in str(e.value) and time.monotonic() - started < 10, str(e.value)
        assert lie.uploads == 0


def test_an_upload_the_shard_keeps_refusing_is_sent_again_then_given_up_in_one_line(liar, caplog):
    vectors = [torch.ones(100), torch.ones(50)]
    claim = ("a" * 64, [b"\0" * 32] * 2)
    info = ShardInfo(CFG, 0, 1, True)
    busy = _LyingShard(refusal=(grpc.StatusCode.ABORTED, FORGED))
    with caplog.at_level(logging.INFO, "streamdiloco.worker"):
        with pytest.raises(SyncError, match="still has no parameters after") as e:
            initialize_shard(liar(busy), "w", {}, vectors, info, claim, timeout=4)
    assert busy.uploads >= 2, busy.uploads  # sent again after a backoff
    assert "sending again in" in caplog.text and "\n2026" not in caplog.text
    for text in (str(e.value), caplog.text):
        assert "\x1b" not in text and "forged\\x1b" in text
    assert "\n" not in str(e.value) and "ABORTED" in str(e.value)
    # a refusal that is not worth another try ends the upload at once, in one line
    denied = _LyingShard(refusal=(grpc.StatusCode.PERMISSION_DENIED, FORGED))
    with pytest.raises(SyncError, match="PERMISSION_DENIED") as e:
        initialize_shard(liar(denied), "w", {}, vectors, info, claim, timeout=4)
    assert denied.uploads == 1 and "\n" not in str(e.value) and "\x1b" not in str(e.value)


def test_an_upload_asks_with_its_fingerprint_alone_then_sends_its_values_in_small_messages(liar):
    """Over 1 Mbit/s: the call's request (its first message) must come within the shard's 5 s
    --request-timeout, and a message of values within --init-timeout (30 s) at the shard's --init-min-rate:
    a MiB of values in either took 8 s and 64 s (tests/test_slow_upload.py runs the link itself)."""
    shard = _LyingShard(refusal=(grpc.StatusCode.PERMISSION_DENIED, "no"))
    vectors = [torch.ones(300_000), torch.ones(10)]
    with pytest.raises(SyncError, match="PERMISSION_DENIED"):
        initialize_shard(
            liar(shard), "w", {"model": "m"}, vectors, ShardInfo(CFG, 0, 1, True), ("a" * 64, [])
        )
    first, *rest = shard.messages
    assert first.fingerprint_json and not first.values and rest[-1].last
    assert sum(len(m.values) for m in rest) == 4 * 300_010
    assert max(len(m.values) for m in rest) <= 256 << 10
