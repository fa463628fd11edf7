"""The data ledger's writes (issue 37, item 5): what a Pieces call costs the shard, and what a big ledger
costs to write.

1. Persist: a ledger of --pieces (2^20) pieces, half of them done at random (the bitmap's worst case: it
   does not compress), --workers workers with names of --name-chars characters holding 8 pieces each and
   their last 64 pieces counted, written as shard 0 writes it (server/storage/ledgerstate.py: the snapshot
   on the loop, then the encoding and the checkpoint's write, fsync and all, on the writer thread): the
   snapshot's time, the write's time and the file's size. Beside it, format 1 (every done piece listed with
   its worker's name, as before the bitmaps) of the same ledger with short names, encoded and written the
   same way (--no-old skips it: it takes seconds and a GB of memory).
2. Unchanged asks: a shard process (nano, run token, a checkpoint on disk), one credentialed worker session
   that asked once and then repeats the same ask (nothing changes) at --rate (263) a second, and meanwhile
   honest Joins one after the other: their latency (p50, p95) against the same Joins on the idle shard, and
   the checkpoint's writes during the asks (0: an unchanged ask writes nothing).

    python -m benchmarks.ledger            # 2^20 pieces, 64 workers of 128-character names; 10 s of asks
    python -m benchmarks.ledger --quick    # 2^16 pieces, 3 s of asks

Writes results.json, results.md and run.log under --out (default benchmarks/results/ledger). `Asker` (a
worker's session held by hand, and its Pieces calls) is also what tests/test_trust_ledger.py's processes
test uses for its liar.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.harness import RESULTS, Session, http_json, loadavg, say, start_shards
from streamdiloco.common.atomic import atomic_write
from streamdiloco.common.wire import PROTOCOL, auth_metadata
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.server.storage.ledger import Dataset, Ledger
from streamdiloco.server.storage.ledgerstate import snapshot
from streamdiloco.server.storage.pieceset import PieceSet

TOKEN = "ledger-bench"
TIMEOUT = 30.0
SHA = "5e" * 32


# --- a worker's session by hand -----------------------------------------------------------------------------
def describe_fingerprint(target: str, token: str = "") -> str:
    """The shard's model fingerprint (JSON), as its Fetch describes it."""
    with grpc.insecure_channel(target) as channel:
        request = pb.FetchRequest(describe=True, token=token)
        call = pb_grpc.ShardStub(channel).Fetch(request, timeout=TIMEOUT)
        first = next(iter(call))
        call.cancel()
        return first.fingerprint_json


class Asker:
    """One worker's Join and Session on shard `target` (passive, or a member that never pushes), its
    messages read and dropped on a thread (so that the shard keeps the session), and its Pieces calls."""

    def __init__(self, target: str, name: str, fingerprint: str, token: str = "", passive: bool = False):
        self.name, self.token = name, token
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.ShardStub(self.channel)
        join = pb.JoinRequest(worker=name, token=token, fingerprint_json=fingerprint, protocol=PROTOCOL)
        self.session = self.stub.Join(join, timeout=TIMEOUT).session
        self._out: queue.Queue = queue.Queue()
        self._welcomes: queue.Queue = queue.Queue()
        self.call = self.stub.Session(iter(self._out.get, None), metadata=auth_metadata(token))
        threading.Thread(target=self._read, name=f"asker-{name}", daemon=True).start()
        self._out.put(pb.WorkerMessage(hello=pb.Hello(worker=name, session=self.session, passive=passive)))
        self._welcomes.get(timeout=TIMEOUT)
        if not passive:
            self.ready()

    def _read(self) -> None:
        try:
            for msg in self.call:
                if msg.WhichOneof("kind") == "welcome":
                    self._welcomes.put(msg.welcome)
        except grpc.RpcError:
            pass

    def ready(self) -> None:
        """Send Ready (a member from now on: rounds expect it) and wait for the shard's answer."""
        self._out.put(pb.WorkerMessage(ready=pb.Ready()))
        self._welcomes.get(timeout=TIMEOUT)

    def ask(
        self, sha: str, tokens: int, done=(), held=(), want: int = 1, timeout: float = TIMEOUT
    ) -> pb.PiecesReply:
        request = pb.PiecesRequest(
            worker=self.name,
            session=self.session,
            token=self.token,
            train_tokens=tokens,
            data_sha256=sha,
            done=list(done),
            held=list(held),
            want=want,
        )
        return self.stub.Pieces(request, timeout=timeout)

    def close(self) -> None:
        self._out.put(None)
        self.call.cancel()
        self.channel.close()


