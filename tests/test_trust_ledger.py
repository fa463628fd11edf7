"""The data ledger against a credentialed liar, and its writes (issue 37, items 3 and 5).

Item 3: the first ask bound the dataset for good (checkpointed), from any session, passive ones included, so
that the honest workers were refused (FAILED_PRECONDITION, and they stopped); done reports needed no training
(2,000 pieces "done" in 251 calls); leases never expired (8 pieces held and never reported stalled the epoch).
Now the operator may pin the data; else a binding is provisional until a worker with an accepted push asks
for it, and a later ask naming other data takes a provisional binding over; a done report counts only
within what the worker's pushes brought into the model (else it waits, deferred, and lapses), and not sooner
than a piece can be trained; leases lapse (and the lapsed piece is barred to its holder as long); a passive
session holds no pieces.

Item 5: every Pieces call rewrote ledger.json and meta.json with fsync, inline on the event loop, even when
nothing changed. Now an ask that changes nothing writes nothing, a change is written off the loop (one write
in flight, of the latest state, awaited by the reply), and a 2^20-piece ledger is a bitmap.

The rules are tested on the pure ledger under a simulated clock, the RPC on in-process shards (real gRPC
servers), and the whole attack on real processes: a shard, two honest workers, and the liar's session
(benchmarks/ledger.py's `Asker`).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from concurrent.futures import Future
from dataclasses import replace

import grpc
import pytest

from benchmarks.ledger import Asker, UnchangedAsks, big_ledger, describe_fingerprint, join_latencies
from streamdiloco.common.config import SyncConfig
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.shard import Shard
from streamdiloco.server.startup import build_shard
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.server.storage.coalesced import CoalescedWrites
from streamdiloco.server.storage.ledger import COVER, FAST, Dataset, Ledger, LedgerError, Pin, Standing
from streamdiloco.server.storage.ledgerstate import from_state, snapshot, to_state
from streamdiloco.server.trust.auth import Auth
from tests.support.inthread import InThreadShard
from tests.support.pieces import ask, credit
from tests.support.procs import Cluster, http_json, wait_until
from tests.support.shards import shard_config

pytestmark = pytest.mark.timeout(120)

SHA, FAKE_SHA = "ab" * 32, "cd" * 32
DATA = Dataset(2000, 100, SHA)  # 20 pieces of 100 tokens
FAKE = Dataset(2000, 100, FAKE_SHA)
NOBODY = Standing()  # a session with no accepted push


def pusher(credited: float = 1e9, piece_seconds: float = 0.0) -> Standing:
    return Standing(pushes=1, credited=credited, piece_seconds=piece_seconds)


def ids(grant) -> list[int]:
    return [p for p, _, _ in grant.held]


# --- the rules, on the pure ledger --------------------------------------------------------------------------
def test_an_ask_without_a_push_binds_the_data_only_until_a_worker_with_a_push_asks():
    led = Ledger(100)
    g = led.ask("mallory", [], [], 8, 0.0, NOBODY, FAKE)
    assert g.binding == "bound" and not led.confirmed and len(g.held) == 8
    g = led.ask("alice", [], [], 2, 1.0, NOBODY, DATA)  # honest, before its first push: it gets pieces
    assert g.binding == "moved" and ids(g) == [0, 1] and led.held == {"alice": [0, 1]}
    assert led.ask("mallory", [], [], 8, 2.0, NOBODY, FAKE).binding == "moved"  # back and forth...
    g = led.ask("alice", [], [0, 1], 2, 3.0, pusher(), DATA)  # ...until the honest worker's first push
    assert g.binding == "moved" and led.confirmed and ids(g) == [0, 1]
    for standing in (NOBODY, pusher()):
        with pytest.raises(LedgerError, match="confirmed by a worker's accepted push") as e:
            led.ask("mallory", [], [], 8, 4.0, standing, FAKE)
        assert e.value.kind == "mismatch"
    back = from_state(json.loads(json.dumps(to_state(led))), 100, 5.0)  # and so after a restart
    assert back.confirmed and back.dataset == DATA
    with pytest.raises(LedgerError, match="confirmed"):
        back.ask("mallory", [], [], 8, 6.0, NOBODY, FAKE)


def test_a_pinned_dataset_refuses_any_other_from_the_start():
    led = Ledger(100, pinned=DATA)
    assert led.confirmed and led.dataset == DATA
    with pytest.raises(LedgerError, match="pinned by the operator"):
        led.ask("bob", [], [], 1, 0.0, pusher(), FAKE)
    assert ids(led.ask("alice", [], [], 1, 0.0, NOBODY, DATA)) == [0]
    provisional = Ledger(100)  # a checkpoint's provisional binding of other data gives way to the pin
    provisional.ask("mallory", [], [], 8, 0.0, NOBODY, FAKE)
    led = from_state(to_state(provisional), 100, 0.0, pinned=DATA)
    assert led.dataset == DATA and led.pinned and led.held == {}
    sha_only = Ledger(100, pinned=Pin(sha256=SHA))  # the sha256 alone: the size comes from the asks
    with pytest.raises(LedgerError, match="pinned by the operator"):
        sha_only.ask("mallory", [], [], 8, 0.0, NOBODY, FAKE)
    sha_only.ask("mallory", [], [], 8, 0.0, NOBODY, Dataset(100, 100, SHA))  # the right name, a wrong size
    assert sha_only.ask("alice", [], [], 1, 1.0, pusher(), DATA).binding == "moved" and sha_only.confirmed
    confirmed = Ledger(100)  # a confirmed one is the run's: the operator must choose
    confirmed.ask("bob", [], [], 1, 0.0, pusher(), FAKE)
    with pytest.raises(ValueError, match="pin the same data, or start with --fresh"):
        from_state(to_state(confirmed), 100, 0.0, pinned=DATA)


def test_2000_done_reports_without_pushes_count_nothing_and_its_pieces_lapse():
    led = Ledger(100, pinned=DATA)
    lease = 30.0
    g = led.ask("mallory", [], [], 8, 0.0, NOBODY)
    reports = refused = 0
    while reports < 2000:  # its own 8, then every piece of the data again and again
        done = ids(g) if reports == 0 else list(range(20))
        g = led.ask("mallory", done, [], 8, reports / 1000, NOBODY)
        reports, refused = reports + len(done), refused + len(g.refused)
    assert len(led.done) == 0 and led.current.by == {} and refused > 1000
    assert led.leases.owned("mallory") == 8  # its 8, trained it says, wait for pushes it never makes
    t = led.tick(lease + 1.0, lambda w: NOBODY, lambda w: lease)
    assert sorted(t.lapsed["mallory"]) == list(range(8)) and led.leases.owned("mallory") == 0
    assert ids(led.ask("mallory", [], [], 8, lease + 2, NOBODY)) == list(range(8, 16))  # not its lapsed 8
    assert ids(led.ask("alice", [], [], 2, lease + 2, pusher())) == [0, 1]


def test_done_reports_count_within_cover_times_the_tokens_the_pushes_brought():
    led = Ledger(100, pinned=DATA)
    carol = pusher(credited=150.0)  # its pushes brought 150 tokens: 300 tokens of pieces count
    led.ask("carol", [], [], 4, 0.0, carol)
    g = led.ask("carol", [0, 1, 2, 3], [], 1, 1.0, carol)
    assert g.refused == [] and sorted(led.done) == [0, 1, 2] and COVER * 150 == 300
    assert led.leases.deferred == {"carol": [3]} and led.current.by == {"carol": 3}
    led.tick(2.0, lambda w: pusher(credited=200.0), lambda w: 60.0)  # its next round is credited
    assert sorted(led.done) == [0, 1, 2, 3] and led.leases.deferred == {}
    assert led.ask("carol", [3], [], 1, 3.0, carol).repeated == [3]  # its retried report: acknowledged


def test_a_report_sooner_than_a_piece_trains_is_refused():
    led = Ledger(100, pinned=DATA)
    fast = pusher(piece_seconds=80.0)  # at its speed a piece takes 80 s: no report within 80 / FAST s
    led.ask("w", [], [], 2, 0.0, fast)
    g = led.ask("w", [0], [1], 2, 80.0 / FAST - 1, fast)
    assert g.refused == [0] and 0 not in led.done and 0 not in led.owner
    g = led.ask("w", [1], ids(g)[1:], 2, 80.0 / FAST + 1, fast)
    assert g.refused == [] and 1 in led.done


def test_a_hoarder_holds_up_the_epoch_one_lease_at_most():
    """A worker without pushes takes 8 pieces and sits on them, asking every second; an honest worker
    trains a piece a second: the epoch ends a lease after the hoard began, every piece the honest one's."""
    led = Ledger(100, pinned=DATA)
    lease, now, alice = 30.0, 0.0, []
    led.ask("mallory", [], [], 8, now, NOBODY)
    while led.epoch == 0 and now < 200:
        now += 1.0
        mine = led.held.get("mallory", [])
        led.ask("mallory", [], mine, 8, now, NOBODY)  # claims what it holds; asks for more
        g = led.ask("alice", alice[:1], alice[1:], 2, now, pusher())
        alice = ids(g)
        led.tick(now, lambda w: pusher() if w == "alice" else NOBODY, lambda w: lease)
    assert led.epoch == 1 and led.previous_by == {"alice": 20}
    assert now <= 12 + 2 * lease, now  # 12 pieces, then mallory's lapse (and its next hoard's)


