"""The one reader of Fetch (common/fetch.py), and a worker that never applies masters it has not checked.

The reader's rules against a scripted Fetch on a real gRPC server (port 0): a whole stream read, a broken
one resumed from what was received, a round that closed meanwhile started over, and every lie refused in
one line. Then a hostile shard: a real in-process gRPC server in front of a real shard (Join and Session
pass through) whose Fetch sends non-finite values, or a slice of another size than the run's layout: a
joining worker refuses it with the reason and its model keeps its parameters; a link that resynchronizes
from it keeps its mirror's state as it was. And (issue 37) a Fetch that a full edge refuses
(RESOURCE_EXHAUSTED) is tried again after a backoff; a call that brings nothing for `stall` seconds is ended
and resumed; a link whose resync Fetch the shard stalls resumes it, or, when every call stalls, fails in one
line after --reconnect-timeout instead of holding its thread for ever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fetch import FetchError, fetch_slices
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker import connection
from streamdiloco.worker.join import SyncError, connect
from streamdiloco.worker.link import ShardLink
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import WAIT, InThreadShard, push_messages
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(60)

SIZES = {0: 1000, 1: 700, 2: 10}
CHUNK = 300  # values per chunk of the scripted shard


def values(f: int, round: int) -> torch.Tensor:
    return torch.randn(SIZES[f], generator=torch.Generator().manual_seed(100 * round + f))


def honest(request: pb.FetchRequest, rounds: dict[int, int] | None = None) -> list[pb.MasterChunk]:
    """What a shard sends for `request`: the fragments asked for (all if none), the first from the offset."""
    rounds = rounds or {}
    out = []
    for i, f in enumerate(list(request.fragments) or list(SIZES)):
        x, n = values(f, rounds.get(f, 4)), SIZES[f]
        for lo in range(request.offset if i == 0 else 0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            raw, r = x[lo:hi].numpy().tobytes(), rounds.get(f, 4)
            out.append(pb.MasterChunk(fragment=f, round=r, offset=lo, total=n, values=raw, last=hi == n))
    return out


class Scripted(pb_grpc.ShardServicer):
    """A Fetch that answers call i with calls[i](request, context) and records the requests."""

    def __init__(self, *calls: Callable):
        self.calls, self.requests = list(calls), []

    def Fetch(self, request, context):
        self.requests.append(request)
        yield from self.calls[min(len(self.requests), len(self.calls)) - 1](request, context)


@pytest.fixture
def scripted():
    servers = []

    def start(*calls: Callable) -> tuple[Scripted, pb_grpc.ShardStub]:
        script = Scripted(*calls)
        server = grpc.server(ThreadPoolExecutor(4))
        pb_grpc.add_ShardServicer_to_server(script, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        return script, pb_grpc.ShardStub(channel)

    yield start
    for server in servers:
        server.stop(None)


def broken_after(n: int, rounds: dict[int, int] | None = None) -> Callable:
    """The first `n` chunks of an honest stream, then the connection is lost."""

    def call(request, context):
        yield from honest(request, rounds)[:n]
        context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")

    return call


def test_the_reader_takes_a_whole_stream_and_describes_it(scripted):
    script, stub = scripted(lambda request, context: honest(request))
    got = fetch_slices(stub, SIZES, where="shard 0 at here")
    assert got.rounds == {0: 4, 1: 4, 2: 4}
    assert all(torch.equal(got.slices[f], values(f, 4)) for f in SIZES)
    assert got.describe() == (
        "shard 0 at here: 3 fragment slice(s), 1,710 values (0.0 MB), rounds {0: 4, 1: 4, 2: 4}"
    )
    assert [list(r.fragments) for r in script.requests] == [[0, 1, 2]]


def test_a_broken_stream_is_resumed_from_what_was_received(scripted):
    script, stub = scripted(broken_after(5), lambda request, context: honest(request))
    got = fetch_slices(stub, SIZES, where="shard 0 at here")
    assert all(torch.equal(got.slices[f], values(f, 4)) for f in SIZES)
    # 4 chunks of fragment 0 (1000 values) and one of fragment 1: the rest of fragment 1 from value 300
    assert [(list(r.fragments), r.offset) for r in script.requests] == [([0, 1, 2], 0), ([1, 2], 300)]


def test_a_round_that_closed_while_the_stream_was_broken_starts_that_fragment_over(scripted):
    script, stub = scripted(broken_after(5), lambda request, context: honest(request, {1: 5, 2: 5}))
    got = fetch_slices(stub, SIZES, where="shard 0 at here")
    assert got.rounds == {0: 4, 1: 5, 2: 5}
    assert torch.equal(got.slices[0], values(0, 4)) and torch.equal(got.slices[1], values(1, 5))
    assert [(list(r.fragments), r.offset) for r in script.requests] == [
        ([0, 1, 2], 0),
        ([1, 2], 300),  # round 5 now: fragment 1 again from its start
        ([1, 2], 0),
    ]


def _changed(i: int, **fields) -> Callable:
    def call(request, context):
        chunks = honest(request)
        for k, v in fields.items():
            setattr(chunks[i], k, v)
        return chunks

    return call


NAN = torch.full((CHUNK,), float("nan")).numpy().tobytes()


@pytest.mark.parametrize(
    "call, words",
    [
        (_changed(1, values=NAN), "shard 0 at here: fragment 0: the chunk holds non-finite values"),
        (_changed(5, values=torch.full((CHUNK,), float("inf")).numpy().tobytes()), "non-finite values"),
        (_changed(1, total=1001), "fragment 0: the slice has 1000 values, the shard says 1001"),
        (_changed(1, round=5), "fragment 0: round 5 after chunks of round 4: start over"),
        (_changed(1, offset=0), "fragment 0: offset 0, expected 300"),
        (_changed(1, values=b"\0" * 7), "whole 4-byte numbers"),
        (_changed(3, last=False), "fragment 0: chunk ends at 1000 of 1000 but last is false"),
        (lambda r, c: [x for x in honest(r) if x.fragment != 1], "sent fragment 2 where fragment 1 was due"),
        (lambda r, c: honest(r)[:2] + honest(r)[4:], "sent fragment 1 amid fragment 0"),
        (lambda r, c: honest(r) + honest(r)[-1:], "sent fragment 2 where the Fetch was over"),
        (lambda r, c: honest(r)[:-1], "shard 0 at here ended the Fetch after 2 of 3 fragments"),
    ],
)
def test_a_stream_that_does_not_fit_is_refused_in_one_line(scripted, call, words):
    _, stub = scripted(call)
    with pytest.raises(FetchError) as e:
        fetch_slices(stub, SIZES, where="shard 0 at here")
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_refused_fetch_is_not_tried_again_and_says_its_status(scripted):
    def refuse(request, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not your run")
        yield  # pragma: no cover

    script, stub = scripted(refuse)
    with pytest.raises(FetchError, match="Fetch from shard 0 at here failed: PERMISSION_DENIED") as e:
        fetch_slices(stub, SIZES, where="shard 0 at here")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and len(script.requests) == 1
    _, stub = scripted(*[broken_after(1)] * 3)  # the connection lost on every try: given up after 3
    with pytest.raises(FetchError, match="UNAVAILABLE: connection reset"):
        fetch_slices(stub, SIZES, where="shard 0 at here", attempts=3)


def _unavailable(request, context):
    context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)")
    yield  # pragma: no cover


def _busy(request, context):
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "4 Fetch calls at once from 127.0.0.1")
    yield  # pragma: no cover


def test_a_patient_fetch_resumes_a_stream_that_keeps_breaking_for_as_long_as_it_moves(scripted):
    """A worker's (patience): a link that drops every chunk, or a shard still busy with our broken call's
    twin, is tried again after a backoff, resuming, however often; `attempts` no longer counts."""
    breaks = [broken_after(1), _busy, broken_after(1), _unavailable] * 3
    script, stub = scripted(*breaks, lambda request, context: honest(request))
    t0 = time.monotonic()
    got = fetch_slices(stub, SIZES, where="shard 0 at here", attempts=3, patience=30)
    assert all(torch.equal(got.slices[f], values(f, 4)) for f in SIZES)
    assert len(script.requests) == len(breaks) + 1
    # each call resumes where the last chunk ended: a break after one chunk moves on by one (300 values)
    assert [(r.fragments[0], r.offset) for r in script.requests] == [
        (0, 0), (0, 300), (0, 300), (0, 600), (0, 600), (0, 900), (0, 900),
        (1, 0), (1, 0), (1, 300), (1, 300), (1, 600), (1, 600),
    ]  # fmt: skip
    # each chunk that came restarts the backoff: the waits stay short while the stream moves
    assert time.monotonic() - t0 < 15


def test_a_patient_fetch_gives_up_after_its_patience_without_a_message_and_says_so(scripted):
    script, stub = scripted(broken_after(2), _unavailable)
    t0 = time.monotonic()
    with pytest.raises(FetchError) as e:
        fetch_slices(stub, SIZES, where="shard 0 at here", patience=1.5)
    took = time.monotonic() - t0
    assert str(e.value).startswith("Fetch from shard 0 at here: nothing received for 2 s (last: UNAVAILABLE")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "\n" not in str(e.value)
    assert 1.5 <= took < 10, took
    assert len(script.requests) >= 3  # tried again, with backoff, until the patience ran out
    # a refusal is final at once, patience or not
    script, stub = scripted(lambda r, c: c.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token"))
    with pytest.raises(FetchError, match="failed: UNAUTHENTICATED: bad token"):
        fetch_slices(stub, SIZES, where="shard 0 at here", patience=30)
    assert len(script.requests) == 1


def test_a_worker_link_fetch_is_patient_and_names_its_bound_when_it_gives_up(scripted):
    """ShardConnection.fetch (a joiner's Fetch, a resync after a restart): patient for --reconnect-timeout;
    the link closing ends its waits."""
    import threading

    from streamdiloco.worker.connection import ShardConnection

    def link_to(server_stub, patience: float) -> ShardConnection:
        conn = ShardConnection("127.0.0.1:1", "w", {}, patience=patience)
        conn.stub, conn.slices = server_stub, [(0, SIZES[f]) for f in SIZES]
        return conn

    _, stub = scripted(*[broken_after(1)] * 5, lambda request, context: honest(request))
    got = link_to(stub, 30).fetch()
    assert all(torch.equal(got[f][0], values(f, 4)) and got[f][1] == 4 for f in SIZES)
    _, stub = scripted(_unavailable)
    gave_up = r"nothing received for 1 s .*; giving up after --reconnect-timeout 1 s"
    with pytest.raises(SyncError, match=gave_up):
        link_to(stub, 1.0).fetch()
    # a reconnect's resync is not patient: three calls, then the reconnect tries again
    script, stub = scripted(_unavailable)
    with pytest.raises(SyncError, match="failed: UNAVAILABLE"):
        link_to(stub, 30).fetch(patient=False)
    assert len(script.requests) == 3
    # closing the link ends a patient Fetch's wait at once
    conn = link_to(scripted(_unavailable)[1], 60)
    threading.Timer(0.5, conn.closed.set).start()
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="stopped: the link is closing"):
        conn.fetch()
    assert time.monotonic() - t0 < 10


def test_a_fetch_of_attempts_tries_a_full_edge_again_after_a_backoff(scripted):
    """RESOURCE_EXHAUSTED: the shard ended the call to make room for a flood's, or this address holds its
    Fetch calls: a tool's Fetch (and a reconnect's resync) tries again, after 0.25..0.5 s, then 0.5..1 s."""
    script, stub = scripted(_busy, _busy, lambda request, context: honest(request))
    t0 = time.monotonic()
    got = fetch_slices(stub, SIZES, where="shard 0 at here", attempts=3)
    assert all(torch.equal(got.slices[f], values(f, 4)) for f in SIZES) and len(script.requests) == 3
    assert time.monotonic() - t0 >= 0.75
    _, stub = scripted(_busy)
    with pytest.raises(FetchError, match="failed: RESOURCE_EXHAUSTED: 4 Fetch calls at once"):
        fetch_slices(stub, SIZES, where="shard 0 at here", attempts=2)


def stalled_after(n: int) -> Callable:
    """The first `n` chunks of an honest stream, then nothing, with the call open until the client ends it."""

    def call(request, context):
        yield from honest(request)[:n]
        while context.is_active():
            time.sleep(0.01)

    return call


def test_a_call_silent_for_the_stall_deadline_is_ended_and_resumed(scripted):
    script, stub = scripted(stalled_after(2), lambda request, context: honest(request))
    t0 = time.monotonic()
    got = fetch_slices(stub, SIZES, where="shard 0 at here", stall=0.5)
    assert all(torch.equal(got.slices[f], values(f, 4)) for f in SIZES)
    assert [(list(r.fragments), r.offset) for r in script.requests] == [([0, 1, 2], 0), ([0, 1, 2], 600)]
    assert time.monotonic() - t0 >= 0.5
    script, stub = scripted(stalled_after(0))  # every call: given up after its attempts, and said why
    with pytest.raises(FetchError) as e:
        fetch_slices(stub, SIZES, where="shard 0 at here", attempts=2, stall=0.3)
    assert str(e.value) == (
        "Fetch from shard 0 at here failed: DEADLINE_EXCEEDED: no message for 0.3 s (the call stalled)"
    )
    assert len(script.requests) == 2


def test_in_describe_mode_the_sizes_come_from_the_shards_description(scripted):
    def described(request, context):
        chunks = honest(request)
        if request.describe:
            chunks[0].fingerprint_json = json.dumps({"sizes": [SIZES[f] for f in SIZES]})
        return chunks

    _, stub = scripted(described)
    seen = []

    def describe(m: pb.MasterChunk) -> dict[int, int]:
        seen.append(m)
        return dict(enumerate(json.loads(m.fingerprint_json)["sizes"]))

    got = fetch_slices(stub, where="shard 0 at here", describe=describe)
    assert got.described is seen[0] and list(got.rounds) == [0, 1, 2]

    def refuse(m: pb.MasterChunk) -> dict[int, int]:
        raise ValueError("the shard at here serves another run")

    with pytest.raises(FetchError, match="^the shard at here serves another run$"):
        fetch_slices(stub, where="shard 0 at here", describe=refuse)
    with pytest.raises(ValueError, match="one of the two"):
        fetch_slices(stub, SIZES, where="x", describe=describe)


# --- a hostile shard ----------------------------------------------------------------------------------------
CFG = SyncConfig(sync_every=6, num_fragments=3)


def non_finite(chunks: list[pb.MasterChunk]) -> list[pb.MasterChunk]:
    x = torch.frombuffer(bytearray(chunks[0].values), dtype=torch.float32).clone()
    x[x.numel() // 2] = float("nan")
    chunks[0].values = x.numpy().tobytes()
    return chunks


def mis_sized(chunks: list[pb.MasterChunk]) -> list[pb.MasterChunk]:
    """Every slice one value short, told consistently (a shard of another layout)."""
    for c in chunks:
        c.total -= 1
        if c.last:
            c.values = c.values[:-4]
    return chunks


class Hostile(pb_grpc.ShardServicer):
    """A shard in front of a real one: Join and Session pass through; Fetch sends `lie(honest chunks)`."""

    def __init__(self, upstream: pb_grpc.ShardStub, lie: Callable[[list], list]):
        self.upstream, self.lie = upstream, lie

    def Join(self, request, context):
        try:
            return self.upstream.Join(request, timeout=WAIT)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details())

    def Session(self, request_iterator, context):
        call = self.upstream.Session(request_iterator)
        context.add_callback(call.cancel)
        yield from call

    def Fetch(self, request, context):
        yield from self.lie(list(self.upstream.Fetch(request, timeout=WAIT)))


class Stalling(Hostile):
    """A shard in front of a real one whose first `stalls` Fetch calls (every one: None) send nothing, the
    call held open until the worker ends it; the others pass through."""

    def __init__(self, upstream: pb_grpc.ShardStub, stalls: int | None):
        super().__init__(upstream, lambda chunks: chunks)
        self.stalls, self.calls = stalls, 0

    def Fetch(self, request, context):
        self.calls += 1
        if self.stalls is None or self.calls <= self.stalls:
            while context.is_active():
                time.sleep(0.01)
            return
        yield from super().Fetch(request, context)


@pytest.fixture
def hostile(tmp_path):
    fp = model_fingerprint(build_layout(build_gpt("nano"), 3), CFG)
    shard = InThreadShard(shard_of(CFG, "nano", 0, 1), tmp_path, json.dumps(fp))
    servers = []

    def start(lie: Callable[[list], list] | None = None, stalls: int | None = None) -> str:
        """A hostile shard's address: Fetch lies (`lie`), or stalls (`stalls` calls, every one: None)."""
        front = Hostile(shard.stub, lie) if lie is not None else Stalling(shard.stub, stalls)
        start.front = front  # type: ignore[attr-defined]
        server = grpc.server(ThreadPoolExecutor(8))
        pb_grpc.add_ShardServicer_to_server(front, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    start.shard, start.fingerprint = shard, fp  # type: ignore[attr-defined]
    yield start
    for server in servers:
        server.stop(None)
    shard.shutdown()


@pytest.mark.parametrize(
    "lie, words",
    [
        (non_finite, "fragment 0: the chunk holds non-finite values"),
        (mis_sized, "fragment 0: the slice has 24704 values, the shard says 24703"),
    ],
)
def test_a_joining_worker_refuses_masters_that_do_not_check_and_keeps_its_parameters(hostile, lie, words):
    torch.manual_seed(1)
    model = build_gpt("nano")  # other values than the run's: a joiner would take the shard's
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SyncError) as e:
        connect(model, [hostile(lie)], CFG, name="joiner", join_timeout=10)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _lose_round_1(link: ShardLink, shard: InThreadShard) -> None:
    """Worker "a" closes rounds 0..2 of fragment 0 on the real shard; the (passive) link takes round 0's
    update and loses round 1's: a resync must fetch fragment 0's master."""
    link.start()  # passive: it gets the updates through the hostile shard's Session
    a = shard.worker("a")
    n = shard.service.state.ranges[0][1]
    for r in range(3):
        delta = torch.randn(n, generator=torch.Generator().manual_seed(r)) * 1e-2
        a.push(push_messages(encode(delta, CFG.uplink_codec, CFG.codec_block_size), round=r))
        assert a.session.result().accepted
        assert a.session.update(), r
    link.wait_update(0, 0, timeout=WAIT)  # taken: the mirror holds round 0
    deadline = time.monotonic() + WAIT
    while not link.inspect(lambda st: {(0, 1), (0, 2)} <= set(st.arrived), timeout=WAIT):
        assert time.monotonic() < deadline, "rounds 1 and 2 did not reach the link"
        time.sleep(0.01)
    link.inspect(lambda st: st.arrived.pop((0, 1)), timeout=WAIT)  # as if round 1's update were lost


