"""A thousand sessions: how one shard (and two) hold up as the members of a run grow from 1 to 1,000.

One asyncio process (grpc.aio) plays N workers at the protocol's level, without training: each Joins every
shard (with the model fingerprint the shard describes), opens its Session with a passive Hello, says Ready,
and once all N are members it pushes every fragment's slice (the same pre-encoded, pre-serialized payload
for every session: encoding is the workers' cost, not the shard's), reads the results and waits for each
fragment's update before it pushes the next round. The shards are real `streamdiloco server` processes on
loopback (benchmarks/harness/), with the model's built-in preset (`--model`, tiny by default).

Per point (shards S, sessions N) it reports:
- round close time: from the last push of a round (the last session's last chunk written) to each session's
  reading of the update's last chunk (median and max over sessions, then the median over the rounds after
  the first, and the max over all); and from the first push of the round to the update;
- the shard's memory (VmRSS before the sessions, at the end, and its peak VmHWM, from /proc/PID/status),
  against what its settings bound (the unread and staged budgets its status reports);
- its CPU seconds (utime + stime of the shard's pid, all threads) per push, over the pushing phase;
- rounds closed (the shard's status) and pushes accepted/refused (the sessions' PushResults).

The shard holds N sessions from one address (127.0.0.1) only with the flags `shard_flags` gives it: the run
token for N names (`--names-per-token`), `--max-sessions` and `--max-sessions-per-peer` above N; and a
lenient `--liveness-timeout` (LIVENESS, on the sessions' side too), because one process plays every worker
here and answers pings late when the machine is busy. Joins are sent at most JOINS_AT_ONCE at a time per
shard, within the default `--max-waiting-calls-per-peer`, as N workers behind one NAT would not all Join in
the same millisecond.

    python -m benchmarks.load                     # 1, 10, 100, 1000 sessions; 1 and 2 shards (minutes)
    python -m benchmarks.load --quick             # 1 and 10 sessions, 1 and 2 shards, nano (seconds)
    python -m benchmarks.load --sessions 100 --shards 1 --profile   # the shard under cProfile

Writes results.json, results.md and run.log under --out (default benchmarks/results/load). The load
generator shares the machine with the shards: at 1,000 sessions it is busy too (its CPU seconds are
reported beside the shard's). It must not import worker code: the wire is spoken here with common/'s
helpers (wire, codecs) and the generated protobuf classes, as tests/test_fuzz.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks.harness import (
    RESULTS,
    Procs,
    Session,
    http_json,
    loadavg,
    proc_stats,
    say,
    start_shards,
)
from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.wire import PROTOCOL, auth_metadata, channel_options, to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

TOKEN = "load-benchmark-token"
SERVICE = "/streamdiloco.v1.Shard/"
JOINS_AT_ONCE = 8  # Joins in flight per shard: the default --max-waiting-calls-per-peer
SESSION_ROOM = 16  # sessions a shard takes beyond N (a session that ends while its successor starts)
WEIGHT = 1024.0  # tokens each push claims: the same for every session, so nothing is capped or clipped
# Liveness (s) of both ends here. One Python process that plays 1,000 workers on a busy 2-core machine
# answers pings late: with the workers' 10 s (LIVENESS_SECONDS) a third of 1,000 sessions were closed by
# ping timeouts (GOAWAY ping_timeout) in a recorded run at load average 20. The shards get it too
# (--liveness-timeout): the figures are of the load, not of a ping that came late.
LIVENESS = 60.0
# every session on its own connection, as workers are: gRPC would otherwise share one connection between
# channels to the same target (and one connection carries at most 100 streams: server/trust/bounds.py)
OPTIONS = [*channel_options(LinkSettings(liveness_timeout=LIVENESS)), ("grpc.use_local_subchannel_pool", 1)]


# --- the shard's side: its flags ---------------------------------------------------------------------------
def shard_flags(sessions: int, model: str, extra: list[str]) -> list[str]:
    """What a shard needs to hold `sessions` members from one address: the run token for that many names,
    and room for that many Session streams in all and from 127.0.0.1 (defaults: 1 name, 512 and 8)."""
    room = sessions + SESSION_ROOM
    return [
        "--model", model, "--token", TOKEN, "--names-per-token", str(sessions),
        "--max-sessions", str(max(512, room)), "--max-sessions-per-peer", str(room),
        "--liveness-timeout", f"{LIVENESS:g}",
        *extra,
    ]  # fmt: skip


# --- the load: N sessions on every shard ------------------------------------------------------------------
@dataclass
class Target:
    """One shard as the sessions see it: its address, and each round's pushes, serialized once."""

    name: str
    grpc_port: int
    http_port: int
    pid: int
    fingerprint_json: str = ""
    cfg: SyncConfig | None = None
    rounds: int = 0  # the rounds to push
    serial: bool = False  # a session waits for each fragment's update before it pushes the next fragment
    pushes: dict[tuple[int, int], list[bytes]] = field(default_factory=dict)  # (fragment, round) -> messages
    joins: asyncio.Semaphore | None = None