def test_an_ask_that_changes_nothing_counts_no_change():
    led = Ledger(100, pinned=DATA)
    led.ask("a", [], [], 2, 0.0)
    before = led.changes
    for i in range(100):
        led.ask("a", [], [0, 1], 2, 1.0 + i)  # a retried or repeated ask
        led.tick(1.0 + i, lambda w: pusher(), lambda w: 1e9)
    assert led.changes == before
    led.ask("a", [0], [1], 2, 200.0)
    assert led.changes > before


def test_a_ledger_of_2_20_pieces_is_written_in_well_under_100_ms_and_a_few_mb(tmp_path):
    """Half the pieces done at random (a bitmap that does not compress), 64 workers with 128-character
    names: format 1 was 42 MB (293 MB with such names) and 3.7 s a write."""
    led = big_ledger(1 << 20, 64, 128)
    ckpt = ShardCheckpoint(tmp_path, fingerprint={})
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert ckpt.save_part("ledger", snapshot(led).to_state())
        times.append(time.perf_counter() - t0)
    size = (tmp_path / "ledger.json").stat().st_size
    assert size < 1 << 20, size
    assert min(times) < 0.1 * 4, times  # ~15 ms here (benchmarks/ledger.py); 4x for a loaded machine
    back = from_state(json.loads((tmp_path / "ledger.json").read_text()), 100, 0.0)
    assert back.current.done.bits == led.current.done.bits and back.held == led.held