def _look(st) -> tuple:
    return (list(st.held), list(st.covered), dict(st.masters), sorted(st.arrived))


def test_a_link_that_resyncs_from_a_hostile_shard_keeps_its_state(hostile):
    link = ShardLink(hostile(non_finite), "L", hostile.fingerprint, join_timeout=10, reconnect_timeout=10)
    try:
        _lose_round_1(link, hostile.shard)
        before = link.inspect(_look, timeout=WAIT)
        with pytest.raises(SyncError, match="shard 0 at .*: fragment 0: the chunk holds non-finite values"):
            link.resync(timeout=WAIT)
        assert link.inspect(_look, timeout=WAIT) == before == ([1, 0, 0], [0, 0, 0], {}, [(0, 2)])
    finally:
        link.close()


def test_a_link_whose_resync_fetch_the_shard_stalls_ends_the_call_and_resumes_it(hostile, monkeypatch):
    """Before, the link's thread waited on the stalled stream for ever (resync() timed out here)."""
    monkeypatch.setattr(connection, "FETCH_STALL_SECONDS", 0.5)  # the worker's is a minute
    link = ShardLink(hostile(stalls=2), "L", hostile.fingerprint, join_timeout=10, reconnect_timeout=10)
    try:
        _lose_round_1(link, hostile.shard)
        link.resync(timeout=2 * WAIT)  # two calls ended at the deadline, the third brings the master
        assert hostile.front.calls == 3 and link.fetches == 1
        assert link.inspect(_look, timeout=WAIT)[1] == [3, 0, 0]  # the master holds rounds < 3
    finally:
        link.close()


def test_a_link_whose_every_resync_fetch_stalls_fails_in_one_line_after_its_patience(hostile, monkeypatch):
    monkeypatch.setattr(connection, "FETCH_STALL_SECONDS", 0.5)
    link = ShardLink(hostile(stalls=None), "L", hostile.fingerprint, join_timeout=10, reconnect_timeout=1.5)
    try:
        _lose_round_1(link, hostile.shard)
        before = link.inspect(_look, timeout=WAIT)
        with pytest.raises(SyncError) as e:
            link.resync(timeout=WAIT)
        assert str(e.value).startswith("Fetch from shard 0 at 127.0.0.1:") and "\n" not in str(e.value)
        assert "(last: DEADLINE_EXCEEDED: no message for 0.5 s (the call stalled)); giving up after " in str(
            e.value
        ) and str(e.value).endswith("--reconnect-timeout 1.5 s")
        assert hostile.front.calls >= 2 and link.inspect(_look, timeout=WAIT) == before
    finally:
        link.close()
