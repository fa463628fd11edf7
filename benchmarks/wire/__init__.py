"""Wire benchmark: what the gRPC wire costs, how fast one shard takes in pushes, and how much of a demo
worker's time goes to training. Each figure is measured beside a reference in the same run.

(a) framing   Real shard and worker processes talk through counting TCP proxies (asyncio, in this
              process, on 127.0.0.1). The proxies count every byte each way and parse the HTTP/2 frames
              and gRPC messages they forward, so the bytes split into: the codec's payload and scales,
              protobuf fields, gRPC's 5-byte message prefixes, HTTP/2 frame headers, HEADERS, flow
              control, pings and settings, and the Join and Fetch calls. Reference: the codec bytes the
              config predicts (encoded_nbytes of every slice pushed or received), cross-checked against
              the workers' summaries, the shards' counters and the chunks the proxy saw. A proxy sees the
              TCP payload only: TCP/IP headers (about 52 B per segment) are not in these figures.
(b) ingest    One shard process (--min-workers 8) and 8 client processes that Join with
              worker.link.ShardLink and push the same E3M0 fragment slice every round, each waiting for
              the round's update before its next push: MB/s of 4-bit payload the shard accepts. Then 2 shard
              processes (--num-shards 2, --b-shards): each client holds a ShardLink per shard, pushes each
              its slice of the fragment (slice_ranges) and waits for both shards' updates before its next
              push: MB/s summed over both shards, against 1 shard. Reference:
              the same 8 senders and bytes over plain TCP sockets to one asyncio receiver process that
              (1) reads and discards, (2) also dequantizes and sums in fp64 like the shard, (3) also runs
              the outer step and sends the E3M0 update back to all 8, as the shard does; each round ends
              with the receiver's reply to all 8 senders. Also: the shards' CPU by thread, and a cProfile of
              one shard's event loop in a separate pass.
(c) demo      `streamdiloco launch --shards 2 --workers 2 --steps 400 --log-every 50` (`make demo`, at half
              its 800 steps): per worker compute utilization (training time / wall time of training), blocked
              seconds, tokens/s. Reference: the same cluster with H = steps (each fragment syncs at most
              once before the final sync). Both again with every worker on all the cores (--threads),
              torch's default, where launch gives each worker cores / M threads and each shard one.

Timings suffer from anything else running on the machine: before each timed run the benchmark waits (up to
--max-wait s) for the CPUs to be nearly idle, and it reports the CPU that other processes used.

    python -m benchmarks.wire                 # the recorded run (see BENCHMARKS.md), about 9 minutes
    python -m benchmarks.wire --quick         # a quick look (about 7 minutes)
    python -m benchmarks.wire --parts b       # one part

(from the repository's root: the benchmarks are the modules of the package `benchmarks`; benchmarks/harness.py
starts and stops the processes and writes the results.)

Writes results.md, results.json and run.log under --out (default benchmarks/results/wire). Every process
it starts is stopped at the end, on an error and on Ctrl+C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    Procs,
    bench,
    http_json,
    machine,
    machine_line,
    say,
    sd,
    start_shards,
    system_busy_seconds,
    wait_files,
    wait_quiet,
    write_results,
)
from streamdiloco.common.atomic import atomic_write_text
from streamdiloco.common.codecs import CODECS, Encoded, chunk_values, decode, encode, expected_sizes
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, slice_ranges
from streamdiloco.common.modelspec import build_model
from streamdiloco.common.schedule import events
from streamdiloco.protos import streamdiloco_pb2 as pb

MB = 1e6


# --- (b) the shard's HTTP pages under load ---------------------------------------------------------------
class HttpProbe:
    """Asks a shard's /healthz and /api/status (with the masters' hashes) one after the other, as fast as
    they answer, while it is under load: their latencies in ms."""

    PATHS = ("/healthz", "/api/status")

    def __init__(self, port: int):
        self.port = port
        self.times: dict[str, list[float]] = {p: [] for p in self.PATHS}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for path in self.PATHS:
                t0 = time.perf_counter()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                        r.read()
                    self.times[path].append((time.perf_counter() - t0) * 1e3)
                except OSError:
                    self.errors += 1
                self._stop.wait(0.02)

    def __enter__(self) -> HttpProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def summary(self) -> dict:
        out: dict = {"errors": self.errors}
        for path, xs in self.times.items():
            ys = sorted(xs)
            out[path] = {
                "n": len(ys),
                "median": statistics.median(ys) if ys else None,
                "p99": ys[min(len(ys) - 1, int(0.99 * len(ys)))] if ys else None,
                "max": ys[-1] if ys else None,
            }
        return out


# --- (a) an HTTP/2 + gRPC parser for the proxy --------------------------------------------------------------
FRAME = {0: "DATA", 1: "HEADERS", 2: "PRIORITY", 3: "RST_STREAM", 4: "SETTINGS", 5: "PUSH_PROMISE", 6: "PING"}
FRAME |= {7: "GOAWAY", 8: "WINDOW_UPDATE", 9: "CONTINUATION"}
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def classify(msg: bytes) -> str:
    """The RPC of a stream, from the first message the client sent on it."""
    try:
        w = pb.WorkerMessage.FromString(msg)
        if w.WhichOneof("kind") == "hello" and len(w.hello.session) == 32:
            return "session"
    except Exception:  # noqa: BLE001 (any parse failure means: not this message type)
        pass
    try:
        j = pb.JoinRequest.FromString(msg)
        if j.protocol and j.fingerprint_json.startswith("{"):
            return "join"
    except Exception:  # noqa: BLE001
        pass
    try:
        pb.FetchRequest.FromString(msg)
        return "fetch"
    except Exception:  # noqa: BLE001
        return "other"


class H2Side:
    """One direction of one proxied connection: bytes by HTTP/2 frame type, gRPC message, stream."""

    def __init__(self, conn: H2Conn, up: bool):
        self.conn, self.up = conn, up
        self.buf = bytearray()
        self.need_preface = up
        self.total = 0
        self.acc: Counter = Counter()  # (stream id or 0, category) -> bytes
        self.msgbuf: dict[int, bytearray] = {}
        self.chunks = 0
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        if self.error:
            return
        try:
            self._feed(data)
        except Exception as e:  # noqa: BLE001 (a parser bug must not break the forwarding)
            self.error = repr(e)

    def _feed(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        if self.need_preface:
            if len(buf) < len(PREFACE):
                return
            if bytes(buf[: len(PREFACE)]) != PREFACE:
                raise ValueError("no HTTP/2 preface")
            self.acc[(0, "preface")] += len(PREFACE)
            pos, self.need_preface = len(PREFACE), False
        view = memoryview(buf)
        try:
            while len(buf) - pos >= 9:
                length = int.from_bytes(view[pos : pos + 3], "big")
                if len(buf) - pos < 9 + length:
                    break
                ftype, flags = view[pos + 3], view[pos + 4]
                sid = int.from_bytes(view[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                self._frame(ftype, flags, sid, view[pos + 9 : pos + 9 + length], 9 + length)
                pos += 9 + length
        finally:
            view.release()
        del buf[:pos]

    def _frame(self, ftype: int, flags: int, sid: int, payload: memoryview, size: int) -> None:
        name = FRAME.get(ftype, f"type{ftype}")
        if sid == 0:
            self.acc[(0, name)] += size
        elif ftype == 0:  # DATA
            body = payload
            if flags & 0x8:  # PADDED
                body = payload[1 : len(payload) - payload[0]]
            self.acc[(sid, "DATA frame headers")] += size - len(body)
            self._grpc(sid, body)
        elif ftype in (1, 9):
            self.acc[(sid, "HEADERS")] += size
        else:
            self.acc[(sid, name)] += size

    def _grpc(self, sid: int, body: memoryview) -> None:
        b = self.msgbuf.setdefault(sid, bytearray())
        b += body
        pos = 0
        while len(b) - pos >= 5:
            n = int.from_bytes(b[pos + 1 : pos + 5], "big")
            if len(b) - pos < 5 + n:
                break
            self.acc[(sid, "gRPC prefixes")] += 5
            self._message(sid, bytes(b[pos + 5 : pos + 5 + n]))
            pos += 5 + n
        del b[:pos]

    def _message(self, sid: int, msg: bytes) -> None:
        kinds = self.conn.kinds
        if sid not in kinds:  # the client's first message names the RPC (it always precedes the reply)
            kinds[sid] = classify(msg) if self.up else "other"
        if kinds[sid] != "session":
            self.acc[(sid, "messages")] += len(msg)
            return
        m = (pb.WorkerMessage if self.up else pb.ShardMessage).FromString(msg)
        kind = m.WhichOneof("kind")
        chunk = m.push.chunk if kind == "push" else m.update if kind == "update" else None
        if chunk is None:
            self.acc[(sid, "other messages")] += len(msg)
            return
        codec = len(chunk.payload) + len(chunk.scales)
        self.chunks += 1
        self.acc[(sid, "codec")] += codec
        self.acc[(sid, "protobuf fields")] += len(msg) - codec


class H2Conn:
    def __init__(self, target: str):
        self.target = target
        self.kinds: dict[int, str] = {}
        self.up, self.down = H2Side(self, True), H2Side(self, False)
        self.open = True

    def breakdown(self, side: H2Side) -> Counter:
        out: Counter = Counter()
        for (sid, cat), n in side.acc.items():
            if sid == 0:
                out[f"connection {cat}"] += n
            else:
                kind = self.kinds.get(sid, "other")
                out[f"{kind} {cat}" if kind == "session" else kind] += n
        parsed = sum(side.acc.values())
        if parsed != side.total:
            out["unparsed"] += side.total - parsed
        return out


class Proxies:
    """Counting TCP proxies on 127.0.0.1, one per target, run by an asyncio loop in a background thread."""

    def __init__(self, targets: list[tuple[str, int]]):
        self.targets = targets
        self.conns: list[H2Conn] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="proxy", daemon=True)
        self.servers: list[asyncio.base_events.Server] = []
        self.ports: list[int] = []
        self.tasks: set[asyncio.Task] = set()

    def start(self) -> list[int]:
        self.thread.start()
        for t in self.targets:
            fut = asyncio.run_coroutine_threadsafe(self._listen(t), self.loop)
            self.ports.append(fut.result(10))
        return self.ports

    async def _listen(self, target: tuple[str, int]) -> int:
        async def handle(reader, writer):
            self.tasks.add(asyncio.current_task())
            conn = H2Conn(f"{target[0]}:{target[1]}")
            self.conns.append(conn)
            try:
                ur, uw = await asyncio.open_connection(*target)
            except OSError:
                writer.close()
                conn.open = False
                return
            try:
                await asyncio.gather(self._pump(reader, uw, conn.up), self._pump(ur, writer, conn.down))
            except asyncio.CancelledError:  # stop(): end quietly (asyncio's server callback reads our result)
                pass
            finally:
                conn.open = False
                for w in (uw, writer):
                    w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.servers.append(server)
        return server.sockets[0].getsockname()[1]

    @staticmethod
    async def _pump(reader, writer, side: H2Side) -> None:
        try:
            while data := await reader.read(1 << 18):
                side.feed(data)  # before forwarding: the shard cannot answer what it has not received
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                writer.write_eof()
            except (OSError, RuntimeError):
                pass

    def wait_closed(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(c.open for c in self.conns):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        async def _close():
            for s in self.servers:
                s.close()
            tasks = [t for t in self.tasks if not t.done()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_close(), self.loop).result(10)
            except Exception:  # noqa: BLE001 (stopping anyway)
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


# --- (a) framing overhead -----------------------------------------------------------------------------------
A_RUNS: dict[str, dict[str, Any]] = {
    # model: (steps, H, batch, block size): H small for many syncs; small gets a short context so that its
    # steps are quick on 2 cores (the bytes on the wire do not depend on batch or context, only wpe shrinks)
    "tiny": dict(steps=60, sync_every=10, batch_size=16, block_size=None),
    "small": dict(steps=30, sync_every=10, batch_size=2, block_size=64),
}
A_QUICK: dict[str, dict[str, Any]] = {"tiny": dict(steps=30, sync_every=10, batch_size=8, block_size=None)}


def predicted_codec_bytes(model: str, block_size: int | None, cfg: SyncConfig, steps: int, shards: int):
    """Per worker: codec bytes of every push (up) and update (down) the schedule makes, and the pushes."""
    layout = build_layout(build_model(model, 0, block_size), cfg.num_fragments, cfg.fragment_pattern)
    up = down = pushes = 0
    for t in range(1, steps + 1):
        for ev in events(t, cfg, steps):
            numel = layout.fragments[ev.fragment].numel
            codec = cfg.uplink_codec if ev.kind == "send" else cfg.downlink_codec
            n = sum(
                CODECS[codec].encoded_nbytes(hi - lo, cfg.codec_block_size)
                for lo, hi in slice_ranges(numel, shards)
            )
            if ev.kind == "send":
                up, pushes = up + n, pushes + 1
            else:
                down += n
    return up, down, pushes, layout.numel


def run_framing(
    model: str, spec: dict, shards: int, workers: int, procs: Procs, tmp: Path, max_wait: float
) -> dict:
    wait_quiet("a", max_wait)  # byte counts hardly depend on timing, but pings and window updates do a little
    cfg = SyncConfig(sync_every=spec["sync_every"])
    steps = spec["steps"]
    up_pred, down_pred, pushes, numel = predicted_codec_bytes(model, spec["block_size"], cfg, steps, shards)
    model_flags = ["--model", model] + (
        ["--block-size", str(spec["block_size"])] if spec["block_size"] else []
    )
    sync_flags = ["--sync-every", str(cfg.sync_every)]
    say(
        f"[a] {model} ({numel:,} params): {shards} shards, {workers} workers, {steps} steps, "
        f"H={cfg.sync_every}, P={cfg.num_fragments}, {cfg.uplink_codec}/{cfg.downlink_codec}, "
        f"batch {spec['batch_size']}: {pushes} pushes per worker"
    )
    t0 = time.monotonic()
    tag = f"a-{model}"
    shard_procs = start_shards(
        procs,
        tmp,
        tag,
        shards,
        ["--min-workers", str(workers), "--round-timeout", "300"] + model_flags + sync_flags,
    )
    proxies = Proxies([("127.0.0.1", info["grpc_port"]) for _, _, info in shard_procs])
    try:
        ports = proxies.start()
        servers = ",".join(f"127.0.0.1:{p}" for p in ports)
        wprocs = []
        for m in range(workers):
            argv = ["worker", "--servers", servers, "--name", f"worker-{m}", "--rank", str(m)]
            argv += ["--steps", str(steps), "--batch-size", str(spec["batch_size"]), "--eval-batches", "1"]
            argv += ["--log-every", str(max(1, steps // 3)), "--summary", str(tmp / f"{tag}-worker{m}.json")]
            argv += ["--checkpoint", str(tmp / f"{tag}-worker{m}.pt")]
            argv += ["--eval-every", "0"]  # compute utilization without evaluations, as recorded
            wprocs.append(
                (f"{tag}-worker{m}", procs.start(f"{tag}-worker{m}", sd(*argv, *model_flags, *sync_flags)))
            )
        deadline = time.monotonic() + 600
        for name, p in wprocs:
            try:
                rc = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name} did not finish in time:\n{procs.tail(name)}") from None
            if rc:
                raise RuntimeError(f"{name} exited with status {rc}:\n{procs.tail(name)}")
        summaries = [json.loads((tmp / f"{tag}-worker{m}.json").read_text()) for m in range(workers)]
        statuses = [http_json(info["http_port"]) for _, _, info in shard_procs]
        closed = proxies.wait_closed(10)
    finally:
        proxies.stop()
        for _, p, _ in shard_procs:
            procs.stop(p)
    wall = time.monotonic() - t0

    dirs = {}
    for dname, up in (("up", True), ("down", False)):
        total: Counter[str] = Counter()
        errors = []
        for c in proxies.conns:
            side = c.up if up else c.down
            total.update(c.breakdown(side))
            total["TOTAL"] += side.total
            if side.error:
                errors.append(side.error)
        pred = (up_pred if up else down_pred) * workers
        summary_codec = sum(s["bytes_sent" if up else "bytes_received"] for s in summaries)
        shard_codec = sum(st["bytes"]["codec_in" if up else "codec_out"] for st in statuses)
        proxy_codec = total.get("session codec", 0)
        sync_total = sum(v for k, v in total.items() if k.startswith(("session", "connection")))
        dirs[dname] = {
            "predicted_codec_bytes": pred,
            "summary_codec_bytes": summary_codec,
            "shard_codec_bytes": shard_codec,
            "proxy_codec_bytes": proxy_codec,
            "proxy_total_bytes": total["TOTAL"],
            "join_bytes": total.get("join", 0),
            "fetch_bytes": total.get("fetch", 0),
            "other_bytes": total.get("other", 0) + total.get("unparsed", 0),
            "sync_bytes": sync_total,
            "overhead_sync_pct": 100 * (sync_total - pred) / pred,
            "overhead_all_pct": 100 * (total["TOTAL"] - pred) / pred,
            # every push (and every update) is one encoded slice per shard
            "overhead_bytes_per_slice": (sync_total - pred) / (pushes * workers * shards),
            "worker_wire_bytes": sum(
                s["message_bytes_sent" if up else "message_bytes_received"] for s in summaries
            ),
            "shard_wire_bytes": sum(
                st["bytes"]["message_bytes_in" if up else "message_bytes_out"] for st in statuses
            ),
            "breakdown": {k: v for k, v in sorted(total.items()) if k != "TOTAL"},
            "parse_errors": errors,
        }
        if errors or dirs[dname]["other_bytes"]:
            say(
                f"[a]   warning: {dname}: {len(errors)} parse errors {errors[:2]}, "
                f"{dirs[dname]['other_bytes']} B not parsed"
            )
    return {
        "model": model,
        "params": numel,
        "shards": shards,
        "workers": workers,
        **spec,
        "H": cfg.sync_every,
        "P": cfg.num_fragments,
        "codec": f"{cfg.uplink_codec}/{cfg.downlink_codec}",
        "codec_block_size": cfg.codec_block_size,
        "pushes_per_worker": pushes,
        "connections": len(proxies.conns),
        "connections_closed": closed,
        "stream_kinds": Counter(k for c in proxies.conns for k in c.kinds.values()),
        "wall_seconds": wall,
        "directions": dirs,
    }


def table_a(runs: list[dict]) -> str:
    head = (
        "| model | dir | codec bytes predicted | = summaries / shards / proxy-parsed | bytes through proxy | "
        "of which Join + Fetch | sync bytes (Session + connection) | overhead, sync | per slice pushed | "
        "overhead, all |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in runs:
        for d in ("up", "down"):
            x = r["directions"][d]
            same = (
                "yes"
                if x["summary_codec_bytes"]
                == x["shard_codec_bytes"]
                == x["proxy_codec_bytes"]
                == x["predicted_codec_bytes"]
                else (
                    f"{x['summary_codec_bytes']:,} / {x['shard_codec_bytes']:,} / {x['proxy_codec_bytes']:,}"
                )
            )
            lines.append(
                f"| {r['model']} | {d} | {x['predicted_codec_bytes']:,} | {same} | "
                f"{x['proxy_total_bytes']:,} | "
                f"{x['join_bytes']:,} + {x['fetch_bytes']:,} | {x['sync_bytes']:,} | "
                f"+{x['overhead_sync_pct']:.2f}% | {x['overhead_bytes_per_slice']:.0f} B | "
                f"+{x['overhead_all_pct']:.1f}% |"
            )
    return "\n".join(lines)


BREAKDOWN_ROWS = [
    ("session codec", "codec payload + scales (Chunk.payload, Chunk.scales)"),
    ("session protobuf fields", "protobuf fields of the chunk messages"),
    ("session other messages", "Hello, Welcome, PushResult messages"),
    ("session gRPC prefixes", "gRPC 5-byte message prefixes"),
    ("session DATA frame headers", "HTTP/2 DATA frame headers (9 B each)"),
    ("session HEADERS", "HTTP/2 HEADERS (call start, trailers)"),
    ("session WINDOW_UPDATE", "HTTP/2 WINDOW_UPDATE on the stream"),
    ("session RST_STREAM", "HTTP/2 RST_STREAM"),
    ("connection preface", "HTTP/2 connection preface"),
    ("connection SETTINGS", "HTTP/2 SETTINGS (+acks)"),
    ("connection WINDOW_UPDATE", "HTTP/2 WINDOW_UPDATE on the connection"),
    ("connection PING", "HTTP/2 PING (keepalive, BDP probes, acks)"),
    ("connection GOAWAY", "HTTP/2 GOAWAY"),
    ("join", "Join call (all frames)"),
    ("fetch", "Fetch call (all frames: fp32 masters)"),
]


def table_a_breakdown(r: dict) -> str:
    up, down = r["directions"]["up"], r["directions"]["down"]
    lines = ["| bytes | up | % of codec | down | % of codec |", "|---|---|---|---|---|"]
    keys = set(up["breakdown"]) | set(down["breakdown"])
    known = {k for k, _ in BREAKDOWN_ROWS}
    rows = BREAKDOWN_ROWS + [(k, k) for k in sorted(keys - known)]
    for key, label in rows:
        u, d = up["breakdown"].get(key, 0), down["breakdown"].get(key, 0)
        if not u and not d:
            continue
        pu = 100 * u / up["predicted_codec_bytes"]
        pd = 100 * d / down["predicted_codec_bytes"]
        lines.append(f"| {label} | {u:,} | {pu:.3f}% | {d:,} | {pd:.3f}% |")
    lines.append(
        f"| **total through the proxy** | {up['proxy_total_bytes']:,} | | {down['proxy_total_bytes']:,} | |"
    )
    return "\n".join(lines)


# --- (b) ingest ---------------------------------------------------------------------------------------------
def ingest_plan(model: str, fragment: int) -> dict:
    cfg = SyncConfig()
    layout = build_layout(build_model(model, 0), cfg.num_fragments, cfg.fragment_pattern)
    numel = layout.fragments[fragment].numel
    return {
        "model": model,
        "fragment": fragment,
        "numel": numel,
        "codec_bytes": CODECS["e3m0"].encoded_nbytes(numel, cfg.codec_block_size),
        "block_size": cfg.codec_block_size,
        "chunk_values": chunk_values("e3m0", cfg.codec_block_size),
        "fingerprint": model_fingerprint(layout, cfg),
    }


def push_bytes(plan: dict, shards: int) -> int:
    """E3M0 bytes one client pushes per round to S shards together: each shard's slice encoded on its own
    (a slice that does not end on a block boundary carries one more scale than the whole would)."""
    return sum(
        CODECS["e3m0"].encoded_nbytes(hi - lo, plan["block_size"])
        for lo, hi in slice_ranges(plan["numel"], shards)
    )


def write_payload(plan: dict, path: Path) -> None:
    """One E3M0-encoded outer gradient of the slice; every client pushes these bytes every round."""
    g = torch.Generator().manual_seed(1)
    enc = encode(torch.randn(plan["numel"], generator=g) * 1e-3, "e3m0", plan["block_size"])
    path.write_bytes(enc.scales.numpy().tobytes() + enc.payload.numpy().tobytes())


def read_payload(plan: dict, path: Path) -> Encoded:
    data = bytearray(path.read_bytes())
    payload_n, scales_n = expected_sizes("e3m0", plan["numel"], plan["block_size"])
    scales = torch.frombuffer(data[: 4 * scales_n], dtype=torch.float32)
    payload = torch.frombuffer(data[4 * scales_n :], dtype=torch.uint8)
    assert payload.numel() == payload_n
    return Encoded("e3m0", plan["numel"], payload, scales, plan["block_size"])


def chunk_layout(plan: dict) -> list[tuple[int, int, int, int]]:
    """(offset, values, payload bytes, scales) of each chunk: the same cut as the gRPC pushes."""
    out = []
    n, cv = plan["numel"], plan["chunk_values"]
    for lo in range(0, n, cv):
        hi = min(n, lo + cv)
        p, s = expected_sizes("e3m0", hi - lo, plan["block_size"])
        out.append((lo, hi - lo, p, s))
    return out


def _client_go(ready: Path) -> float:
    """Say ready, wait for the go line on stdin; returns the process's CPU seconds at go."""
    ready.write_text("ready")
    sys.stdin.readline()
    return time.process_time()