def test_coalesced_writes_one_in_flight_of_the_latest_state():
    """Ten changes while a write is out: the callers of all of them await one more write, of the last."""
    written: list[int] = []
    gates: list[Future] = []

    def submit(fn, snap) -> Future:
        f: Future = Future()
        gates.append(f)
        f.add_done_callback(lambda _: written.append(snap))
        return f

    async def run() -> None:
        version = [1]
        w = CoalescedWrites(lambda: version[0], lambda: version[0], lambda s: True, submit)
        w.saved = 0
        first = asyncio.ensure_future(w.durable())
        while not gates:  # the write of version 1 is out
            await asyncio.sleep(0)
        waiters = []
        for _ in range(10):
            version[0] += 1
            waiters.append(asyncio.ensure_future(w.durable()))
        await asyncio.sleep(0)
        assert len(gates) == 1 and not first.done()
        gates[0].set_result(True)
        assert await first
        for _ in range(100):
            if len(gates) == 2:
                break
            await asyncio.sleep(0)
        gates[1].set_result(True)
        assert all(await asyncio.gather(*waiters))
        assert written == [1, 11] and w.writes == 2 and not w.dirty
        assert await w.durable() and len(gates) == 2  # nothing changed: no write

    asyncio.run(run())


# --- the RPC, on in-process shards --------------------------------------------------------------------------
TOKEN = "sekrit"
CFG = SyncConfig(sync_every=6, num_fragments=2)