@dataclass
class Timings:
    """Per (shard, fragment, round): when its pushes started and ended, when each session read the update."""

    first: dict[tuple[int, int, int], float] = field(default_factory=dict)
    last: dict[tuple[int, int, int], float] = field(default_factory=dict)
    updates: dict[tuple[int, int, int], list[float]] = field(default_factory=dict)
    results: Counter = field(default_factory=Counter)  # "accepted" or the refusal's reason
    errors: Counter = field(default_factory=Counter)  # sessions that failed, by their error's first line

    def pushed(self, key: tuple[int, int, int], t0: float, t1: float) -> None:
        self.first[key] = min(self.first.get(key, t0), t0)
        self.last[key] = max(self.last.get(key, t1), t1)


async def describe(target: Target) -> None:
    """The run's fingerprint (Fetch's description) and settings (a config-only Join), and the pushes of
    every round, encoded and serialized once."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{target.grpc_port}", options=channel_options()) as ch:
        stub = pb_grpc.ShardStub(ch)
        call = stub.Fetch(pb.FetchRequest(fragments=[0], token=TOKEN, describe=True), timeout=60)
        async for chunk in call:
            target.fingerprint_json = chunk.fingerprint_json
            call.cancel()
            break
        reply = await stub.Join(
            pb.JoinRequest(worker="load-probe", token=TOKEN, protocol=PROTOCOL, config_only=True), timeout=60
        )
    target.cfg = SyncConfig.from_dict(json.loads(reply.config_json))


def encode_pushes(target: Target, slices: list[int], chunk_values: int) -> None:
    """Every fragment's push for rounds 0..target.rounds-1: an update of the slice's size in the uplink codec,
    one header, chunks as the shard prefers them."""
    cfg = target.cfg
    assert cfg is not None
    g = torch.Generator().manual_seed(0)
    header = pb.PushHeader(weight=WEIGHT, has_loss=True, loss=3.0, step=1, tokens=int(WEIGHT))
    for f, n in enumerate(slices):
        enc = encode(torch.randn(n, generator=g) * 1e-3, cfg.uplink_codec, cfg.codec_block_size)
        for r in range(target.rounds):
            target.pushes[(f, r)] = [
                pb.WorkerMessage(
                    push=pb.Push(chunk=c, header=header if c.seq == 0 else None)
                ).SerializeToString()
                for c in to_chunks(enc, f, r, chunk_values)
            ]


class LoadSession:
    """One worker's session with one shard, on its own connection: Join, Hello (passive), Ready; then
    rounds of pushes, each waiting for its fragments' updates."""

    def __init__(self, name: str, s: int, target: Target, timings: Timings):
        self.name, self.s, self.target, self.timings = name, s, target, timings
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{target.grpc_port}", options=OPTIONS)
        self.call: Any = None
        self.waiting: dict[tuple[int, int], asyncio.Future] = {}  # (fragment, round) -> its update's end
        self.reader: asyncio.Task | None = None
        self.broken = False  # failed: it takes no further part

    async def open(self) -> None:
        """Join (at most JOINS_AT_ONCE per shard in flight), Hello, Ready: a member once this returns (or
        the session's error counted and the session closed)."""
        try:
            await self._open()
        except (grpc.aio.AioRpcError, RuntimeError) as e:
            self.failed("open", e)

    def failed(self, phase: str, e: BaseException) -> None:
        what = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
        self.timings.errors[f"{phase}: {what.splitlines()[0][:200]}"] += 1
        self.broken = True
        if self.call is not None:
            self.call.cancel()

    async def _open(self) -> None:
        t = self.target
        assert t.joins is not None
        request = pb.JoinRequest(
            worker=self.name, token=TOKEN, fingerprint_json=t.fingerprint_json, protocol=PROTOCOL
        )
        async with t.joins:
            # waits for the connection (a busy shard may take its handshake late), as a worker retries
            reply = await pb_grpc.ShardStub(self.channel).Join(request, timeout=120, wait_for_ready=True)
        if not t.pushes:  # the first Join's reply gives the slices and chunk size: the same for every session
            encode_pushes(t, [r.length for r in reply.slices], reply.chunk_values)
        session = self.channel.stream_stream(
            SERVICE + "Session", request_serializer=None, response_deserializer=None
        )
        self.call = session(metadata=auth_metadata(TOKEN))
        hello = pb.Hello(worker=self.name, session=reply.session, passive=True)
        await self.call.write(pb.WorkerMessage(hello=hello).SerializeToString())
        await self._welcome()
        await self.call.write(pb.WorkerMessage(ready=pb.Ready()).SerializeToString())
        if not (await self._welcome()).member:
            raise RuntimeError(f"{self.name}: shard {self.s} did not make it a member at Ready")

    async def _welcome(self) -> pb.Welcome:
        raw = await self.call.read()
        if raw is grpc.aio.EOF:
            raise RuntimeError(f"{self.name}: shard {self.s} ended the session: {await self.call.details()}")
        msg = pb.ShardMessage.FromString(raw)
        if msg.WhichOneof("kind") != "welcome":
            raise RuntimeError(f"{self.name}: expected a Welcome from shard {self.s}, got {msg}")
        return msg.welcome

    async def _read(self) -> None:
        """Results counted; an update's last chunk timed and its waiter woken."""
        loop = asyncio.get_running_loop()
        while (raw := await self.call.read()) is not grpc.aio.EOF:
            msg = pb.ShardMessage.FromString(raw)
            kind = msg.WhichOneof("kind")
            if kind == "result":
                r = msg.result
                self.timings.results["accepted" if r.accepted else r.reason] += 1
            elif kind == "update" and msg.update.last:
                c = msg.update
                self.timings.updates.setdefault((self.s, c.fragment, c.round), []).append(loop.time())
                fut = self.waiting.pop((c.fragment, c.round), None)
                if fut is not None and not fut.done():
                    fut.set_result(None)

    async def run(self, rounds: range) -> None:
        """These rounds of every fragment: push them all, then wait for their updates."""
        if self.broken:
            return
        try:
            await self._run(rounds)
        except (grpc.aio.AioRpcError, RuntimeError) as e:
            self.failed("push", e)

    async def _run(self, rounds: range) -> None:
        loop = asyncio.get_running_loop()
        if self.reader is None:
            self.reader = asyncio.create_task(self._read())
        cfg = self.target.cfg
        assert cfg is not None
        for r in rounds:
            futs = []
            for f in range(cfg.num_fragments):
                fut = self.waiting[(f, r)] = loop.create_future()
                futs.append(fut)
                t0 = loop.time()
                for data in self.target.pushes[(f, r)]:
                    await self.call.write(data)
                self.timings.pushed((self.s, f, r), t0, loop.time())
                if self.target.serial:
                    await _either([fut], self.reader)
            await _either(futs, self.reader)

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self.reader is not None:
            self.reader.cancel()
        await self.channel.close()