# --- 1. persist -------------------------------------------------------------------------------------------
def big_ledger(pieces: int, workers: int, name_chars: int, seed: int = 0) -> Ledger:
    """A ledger of `pieces` pieces, half done at random, with `workers` workers of long names."""
    rng = random.Random(seed)
    led = Ledger(100, pinned=Dataset(pieces * 100, 100, SHA))
    names = [f"worker-{i:04d}-".ljust(name_chars, "x") for i in range(workers)]
    bits = bytearray(rng.randbytes((pieces + 7) // 8))
    bits[0] = 0  # piece 0 free, and the last byte's padding clear
    if pieces % 8:
        bits[-1] &= (1 << (pieces % 8)) - 1
    led.current.done = PieceSet(pieces, bits)
    share, extra = divmod(len(led.current.done), workers)
    led.current.by = {n: share + (i < extra) for i, n in enumerate(names)}
    free = [p for p in range(pieces) if p not in led.current.done][: 8 * workers]
    for i, n in enumerate(names):
        for p in free[i * 8 : i * 8 + 8]:
            led.leases.give(n, p, 0.0)
        led.counted[n] = led.current.by[n] * 100
        led.recent[n] = tuple((0, rng.randrange(pieces)) for _ in range(64))
    return led


def legacy_state(led: Ledger, names: int) -> dict:
    """The same ledger in format 1 (every done piece and the last epoch's, with a short worker name)."""
    ds = led.dataset
    assert ds is not None
    short = [f"w{i}" for i in range(names)]
    return {
        "format": 1,
        "dataset": {"train_tokens": ds.train_tokens, "piece_tokens": ds.piece_tokens, "sha256": ds.sha256},
        "epoch": 1,
        "done": {str(p): short[p % names] for p in led.current.done},
        "previous": {str(p): short[p % names] for p in range(ds.pieces)},
        "held": {},
    }


def persist(pieces: int, workers: int, name_chars: int, folder: Path, old: bool) -> dict[str, Any]:
    """Time and size of one ledger.json write, the bitmap format's and (`old`) format 1's."""
    led = big_ledger(pieces, workers, name_chars)
    ckpt = ShardCheckpoint(folder / "ckpt", fingerprint={})
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        snap = snapshot(led)
        t1 = time.perf_counter()
        assert ckpt.save_part("ledger", snap.to_state())
        t2 = time.perf_counter()
        runs.append((t1 - t0, t2 - t1))
    out: dict[str, Any] = {
        "pieces": pieces,
        "workers": workers,
        "name_chars": name_chars,
        "snapshot_ms": 1000 * statistics.median(r[0] for r in runs),
        "write_ms": 1000 * statistics.median(r[1] for r in runs),
        "bytes": (folder / "ckpt" / "ledger.json").stat().st_size,
    }
    if old:
        state = legacy_state(led, min(workers, 64))
        t0 = time.perf_counter()
        data = json.dumps(state, separators=(",", ":")).encode()
        atomic_write(folder / "legacy.json", lambda f: f.write(data))
        out["legacy_write_ms"] = 1000 * (time.perf_counter() - t0)
        out["legacy_bytes"] = len(data)
    return out


# --- 2. unchanged asks against a shard process --------------------------------------------------------------
def join_latencies(target: str, fingerprint: str, n: int, tag: str, token: str = TOKEN) -> list[float]:
    """Seconds each of `n` honest Joins (one after the other, fresh names) took."""
    out = []
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ShardStub(channel)
        grpc.channel_ready_future(channel).result(timeout=TIMEOUT)
        for i in range(n):
            request = pb.JoinRequest(
                worker=f"{tag}-{i}", token=token, fingerprint_json=fingerprint, protocol=PROTOCOL
            )
            t0 = time.perf_counter()
            stub.Join(request, timeout=TIMEOUT)
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)
    return out


class UnchangedAsks:
    """A thread that repeats one worker's unchanged ask (the same claim, nothing done) at `rate` a second."""

    def __init__(self, asker: Asker, rate: float, tokens: int):
        self.asker, self.rate, self.tokens = asker, rate, tokens
        self.held = [p.id for p in asker.ask(SHA, tokens, want=2).held]
        self.sent = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unchanged-asks", daemon=True)

    def start(self) -> UnchangedAsks:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.is_set():
            try:
                self.asker.ask(SHA, self.tokens, held=self.held, want=2)
            except grpc.RpcError as e:
                self.failed.append(f"{e.code().name}: {e.details()}")
            self.sent += 1
            delay = t0 + self.sent / self.rate - time.perf_counter()
            if delay > 0:
                self._stop.wait(delay)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)