def build(tmp_path, **pieces) -> Shard:
    """Shard 0 of a nano run with a checkpoint, pieces of 100 tokens (`pieces`: PieceSettings' others)."""
    config = shard_config(
        CFG,
        "nano",
        auth=Auth(token=TOKEN, names_per_token=4),
        checkpoint_dir=str(tmp_path / "ckpt-0"),
        piece_tokens=100,
    )
    svc = build_shard(replace(config, pieces=replace(config.pieces, **pieces)))
    assert isinstance(svc, Shard)
    return svc


@pytest.fixture
def pieces_shard(tmp_path, shards):
    svc = build(tmp_path)
    return shards.add(InThreadShard(svc, tmp_path, json.dumps(svc.fingerprint), token=TOKEN))


def rpc_ask(s: InThreadShard, w, sha=SHA, done=(), held=(), want=1) -> pb.PiecesReply:
    return ask(s, w, sha, 2000, TOKEN, done, held, want)


def test_a_passive_session_holds_no_pieces_until_it_is_ready(pieces_shard):
    w = pieces_shard.worker("p", passive=True)
    with pytest.raises(grpc.RpcError) as e:
        rpc_ask(pieces_shard, w, want=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "passive" in e.value.details()
    assert pieces_shard.status()["data"]["held"] == {}
    w.ready()
    pieces_shard.wait_for(lambda: pieces_shard.service.roster.open["p"].active, "p to be a member")
    assert [p.id for p in rpc_ask(pieces_shard, w, want=2).held] == [0, 1]


def test_a_session_without_a_push_binds_no_data_for_good(pieces_shard):
    mallory, alice = pieces_shard.worker("mallory"), pieces_shard.worker("alice")
    assert len(rpc_ask(pieces_shard, mallory, sha=FAKE_SHA, want=8).held) == 8  # provisional
    r = rpc_ask(pieces_shard, alice, want=2)  # the honest worker, before its first push: served
    assert [p.id for p in r.held] == [0, 1]
    credit(pieces_shard, "alice")  # its first push: its next ask confirms its data
    rpc_ask(pieces_shard, alice, held=[0, 1], want=2)
    with pytest.raises(grpc.RpcError) as e:
        rpc_ask(pieces_shard, mallory, sha=FAKE_SHA, want=8)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "confirmed" in e.value.details()
    data = pieces_shard.status()["data"]
    assert data["confirmed"] and data["sha256"] == SHA


def test_unchanged_asks_write_nothing_and_a_change_is_on_disk_before_the_reply(pieces_shard, tmp_path):
    w = pieces_shard.worker("a")
    held = [p.id for p in rpc_ask(pieces_shard, w, want=2).held]
    ckpt = pieces_shard.service.checkpoint
    writes = pieces_shard.on_loop(lambda: ckpt.writes)
    for _ in range(200):
        rpc_ask(pieces_shard, w, held=held, want=2)
    assert pieces_shard.on_loop(lambda: ckpt.writes) == writes
    r = rpc_ask(pieces_shard, w, held=held, want=3)  # one more piece: on disk before the answer
    saved = json.loads((tmp_path / "ckpt-0" / "ledger.json").read_text())
    assert saved["held"] == {"a": [p.id for p in r.held]} == {"a": [0, 1, 2]}


def test_a_pinned_shard_refuses_other_data(tmp_path, shards):
    svc = build(tmp_path, data_sha256=SHA, data_tokens=2000)
    s = shards.add(InThreadShard(svc, tmp_path, json.dumps(svc.fingerprint), token=TOKEN))
    assert s.status()["data"]["pinned"]
    w = s.worker("mallory")
    with pytest.raises(grpc.RpcError) as e:
        rpc_ask(s, w, sha=FAKE_SHA, want=8)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pinned by the operator" in e.value.details()
    assert [p.id for p in rpc_ask(s, w, want=1).held] == [0]


# --- the attack, on real processes --------------------------------------------------------------------------
NANO = ["--model", "nano", "--sync-every", "4", "--num-fragments", "2", "--merge-policy", "fixed"]
PIECE_TOKENS = 256  # nano's windows are 33 bytes: 7 windows, 2 steps of batch 4 per piece


@pytest.mark.timeout(400)
def test_bind_drain_and_hoard_by_a_session_without_pushes_leave_the_honest_epoch_whole(tmp_path):
    """A credentialed liar that never pushes binds fake data, takes 8 pieces and reports them and 2,000
    others done, and keeps asking; two honest workers train the first epoch to its end anyway, and the
    ledger counts every piece theirs."""
    text = "".join(f"word{i % 97} " for i in range(1000))[:5600]  # 5320 train bytes: 21 pieces
    (tmp_path / "text.txt").write_text(text)
    shard = [*NANO, "--min-workers", "1", "--round-timeout", "3", "--piece-tokens", str(PIECE_TOKENS)]
    shard += ["--token", TOKEN, "--names-per-token", "4"]
    work = [*NANO, "--data", str(tmp_path / "text.txt"), "--data-pieces", "--batch-size", "4"]
    work += ["--eval-every", "0", "--step-delay", "0.05", "--steps", "100000", "--token", TOKEN]
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *shard)
        fp = describe_fingerprint(target, TOKEN)
        mallory = Asker(target, "mallory", fp, TOKEN)  # a member that never pushes
        fake = mallory.ask(FAKE_SHA, 5320, want=8)  # binds fake data first
        assert len(fake.held) == 8
        for name in ("alice", "bob"):
            c.worker(name, [target], *work)

        def data() -> dict:
            return http_json(http)["data"]

        wait_until("the honest workers' data", lambda: data()["sha256"] not in ("", FAKE_SHA), timeout=120)
        sha = data()["sha256"]
        wait_until("their data to be confirmed by a push", lambda: data()["confirmed"], timeout=120)
        with pytest.raises(grpc.RpcError) as e:
            mallory.ask(FAKE_SHA, 5320, want=8)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        hoard = [p.id for p in mallory.ask(sha, 5320, want=8).held]  # takes what it can, and sits on it
        reports = 0
        rng = random.Random(0)
        while reports < 2000:  # and says it trained everything
            done = hoard if reports == 0 else rng.sample(range(21), 21)
            mallory.ask(sha, 5320, done=done, want=8)
            reports += len(done)
        wait_until("the first epoch to end", lambda: data()["epoch"] >= 1, timeout=180)
        status = data()
        for name in ("alice", "bob"):
            assert "refused to assign data" not in c.log(name), c.log(name)[-2000:]
        mallory.close()
    assert sum(status["previous_by"].values()) == 21 and set(status["previous_by"]) <= {"alice", "bob"}