async def _either(futs: list[asyncio.Future], reader: asyncio.Task) -> None:
    """Wait for the updates `futs`; a reader that ends first (the shard ended the session) is an error: the
    reader's own (an AioRpcError), or a RuntimeError."""
    pending = set(futs)
    while pending:
        done, pending = await asyncio.wait(pending | {reader}, return_when=asyncio.FIRST_COMPLETED)
        if reader in done:
            error = reader.exception() if not reader.cancelled() else None
            if isinstance(error, grpc.aio.AioRpcError):
                raise error
            raise RuntimeError(f"the session ended before its updates came: {error!r}")
        pending.discard(reader)


class Peaks:
    """Each shard's largest VmRSS (MiB) in each phase ("open", "warm", "push"), sampled every `period` s."""

    def __init__(self, targets: list[Target], period: float = 0.2):
        self.targets, self.period = targets, period
        self.phase = "open"
        self.peaks: dict[str, list[float]] = {}

    async def run(self) -> None:
        while True:
            rss = [proc_stats(t.pid)["vmrss"] for t in self.targets]
            have = self.peaks.setdefault(self.phase, rss)
            self.peaks[self.phase] = [max(a, b) for a, b in zip(have, rss, strict=True)]
            await asyncio.sleep(self.period)


async def load(
    targets: list[Target], sessions: int, rounds: int, timeout: float, serial: bool = False
) -> dict:
    """N sessions on every shard; rounds of pushes once all are members. The phases' times, the shards'
    /proc figures around the pushing, and what the sessions saw."""
    for t in targets:
        await describe(t)
        t.rounds, t.serial = rounds, serial
        t.joins = asyncio.Semaphore(JOINS_AT_ONCE)
    timings = Timings()
    all_sessions = [
        LoadSession(f"load-{i:04d}", s, t, timings) for i in range(sessions) for s, t in enumerate(targets)
    ]
    out: dict[str, Any] = {"idle": [proc_stats(t.pid) for t in targets]}
    peaks = Peaks(targets)
    sampler = asyncio.create_task(peaks.run())
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(*(x.open() for x in all_sessions)), timeout)
        out["open_seconds"] = time.monotonic() - t0
        out["members"] = [proc_stats(t.pid) for t in targets]
        # round 0 warms up (the shard's first close, its pool's threads, the codec's kernels): not measured
        peaks.phase = "warm"
        await asyncio.wait_for(asyncio.gather(*(x.run(range(1)) for x in all_sessions)), timeout)
        peaks.phase = "push"
        out["warm"] = [proc_stats(t.pid) for t in targets]
        client0 = os.times()
        t1 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(x.run(range(1, rounds)) for x in all_sessions)), timeout)
        out["push_seconds"] = time.monotonic() - t1
        client1 = os.times()
        out["client_cpu"] = (client1.user + client1.system) - (client0.user + client0.system)
        out["end"] = [proc_stats(t.pid) for t in targets]
    except asyncio.TimeoutError:
        out["timed_out"] = True
        out["end"] = [proc_stats(t.pid) for t in targets]
    finally:
        sampler.cancel()
        out["peaks"] = peaks.peaks
        out["status"] = [_status(t) for t in targets]
        await asyncio.gather(*(x.close() for x in all_sessions), return_exceptions=True)
    out["timings"] = timings
    for what, n in timings.errors.most_common(5):
        say(f"    {n} sessions failed: {what}")
    return out


