"""A worker facing a hostile shard (issue 26, item 9): a compromised shard, or a man in the middle on an
`--insecure` link, must not fill a worker's mirror with NaN or exhaust its memory.

The shard here is a real gRPC server on port 0 whose servicer lies (`FakeShard`): its Join answers as a shard
of a small run would, its Session sends a Welcome and then whatever the test scripts, its Fetch sends the
masters the test scripts. Against it a real ShardLink (worker/link.py over worker/connection.py):
- a master that is not finite, or beyond the value bound (common/chunks.py MAX_ABS_VALUE), is refused in
  one line naming the shard, and the link's state is unchanged;
- an update beyond the bound is refused the same way;
- updates for 10^4 distinct rounds end the link with one line naming the shard and the fault, with the
  update buffers bounded (counted and measured in bytes); updates in order that pile up untaken are
  replaced by one fetched master (bounded), and a shard whose master does not cover them is refused;
- export's fetch_masters refuses offsets with a gap or an overlap and a round that changes within a slice.
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from streamdiloco.common.chunks import MAX_ABS_VALUE
from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.wire import to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker.link import ShardLink
from streamdiloco.worker.session import MAX_UPDATES_UNDER_WAY, SyncError

pytestmark = pytest.mark.timeout(60)

CFG = SyncConfig(sync_every=6, num_fragments=2)
SIZES = [256, 384]  # this (only) shard's slice of each fragment
CHUNK = 128  # values per chunk: the e3m0 codec's alignment (block 128)
WAIT = 20.0


def master(f: int, round: int) -> torch.Tensor:
    return torch.randn(SIZES[f], generator=torch.Generator().manual_seed(100 * round + f))


def master_chunks(f: int, round: int, x: torch.Tensor | None = None) -> list[pb.MasterChunk]:
    x = master(f, round) if x is None else x
    n = SIZES[f]
    return [
        pb.MasterChunk(
            fragment=f,
            round=round,
            offset=lo,
            total=n,
            values=x[lo : lo + CHUNK].numpy().tobytes(),
            last=lo + CHUNK >= n,
        )
        for lo in range(0, n, CHUNK)
    ]


@functools.cache
def _chunks(f: int, scale: float, per_chunk: int) -> list[pb.Chunk]:
    delta = torch.randn(SIZES[f], generator=torch.Generator().manual_seed(f)) * scale
    return to_chunks(encode(delta, CFG.downlink_codec, CFG.codec_block_size), f, 0, per_chunk)


def update_chunks(f: int, round: int, scale: float = 1e-3, per_chunk: int = CHUNK) -> list[pb.Chunk]:
    """An update's chunks (the same values for every round: made once)."""
    out = []
    for c in _chunks(f, scale, per_chunk):
        out.append(pb.Chunk())
        out[-1].CopyFrom(c)
        out[-1].round = round
    return out


def updates(chunks: Iterable[pb.Chunk]) -> Iterator[pb.ShardMessage]:
    for c in chunks:
        yield pb.ShardMessage(update=c)


class FakeShard(pb_grpc.ShardServicer):
    """A shard that says what the test scripts: `session()` the messages after the Welcome, `fetch(request)`
    the master chunks (default: every fragment's master at `fetch_round`)."""

    def __init__(
        self,
        session: Callable[[], Iterable[pb.ShardMessage]] = lambda: (),
        fetch: Callable[[pb.FetchRequest], Iterable[pb.MasterChunk]] | None = None,
    ):
        self.session, self.fetch = session, fetch
        self.fetch_round = 0
        self.fetches = 0

    def Join(self, request, context):
        return pb.JoinReply(
            config_json=json.dumps(CFG.to_dict()),
            shard=0,
            num_shards=1,
            slices=[pb.SliceRange(offset=0, length=n) for n in SIZES],
            rounds=[0] * len(SIZES),
            session="s",
            chunk_values=CHUNK,
        )

    def Session(self, request_iterator, context):
        next(request_iterator)  # Hello
        n = len(SIZES)
        yield pb.ShardMessage(welcome=pb.Welcome(rounds=[0] * n, started=[False] * n, pushes=[0] * n))
        yield from self.session()
        for _ in request_iterator:  # held open until the worker leaves
            pass

    def Fetch(self, request, context):
        self.fetches += 1
        if self.fetch is not None:
            yield from self.fetch(request)
            return
        for f in list(request.fragments) or range(len(SIZES)):
            yield from master_chunks(f, self.fetch_round)