# a latency ratio on a shared machine: in `make test-slow` (benchmarks/ledger.py measures it too); `make test`
# has the unchanged asks' writes (test_unchanged_asks_write_nothing_and_a_change_is_on_disk_before_the_reply)
@pytest.mark.slow
def test_an_honest_join_is_as_quick_while_263_unchanged_asks_a_second_arrive(tmp_path):
    """A worker repeats an ask that changes nothing, 263 times a second: the shard writes nothing for them,
    and an honest Join's median latency stays within twice the idle shard's (it was 5x: 2.0 -> 10.8 ms)."""
    flags = ["--model", "nano", "--token", TOKEN, "--names-per-token", "128", "--piece-tokens", "100"]
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *flags)
        fp = describe_fingerprint(target, TOKEN)
        join_latencies(target, fp, 5, "warm", TOKEN)
        idle = join_latencies(target, fp, 40, "idle", TOKEN)
        asker = Asker(target, "asker", fp, TOKEN)
        asks = UnchangedAsks(asker, 263.0, tokens=6400).start()
        wait_until("the asks to run", lambda: asks.sent > 50, timeout=30)
        ledger = tmp_path / "shard-checkpoint" / "ledger.json"
        before, sent = ledger.stat().st_mtime_ns, asks.sent
        loaded = join_latencies(target, fp, 40, "loaded", TOKEN)
        written = ledger.stat().st_mtime_ns != before
        sent = asks.sent - sent
        asks.stop()
        asker.close()
    assert not written, f"ledger.json written during {sent} unchanged asks"
    assert not asks.failed and sent > 100, (asks.failed[:3], sent)
    p50_idle, p50_loaded = statistics.median(idle), statistics.median(loaded)
    assert p50_loaded <= 2 * p50_idle + 0.002, (p50_idle, p50_loaded)