def grpc_client_main(a: argparse.Namespace) -> int:
    """Join with ShardLink, then each round: push the slice, wait for the round's update."""
    from streamdiloco.worker.link import ShardLink

    plan = json.loads(Path(a.plan).read_text())
    enc = read_payload(plan, Path(a.payload))
    f = plan["fragment"]
    links = [ShardLink(t, a.name, plan["fingerprint"]) for t in a.target.split(",")]
    try:
        for link in links:
            link.start()
        welcomes = [link.ready() for link in links]  # every client joins before the first push
        if len(links) == 1:
            assert links[0].slices[f][1] == plan["numel"], links[0].slices
            encs = [enc]
        else:  # each shard its slice of the same values, encoded as a worker would
            want = [(lo, hi - lo) for lo, hi in slice_ranges(plan["numel"], len(links))]
            assert [x.slices[f] for x in links] == want, [x.slices[f] for x in links]
            values = decode(enc)
            encs = [
                encode(values[lo : lo + n], "e3m0", plan["block_size"])
                for lo, n in (x.slices[f] for x in links)
            ]
        # --pipeline F: pushes go to fragments f, f+1, ..., f+F-1 in turn (the same values: the fragments are
        # the same size), each waiting only for the update of the push F before it, as a worker's fragments
        # overlap: the shard takes one fragment's pushes while it closes another's round
        frags = [f + i for i in range(a.pipeline)]
        firsts = [[w.rounds[g] for g in frags] for w in welcomes]
        cpu0 = _client_go(Path(a.ready))
        starts, ends, cpu = [], [], []

        def wait(k: int) -> None:
            g = k % a.pipeline
            for link, first in zip(links, firsts, strict=True):
                link.wait_update(frags[g], first[g] + k // a.pipeline, timeout=300)
            ends.append(time.monotonic())
            cpu.append(time.process_time() - cpu0)

        for k in range(a.rounds):
            g = k % a.pipeline
            starts.append(time.monotonic())
            for link, first, e in zip(links, firsts, encs, strict=True):
                link.push(frags[g], first[g] + k // a.pipeline, e, weight=1.0, loss=None)
            if k - a.pipeline + 1 >= 0:
                wait(k - a.pipeline + 1)
        for k in range(max(0, a.rounds - a.pipeline + 1), a.rounds):
            wait(k)
        refused = [r.reason for link in links for r in link.refusals]
        result = {"starts": starts, "ends": ends, "cpu": cpu, "refused": refused}
        Path(a.result).write_text(json.dumps(result))
    finally:
        for link in links:
            link.close()
    return 0


def tcp_sender_main(a: argparse.Namespace) -> int:
    """Send the same chunks' bytes (scales, payload) every round; wait for the receiver's reply."""
    import socket

    plan = json.loads(Path(a.plan).read_text())
    enc = read_payload(plan, Path(a.payload))
    pieces = []
    for lo, _n, p, s in chunk_layout(plan):
        b0, s0 = lo // 2, lo // plan["block_size"]
        pieces.append(enc.scales[s0 : s0 + s].numpy().tobytes() + enc.payload[b0 : b0 + p].numpy().tobytes())
    reply_n = plan["codec_bytes"] if a.mode == "full" else 1
    reply = bytearray(reply_n)
    view = memoryview(reply)
    sock = socket.create_connection(("127.0.0.1", a.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cpu0 = _client_go(Path(a.ready))
    starts, ends, cpu = [], [], []
    for _ in range(a.rounds):
        starts.append(time.monotonic())
        for piece in pieces:
            sock.sendall(piece)
        got = 0
        while got < reply_n:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("receiver closed the connection")
            got += n
        ends.append(time.monotonic())
        cpu.append(time.process_time() - cpu0)
    sock.close()
    Path(a.result).write_text(json.dumps({"starts": starts, "ends": ends, "cpu": cpu, "refused": []}))
    return 0


def tcp_receiver_main(a: argparse.Namespace) -> int:
    """One asyncio event loop, like the shard's. `discard` reads every sender's chunks; `decode` also
    dequantizes them and sums them into an fp64 accumulator once a sender's slice is complete (what
    ShardState.push_chunk does); `full` also closes the round with the outer step and the E3M0 update
    (OuterOptimizer.step, what close_round does) and sends the update to every sender. The other modes reply
    with one byte when all senders' slices are in."""
    from streamdiloco.common.outer import OuterOptimizer

    plan = json.loads(Path(a.plan).read_text())
    layout = chunk_layout(plan)
    bs, n = plan["block_size"], plan["numel"]
    cfg = SyncConfig()
    opt = OuterOptimizer(torch.zeros(n), cfg.outer_lr, cfg.outer_momentum, True, "e3m0", bs)

    async def run() -> None:
        state: dict[str, Any] = {"acc": torch.zeros(n, dtype=torch.float64), "count": 0, "weight": 0.0}
        writers: list[asyncio.StreamWriter] = []

        async def close_round() -> None:
            if a.mode == "full":
                upd, _ = opt.step((state["acc"] / state["weight"]).to(torch.float32))
                reply = upd.scales.numpy().tobytes() + upd.payload.numpy().tobytes()
            else:
                reply = b"\x01"
            state.update(acc=torch.zeros(n, dtype=torch.float64), count=0, weight=0.0)
            for w in writers:
                w.write(reply)
            for w in writers:
                await w.drain()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            for _ in range(a.rounds):
                parts = []
                for lo, cnt, p, s in layout:
                    data = await reader.readexactly(4 * s + p)
                    if a.mode != "discard":
                        scales = torch.frombuffer(bytearray(data[: 4 * s]), dtype=torch.float32)
                        payload = torch.frombuffer(bytearray(data[4 * s :]), dtype=torch.uint8)
                        parts.append((lo, Encoded("e3m0", cnt, payload, scales, bs)))
                for lo, part in parts:
                    state["acc"][lo : lo + part.numel].add_(decode(part).to(torch.float64), alpha=1.0)
                state["count"] += 1
                state["weight"] += 1.0
                if state["count"] == a.senders:
                    await close_round()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        atomic_write_text(a.port_file, str(server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()  # until stopped: the benchmark reads our CPU time after the senders end

    asyncio.run(run())
    return 0


class CpuSampler:
    """Samples processes' CPU seconds per thread every `period` s, so that CPU over a window can be read.
    With more than one process the threads are named "p<i> ..." (the i-th pid given)."""

    def __init__(self, pids: list[int], period: float = 0.02):
        self.pids, self.period = pids, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = {"ALL": system_busy_seconds()}
            for i, pid in enumerate(self.pids):
                for k, v in thread_cpu(pid).items():
                    sample[k if len(self.pids) == 1 else f"p{i} {k}"] = v
            self.samples.append((time.monotonic(), sample))
            self._stop.wait(self.period)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2)

    def between(self, t0: float, t1: float) -> tuple[dict[str, float], float]:
        """CPU seconds per thread from the last sample at or before t0 to the first at or after t1, and the
        seconds between those two samples."""
        before = [(t, s) for t, s in self.samples if t <= t0] or self.samples[:1]
        after = [(t, s) for t, s in self.samples if t >= t1] or self.samples[-1:]
        (ta, a), (tb, b) = before[-1], after[0]
        return {k: b[k] - a.get(k, 0.0) for k in b if b[k] - a.get(k, 0.0) >= 0.005}, tb - ta


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process: the main thread as "main", the others by name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "main thread" if task.name == str(pid) else f"{comm} threads"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def run_clients(
    procs: Procs,
    tmp: Path,
    tag: str,
    client_argv,
    clients: int,
    servers: list[tuple[str, subprocess.Popen]],
    push_bytes: int,
    warmup: int,
    per: int,
):
    """Start the clients, wait until all are ready, say go, wait for them; then the rates per repeat
    (warm-up rounds left out: push_bytes per client and round) and the CPU of the servers (by thread, all
    of them together) and of the clients over the measured rounds."""
    cl = []
    for i in range(clients):
        ready, result = tmp / f"{tag}-c{i}.ready", tmp / f"{tag}-c{i}.json"
        for f in (ready, result):
            f.unlink(missing_ok=True)
        p = procs.start(f"{tag}-c{i}", client_argv(i, ready, result), stdin=True)
        cl.append((f"{tag}-c{i}", p, ready, result))
    wait_files(procs, [c[2] for c in cl], [(c[0], c[1]) for c in cl] + servers, timeout=180)
    with CpuSampler([sp.pid for _, sp in servers]) as sampler:
        for c in cl:
            stdin = c[1].stdin
            assert stdin is not None  # started with stdin=True
            stdin.write("go\n")
            stdin.flush()
        deadline = time.monotonic() + 600
        for name, p, _, _ in cl:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name} did not finish:\n{procs.tail(name)}") from None
            if p.returncode:
                raise RuntimeError(f"{name} exited with status {p.returncode}:\n{procs.tail(name)}")
        time.sleep(0.05)
    results = [json.loads(c[3].read_text()) for c in cl]
    rounds = len(results[0]["starts"])
    start = [min(r["starts"][k] for r in results) for k in range(rounds)]
    end = [max(r["ends"][k] for r in results) for k in range(rounds)]
    bytes_per_round = clients * push_bytes
    reps = []
    for j in range((rounds - warmup) // per):
        k0, k1 = warmup + j * per, warmup + (j + 1) * per - 1
        reps.append(bytes_per_round * per / (end[k1] - start[k0]) / MB)
    t0, t1 = start[warmup], end[-1]
    server_cpu, span = sampler.between(t0, t1)
    machine_cpu = server_cpu.pop("ALL", 0.0)
    clients_cpu = sum(r["cpu"][-1] - r["cpu"][warmup - 1] for r in results)
    return results, {
        "push_bytes_per_client": push_bytes,
        "repeat_mb_s": reps,
        "median_mb_s": statistics.median(reps),
        "rounds_measured": rounds - warmup,
        "median_round_seconds": statistics.median(end[k] - start[k] for k in range(warmup, rounds)),
        "measured_seconds": t1 - t0,
        "server_cpu_seconds": sum(server_cpu.values()),
        "server_cpu_by_thread": {k: round(v, 2) for k, v in sorted(server_cpu.items(), key=lambda x: -x[1])},
        "clients_cpu_seconds": clients_cpu,
        "machine_cpu_seconds": machine_cpu,  # every process on the machine, this one and the others included
        "sampled_seconds": span,  # the span over which server and machine CPU were read (>= measured_seconds)
    }


def _fmt_rate(row: dict) -> str:
    reps = ", ".join(f"{x:.1f}" for x in row["repeat_mb_s"])
    rnd = row["median_round_seconds"]
    return f"[b]   {row['median_mb_s']:.1f} MB/s (repeats: {reps}); median round {rnd:.3f}s"


def part_b(args, procs: Procs, tmp: Path) -> dict:
    plan = ingest_plan(args.b_model, 0)
    clients, warmup, per, reps = args.b_clients, 2, args.b_rounds, args.b_repeats
    plan_file, payload = tmp / "b-plan.json", tmp / "b-payload.bin"
    plan_file.write_text(json.dumps(plan))
    write_payload(plan, payload)
    me = bench("wire")
    say(
        f"[b] {args.b_model}, fragment 0: {plan['numel']:,} values = {plan['codec_bytes']:,} B of E3M0 per "
        f"push ({len(chunk_layout(plan))} chunks), {clients} clients, {warmup} warm-up + {reps} x {per} "
        "rounds"
    )
    rows = []
    for mode in args.b_tcp_modes:
        # reading and discarding is so fast that a repeat of `per` rounds lasts a few ms: give it more rounds
        m_per = per * 5 if mode == "discard" else per
        rounds = warmup + m_per * reps
        say(f"[b] plain TCP, receiver: {mode} ({warmup} + {reps} x {m_per} rounds) ...")
        busy = wait_quiet("b", args.max_wait)
        port_file = tmp / f"b-tcp-{mode}.port"
        port_file.unlink(missing_ok=True)
        rname = f"b-tcp-{mode}-receiver"
        recv = procs.start(
            rname,
            me + ["_tcp-receiver", "--plan", str(plan_file), "--mode", mode, "--senders", str(clients)]
            + ["--rounds", str(rounds), "--port-file", str(port_file)],
        )  # fmt: skip
        try:
            wait_files(procs, [port_file], [(rname, recv)], timeout=60)
            port = int(port_file.read_text())

            def argv(i, ready, result, mode=mode, port=port, rounds=rounds):
                return me + ["_tcp-sender", "--plan", str(plan_file), "--payload", str(payload)] + [
                    "--mode", mode, "--port", str(port), "--rounds", str(rounds), "--ready", str(ready),
                    "--result", str(result)]  # fmt: skip

            _, rates = run_clients(
                procs,
                tmp,
                f"b-tcp-{mode}",
                argv,
                clients,
                [(rname, recv)],
                plan["codec_bytes"],
                warmup,
                m_per,
            )
        finally:
            procs.stop(recv)
        rows.append(
            {
                "transport": "plain TCP",
                "receiver": mode,
                "rounds_per_repeat": m_per,
                **rates,
                "busy_before": busy,
            }
        )
        say(_fmt_rate(rows[-1]))

    def grpc_run(
        tag: str,
        wrap: list[str] | None,
        rounds: int,
        per: int,
        shards: int = 1,
        ckpt: bool = True,
        pipe: int = 1,
    ):
        flags = ["--min-workers", str(clients), "--round-timeout", "600", "--model", args.b_model]
        flags += ["--max-sessions-per-peer", str(max(8, clients))]  # every client comes from 127.0.0.1
        started = start_shards(procs, tmp, tag, shards, flags, wrap=wrap, checkpoint=ckpt)
        try:
            targets = ",".join(f"127.0.0.1:{info['grpc_port']}" for _, _, info in started)

            def argv(i, ready, result):
                return me + ["_grpc-client", "--plan", str(plan_file), "--payload", str(payload)] + [
                    "--target", targets, "--name", f"client-{i}", "--rounds", str(rounds),
                    "--pipeline", str(pipe), "--ready", str(ready), "--result", str(result)]  # fmt: skip

            servers = [(n, p) for n, p, _ in started]  # CPU by thread: all shards' (p0 = shard 0, ...)
            nbytes = push_bytes(plan, shards)  # per client and round, summed over the shards' slices
            with HttpProbe(started[0][2]["http_port"]) as probe:  # health and status while it ingests
                results, rates = run_clients(procs, tmp, tag, argv, clients, servers, nbytes, warmup, per)
            rates["http_ms"] = probe.summary()
            statuses = [http_json(info["http_port"]) for _, _, info in started]
        finally:
            for _, p, _ in started:
                procs.stop(p, timeout=30)
        return results, rates, statuses

    configs = [(n, ckpt, 1) for n in args.b_shards for ckpt in (True, False)]
    configs += [(n, ckpt, 2) for n in args.b_shards for ckpt in (True, False) if args.b_pipeline]
    for shards, ckpt, pipe in configs:
        if True:
            what = f"{shards} shard{'s' if shards > 1 else ''}, " + (
                "checkpoint every round" if ckpt else "--no-checkpoint"
            )
            if pipe > 1:
                what += f", {pipe} fragments in flight"
            say(f"[b] gRPC: {what}, --min-workers {clients} ({warmup} + {reps} x {per} rounds) ...")
            busy = wait_quiet("b", args.max_wait)
            tag = f"b-grpc-s{shards}-{'ckpt' if ckpt else 'nockpt'}-p{pipe}"
            results, rates, statuses = grpc_run(tag, None, warmup + per * reps, per, shards, ckpt, pipe)
            closes = [h["seconds"] for h in statuses[0]["recent_rounds"]][warmup:]
            rows.append(
                {
                    "transport": f"gRPC, {what}",
                    "receiver": "full",
                    "shards": shards,
                    "checkpoint": ckpt,
                    "pipeline": pipe,
                    "rounds_per_repeat": per,
                    **rates,
                    "refused": sum(len(r["refused"]) for r in results),
                    "shard_pushes_accepted": sum(st["pushes_accepted"] for st in statuses),
                    "shard_codec_in": sum(st["bytes"]["codec_in"] for st in statuses),
                    # what the rate counts: every client's slices of every round (warm-up included)
                    "shard_codec_in_expected": clients
                    * (warmup + per * reps)
                    * rates["push_bytes_per_client"],
                    "shard_wire_in": sum(st["bytes"]["message_bytes_in"] for st in statuses),
                    "shard_first_push_to_close_seconds": closes,
                    "median_shard_first_push_to_close": statistics.median(closes) if closes else None,
                    "busy_before": busy,
                }
            )
            say(_fmt_rate(rows[-1]))
            if rows[-1]["shard_codec_in"] != rows[-1]["shard_codec_in_expected"]:
                say(
                    f"[b]   warning: the shards counted {rows[-1]['shard_codec_in']:,} B of codec in, "
                    f"the clients pushed {rows[-1]['shard_codec_in_expected']:,} B"
                )

    profile = None
    if args.b_profile:
        say(f"[b] the gRPC shard again under cProfile (its main thread), {warmup} + {per} rounds ...")
        prof = tmp / "b-shard.prof"
        grpc_run("b-prof", [sys.executable, "-m", "cProfile", "-o", str(prof)], warmup + per, per, 1, True)
        profile = profile_rows(prof, warmup + per) if prof.exists() else None
    return {
        **{k: v for k, v in plan.items() if k != "fingerprint"},
        "clients": clients,
        "warmup_rounds": warmup,
        "repeats": reps,
        "rows": rows,
        "profile": profile,
    }


# (file name, function, what it is): the shard's main-thread work, by cumulative time in cProfile
PROFILE_ROWS = [
    ("intake.py", "read", "receiving pushes: everything the loop does per incoming message"),
    ("intake.py", "_on_push", "  handling one chunk (below, and closing the round after the last push)"),
    ("wire.py", "from_chunk", "    protobuf bytes to tensors (copies)"),
    ("shard.py", "push_chunk", "    validation, staging, dequantize + fp64 sum"),
    ("staging.py", "_check", "      validation"),
    ("codecs.py", "decode", "      E3M0 decode (pushes and the update)"),
    ("rounds.py", "close_due", "    closing rounds"),
    ("outer.py", "step", "      outer Nesterov step, E3M0 encode + decode of the update"),
    ("wire.py", "to_chunks", "      update to protobuf chunks"),
    ("service.py", "Session", "sending: the session's writer (queue, ByteSize)"),
]


def profile_rows(path: Path, rounds: int) -> dict:
    """Cumulative main-thread seconds of the shard's steps (PROFILE_ROWS), per round, from a cProfile file
    of the whole process (start-up included; these rows are all from the serving part)."""
    import pstats

    st = pstats.Stats(str(path))
    rows = []
    for fname, fn, what in PROFILE_ROWS:
        ct = sum(
            v[3]
            for (file, _line, func), v in st.stats.items()  # type: ignore[attr-defined]  # not in typeshed's pstats
            if func == fn and Path(file).name == fname
        )
        calls = sum(
            v[1]
            for (file, _line, func), v in st.stats.items()  # type: ignore[attr-defined]  # not in typeshed's pstats
            if func == fn and Path(file).name == fname
        )
        rows.append({"function": f"{fname}:{fn}", "what": what, "calls": calls, "seconds": ct,
                     "per_round": ct / rounds})  # fmt: skip
    return {"rounds": rounds, "total_seconds": st.total_tt, "rows": rows}  # type: ignore[attr-defined]  # as above


def table_b(b: dict) -> str:
    ref = b["rows"][0]["median_mb_s"]
    lines = [
        "| transport | receiver does | MB/s of E3M0 accepted (median) | repeats (MB/s) | median round | "
        "÷ plain TCP, discard | receiver CPU | clients' CPU | machine CPU (all processes) |",
        "|" + "---|" * 9,
    ]
    what = {
        "discard": "read, discard",
        "decode": "read, decode, fp64 sum",
        "full": "decode, fp64 sum, outer step, E3M0 update to all",
    }
    for r in b["rows"]:
        lines.append(
            f"| {r['transport']} | {what[r['receiver']]} | **{r['median_mb_s']:.1f}** | "
            f"{', '.join(f'{x:.1f}' for x in r['repeat_mb_s'])} | {r['median_round_seconds']:.3f}s | "
            f"{r['median_mb_s'] / ref:.3f}× | {r['server_cpu_seconds'] / r['sampled_seconds']:.2f} cores | "
            f"{r['clients_cpu_seconds'] / r['measured_seconds']:.2f} cores | "
            f"{r['machine_cpu_seconds'] / r['sampled_seconds']:.2f} cores |"
        )
    return "\n".join(lines)


def shards_summary(b: dict) -> list[dict]:
    """For each gRPC setting (checkpointing, fragments in flight): plain TCP read-and-discard, 1 shard and
    the other shard counts, MB/s of E3M0 accepted (over all shards), and the ratios."""
    tcp = next((r for r in b["rows"] if r["transport"] == "plain TCP" and r["receiver"] == "discard"), None)
    grpc_rows = [r for r in b["rows"] if r["transport"] != "plain TCP"]
    out = []
    for pipe in sorted({g["pipeline"] for g in grpc_rows}):
        for ckpt in (True, False):
            by = {g["shards"]: g for g in grpc_rows if (g["checkpoint"], g["pipeline"]) == (ckpt, pipe)}
            if not by:
                continue
            one = by.get(1)
            row = {
                "checkpoint": ckpt,
                "pipeline": pipe,
                "tcp_discard_mb_s": tcp["median_mb_s"] if tcp else None,
                "mb_s": {n: g["median_mb_s"] for n, g in sorted(by.items())},
                "one_shard_over_tcp_discard": one["median_mb_s"] / tcp["median_mb_s"]
                if one and tcp
                else None,
                "over_one_shard": {
                    n: g["median_mb_s"] / one["median_mb_s"] for n, g in sorted(by.items()) if one and n > 1
                },
            }
            out.append(row)
    return out


def table_b_shards(summary: list[dict]) -> str:
    counts = sorted({n for r in summary for n in r["mb_s"]})
    more = [n for n in counts if n > 1]
    head = "| gRPC setting | plain TCP, discard (MB/s) | "
    head += " | ".join(f"gRPC, {n} shard{'s' if n > 1 else ''} (MB/s)" for n in counts)
    head += " | gRPC 1 shard / TCP discard | " + " | ".join(f"{n} shards / 1 shard" for n in more) + " |"
    lines = [head, "|" + "---|" * (3 + len(counts) + len(more))]

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    for r in summary:
        what = ("checkpoint every round" if r["checkpoint"] else "--no-checkpoint") + (
            f", {r['pipeline']} fragments in flight" if r["pipeline"] > 1 else ""
        )
        cells = [what, f(r["tcp_discard_mb_s"], ".1f")]
        cells += [f"**{r['mb_s'][n]:.1f}**" if n in r["mb_s"] else "n/a" for n in counts]
        cells += [f(r["one_shard_over_tcp_discard"], ".3f") + "×"]
        cells += [f(r["over_one_shard"].get(n), ".2f") + "×" for n in more]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- (c) the demo's compute utilization --------------------------------------------------------------------
def session_cpu(sid: int) -> dict[int, float]:
    """CPU seconds of every process in a session (a process we started and its children), by pid."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            out[int(d.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def run_launch(
    procs: Procs,
    tmp: Path,
    tag: str,
    steps: int,
    extra: list[str],
    max_wait: float,
    log_every: int,
    env_extra: dict | None = None,
) -> dict:
    busy = wait_quiet("c", max_wait)
    out = tmp / tag
    argv = sd(
        "launch", "--shards", "2", "--workers", "2", "--steps", str(steps), "--log-every", str(log_every)
    )
    argv += ["--out", str(out), *extra]
    t0 = time.monotonic()
    sys0 = system_busy_seconds()
    p = procs.start(tag, argv, env_extra=env_extra)
    log = procs.logdir / f"{tag}.log"
    last = 0.0
    ours: dict[int, float] = {}  # the cluster's processes' CPU, last seen (sampled every 0.5 s)
    try:
        while p.poll() is None:
            try:
                p.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
            ours.update(session_cpu(p.pid))
            if time.monotonic() - last > 20:
                last = time.monotonic()
                steps_lines = [ln for ln in log.read_text(errors="replace").splitlines() if " step " in ln]
                if steps_lines:
                    say(f"[c]   {time.monotonic() - t0:.0f}s: {steps_lines[-1].split('INFO ')[-1]}")
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"{tag} did not finish:\n{procs.tail(tag)}")
        if p.returncode:
            raise RuntimeError(f"{tag} exited with status {p.returncode}:\n{procs.tail(tag, 30)}")
    finally:
        procs.stop(p)
    summary = json.loads((out / "summary.json").read_text())
    env = " ".join(f"{k}={v}" for k, v in (env_extra or {}).items())
    summary["command"] = (env + " " if env else "") + shlex.join(["streamdiloco", *argv[3:]]).replace(
        str(out), "DIR"
    )
    wall = time.monotonic() - t0
    summary["launch_seconds"] = wall
    summary["busy_before"] = busy
    summary["cluster_cores"] = sum(ours.values()) / wall
    summary["machine_cores"] = (system_busy_seconds() - sys0) / wall  # all processes, ours included
    return summary


C_RUNS = {
    "demo": "demo, H=30",
    "reference": "reference, H=steps",
    "demo-all": "demo, H=30, every worker on all cores",
    "reference-all": "reference, H=steps, every worker on all cores",
}


def part_c(args, procs: Procs, tmp: Path) -> dict:
    """The demo cluster, and the same with H = steps; and (not --quick) both again with every worker using as
    many torch threads as the machine has cores (torch's default; launch gives each worker cores / M)."""
    out = {}
    every = ["--threads", str(os.cpu_count() or 1)]
    plan: list[tuple[str, list[str], dict | None]] = [("demo", [], None)]
    if args.c_reference:
        plan.append(("reference", ["--sync-every", str(args.c_steps)], None))
    if args.c_threads:
        plan.append(("demo-all", every, None))
        if args.c_reference:
            plan.append(("reference-all", ["--sync-every", str(args.c_steps), *every], None))
    for key, extra, env in plan:
        say(f"[c] {C_RUNS[key]}: launch --shards 2 --workers 2 --steps {args.c_steps} {' '.join(extra)} ...")
        out[key] = run_launch(
            procs, tmp, f"c-{key}", args.c_steps, extra, args.max_wait, args.c_log_every, env_extra=env
        )
    return out


def table_c(c: dict) -> str:
    lines = [
        "| run | worker | compute utilization | compute s | train s | blocked s | merges that waited | "
        "tokens/s (wall of training) | tokens/s (compute only) | eval loss | cluster CPU | other processes |",
        "|" + "---|" * 12,
    ]
    for key, label in C_RUNS.items():
        if key not in c:
            continue
        run = c[key]
        other = max(0.0, run["machine_cores"] - run["cluster_cores"])
        for w in run["workers"]:
            waited = f"{w['merges_that_waited']} of {w['merges']}" if "merges" in w else "n/a"
            lines.append(
                f"| {label} | {w['worker']} | **{100 * w['compute_utilization']:.1f}%** | "
                f"{w['compute_seconds']:.1f} | {w['train_seconds']:.1f} | {w['blocked_seconds']:.2f} | "
                f"{waited} | "
                f"{w['tokens'] / w['train_seconds']:,.0f} | {w['tokens'] / w['compute_seconds']:,.0f} | "
                f"{w['eval_loss']:.4f} | {run['cluster_cores']:.2f} cores | {other:.2f} cores |"
            )
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------------
def _internal(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="wire.py (internal)")
    p.add_argument("role", choices=["_grpc-client", "_tcp-sender", "_tcp-receiver"])
    p.add_argument("--plan", required=True)
    p.add_argument("--payload")
    p.add_argument("--target")
    p.add_argument("--name")
    p.add_argument("--mode", default="discard")
    p.add_argument("--port", type=int)
    p.add_argument("--port-file")
    p.add_argument("--senders", type=int, default=8)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--ready")
    p.add_argument("--result")
    a = p.parse_args(argv)
    if a.role != "_tcp-receiver":  # the load generators; the receiver keeps torch's default, like the shard
        torch.set_num_threads(1)
    if a.role == "_grpc-client":
        return grpc_client_main(a)
    if a.role == "_tcp-sender":
        return tcp_sender_main(a)
    return tcp_receiver_main(a)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):
        return _internal(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--parts", default="a,b,c", help="which parts to run, comma-separated (default %(default)s)"
    )
    p.add_argument("--quick", action="store_true", help="smaller models and fewer rounds and steps (~7 min)")
    p.add_argument("--out", default="benchmarks/results/wire", help="output folder (default %(default)s)")
    p.add_argument("--a-models", default=None, help="(a) models, comma-separated (default tiny,small)")
    p.add_argument("--b-model", default=None, help="(b) model whose fragment 0 is pushed (default medium)")
    p.add_argument("--b-clients", type=int, default=8, help="(b) concurrent clients (default 8)")
    p.add_argument(
        "--b-shards", default="1,2", help="(b) shard counts for the gRPC runs (default %(default)s)"
    )
    p.add_argument(
        "--no-pipeline",
        dest="b_pipeline",
        action="store_false",
        help="(b) skip the gRPC runs with 2 fragments in flight (pushes during the other's close)",
    )
    p.add_argument("--b-rounds", type=int, default=None, help="(b) rounds per repeat (default 3)")
    p.add_argument(
        "--b-repeats", type=int, default=None, help="(b) repeats; the median is reported (default 3)"
    )
    p.add_argument("--no-profile", dest="b_profile", action="store_false", help="(b) skip the cProfile pass")
    p.add_argument("--c-steps", type=int, default=None, help="(c) steps of the demo cluster (default 400)")
    p.add_argument("--c-log-every", type=int, default=50, help="(c) as make demo (default %(default)s)")
    p.add_argument(
        "--no-reference", dest="c_reference", action="store_false", help="(c) skip the H=steps run"
    )
    p.add_argument(
        "--no-threads",
        dest="c_threads",
        action="store_false",
        help="(c) skip the runs with every worker on all the cores",
    )
    p.add_argument(
        "--max-wait",
        type=float,
        default=120.0,
        help="seconds to wait, before each timed run, for other processes to leave the CPUs (default 120)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the processes' logs (and profile) in a temp folder"
    )
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if parts - {"a", "b", "c"}:
        p.error(f"--parts: choose from a, b, c; got {args.parts!r}")
    q = args.quick
    a_models = (args.a_models or ("tiny" if q else "tiny,small")).split(",")
    args.b_model = args.b_model or ("small" if q else "medium")
    args.b_rounds = args.b_rounds or (2 if q else 3)
    try:
        args.b_shards = [int(x) for x in args.b_shards.split(",") if x.strip()]
    except ValueError:
        p.error(f"--b-shards: comma-separated shard counts, got {args.b_shards!r}")
    if not args.b_shards or min(args.b_shards) < 1:
        p.error(f"--b-shards: shard counts of at least 1, got {args.b_shards}")
    args.b_repeats = args.b_repeats or (2 if q else 3)
    args.b_tcp_modes = ["discard", "decode", "full"]
    if q:
        args.b_profile = False
    args.c_steps = args.c_steps or (60 if q else 400)
    if q:
        args.c_reference = args.c_threads = False

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "benchmarks.wire", *argv])
    info = machine()
    say(f"$ {command}")
    say(f"machine: {machine_line(info)}")
    results: dict = {"command": command, "machine": info, "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="wire-bench-"))
    procs = Procs(tmp)
    md: list[str] = []
    status = 0
    try:
        if "a" in parts:
            runs = []
            for m in a_models:
                spec = (A_QUICK if q else A_RUNS).get(m) or A_RUNS.get(m) or dict(A_RUNS["tiny"])
                runs.append(run_framing(m, spec, 2, 2, procs, tmp, args.max_wait))
                d = runs[-1]["directions"]
                say(
                    f"[a]   {runs[-1]['wall_seconds']:.0f}s; overhead of the sync traffic: "
                    f"up +{d['up']['overhead_sync_pct']:.2f}%, down +{d['down']['overhead_sync_pct']:.2f}%"
                )
            results["a"] = runs
            t = table_a(runs)
            say(
                "\n(a) Framing overhead: bytes through the proxies against the codec bytes the config "
                "predicts\n"
            )
            say(t)
            md += ["## (a) Framing overhead", "", t, ""]
            for r in runs:
                bt = table_a_breakdown(r)
                u, d = r["directions"]["up"], r["directions"]["down"]
                bt += (
                    "\n\nThe processes' own counters (protobuf message bytes, ByteSize): workers' "
                    f"message_bytes_sent {u['worker_wire_bytes']:,}, received {d['worker_wire_bytes']:,} "
                    f"(Fetch included); shards' wire_in {u['shard_wire_bytes']:,}, "
                    f"wire_out {d['shard_wire_bytes']:,}. "
                    f"Streams seen: {dict(r['stream_kinds'])} on {r['connections']} connections."
                )
                say(f"\n(a) {r['model']}: where the bytes go (all connections, both shards)\n")
                say(bt)
                md += [f"### (a) {r['model']}: where the bytes go", "", bt, ""]
        if "b" in parts:
            b = part_b(args, procs, tmp)
            results["b"] = b
            t = table_b(b)
            tcp = {r["receiver"]: r for r in b["rows"] if r["transport"] == "plain TCP"}
            grpc_rows = [r for r in b["rows"] if r["transport"] != "plain TCP"]
            lines = [t, ""]
            b["ratios"] = {}
            for g in grpc_rows:
                over = {m: g["median_mb_s"] / r["median_mb_s"] for m, r in tcp.items()}
                b["ratios"][g["transport"]] = {"over_tcp": over}
                lines.append(
                    f"- {g['transport']}: ÷ plain TCP by what its receiver does: "
                    + ", ".join(f"{m} {v:.3f}×" for m, v in over.items())
                    + f"; {g['refused']} pushes refused, {g['shard_pushes_accepted']} accepted; "
                    "shard 0's time from a round's first whole push to its close (median) "
                    f"{g['median_shard_first_push_to_close']:.3f}s "
                    f"of a {g['median_round_seconds']:.3f}s round; CPU over the measured rounds "
                    f"({g['sampled_seconds']:.2f}s): "
                    + ("shard" if g["shards"] == 1 else "shards (p0 = shard 0, ...)")
                    + f" by thread {g['server_cpu_by_thread']}, "
                    f"the {b['clients']} clients {g['clients_cpu_seconds']:.2f}, "
                    f"the whole machine {g['machine_cpu_seconds']:.2f}; while it ran, shard 0 answered "
                    + ", ".join(
                        f"{path} in {h['median']:.1f} ms median, {h['p99']:.1f} p99, {h['max']:.1f} max "
                        f"({h['n']} asked)"
                        for path, h in g["http_ms"].items()
                        if path != "errors" and h["n"]
                    )
                    + f" ({g['http_ms']['errors']} errors)"
                )
            for ckpt, pipe in [(c, q) for q in (1, 2) for c in (True, False)]:
                by = {g["shards"]: g for g in grpc_rows if (g["checkpoint"], g["pipeline"]) == (ckpt, pipe)}
                if 1 in by and len(by) > 1:
                    for n, g in sorted(by.items()):
                        if n > 1:
                            x = g["median_mb_s"] / by[1]["median_mb_s"]
                            b["ratios"][g["transport"]]["over_one_shard"] = x
                            lines.append(f"- {g['transport']} ÷ 1 shard: {x:.2f}×")
            b["shards_summary"] = shards_summary(b)
            if b["shards_summary"]:
                lines += [
                    "",
                    "1 shard against plain TCP reading and discarding the same bytes, and S shards "
                    "(MB/s summed over the shards) against 1 shard:",
                    "",
                    table_b_shards(b["shards_summary"]),
                ]
            if b["profile"]:
                pr = b["profile"]
                lines += [
                    "",
                    "Where the shard's main thread (the event loop) spends its time: cProfile, a separate "
                    f"pass of {pr['rounds']} rounds (profiling slows it), cumulative seconds per round:",
                    "",
                    "| function | what | calls | s per round |",
                    "|---|---|---|---|",
                ]
                lines += [
                    f"| `{r['function']}` | {r['what'].strip()} | {r['calls']} | {r['per_round']:.3f} |"
                    for r in pr["rows"]
                ]
            shard_counts = " and ".join(str(n) for n in args.b_shards)
            say(f"\n(b) Ingest: {shard_counts} shard(s), {b['clients']} concurrent pushers of E3M0 payload\n")
            for ln in lines:
                say(ln)
            md += ["## (b) Ingest rate", "", *lines, ""]
        if "c" in parts:
            c = part_c(args, procs, tmp)
            results["c"] = c
            t = table_c(c)
            say(f"\n(c) The demo cluster's compute utilization ({args.c_steps} steps)\n")
            say(t)
            extra = [
                f"command: `{c['demo']['command']}`; wall {c['demo']['wall_seconds']:.0f}s; "
                f"mirrors equal masters: {c['demo']['mirrors_match_masters']}"
            ]

            def cluster_tps(run: dict) -> float:
                return sum(w["tokens"] / w["train_seconds"] for w in run["workers"])

            ratios = {}
            for key in C_RUNS:
                if key != "demo" and key in c:
                    ratios[key] = cluster_tps(c[key]) / cluster_tps(c["demo"])
                    extra.append(
                        f"{C_RUNS[key]}: `{c[key]['command']}`; cluster tokens/s (wall of training) "
                        f"{cluster_tps(c[key]):,.0f} against the demo's {cluster_tps(c['demo']):,.0f}: "
                        f"{ratios[key]:.3f}×"
                    )
            c["throughput_vs_demo"] = ratios
            for ln in extra:
                say(ln)
            md += [
                f"## (c) Demo compute utilization ({args.c_steps} steps)",
                "",
                t,
                "",
                *[f"- {x}" for x in extra],
                "",
            ]
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every process")
        status = 130
    except Exception as e:  # noqa: BLE001 (report, clean up, exit non-zero)
        say(f"\nerror: {e}")
        status = 1
    finally:
        procs.stop_all()
        if args.keep:
            say(f"kept the processes' logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results["seconds"] = time.monotonic() - t0
    say(f"\n{results['seconds']:.0f}s in all; wrote {out}/results.md, results.json, run.log")
    head = [
        "# Wire benchmark results",
        "",
        f"Command: `{command}`  ",
        f"Run: {results['started']}, {results['seconds']:.0f} s  ",
        f"Machine: {machine_line(info)}",
        "",
    ]
    write_results(out, results, head + md, echo=False)
    return status


if __name__ == "__main__":
    sys.exit(main())