@pytest.fixture
def fake():
    servers, links = [], []

    def start(shard: FakeShard, **kw) -> ShardLink:
        server = grpc.server(ThreadPoolExecutor(4))
        pb_grpc.add_ShardServicer_to_server(shard, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        link = ShardLink(f"127.0.0.1:{port}", "w", {}, join_timeout=10, reconnect_timeout=5, **kw)
        links.append(link)
        link.start()
        return link

    yield start
    for link in links:
        link.close()
    for server in servers:
        server.stop(None)


def wait_error(link: ShardLink) -> str:
    deadline = time.monotonic() + WAIT
    while link.error is None:
        assert time.monotonic() < deadline, "the link took what a hostile shard sent without a word"
        time.sleep(0.01)
    assert "\n" not in link.error and f"shard 0 at {link.target}" in link.error, link.error
    return link.error


def buffered(link: ShardLink) -> tuple[int, int, int, int]:
    """What the link holds of updates: (updates under way, their bytes, whole updates waiting, theirs)."""
    partial = dict(link.conn.updates.partial) if link.conn.updates is not None else {}
    arrived = link.inspect(lambda st: dict(st.arrived), timeout=WAIT)
    return (
        len(partial),
        sum(a.nbytes for a in partial.values()),
        len(arrived),
        sum(p.nbytes for parts in arrived.values() for _, p in parts),
    )


def look(st) -> tuple:
    return (list(st.held), list(st.covered), dict(st.masters), sorted(st.arrived))


# --- Fetch -------------------------------------------------------------------------------------------------
def _poisoned(value: float) -> Callable[[pb.FetchRequest], list[pb.MasterChunk]]:
    def fetch(request: pb.FetchRequest) -> list[pb.MasterChunk]:
        out = []
        for f in list(request.fragments) or range(len(SIZES)):
            x = master(f, 3)
            x[CHUNK + 5] = value
            out += master_chunks(f, 3, x)
        return out

    return fetch


@pytest.mark.parametrize(
    "value, words",
    [
        (float("nan"), "fragment 0: the chunk holds non-finite values"),
        (float("inf"), "fragment 0: the chunk holds non-finite values"),
        (3e38, "fragment 0: the chunk holds values above 1e+30 in magnitude"),  # finite, absurd
        (-1.5 * MAX_ABS_VALUE, "values above 1e+30"),
    ],
)
def test_a_master_that_is_not_finite_or_beyond_the_bound_is_refused(fake, value, words):
    link = fake(FakeShard(fetch=_poisoned(value)))
    before = link.inspect(look, timeout=WAIT)
    with pytest.raises(SyncError) as e:
        link.conn.fetch()
    assert words in str(e.value) and f"shard 0 at {link.target}" in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert link.inspect(look, timeout=WAIT) == before


def test_a_joiner_refuses_a_master_beyond_the_bound_and_keeps_its_parameters():
    """connect()'s path: the masters a joiner would take are checked before anything is installed."""
    from streamdiloco.worker.transport import GrpcTransport

    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_ShardServicer_to_server(FakeShard(fetch=_poisoned(1e35)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    got: list = []
    try:
        transport = GrpcTransport.open([f"127.0.0.1:{port}"], "w", {}, join_timeout=10, reconnect_timeout=5)
        try:
            with pytest.raises(SyncError, match="values above 1e\\+30"):
                transport.join_run(got.append)
            assert got == []
        finally:
            transport.close()
    finally:
        server.stop(None)


# --- updates -----------------------------------------------------------------------------------------------
def test_an_update_beyond_the_value_bound_is_refused(fake):
    link = fake(FakeShard(session=lambda: updates(update_chunks(0, 0, scale=1e31))))
    error = wait_error(link)
    assert "malformed update chunk for fragment 0 round 0" in error and "above 1e+30" in error, error
    assert buffered(link)[2] == 0


def test_updates_for_ten_thousand_distinct_rounds_end_the_link_with_bounded_buffers(fake):
    """The first chunk of 10^4 updates, each of another round: at most a few are buffered, and the link
    fails with one line naming the shard and the round."""
    rounds = random.Random(0).sample(range(1, 10**9), 10**4)

    def session() -> Iterator[pb.ShardMessage]:
        for r in rounds:
            yield from updates(update_chunks(r % 2, r)[:1])

    link = fake(FakeShard(session=session))
    error = wait_error(link)
    assert f"round {rounds[0]} of fragment {rounds[0] % 2}" in error, error
    under_way, nbytes, waiting, _ = buffered(link)
    assert under_way <= MAX_UPDATES_UNDER_WAY * len(SIZES) and waiting == 0
    assert nbytes <= MAX_UPDATES_UNDER_WAY * sum(SIZES)  # e3m0: under a byte a value


def test_updates_started_and_never_finished_are_bounded(fake):
    """Updates of rounds the shard may close (the open one and the next) whose chunks never end: no more
    than MAX_UPDATES_UNDER_WAY per fragment under way."""

    def session() -> Iterator[pb.ShardMessage]:
        for r in range(MAX_UPDATES_UNDER_WAY + 1):
            yield from updates(update_chunks(1, r)[:1])

    link = fake(FakeShard(session=session))
    error = wait_error(link)
    assert f"updates of fragment 1 under way at once (at most {MAX_UPDATES_UNDER_WAY})" in error, error
    assert buffered(link)[0] <= MAX_UPDATES_UNDER_WAY * len(SIZES)


def _in_order(shard: FakeShard, fragment: int, n: int) -> Callable[[], Iterator[pb.ShardMessage]]:
    """Whole updates of rounds 0..n-1 of a fragment, in order, as fast as the link takes them; the fake's
    Fetch then says the master of the next round (an honest shard's: every round sent is in it)."""

    def session() -> Iterator[pb.ShardMessage]:
        for r in range(n):
            shard.fetch_round = r + 1
            yield from updates(update_chunks(fragment, r))

    return session


@pytest.mark.parametrize("n", [1000, pytest.param(10**4, marks=[pytest.mark.slow, pytest.mark.timeout(300)])])
def test_updates_nobody_takes_are_replaced_by_one_master(fake, n):
    """An honest shard's rounds that pile up untaken (a worker far behind, or a passive link) are bounded:
    past MAX_WAITING_UPDATES of a fragment, the link fetches the fragment's master in their place."""
    shard = FakeShard()
    shard.session = _in_order(shard, 0, n)
    link = fake(shard, max_waiting=16)
    deadline = time.monotonic() + (WAIT if n <= 1000 else 240)
    while link.inspect(lambda st: st.have(0), timeout=WAIT) < n:
        assert time.monotonic() < deadline and link.error is None, link.error
        _, _, waiting, _ = buffered(link)
        assert waiting <= 16
        time.sleep(0.05)
    assert link.error is None and shard.fetches >= 1
    under_way, _, waiting, nbytes = buffered(link)
    assert under_way <= 1 and waiting <= 16 and nbytes <= 16 * SIZES[0]
    assert link.inspect(lambda st: len(st.masters), timeout=WAIT) <= 1


def test_updates_that_a_fetched_master_does_not_cover_end_the_link(fake):
    """A shard that sends rounds in order but whose Fetch says an older master: refused, bounded."""
    shard = FakeShard()
    shard.session = _in_order(shard, 1, 10**4)
    shard.fetch = lambda request: master_chunks(1, 0)
    link = fake(shard, max_waiting=8)
    error = wait_error(link)
    assert "fragment 1" in error and "its master of round 0" in error, error
    assert buffered(link)[2] <= 9


# --- export's fetch_masters --------------------------------------------------------------------------------
def _describing(lie: Callable[[list[pb.MasterChunk]], list[pb.MasterChunk]]) -> FakeShard:
    from streamdiloco.common.fingerprint import model_fingerprint
    from streamdiloco.common.fragments import build_layout

    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
    fp = model_fingerprint(build_layout(model, 1), SyncConfig(sync_every=6, num_fragments=1))
    n = sum(p.numel() for p in model.parameters())

    def fetch(request: pb.FetchRequest) -> list[pb.MasterChunk]:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        chunks = [
            pb.MasterChunk(
                fragment=0,
                round=2,
                offset=lo,
                total=n,
                values=x[lo : lo + 64].numpy().tobytes(),
                last=lo + 64 >= n,
            )
            for lo in range(request.offset, n, 64)
        ]
        if request.describe:
            chunks[0].fingerprint_json, chunks[0].shard, chunks[0].num_shards = json.dumps(fp), 0, 1
        return lie(chunks)

    return FakeShard(fetch=fetch)


def _set(i: int, **fields) -> Callable[[list[pb.MasterChunk]], list[pb.MasterChunk]]:
    def lie(chunks: list[pb.MasterChunk]) -> list[pb.MasterChunk]:
        for k, v in fields.items():
            setattr(chunks[i], k, v)
        return chunks

    return lie


@pytest.mark.parametrize(
    "lie, words",
    [
        (_set(2, offset=64), "offset 64, expected 128"),  # an overlap
        (_set(2, offset=192), "offset 192, expected 128"),  # a gap
        (_set(3, round=3), "round 3 after chunks of round 2"),
        (lambda c: c[:-1], "ended the Fetch after 0 of 1 fragments"),
        (_set(1, values=b""), "do not fit"),
    ],
)
def test_export_fetch_masters_checks_offsets_and_rounds(lie, words):
    from streamdiloco.export import fetch_masters

    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_ShardServicer_to_server(_describing(lie), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(ValueError) as e:
            fetch_masters([f"127.0.0.1:{port}"], timeout=10)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    finally:
        server.stop(None)


def test_export_fetch_masters_takes_an_honest_stream():
    from streamdiloco.export import fetch_masters

    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_ShardServicer_to_server(_describing(lambda c: c), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        [got] = fetch_masters([f"127.0.0.1:{port}"], timeout=10)
        assert torch.equal(got, torch.randn(got.numel(), generator=torch.Generator().manual_seed(0)))
    finally:
        server.stop(None)


def test_a_shard_refuses_starting_values_no_worker_could_fetch():
    """Initialize keeps to the bound a worker's Fetch holds masters to (common/chunks.py out_of_bounds):
    else the shard would take a model that every worker then refuses."""
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.common.wire import values_to_bytes
    from streamdiloco.server.edge.initialize import InitRefused, Upload

    layout = build_layout(torch.nn.Linear(4, 4), 1)
    for value, words in (
        (3e38, "values above 1e+30 in magnitude"),
        (float("nan"), "values that are not finite"),
    ):
        upload = Upload(layout, 0, 1)
        x = torch.zeros(20)
        x[7] = value
        with pytest.raises(InitRefused, match=f"fragment 0 at offset 0: {words}".replace("+", r"\+")):
            upload.add(0, 0, values_to_bytes(x), True)
        assert not upload.done and upload.received == 0