def _ms(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` seconds, in ms."""
    if len(xs) < 2:
        return 1000 * xs[0] if xs else 0.0
    return 1000 * statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


def unchanged_asks(target: str, http_port: int, args: argparse.Namespace) -> dict[str, Any]:
    """Honest Join latency, idle and under a stream of unchanged asks; the checkpoint writes meanwhile."""
    fingerprint = describe_fingerprint(target, TOKEN)
    idle = join_latencies(target, fingerprint, args.joins, "idle")
    asker = Asker(target, "asker", fingerprint, TOKEN)
    asks = UnchangedAsks(asker, args.rate, tokens=100 * 64).start()
    time.sleep(0.5)
    writes0, sent0, t0 = http_json(http_port)["checkpoint"]["writes"], asks.sent, time.perf_counter()
    loaded = join_latencies(target, fingerprint, args.joins, "loaded")
    while time.perf_counter() - t0 < args.seconds:
        time.sleep(0.1)
    writes1, sent1, t1 = http_json(http_port)["checkpoint"]["writes"], asks.sent, time.perf_counter()
    asks.stop()
    asker.close()
    return {
        "idle_p50_ms": _ms(idle, 0.5),
        "idle_p95_ms": _ms(idle, 0.95),
        "loaded_p50_ms": _ms(loaded, 0.5),
        "loaded_p95_ms": _ms(loaded, 0.95),
        "asks_per_second": (sent1 - sent0) / (t1 - t0),
        "asks_failed": len(asks.failed),
        "writes_during_asks": writes1 - writes0,
    }


def table(r: dict[str, Any]) -> list[str]:
    p, a = r["persist"], r["asks"]
    out = [
        "| ledger.json of | format | snapshot on the loop ms | write ms (encode, fsync) | bytes |",
        "|---|---|---|---|---|",
        f"| {p['pieces']:,} pieces, {p['workers']} workers of {p['name_chars']} characters | 2 (bitmap) | "
        f"{p['snapshot_ms']:.2f} | {p['write_ms']:.1f} | {p['bytes']:,} |",
    ]
    if "legacy_write_ms" in p:
        out.append(
            f"| the same, short names | 1 (every piece named) | - | {p['legacy_write_ms']:,.0f} | "
            f"{p['legacy_bytes']:,} |"
        )
    out += [
        "",
        "| honest Join | p50 ms | p95 ms |",
        "|---|---|---|",
        f"| idle shard | {a['idle_p50_ms']:.1f} | {a['idle_p95_ms']:.1f} |",
        f"| {a['asks_per_second']:.0f} unchanged Pieces asks/s | {a['loaded_p50_ms']:.1f} | "
        f"{a['loaded_p95_ms']:.1f} |",
        "",
        f"Checkpoint writes during the asks: {a['writes_during_asks']} (the contribution credits' included, "
        f"written every 10 s while they change; asks refused: {a['asks_failed']}).",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2^16 pieces, 3 s of asks, 20 Joins a phase")
    ap.add_argument("--pieces", type=int, default=None, help="pieces of the persisted ledger (2^20)")
    ap.add_argument("--workers", type=int, default=64, help="workers in the persisted ledger")
    ap.add_argument("--name-chars", type=int, default=128, help="characters of each worker's name")
    ap.add_argument("--no-old", dest="old", action="store_false", help="skip format 1's write")
    ap.add_argument("--rate", type=float, default=263.0, help="unchanged asks a second")
    ap.add_argument("--seconds", type=float, default=None, help="seconds of asks (default 10)")
    ap.add_argument("--joins", type=int, default=None, help="honest Joins a phase (default 60)")
    ap.add_argument("--out", type=Path, default=RESULTS / "ledger")
    args = ap.parse_args(argv)
    args.pieces = args.pieces or (1 << 16 if args.quick else 1 << 20)
    args.seconds = args.seconds or (3.0 if args.quick else 10.0)
    args.joins = args.joins or (20 if args.quick else 60)
    flags = ["--model", "nano", "--token", TOKEN, "--names-per-token", "512", "--piece-tokens", "100"]
    with Session("ledger", argv, args.out, scratch_in_out=True) as s:
        say(f"load average {loadavg()}")
        persisted = persist(args.pieces, args.workers, args.name_chars, s.tmp, args.old)
        say(f"persist: {persisted}")
        (_, p, ports), *_ = start_shards(s.procs, s.tmp, "ledger", 1, flags)
        try:
            asks = unchanged_asks(f"127.0.0.1:{ports['grpc_port']}", ports["http_port"], args)
        finally:
            s.procs.stop(p, timeout=30)
        say(f"asks: {asks}")
        s.results.update(flags=flags, persist=persisted, asks=asks)
        md = [f"Command: `{s.command}`", "", *table(s.results)]
    return s.finish(md)


if __name__ == "__main__":
    sys.exit(main())