def _status(t: Target) -> dict:
    """What of the shard's status this benchmark reports (the member list left out: it is long)."""
    st = http_json(t.http_port)
    return {k: st.get(k) for k in ("rounds_closed", "pushes_accepted", "pushes_refused", "bounds")} | {
        "members": len(st.get("members", []))
    }


# --- one point and its figures -----------------------------------------------------------------------------
def close_times(timings: Timings, skip_first: bool) -> dict[str, float]:
    """Round close times (ms): per (shard, fragment, round), the median and max over sessions of (update
    read - last push written) and the median of (update read - first push written); then over rounds."""
    last_med, last_max, first_med = [], [], []
    for key, reads in timings.updates.items():
        if skip_first and key[2] == 0:
            continue
        if key not in timings.last:
            continue
        last_med.append(1e3 * (statistics.median(reads) - timings.last[key]))
        last_max.append(1e3 * (max(reads) - timings.last[key]))
        first_med.append(1e3 * (statistics.median(reads) - timings.first[key]))
    if not last_med:
        return {}
    return {
        "last_to_update_ms": statistics.median(last_med),
        "last_to_update_max_ms": max(last_max),
        "first_to_update_ms": statistics.median(first_med),
    }


async def point(procs: Procs, tmp: Path, args: argparse.Namespace, shards: int, sessions: int) -> dict:
    tag = f"s{shards}-n{sessions}"
    flags = shard_flags(sessions, args.model, args.shard_flag or [])
    wrap = None
    if args.profile:
        wrap = [sys.executable, "-m", "cProfile", "-o", str(args.out / f"profile-{tag}.prof")]
    started = start_shards(procs, tmp, tag, shards, flags, wrap=wrap, checkpoint=False,
                           env_extra={"OMP_NUM_THREADS": "1"})  # fmt: skip
    targets = []
    for name, p, ports in started:
        targets.append(Target(name, ports["grpc_port"], ports["http_port"], p.pid))
    load_before = loadavg()
    try:
        raw = await load(targets, sessions, args.rounds, args.timeout, args.serial)
    finally:
        for _, p, _ in started:
            procs.stop(p, timeout=30)  # a clean exit: cProfile writes its file then
    timings: Timings = raw.pop("timings")
    status = raw["status"]
    rounds_closed = [st["rounds_closed"] for st in status]
    pushes = [st["pushes_accepted"] for st in status]
    # pushes after the warm-up round: each shard's pushes of rounds 1.. (every session, every fragment)
    measured = [
        n - sessions * len(t.pushes) // max(1, t.rounds) for n, t in zip(pushes, targets, strict=True)
    ]
    cpu = [
        (e["cpu"] - w["cpu"]) / max(1, n)
        for e, w, n in zip(raw["end"], raw.get("warm", raw["end"]), measured, strict=True)
    ]
    row: dict[str, Any] = {
        "shards": shards,
        "sessions": sessions,
        "rounds": args.rounds,
        "timed_out": raw.get("timed_out", False),
        "open_seconds": raw.get("open_seconds"),
        "push_seconds": raw.get("push_seconds"),
        "rounds_closed": rounds_closed,
        "pushes_accepted": pushes,
        "results": dict(timings.results),
        "errors": dict(timings.errors),
        "rss_idle_mib": [x["vmrss"] for x in raw["idle"]],
        "rss_members_mib": [x["vmrss"] for x in raw.get("members", raw["end"])],
        "rss_end_mib": [x["vmrss"] for x in raw["end"]],
        "hwm_mib": [x["vmhwm"] for x in raw["end"]],
        "rss_peak_by_phase_mib": raw["peaks"],
        "cpu_ms_per_push": [1e3 * c for c in cpu],
        "client_cpu_seconds": raw.get("client_cpu"),
        "bounds": [st["bounds"] for st in status],
        "loadavg": [load_before, loadavg()],
        **close_times(timings, skip_first=args.rounds > 1),
    }
    say(
        f"[{tag}] members in {row['open_seconds'] or float('nan'):.1f}s, {args.rounds} rounds in "
        f"{row['push_seconds'] or float('nan'):.1f}s; rounds closed {rounds_closed}, pushes {pushes}, "
        f"results {row['results']}; RSS {row['rss_idle_mib']} -> {row['rss_end_mib']} MiB "
        f"(peak {row['hwm_mib']}); load {row['loadavg']}" + (" TIMED OUT" if row["timed_out"] else "")
    )
    if row["errors"] or row["timed_out"]:
        for name, _, _ in started:
            say(procs.tail(name, 20))
    return row


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def table(rows: list[dict]) -> list[str]:
    out = [
        "| shards | sessions | rounds closed | last push -> update (median / max) | first push -> update "
        "| shard RSS idle -> members -> end (peak), MiB | CPU per push | load client CPU | load avg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        closed = "+".join(str(c) for c in r["rounds_closed"]) + (" (timed out)" if r["timed_out"] else "")
        if r["errors"]:
            closed += f" ({sum(r['errors'].values())} sessions failed)"
        rss = " / ".join(
            f"{a:.0f} -> {b:.0f} -> {c:.0f} ({d:.0f})"
            for a, b, c, d in zip(
                r["rss_idle_mib"], r["rss_members_mib"], r["rss_end_mib"], r["hwm_mib"], strict=True
            )
        )
        cpu = " / ".join(f"{c:.2f} ms" for c in r["cpu_ms_per_push"])
        client = "-" if r["client_cpu_seconds"] is None else f"{r['client_cpu_seconds']:.1f} s"
        out.append(
            f"| {r['shards']} | {r['sessions']:,} | {closed} | {_ms(r.get('last_to_update_ms'))} / "
            f"{_ms(r.get('last_to_update_max_ms'))} ms | {_ms(r.get('first_to_update_ms'))} ms | {rss} | "
            f"{cpu} | {client} | {r['loadavg'][1]} |"
        )
    return out


def slopes(rows: list[dict]) -> list[str]:
    """Between successive points of each shard count: the shard's peak memory per added session (the
    largest shard's) and its CPU per push, where the bends show."""
    out = []
    for s in sorted({r["shards"] for r in rows}):
        mine = sorted((r for r in rows if r["shards"] == s), key=lambda r: r["sessions"])
        for a, b in itertools.pairwise(mine):
            if a["sessions"] < 10:
                continue  # one session's figures are the shard's warm-up
            per = 1024 * (max(b["hwm_mib"]) - max(a["hwm_mib"])) / (b["sessions"] - a["sessions"])
            out.append(
                f"- {s} shard{'s' * (s > 1)}, {a['sessions']:,} -> {b['sessions']:,} sessions: peak RSS "
                f"{per:,.0f} KiB per added session; CPU per push {max(a['cpu_ms_per_push']):.2f} -> "
                f"{max(b['cpu_ms_per_push']):.2f} ms"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 and 10 sessions, the nano model, 3 rounds")
    ap.add_argument("--sessions", default=None, help="comma-separated N (default 1,10,100,1000)")
    ap.add_argument("--shards", default=None, help="comma-separated S (default 1,2)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of every fragment per point, the first a warm-up (default 4)",
    )
    ap.add_argument("--model", default=None, help="the shards' built-in preset (default tiny; --quick nano)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds each phase of a point may take")
    ap.add_argument(
        "--serial",
        action="store_true",
        help="each session pushes one fragment and waits for its update before the next (default: every "
        "fragment, then their updates): one push per session in flight instead of P",
    )
    ap.add_argument("--profile", action="store_true", help="run the shard under cProfile (one shard only)")
    ap.add_argument("--shard-flag", action="append", help="one more shard flag (repeat: --shard-flag=--x)")
    ap.add_argument("--out", type=Path, default=RESULTS / "load")
    args = ap.parse_args(argv)
    sessions = [int(x) for x in (args.sessions or ("1,10" if args.quick else "1,10,100,1000")).split(",")]
    shards = [int(x) for x in (args.shards or "1,2").split(",")]
    args.rounds = args.rounds or (3 if args.quick else 4)
    args.model = args.model or ("nano" if args.quick else "tiny")
    if args.profile and shards != [1]:
        ap.error("--profile runs one shard under cProfile: give --shards 1")
    rows: list[dict] = []
    md: list[str] = []
    with Session("load", argv, args.out) as s:
        say(f"load average {loadavg()}")

        async def every_point() -> None:  # one event loop for all: grpc.aio keeps its poller on the first one
            for n_shards in shards:
                for n in sessions:
                    rows.append(await point(s.procs, s.tmp, args, n_shards, n))

        asyncio.run(every_point())
        s.results.update(
            model=args.model,
            rounds=args.rounds,
            flags=shard_flags(0, args.model, args.shard_flag or []),
            rows=rows,
        )
        md += [f"Command: `{s.command}` ({args.model}, {args.rounds} rounds per point)", "", *table(rows)]
        md += ["", *slopes(rows)]
    return s.finish(md, status=1 if any(r["timed_out"] for r in rows) else 0)


if __name__ == "__main__":
    sys.exit(main())
