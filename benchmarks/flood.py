"""A flood of stalled calls against one shard, and what it costs honest workers (issue 37, item 4).

The attack: calls that send their headers and never their request, from 16 loopback addresses (127.0.0.2 to
127.0.0.17: one /24), each address keeping --streams of them open and opening another the moment the
shard ends one, as fast as the machine lets it (--procs processes of raw HTTP/2 connections, no gRPC
library: the cheapest client there is). Past `--max-waiting-calls` (64) the shard ends one waiting call for
each new one (server/edge/slots.py): the oldest of the address holding the most.

The honest side, from 127.0.0.1 meanwhile: Joins that send their request 0.2 s (--delay) after opening the
call (a large fingerprint, or a slow link), one after the other, and Joins as a worker makes them
(worker/connection.py's ShardConnection.join, which retries RESOURCE_EXHAUSTED with backoff). Before the
flood the same Joins run against the idle shard. Reported: honest Join latency (p50, p95, max: from opening
the call to its reply, the 0.2 s included), how many were answered and how many ended otherwise (an
eviction: RESOURCE_EXHAUSTED), the flood's calls opened and the shard's evictions per second (its
/api/status), and the shard's refusals by kind.

    python -m benchmarks.flood                   # 40 delayed Joins and 10 worker Joins per phase
    python -m benchmarks.flood --quick           # 10 and 3

Writes results.json, results.md and run.log under --out (default benchmarks/results/flood). The flood and
the shard share the machine: the rate is what the machine allows both together. The raw client (`RawCalls`)
is also what tests/test_trust_slots.py floods an in-process shard with.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from benchmarks.harness import RESULTS, Session, http_json, loadavg, say, start_shards
from streamdiloco.common.wire import PROTOCOL
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

SERVICE = "/streamdiloco.v1.Shard/"
ADDRESSES = [f"127.0.0.{2 + i}" for i in range(16)]  # the flood's: one /24, beside the honest 127.0.0.1
DELAY = 0.2  # seconds between opening an honest Join and sending its request
REPLY_TIMEOUT = 30.0  # seconds an honest Join may take in all


# --- a raw HTTP/2 client: calls that send their headers (and a message, or nothing) -------------------------
def _hpack(headers: list[tuple[str, str]]) -> bytes:
    """A header block of literal fields without indexing (no Huffman): all a server must take."""
    out = bytearray()
    for name, value in headers:
        out.append(0)
        for s in (name.encode(), value.encode()):
            assert len(s) < 127
            out.append(len(s))
            out += s
    return bytes(out)


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


class RawCalls:
    """gRPC calls of `method` on one HTTP/2 connection from `source` (a loopback address: to 127.0.0.1, or
    from an IPv6 one to ::1) to `port`: `streams`
    of them open at once, each sending its headers and then `body` (a serialized request, as the end of its
    side) or, without one, nothing. With `reopen`, a call the server ends is followed at once by another,
    until close(). A thread reads the server's frames (answering SETTINGS and PINGs, granting flow-control
    credit for what it sends) and counts the calls opened and ended."""

    def __init__(
        self,
        port: int,
        source: str,
        method: str,
        streams: int,
        body: bytes | None = None,
        reopen: bool = False,
        timeout: float = 30.0,
    ):
        v6 = ":" in source  # an IPv6 source connects to ::1
        self.sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET)
        self.sock.settimeout(timeout)
        self.sock.bind((source, 0))
        self.sock.connect(("::1" if v6 else "127.0.0.1", port))
        self.body, self.reopen = body, reopen
        self.lock = threading.Lock()
        self.opened_at = time.monotonic()
        self.open: set[int] = set()
        self.ended: dict[int, float] = {}  # stream -> when the server ended it (seconds since the start)
        self.opened = 0
        self.next_id = 1
        self.pinged = threading.Event()
        self.closed = False
        self.stopping = False
        self.headers = _hpack(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", SERVICE + method),
                (":authority", f"127.0.0.1:{port}"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
        )
        out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(SETTINGS, 0, 0)
        out += b"".join(self._call() for _ in range(streams))
        out += _frame(PING, 0, 0, b"flooding")  # its answer comes once the server has read all the above
        self._send(out)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _call(self) -> bytes:
        """The frames that open one more call (its stream is counted open)."""
        stream, self.next_id = self.next_id, self.next_id + 2
        self.open.add(stream)
        self.opened += 1
        if self.body is None:
            return _frame(HEADERS, END_HEADERS, stream, self.headers)
        message = b"\0" + struct.pack(">I", len(self.body)) + self.body  # gRPC's length-prefixed message
        return _frame(HEADERS, END_HEADERS, stream, self.headers) + _frame(DATA, END_STREAM, stream, message)

    def _send(self, data: bytes) -> None:
        with self.lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = self.sock.recv(n - len(data))
            if not more:
                raise ConnectionError
            data += more
        return data

    def _read(self) -> None:
        try:
            while True:
                head = self._recv(9)
                length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                stream = int.from_bytes(head[5:], "big") & 0x7FFFFFFF
                payload = self._recv(length)
                if kind == SETTINGS and not flags & ACK:
                    self._send(_frame(SETTINGS, ACK, 0))
                elif kind == PING:
                    if flags & ACK:
                        self.pinged.set()
                    else:
                        self._send(_frame(PING, ACK, 0, payload))
                elif kind == GOAWAY:
                    raise ConnectionError
                if kind == DATA and length:  # the connection's credit back (each stream's is its own)
                    self._send(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", length)))
                if kind == RST_STREAM or (kind in (DATA, HEADERS) and flags & END_STREAM):
                    self._ended(stream, reset=kind == RST_STREAM)
        except (OSError, ConnectionError):
            self.closed = True
            now = time.monotonic() - self.opened_at
            with self.lock:
                for s in self.open:
                    self.ended.setdefault(s, now)
                self.open.clear()

    def _ended(self, stream: int, reset: bool) -> None:
        if stream not in self.open:
            return
        self.open.discard(stream)
        self.ended[stream] = time.monotonic() - self.opened_at
        out = b"" if reset else _frame(RST_STREAM, 0, stream, struct.pack(">I", 8))  # CANCEL: ours closes
        if self.reopen and not self.stopping:
            out += self._call()
        if out:
            self._send(out)

    @property
    def open_streams(self) -> int:
        return len(self.open)

    def lifetimes(self) -> list[float]:
        """Seconds from the connection's start to each ended call's end, in order."""
        return sorted(self.ended.values())

    def close(self) -> None:
        self.stopping = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # ends the reader's recv (a close alone does not)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(10.0)


# --- the honest side ---------------------------------------------------------------------------------------
def delayed_join(
    channel: grpc.Channel, request: pb.JoinRequest, delay: float = DELAY, timeout: float = REPLY_TIMEOUT
) -> tuple[float, grpc.StatusCode, pb.JoinReply | None]:
    """A Join whose request is sent `delay` seconds after the call opens (its headers go at once): its
    seconds from opening to the answer, its status and its reply (None unless OK)."""
    join = channel.stream_unary(
        SERVICE + "Join",
        request_serializer=pb.JoinRequest.SerializeToString,
        response_deserializer=pb.JoinReply.FromString,
    )

    def late():
        time.sleep(delay)
        yield request

    t0 = time.monotonic()
    try:
        reply = join(late(), timeout=timeout)
        return time.monotonic() - t0, grpc.StatusCode.OK, reply
    except grpc.RpcError as e:
        return time.monotonic() - t0, e.code(), None


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass
class Honest:
    """What the honest Joins of one phase got."""

    latencies: list[float] = field(default_factory=list)  # of the delayed Joins answered
    codes: dict[str, int] = field(default_factory=dict)  # every delayed Join's status
    worker_joins: list[float] = field(default_factory=list)  # seconds of each ShardConnection.join
    worker_failed: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        ms = [1e3 * x for x in self.latencies]
        return {
            "joins": sum(self.codes.values()),
            "answered": self.codes.get("OK", 0),
            "codes": dict(self.codes),
            "p50_ms": _quantile(ms, 0.5),
            "p95_ms": _quantile(ms, 0.95),
            "max_ms": max(ms, default=None),
            "worker_joins": len(self.worker_joins) + len(self.worker_failed),
            "worker_joined": len(self.worker_joins),
            "worker_p50_ms": _quantile([1e3 * x for x in self.worker_joins], 0.5),
            "worker_failed": self.worker_failed,
        }


def honest_joins(port: int, fingerprint: str, n: int, workers: int, tag: str, delay: float) -> Honest:
    """`n` delayed Joins one after the other, then `workers` Joins as a worker makes them (fingerprint: the
    shard's, as JSON), from 127.0.0.1."""
    from streamdiloco.worker.connection import ShardConnection  # the worker's own Join, retries and all
    from streamdiloco.worker.session import SyncError

    got = Honest()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for i in range(n):
            request = pb.JoinRequest(worker=f"{tag}-{i}", fingerprint_json=fingerprint, protocol=PROTOCOL)
            seconds, code, _ = delayed_join(channel, request, delay)
            got.codes[code.name] = got.codes.get(code.name, 0) + 1
            if code == grpc.StatusCode.OK:
                got.latencies.append(seconds)
    for i in range(workers):
        conn = ShardConnection(f"127.0.0.1:{port}", f"{tag}-w{i}", json.loads(fingerprint), join_timeout=60)
        t0 = time.monotonic()
        try:
            conn.join()
            got.worker_joins.append(time.monotonic() - t0)
        except SyncError as e:
            got.worker_failed.append(str(e)[:300])
        finally:
            conn.close()
    return got


# --- the flood ---------------------------------------------------------------------------------------------
def _flood_process(port: int, addresses: list[str], streams: int, stop: Any, out: Any) -> None:
    """One process of the flood: a RawCalls per address, reopening, until `stop` is set; puts "ready" once
    they are open, then the calls opened and the seconds it flooded."""
    t0 = time.monotonic()
    floods = [RawCalls(port, a, "Join", streams, reopen=True) for a in addresses]
    out.put("ready")
    stop.wait()
    for f in floods:
        f.close()
    out.put((sum(f.opened for f in floods), time.monotonic() - t0))


class Flood:
    """The flood's processes (`procs` of them, sharing the 16 addresses), from start to stop()."""

    def __init__(self, port: int, procs: int, streams: int):
        ctx = multiprocessing.get_context("spawn")
        self.queue, self.stop_event = ctx.Queue(), ctx.Event()
        self.parts = [
            ctx.Process(
                target=_flood_process, args=(port, ADDRESSES[i::procs], streams, self.stop_event, self.queue)
            )
            for i in range(procs)
        ]
        for p in self.parts:
            p.start()
        for _ in self.parts:
            assert self.queue.get(timeout=120) == "ready"

    def stop(self) -> float:
        """Ends the flood; the calls it opened per second."""
        self.stop_event.set()
        ends = [self.queue.get(timeout=60) for _ in self.parts]
        for p in self.parts:
            p.join(30)
        return sum(n / t for n, t in ends)


def _refused(http_port: int) -> dict[str, int]:
    return dict(http_json(http_port)["bounds"]["refused"])


def describe_fingerprint(port: int) -> str:
    """The shard's model fingerprint (JSON), as its Fetch describes it."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ShardStub(channel).Fetch(pb.FetchRequest(describe=True), timeout=REPLY_TIMEOUT)
        first = next(iter(call))
        call.cancel()
        return first.fingerprint_json


def measure(port: int, http_port: int, args: argparse.Namespace) -> dict[str, Any]:
    """The idle phase, then the flood phase (the honest Joins once the shard ends calls to make room, the
    flood stopped after them); their figures: the evictions per second are the shard's while the honest
    Joins ran."""
    fingerprint = describe_fingerprint(port)
    idle = honest_joins(port, fingerprint, args.joins, args.workers, "idle", args.delay)
    say(f"idle: {idle.row()}")
    flood = Flood(port, args.procs, args.streams)
    try:
        start, deadline = _refused(http_port).get("evicted", 0), time.monotonic() + 30
        while _refused(http_port).get("evicted", 0) - start < 1000 and time.monotonic() < deadline:
            time.sleep(0.1)  # the flood at full rate first
        before, t0 = _refused(http_port), time.monotonic()
        during = honest_joins(port, fingerprint, args.joins, args.workers, "flood", args.delay)
        after, seconds = _refused(http_port), time.monotonic() - t0
    finally:
        calls_per_second = flood.stop()
    refused = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    say(f"flood: {during.row()}; refused while the honest Joins ran ({seconds:.1f} s): {refused}")
    return {
        "idle": idle.row(),
        "flood": during.row(),
        "honest_seconds": seconds,
        "flood_calls_per_second": calls_per_second,
        "evictions_per_second": refused.get("evicted", 0) / seconds,
        "refused": refused,
    }


def table(r: dict[str, Any]) -> list[str]:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    out = [
        "| phase | delayed Joins answered | p50 ms | p95 ms | max ms | worker Joins joined | worker p50 ms "
        "| flood calls/s | evictions/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in ("idle", "flood"):
        x = r[phase]
        rate = (
            (f"{r['flood_calls_per_second']:,.0f}", f"{r['evictions_per_second']:,.0f}")
            if phase == "flood"
            else ("-", "-")
        )
        out.append(
            f"| {phase} | {x['answered']} of {x['joins']} | {ms(x['p50_ms'])} | {ms(x['p95_ms'])} | "
            f"{ms(x['max_ms'])} | {x['worker_joined']} of {x['worker_joins']} | {ms(x['worker_p50_ms'])} | "
            f"{rate[0]} | {rate[1]} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 delayed Joins and 3 worker Joins per phase")
    ap.add_argument("--joins", type=int, default=None, help="delayed honest Joins per phase (default 40)")
    ap.add_argument("--workers", type=int, default=None, help="worker Joins per phase (default 10)")
    ap.add_argument("--delay", type=float, default=DELAY, help="seconds before a delayed Join's request")
    ap.add_argument("--procs", type=int, default=2, help="processes of the flood (the 16 addresses shared)")
    ap.add_argument("--streams", type=int, default=8, help="calls each flood address keeps open")
    ap.add_argument("--shard-flag", action="append", help="one more shard flag (repeat: --shard-flag=--x)")
    ap.add_argument("--out", type=Path, default=RESULTS / "flood")
    args = ap.parse_args(argv)
    args.joins = args.joins or (10 if args.quick else 40)
    args.workers = args.workers or (3 if args.quick else 10)
    flags = ["--model", "nano", *(args.shard_flag or [])]
    with Session("flood", argv, args.out) as s:
        say(f"load average {loadavg()}")
        (_, p, ports), *_ = start_shards(s.procs, s.tmp, "flood", 1, flags, checkpoint=False)
        try:
            result = measure(ports["grpc_port"], ports["http_port"], args)
        finally:
            s.procs.stop(p, timeout=30)
        s.results.update(flags=flags, delay=args.delay, addresses=len(ADDRESSES), **result)
        md = [f"Command: `{s.command}`", "", *table(result), "", f"Refused by the shard: {result['refused']}"]
    failed = result["flood"]["answered"] < result["flood"]["joins"] or result["flood"]["worker_failed"]
    return s.finish(md, status=1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
