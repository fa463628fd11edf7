"""What a client can hold before or outside the shard's first bounds (issue 26, items 4, 5 and 8).

- Calls before their request (server/edge/slots.py): Join, Fetch and Initialize streams that send their
  headers and never their request message held one of gRPC's concurrent-call slots each, for ever; 81 of
  them froze every new call of a shard with `--max-sessions 8`. Now they are ended at `--request-timeout`,
  counted per address and in total, and an honest Join is answered within a second while they are held. The
  attackers are raw HTTP/2 connections (benchmarks/flood.py's `RawCalls`) from other loopback addresses
  (127.0.0.2, ...) than the honest worker (127.0.0.1), as they would come from other machines. A request
  over its method's size, and any message over what the largest legitimate one needs, are refused before
  they are parsed.
- Pushes arriving (server/rounds/staging.py): each staged push reserves its whole size from
  `--max-staged-bytes` before its first chunk is copied; a worker stages one push at a time; 8 sessions that
  each stage every fragment but the last chunk keep the shard's staged bytes within the budget, and the
  pushes it took finish.
- HTTP (server/trust/bounds.py): a GET that announces a body and trickles it is closed at `--header-timeout`;
  IPv6 peers are counted by their /64.

Issue 37, item 4: past `--max-waiting-calls` the call ended was the globally oldest, so a flood from 16
addresses ended every honest Join whose request came 0.2 s after the call opened. Now it is the oldest of
the address holding the most (ties: the /24 or /48 holding the most): the flood (benchmarks/flood.py's
`RawCalls`, reopening every call the shard ends) ends only its own, and a worker's delayed Joins are all
answered; the Joins never followed by a Session are forgotten by the same rule, so a flood of Joins from
other addresses does not forget a worker's before its Hello; IPv6 peers, which grpc-core names with
percent-encoded brackets, are counted by their /64 (each connection was an address of its own).
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from benchmarks.flood import ADDRESSES, RawCalls, delayed_join
from streamdiloco.common.codecs import encode, get_codec
from streamdiloco.common.fragments import build_layout
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.config import FROM_WORKER
from streamdiloco.server.edge.slots import REQUEST_BYTES
from streamdiloco.server.trust.bounds import (
    Crowd,
    Limits,
    PeerCounts,
    address_group,
    network_group,
    peer_host,
)
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import RPC_TIMEOUT, WAIT, InThreadShard, push_messages
from tests.support.nano_shard import CFG, GOOD_FP
from tests.support.procs import SLACK, wait_until
from tests.support.shards import shard_of

SERVICE = "/streamdiloco.v1.Shard/"


@pytest.fixture
def attackers():
    """`make(port, source, method, n)`: n calls from `source` that send their headers and never a message
    (benchmarks/flood.py's raw HTTP/2 client), closed after the test."""
    opened: list[RawCalls] = []

    def make(port: int, source: str, method: str, n: int) -> RawCalls:
        opened.append(RawCalls(port, source, method, n, timeout=RPC_TIMEOUT))
        return opened[-1]

    yield make
    for a in opened:
        a.close()


@pytest.fixture
def make_shard(tmp_path, shards):
    """In-process shards of one shard with these limits (the nano run's), shut down after the test."""

    def make(chunk_bytes: int = 256, init: str | None = None, **limits) -> InThreadShard:
        model = None if init == FROM_WORKER else "nano"
        service = shard_of(
            CFG, model, 0, 1, min_workers=2, chunk_bytes=chunk_bytes, init=init, limits=Limits(**limits)
        )
        return shards.add(InThreadShard(service, tmp_path, GOOD_FP))  # type: ignore[arg-type]

    return make


def _timed_join(s: InThreadShard, name: str) -> float:
    t0 = time.monotonic()
    reply = s.stub.Join(
        pb.JoinRequest(worker=name, fingerprint_json=s.fingerprint_json, protocol=1), timeout=RPC_TIMEOUT
    )
    assert reply.session
    return time.monotonic() - t0


# === item 4: calls before their request ==================================================================
def test_81_stalled_joins_from_11_addresses_hold_no_slot_and_an_honest_join_answers_within_a_second(
    make_shard, attackers
):
    # gRPC's slots: 2 x 8 sessions + 64 = 80 on main, all taken by the 81 streams
    s = make_shard(max_sessions=8, max_sessions_per_peer=8, request_timeout=2.0)
    flood = [attackers(s.port, f"127.0.0.{2 + i}", "Join", 8 if i < 4 else 7) for i in range(11)]
    assert sum(a.opened for a in flood) == 81
    for a in flood:
        assert a.pinged.wait(RPC_TIMEOUT), "the shard did not read the streams' headers"
    assert _timed_join(s, "honest") < 1.0
    # every stalled stream ends: at the deadline, or earlier to make room (the total cap, 64)
    wait_until(
        "every stalled Join to end", lambda: all(a.open_streams == 0 for a in flood), timeout=2 + SLACK
    )
    assert max(t for a in flood for t in a.lifetimes()) <= 2.0 + SLACK
    assert not any(a.closed for a in flood)  # the streams were ended, not the connections
    bounds = s.status()["bounds"]
    assert bounds["waiting_calls"] == 0
    refused = bounds["refused"]
    assert refused.get("evicted", 0) + refused.get("no_request", 0) == 81, refused
    assert 81 - 64 <= refused.get("evicted", 0) <= 81 - 64 + 1, refused  # the honest one may have made room
    assert _timed_join(s, "after") < 1.0


def test_calls_waiting_for_their_request_are_capped_per_address_and_end_at_the_deadline(
    make_shard, attackers
):
    s = make_shard(request_timeout=1.0, max_waiting_calls_per_peer=4)
    fetches = attackers(s.port, "127.0.0.2", "Fetch", 6)  # 2 over the cap: refused at once
    assert fetches.pinged.wait(RPC_TIMEOUT)
    wait_until("two Fetches refused", lambda: len(fetches.ended) >= 2, timeout=SLACK)
    s.wait_for(lambda: s.service.gates.waiting.held == 4, "four Fetches waiting")
    joins = attackers(s.port, "127.0.0.3", "Join", 4)  # another address has its own 4
    assert joins.pinged.wait(RPC_TIMEOUT)
    s.wait_for(lambda: s.service.gates.waiting.held == 8, "eight calls waiting")
    assert _timed_join(s, "honest") < 1.0  # from 127.0.0.1
    wait_until("every stalled call to end", lambda: fetches.open_streams + joins.open_streams == 0, SLACK + 1)
    lives = fetches.lifetimes()
    assert all(t < 0.9 for t in lives[:2]) and all(0.9 <= t <= 1.0 + SLACK for t in lives[2:]), lives
    assert all(0.9 <= t <= 1.0 + SLACK for t in joins.lifetimes())
    assert s.status()["bounds"]["refused"] == {"calls waiting for their request": 2, "no_request": 8}


def test_a_stalled_initialize_is_capped_and_ended_like_the_others(make_shard, attackers):
    s = make_shard(init=FROM_WORKER, request_timeout=1.0, max_waiting_calls_per_peer=2)
    t0 = time.monotonic()
    uploads = attackers(s.port, "127.0.0.2", "Initialize", 3)
    assert uploads.pinged.wait(RPC_TIMEOUT)
    wait_until("one Initialize refused at once", lambda: len(uploads.ended) >= 1, timeout=SLACK)
    assert time.monotonic() - t0 < 0.9
    join = s.stub.Join(pb.JoinRequest(worker="w", protocol=1), timeout=RPC_TIMEOUT)
    assert join.uninitialized  # the pending shard answers while they wait
    wait_until("the stalled uploads to end", lambda: uploads.open_streams == 0, timeout=1.0 + SLACK)
    assert all(0.9 <= t <= 1.0 + SLACK for t in uploads.lifetimes()[1:])


def test_a_request_over_its_methods_size_and_a_message_over_the_shards_are_refused(make_shard):
    s = make_shard()
    big_fetch = pb.FetchRequest(fragments=[0] * (100 << 10)).SerializeToString()
    fetch = s.channel.unary_stream(SERVICE + "Fetch")
    with pytest.raises(grpc.RpcError) as e:
        list(fetch(big_fetch, timeout=RPC_TIMEOUT))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details() == f"a Fetch request of {len(big_fetch):,} bytes is over its limit of 65,536"
    join = s.channel.unary_unary(SERVICE + "Join")
    huge = pb.JoinRequest(worker="w", fingerprint_json="x" * (20 << 20)).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:  # over the server's limit on any message: gRPC refuses it
        join(huge, timeout=RPC_TIMEOUT)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert REQUEST_BYTES["Join"] < len(huge) < 64 << 20  # main took up to 64 MiB of anything
    assert _timed_join(s, "honest") < 1.0


# === issue 37, item 4: a flood makes room from its own calls ============================================
def test_a_flood_from_16_addresses_ends_no_honest_join_whose_request_comes_after_0_2_s(make_shard):
    """The issue's probe, on an in-process shard (a real gRPC server; the flood in threads of this process):
    32 waiting calls at most, every flood address reopening its 8 as fast as the shard ends them. Before,
    each honest Join was ended by the 32 calls that came after it, within its 0.2 s."""
    s = make_shard(max_waiting_calls=32)
    waiting, refused = s.service.gates.waiting, s.service.gates.refused
    flood = [RawCalls(s.port, a, "Join", 8, reopen=True) for a in ADDRESSES]
    try:
        s.wait_for(lambda: refused.get("evicted", 0) >= 32, "the flood to fill the table and churn")
        evicted = refused["evicted"]
        for i in range(6):  # one after the other: 0.2 s each under the flood
            request = pb.JoinRequest(worker=f"honest{i}", fingerprint_json=s.fingerprint_json, protocol=1)
            seconds, code, reply = delayed_join(s.channel, request, delay=0.2, timeout=RPC_TIMEOUT)
            assert code == grpc.StatusCode.OK and reply is not None and reply.session, (i, code)
            assert seconds >= 0.2
        assert refused["evicted"] > evicted  # the flood went on meanwhile
    finally:
        for f in flood:
            f.close()
    s.wait_for(lambda: waiting.held == 0, "the flood's calls to end")


def test_a_flood_of_joins_from_other_addresses_forgets_no_pending_join_of_a_worker(make_shard):
    """Joins never followed by a Session are bounded (4 x --max-sessions: 8 here); the flood's (no
    credentials needed on a shard without a token: a credentialed flood is the same) were forgotten oldest
    first, a worker's among them, between its Join and its Hello."""
    s = make_shard(max_sessions=2, max_sessions_per_peer=2)
    honest = s.join("honest")
    body = pb.JoinRequest(worker="flood", fingerprint_json=s.fingerprint_json, protocol=1).SerializeToString()
    pending = s.service.roster.joins.pending
    for a in ADDRESSES[:3]:  # 3 x 6 Joins, each answered with a session id
        joins = RawCalls(s.port, a, "Join", 6, body=body)
        try:
            wait_until("the flood's Joins answered", lambda j=joins: j.open_streams == 0, timeout=WAIT)
        finally:
            joins.close()
    assert s.on_loop(lambda: len(pending)) == 8
    assert s.on_loop(lambda: honest.session in pending)
    hello = pb.WorkerMessage(hello=pb.Hello(worker="honest", session=honest.session))
    assert s.open_session(hello).next_message("welcome").welcome


def test_what_gives_way_is_the_oldest_of_the_address_holding_most_then_of_the_most_crowded_network():
    c: Crowd[str] = Crowd()
    c.add("honest", "10.0.0.1")
    for i in range(3):
        c.add(f"a{i}", "10.9.9.2")
    c.add("b0", "10.9.9.3")
    assert c.crowded() == "a0" and c.held_from("10.9.9.2") == 3
    for i in range(3):
        c.discard(f"a{i}")
    # all alone at their addresses: the network holding the most (10.9.9.0/24) gives way first
    c.add("b1", "10.9.9.4")
    assert c.crowded() == "b0"
    assert c.crowded(sparing="b0") == "b1"  # never the newcomer that needs the room
    c.discard("b0"), c.discard("b1")
    c.add("later", "10.0.1.1")  # two networks of one each: the oldest
    assert c.crowded() == "honest" and len(c) == 2 and "later" in c
    with pytest.raises(ValueError, match="held already"):
        c.add("later", "10.0.1.1")
    # IPv6: a subscriber's /64s are addresses of one /48
    c = Crowd()
    c.add("honest", "2001:db8:1:1::1")
    for i in range(3):
        c.add(f"v{i}", f"2001:db8:2:{i}::1")
    assert c.crowded() == "v0"
    c.discard("honest"), c.discard("v0"), c.discard("v1"), c.discard("v2"), c.discard("none")
    assert len(c) == 0 and c.crowded() is None


def test_connections_from_one_ipv6_address_share_its_limit(tmp_path):
    """A real gRPC server on ::1 behind the interceptor: three connections from ::1, one stalled Join each,
    with 2 per address. grpc-core names the peer "ipv6:%5B::1%5D:PORT": read as it came, each connection
    was an address of its own, and none was refused."""
    import asyncio

    from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
    from streamdiloco.server.edge.slots import WaitingCalls

    waiting = WaitingCalls(Limits(max_waiting_calls_per_peer=2, request_timeout=RPC_TIMEOUT))
    loop = asyncio.new_event_loop()
    started: list = []

    async def start() -> None:
        server = grpc.aio.server(interceptors=[waiting])
        pb_grpc.add_ShardServicer_to_server(pb_grpc.ShardServicer(), server)
        started.extend([server, server.add_insecure_port("[::1]:0")])
        await server.start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(RPC_TIMEOUT)
    server, port = started
    calls = []
    try:
        for _ in range(3):
            calls.append(RawCalls(port, "::1", "Join", 1))
            assert calls[-1].pinged.wait(RPC_TIMEOUT)
        wait_until("the third call refused", lambda: calls[2].open_streams == 0, timeout=SLACK)
        assert waiting.held == 2 and calls[0].open_streams == calls[1].open_streams == 1
        assert waiting.refused == {"calls waiting for their request": 1}
    finally:
        for c in calls:
            c.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(RPC_TIMEOUT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(RPC_TIMEOUT)
        loop.close()


# === item 5: pushes arriving ==============================================================================
def test_8_sessions_staging_every_fragment_but_its_last_chunk_stay_within_the_staged_budget(make_shard):
    layout = build_layout(build_gpt("nano"), CFG.num_fragments)  # one shard: its slices are the fragments
    sizes = [get_codec("e3m0").encoded_nbytes(f.numel, 128) for f in layout.fragments]
    budget = 3 * sizes[0]  # three pushes of fragment 0
    s = make_shard(max_staged_bytes=budget)
    st = s.service.state
    assert s.status()["bounds"]["staged_limit"] == budget
    workers = [s.worker(f"w{i}") for i in range(8)]
    held: list[tuple] = []  # (worker, last chunk) of the pushes the shard staged
    for w in workers:
        for f in range(CFG.num_fragments):
            lo, hi = st.ranges[f]
            delta = torch.randn(hi - lo, generator=torch.Generator().manual_seed(f)) * 1e-2
            msgs = push_messages(encode(delta, "e3m0", 128), fragment=f)
            assert len(msgs) > 2
            w.push(msgs[:-1])
            held.append((w, f, msgs[-1]))
        s.quiesce(w)
        holds = s.on_loop(lambda: sum(p.asm.nbytes for p in st.staged.values()))  # what staging holds
        assert holds <= budget, f"{holds:,} bytes staged, over the budget of {budget:,}"
    assert holds <= s.on_loop(lambda: st.staging.staged_bytes) == budget  # reserved: whole pushes
    # three workers staged fragment 0; every other push was refused at its first chunk
    refused = [w.session.result() for w in workers for _ in range(CFG.num_fragments - 1)]
    refused += [w.session.result() for w in workers[3:]]
    assert all(not r.accepted and r.reason == "staging_full" for r in refused)
    one_at_a_time = [r for r in refused if "a worker sends one push at a time" in r.message]
    over = [r for r in refused if "(--max-staged-bytes)" in r.message]
    assert len(one_at_a_time) == 3 * (CFG.num_fragments - 1) and len(over) == 5 * CFG.num_fragments
    assert over[0].message == (
        f"round 0: fragment 0: the shard's budget of {budget:,} bytes for pushes arriving "
        f"(--max-staged-bytes) holds {budget:,}, and this push needs {sizes[0]:,}"
    )
    bounds = s.status()["bounds"]
    assert bounds["staged_bytes"] == budget and bounds["staged_limit"] == budget
    # nothing the shard took is lost: the three staged pushes finish
    for w, f, last in held:
        if f == 0 and w in workers[:3]:
            w.push([last])
            assert w.session.result().accepted
    assert s.on_loop(lambda: st.staging.staged_bytes) == 0
    assert sorted(s.status()["fragments"][0]["contributors"]) == ["w0", "w1", "w2"]


def test_the_staged_budget_defaults_to_one_push_of_the_largest_fragment_per_session(make_shard):
    s = make_shard(max_sessions=8)
    staging = s.service.state.staging
    largest = max(staging.push_bytes(f) for f in range(CFG.num_fragments))
    assert staging.limit == max(256 << 20, 8 * largest)
    assert Limits(max_staged_bytes=1 << 30).max_staged_bytes == 1 << 30
    with pytest.raises(ValueError, match="--max-staged-bytes must be 0 .derived. or positive, got -1"):
        Limits(max_staged_bytes=-1)
    with pytest.raises(ValueError, match="--max-waiting-calls-per-peer cannot be above --max-waiting-calls"):
        Limits(max_waiting_calls=4, max_waiting_calls_per_peer=8)
    with pytest.raises(ValueError, match="--request-timeout must be a number of seconds"):
        Limits(request_timeout=0)


# === item 8: HTTP ========================================================================================
def test_a_get_whose_body_never_ends_is_closed_at_the_header_deadline(tmp_path):
    service = shard_of(CFG, "nano", 0, 1, chunk_bytes=256, limits=Limits(header_timeout=1.0))
    s = InThreadShard(service, tmp_path, GOOD_FP, http=True)
    try:
        with socket.create_connection(("127.0.0.1", s.http_port), timeout=RPC_TIMEOUT) as c:
            t0 = time.monotonic()
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            c.settimeout(0.2)
            got, closed = b"", None
            while closed is None and time.monotonic() - t0 < 1.0 + SLACK:
                try:
                    c.sendall(b"x")  # a byte at a time: each one stopped uvicorn's keep-alive timer
                    data = c.recv(4096)
                except TimeoutError:
                    continue
                except (ConnectionResetError, BrokenPipeError):
                    data = b""
                if not data:
                    closed = time.monotonic() - t0
                got += data
            assert got.startswith(b"HTTP/1.1 200")  # the request was answered; the body never ended
            assert closed is not None and 0.9 <= closed <= 1.0 + SLACK, closed
        with socket.create_connection(("127.0.0.1", s.http_port), timeout=RPC_TIMEOUT) as ok:
            # a body that ends in time is no trouble
            ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
            assert ok.recv(1000).startswith(b"HTTP/1.1 200")
    finally:
        s.shutdown()


def test_ipv6_peers_are_counted_by_their_64():
    assert address_group("2001:db8:1:2::1") == address_group("2001:db8:1:2:ffff:ffff:ffff:ffff")
    assert address_group("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert address_group("2001:db8:1:3::1") != address_group("2001:db8:1:2::1")
    assert address_group("::ffff:10.0.0.1") == "10.0.0.1" == address_group("10.0.0.1")
    assert address_group("fe80::1%eth0") == "fe80::/64"
    assert address_group("unix:/tmp/sock") == "unix:/tmp/sock"
    assert network_group("10.1.2.3") == "10.1.2.0/24" == network_group("::ffff:10.1.2.200")
    assert network_group("2001:db8:1:2::1") == "2001:db8:1::/48" == network_group("2001:db8:1:ff::9")
    # grpc-core (1.85) writes an IPv6 peer's brackets percent-encoded: the port is not part of the address
    assert peer_host("ipv6:%5B2001:db8:1:2::1%5D:443") == "2001:db8:1:2::1"
    assert peer_host("ipv6:[::1]:443") == "::1" and peer_host("ipv4:10.0.0.1:5") == "10.0.0.1"
    c = PeerCounts("sessions", total=100, per_peer=2)
    peers = [peer_host(f"ipv6:[2001:db8:1:2::{i:x}]:443") for i in range(1, 4)]
    assert c.acquire(peers[0]) is None and c.acquire(peers[1]) is None
    assert c.acquire(peers[2]) == "sessions from 2001:db8:1:2::/64 are at their limit of 2 per address"
    assert c.acquire("2001:db8:1:3::1") is None  # the next /64 is another subscriber
    c.release(peers[1])
    assert c.acquire(peers[2]) is None
    for p in (peers[0], peers[2], "2001:db8:1:3::1"):
        c.release(p)
    assert (c.held, c.by_peer) == (0, {})
