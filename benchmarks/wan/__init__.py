"""WAN testbed: Streaming DiLoCo against data-parallel (DDP over gloo) across emulated internet links.

Sites joined by slow links, on one Linux machine (run as root):

    namespace sdlwan-dc   the shard (a datacenter: its link is not shaped)          10.213.77.10
    namespace sdlwan-w0   worker 0 (a site: shaped link, delaying proxy)            10.213.77.11
    namespace sdlwan-w1   worker 1 ...                                              10.213.77.12
    namespace sdlwan-hub  a Linux bridge (br0) joining every site's veth pair

The network 10.213.77.0/24 exists only inside these namespaces; the testbed touches nothing outside them.

Bandwidth: `tc qdisc tbf` on both ends of each worker's veth pair: the worker side's egress is its uplink,
the bridge port's egress its downlink (the same rate each way). burst = max(2 full frames (3028 B), 2 ms at
the rate): the bucket refills in 2 ms, so the timer never has to fire per packet at the high rates; limit =
burst + max(100 ms at the rate, 8 full frames): a queue of about 100 ms (`--queue-ms`: a home modem's often
holds a second or more), that the lowest rates stretch to a few frames so that TCP's first flight is not
dropped. tbf counts Ethernet frames: TCP's payload
(1448 B in a 1514 B frame) gets about 95.6% of the rate. "unlimited": no qdisc (veth speed).

Delay: the kernel has no netem, so each worker namespace runs a delaying TCP proxy (this file's `_proxy`,
asyncio). An nftables rule (table ip sdlwan, nat output) redirects every TCP connection that the worker's
processes open through wan0 to the testbed's /24 to the proxy on 127.0.0.1; the proxy reads the original
destination (SO_ORIGINAL_DST), connects there itself (its socket carries SO_MARK 0x5d1, which the rule
skips), and forwards each chunk, each way, d seconds after it arrived, in order (a time-stamped queue per
direction). So every round trip from a worker is 2d, whatever the other end; worker-to-worker connections
(gloo) pass through the connecting side's proxy once (round trip 2d) and through both workers' tbf links.
The proxy holds at most max(256 KiB, 2 x rate x (d + 50 ms)) bytes per direction (64 MiB unlimited): about
what a real path holds in flight, so it never limits throughput and backpressure reaches the sender's socket.
Not emulated: the TCP handshake's extra round trip (connect() returns at once: connections here are long
lived), packet loss, and TCP's own reaction to a long RTT (the proxy's legs have short ones).

Each (rate, delay) point starts with a self-check printed before its runs: the round trip of a 1-byte echo
from every worker to the shard's namespace and from worker 0 to worker 1, and a bulk transfer up and down
through worker 0's link. Then the reference: the training loop without any communication (wan_ddp.py
--no-comm), in every worker namespace at once (the same CPU contention as a run): its mean step time t_ref.
Then the runs:

  sdl  one shard (`streamdiloco server --min-workers M --no-checkpoint`) and M `streamdiloco worker`s
  ddp  benchmarks/wan_ddp.py: DDP over gloo, one rank per worker namespace, the same model, seed, data
       streams (rank r), batch, AdamW and learning-rate schedule as the workers

every process with 1 torch thread. Per run: compute utilization = steps x t_ref / wall time of the training
loop (the same definition for both; the workers' own compute_utilization, compute time / training time, is
shown beside it), steps/s, bytes per step at the worker's interface (tx = up, rx = down; during training, and
in results.json also for the whole run with the shard's Fetch or DDP's first broadcast), streamdiloco's
blocked seconds, eval loss of the global model. A run past its time bound (--timeout, --ddp-timeout) is
stopped and reported from the steps it did (eval loss "—").

    make bench-wan                                    # the full sweep (hours; a quiet machine)
    python -m benchmarks.wan --quick                  # 1 and unlimited Mbit/s at 25 ms, 60 steps
    python -m benchmarks.wan --rates 1,unlimited --delays 25 --systems sdl \\
        --sdl-flags "--fragment-sync-delay 3"         # flags for shard and workers both
    python -m benchmarks.wan --check-only             # the network and its self-checks, no training
    GRPC_TRACE=http2_ping GRPC_VERBOSITY=debug python -m benchmarks.wan --workers 1 --rates 1 --delays 25 \\
        --systems sdl --steps 40 --queue-ms 1000 --keep  # then: python -m benchmarks.wan pings KEPT/*.log

Writes results.md, results.json (after every run), utilization.png and run.log under --out. Every process,
namespace, qdisc and nftables table it makes is removed at the end, on an error, on Ctrl+C and on SIGTERM;
leftovers of a run that was killed are removed at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from benchmarks.harness import Procs, bench, machine, machine_line, say, wait_quiet, write_results
from streamdiloco.common.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent
PREFIX = "sdlwan-"  # every namespace of the testbed; leftovers with it are removed at the start
SUBNET = "10.213.77"  # the testbed's /24, only inside its namespaces
HUB, DC = PREFIX + "hub", PREFIX + "dc"
QUEUE = 0.1  # seconds of the link's rate that its tbf queue holds (--queue-ms)
DC_ADDR = f"{SUBNET}.10"
IFACE = "wan0"  # each site's end of its veth pair
BRIDGE = "br0"
PROXY_PORT = 15001  # the delaying proxy, on 127.0.0.1 in each worker namespace
CHECK_PORT = 15002  # the self-check's echo/sink server
SHARD_PORT = 7070
DDP_PORT = 29500
MARK = 0x5D1  # the proxy's own connections: the redirect rule skips them
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
FRAME = 1514  # a full Ethernet frame as tbf counts it
MiB = 1 << 20

DEFAULT_RATES = "0.25,0.5,1,2,4,8,16,64,256,unlimited"
QUICK_RATES = "1,unlimited"


# --- the delaying proxy (runs inside a worker namespace) --------------------------------------------------
def proxy_limit(delay: float, rate_mbit: float | None) -> int:
    """Bytes the proxy may hold per direction: about what the path holds in flight, never a throttle."""
    if rate_mbit is None:
        return 64 * MiB
    return max(256 << 10, int(2 * rate_mbit * 1e6 / 8 * (delay + 0.05)))


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(addr), port


async def _delay_line(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float, limit: int) -> None:
    """Copy src to dst, each chunk `delay` seconds after it was read, in order; its EOF, or its error (then
    raised here), as well. Reading pauses while `limit` bytes wait, so that the sender's socket fills
    (backpressure) instead of our memory."""
    loop = asyncio.get_running_loop()
    queue: collections.deque[tuple[float, bytes | Exception]] = collections.deque()
    queued = 0
    arrived, room = asyncio.Event(), asyncio.Event()
    room.set()

    async def read() -> None:
        nonlocal queued
        while True:
            try:
                data: bytes | Exception = await src.read(256 << 10)
            except OSError as e:  # a reset: it reaches the other end after the delay, like the data before it
                data = e
            queue.append((loop.time() + delay, data))
            arrived.set()
            if not isinstance(data, bytes) or not data:
                return
            queued += len(data)
            while queued >= limit:
                room.clear()
                await room.wait()

    async def write() -> None:
        nonlocal queued
        while True:
            while not queue:
                arrived.clear()
                await arrived.wait()
            wait = queue[0][0] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            now, sent = loop.time(), 0
            while queue and queue[0][0] <= now:  # everything due goes out together
                _, data = queue.popleft()
                if isinstance(data, Exception):
                    raise data
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    await dst.drain()
                    return
                dst.write(data)
                sent += len(data)
            await dst.drain()
            queued -= sent
            if queued < limit:
                room.set()

    reader = asyncio.create_task(read())
    try:
        await write()
    finally:
        reader.cancel()


async def _proxy_main(port: int, delay: float, limit: int, ready: str | None) -> None:
    loop = asyncio.get_running_loop()

    async def handle(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        csock = cwriter.get_extra_info("socket")
        uwriter = None
        try:
            host, dport = original_dst(csock)
            csock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            usock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            usock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)  # the redirect rule skips it
            usock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            usock.setblocking(False)
            try:
                await loop.sock_connect(usock, (host, dport))
            except OSError:
                usock.close()
                raise
            ureader, uwriter = await asyncio.open_connection(sock=usock)
            lines = [
                asyncio.create_task(_delay_line(creader, uwriter, delay, limit)),
                asyncio.create_task(_delay_line(ureader, cwriter, delay, limit)),
            ]
            try:  # both ways to their EOF, or the first error
                done, _ = await asyncio.wait(lines, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()
            finally:
                for t in lines:
                    t.cancel()
        except OSError:  # one end went away: so does the other, with a reset
            for w in (cwriter, uwriter):
                if w is not None:
                    sock = w.get_extra_info("socket")
                    if sock is not None and sock.fileno() >= 0:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    w.transport.abort()
        finally:
            for w in (cwriter, uwriter):
                if w is not None:
                    w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=256)
    if ready:
        Path(ready).write_text(str(os.getpid()))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


# --- the self-check's two ends ------------------------------------------------------------------------------
async def _check_server_main(host: str, port: int, ready: str | None) -> None:
    """One byte says what a connection wants: E echo, U n: take n bytes then answer K, D n: send n bytes."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            kind = await r.readexactly(1)
            if kind == b"E":
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            elif kind in (b"U", b"D"):
                (n,) = struct.unpack("!Q", await r.readexactly(8))
                if kind == b"U":
                    got = 0
                    while got < n and (data := await r.read(MiB)):
                        got += len(data)
                    w.write(b"K")
                else:
                    block = bytes(MiB)
                    for at in range(0, n, MiB):
                        w.write(block[: min(MiB, n - at)])
                        await w.drain()
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(handle, host, port)
    if ready:
        Path(ready).write_text(str(os.getpid()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _round_trips(host: str, port: int, n: int = 7) -> list[float]:
    """Seconds for a 1-byte echo, n times on one connection (the first, which may meet ARP, dropped)."""
    with socket.create_connection((host, port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"E")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(b"p")
            if not s.recv(1):
                raise OSError("echo closed")
            out.append(time.perf_counter() - t0)
        return out[1:]


def _bulk(host: str, port: int, n: int, up: bool, rtt: float) -> float:
    """Mbit/s of TCP payload moving n bytes up (here to there) or down, less one round trip."""
    with socket.create_connection((host, port), timeout=600) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall((b"U" if up else b"D") + struct.pack("!Q", n))
        if up:
            block = bytes(MiB)
            for at in range(0, n, MiB):
                s.sendall(block[: min(MiB, n - at)])
            if s.recv(1) != b"K":
                raise OSError("upload not acknowledged")
        else:
            got = 0
            while got < n:
                data = s.recv(MiB)
                if not data:
                    raise OSError(f"download ended after {got} of {n} bytes")
                got += len(data)
        # the request (or the ack) and the first byte cross the delay once each: one round trip
        seconds = time.perf_counter() - t0 - rtt
        return n * 8 / 1e6 / max(seconds, 1e-6)


def _check_client_main(a: argparse.Namespace) -> int:
    host, port = a.target.split(":")
    trips = _round_trips(host, int(port))
    out: dict = {"rtt_ms": 1e3 * statistics.median(trips), "rtt_min_ms": 1e3 * min(trips)}
    if a.peer:
        phost, pport = a.peer.split(":")
        out["rtt_peer_ms"] = 1e3 * statistics.median(_round_trips(phost, int(pport)))
    if a.bytes:
        rtt = statistics.median(trips)
        out["up_mbit"] = _bulk(host, int(port), a.bytes, True, rtt)
        out["down_mbit"] = _bulk(host, int(port), a.bytes, False, rtt)
        out["bulk_bytes"] = a.bytes
    print(json.dumps(out))
    return 0


def _internal(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="wan.py (internal)")
    p.add_argument("role", choices=["_proxy", "_check-server", "_check"])
    p.add_argument("--port", type=int)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--delay", type=float, default=0.0, help="one-way seconds")
    p.add_argument("--limit", type=int, default=64 * MiB)
    p.add_argument("--ready")
    p.add_argument("--target")
    p.add_argument("--peer")
    p.add_argument("--bytes", type=int, default=0)
    a = p.parse_args(argv)
    if a.role == "_proxy":
        asyncio.run(_proxy_main(a.port, a.delay, a.limit, a.ready))
    elif a.role == "_check-server":
        asyncio.run(_check_server_main(a.host, a.port, a.ready))
    else:
        return _check_client_main(a)
    return 0


# --- the network --------------------------------------------------------------------------------------------
def sh(*cmd: str, check: bool = True, stdin: str | None = None) -> str:
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{shlex.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def tbf_params(rate_mbit: float, queue: float = QUEUE) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at this rate whose queue holds `queue` seconds of it: see the
    module docstring."""
    bps = rate_mbit * 1e6 / 8
    burst = max(2 * FRAME, int(bps * 0.002))
    return burst, burst + max(int(bps * queue), 8 * FRAME)


class Testbed:
    """The namespaces, the bridge, the veth pairs, the redirect rules and the shaping of one testbed. Its
    namespaces' names start with `prefix`: testbeds of other prefixes (a test's, beside a benchmark) are
    separate networks, each with the same addresses."""

    def __init__(self, workers: int, prefix: str = PREFIX):
        self.workers, self.prefix = workers, prefix
        self.hub, self.dc = prefix + "hub", prefix + "dc"
        self.ns = [f"{prefix}w{i}" for i in range(workers)]
        self.addr = [f"{SUBNET}.{11 + i}" for i in range(workers)]

    @staticmethod
    def leftovers(prefix: str = PREFIX) -> list[str]:
        return [
            line.split()[0]
            for line in sh("ip", "netns", "list").splitlines()
            if line.split() and line.split()[0].startswith(prefix)
        ]

    @staticmethod
    def remove_all(prefix: str = PREFIX) -> list[str]:
        """Delete every namespace of ours (and so its veths, qdiscs and nft tables), first killing any
        process still inside one (ours: only this testbed starts processes there)."""
        gone = Testbed.leftovers(prefix)
        for ns in gone:
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in gone:
            for _ in range(50):  # a killed process may hold the namespace a moment longer
                if not sh("ip", "netns", "pids", ns, check=False).split():
                    break
                time.sleep(0.1)
            sh("ip", "netns", "del", ns, check=False)
        return gone

    def create(self) -> None:
        if self.workers > 100:
            raise ValueError(f"--workers {self.workers}: the testbed's /24 has room for 100 workers")
        hub = self.hub
        sh("ip", "netns", "add", hub)
        self._quiet(hub)
        sh("ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", hub, "link", "set", BRIDGE, "up")
        for ns, addr, port in [(self.dc, DC_ADDR, "p-dc")] + [
            (ns, addr, f"p-w{i}") for i, (ns, addr) in enumerate(zip(self.ns, self.addr, strict=True))
        ]:
            sh("ip", "netns", "add", ns)
            self._quiet(ns)
            sh("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns)
            sh("ip", "-n", hub, "link", "set", port, "master", BRIDGE, "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            sh("ip", "-n", ns, "link", "set", IFACE, "up")
        for ns in self.ns:  # a worker's outgoing TCP to the testbed goes to its delaying proxy
            rules = f"""
            table ip sdlwan {{
                chain out {{
                    type nat hook output priority -100; policy accept;
                    oifname "{IFACE}" ip daddr {SUBNET}.0/24 meta l4proto tcp meta mark != {MARK:#x} \
redirect to :{PROXY_PORT}
                }}
            }}
            """
            sh(*in_ns(ns, "nft", "-f", "-"), stdin=rules)

    @staticmethod
    def _quiet(ns: str) -> None:
        """Loopback up; no IPv6 (its chatter would count in the interfaces' bytes)."""
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh(
            *in_ns(ns, "sysctl", "-q", "-w"),
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        )

    def shape(self, rate_mbit: float | None, queue: float = QUEUE) -> None:
        """rate_mbit each way on every worker's link (None: unshaped), behind a queue of `queue` seconds."""
        for i, ns in enumerate(self.ns):
            for where, dev in ((["-n", ns], IFACE), (["-n", self.hub], f"p-w{i}")):
                if rate_mbit is None:
                    sh("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)
                else:
                    burst, limit = tbf_params(rate_mbit, queue)
                    sh(
                        *("tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf"),
                        *("rate", f"{int(rate_mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit)),
                    )

    def counters(self, i: int) -> dict:
        """Bytes through worker i's interface so far: tx (up), rx (down)."""
        link = json.loads(sh("ip", "-n", self.ns[i], "-j", "-s", "link", "show", "dev", IFACE))[0]
        stats = link.get("stats64") or link["stats"]
        return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}


# --- one sweep point ----------------------------------------------------------------------------------------
def rate_label(rate: float | None) -> str:
    return "unlimited" if rate is None else f"{rate:g} Mbit/s"


def wan_py(*args: str) -> list[str]:
    return bench("wan", *args)


class LogWatch:
    """Reads what a process has added to its log since the last look."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # whole lines only: the rest is still being written
        self.pos += end
        return data[:end].decode(errors="replace").splitlines()


class Sweep:
    """Runs the points of the sweep on one testbed; every process goes through `procs` (wire.py's Procs)."""

    def __init__(self, args: argparse.Namespace, bed: Testbed, procs, tmp: Path, say):
        self.a, self.bed, self.procs, self.tmp, self.say = args, bed, procs, tmp, say
        self.env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proxies: list = []
        self.checkers: list = []
        self.count = 0  # runs so far
        self.refs = 0  # references so far

    # --- per point: proxies, self-check, reference
    def start_proxies(self, delay: float, rate: float | None) -> None:
        self.stop_proxies()
        limit = proxy_limit(delay, rate)
        ready = []
        for i, ns in enumerate(self.bed.ns):
            f = self.tmp / f"proxy-w{i}.ready"
            f.unlink(missing_ok=True)
            argv = wan_py("_proxy", "--port", str(PROXY_PORT), "--delay", str(delay), "--limit", str(limit))
            p = self.procs.start(f"proxy-w{i}", in_ns(ns, *argv, "--ready", str(f)))
            self.proxies.append(p)
            ready.append((f, p))
        servers = [(DC, DC_ADDR)] + ([(self.bed.ns[1], self.bed.addr[1])] if self.bed.workers > 1 else [])
        for ns, addr in servers:
            f = self.tmp / f"check-{ns}.ready"
            f.unlink(missing_ok=True)
            argv = wan_py("_check-server", "--host", addr, "--port", str(CHECK_PORT), "--ready", str(f))
            p = self.procs.start(f"check-{ns}", in_ns(ns, *argv))
            self.checkers.append(p)
            ready.append((f, p))
        deadline = time.monotonic() + 30
        for f, p in ready:
            while not f.exists():
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"a proxy or check server did not start (see {self.tmp})")
                time.sleep(0.02)

    def stop_proxies(self) -> None:
        for p in self.proxies + self.checkers:
            self.procs.stop(p, timeout=5)
        self.proxies, self.checkers = [], []

    def self_check(self, rate: float | None, delay: float) -> dict:
        """Round trips from every worker, bulk up and down through worker 0's link."""
        n = 64 * MiB if rate is None else max(64 << 10, int(rate * 1e6 / 8 * self.a.check_seconds))
        n = min(n, 64 * MiB)
        out: dict = {"workers": []}
        for i, ns in enumerate(self.bed.ns):
            argv = ["_check", "--target", f"{DC_ADDR}:{CHECK_PORT}"]
            if i == 0:
                argv += ["--bytes", str(n)]
                if self.bed.workers > 1:
                    argv += ["--peer", f"{self.bed.addr[1]}:{CHECK_PORT}"]
            limit = 60 + (0 if rate is None else 3 * n * 8 / (rate * 1e6))
            r = subprocess.run(in_ns(ns, *wan_py(*argv)), capture_output=True, text=True, timeout=limit)
            if r.returncode != 0:
                raise RuntimeError(f"self-check from {ns} failed: {r.stderr.strip()[-2000:]}")
            out["workers"].append(json.loads(r.stdout))
        w0 = out["workers"][0]
        out.update(
            rtt_ms=[w["rtt_ms"] for w in out["workers"]],
            rtt_peer_ms=w0.get("rtt_peer_ms"),
            up_mbit=w0["up_mbit"],
            down_mbit=w0["down_mbit"],
            bulk_bytes=n,
        )
        return out

    def reference(self) -> dict:
        """The training loop without communication, in every worker namespace at once: mean step time."""
        if self.a.max_wait > 0:
            self.a.wait_quiet("reference", self.a.max_wait)
        self.refs += 1
        d = self.tmp / f"ref-{self.refs}"
        d.mkdir()
        go = d / "go"
        started = []
        for i, ns in enumerate(self.bed.ns):
            argv = [sys.executable, str(HERE / "wan_ddp.py"), "--no-comm", "--rank", str(i)]
            argv += ["--steps", str(self.a.ref_steps), "--summary", str(d / f"r{i}.json")]
            argv += ["--ready-file", str(d / f"r{i}.ready"), "--go-file", str(go)]
            argv += self.train_flags()
            started.append(self.procs.start(f"ref-{self.refs}-r{i}", in_ns(ns, *argv), env_extra=self.env))
        deadline = time.monotonic() + 180
        while not all((d / f"r{i}.ready").exists() for i in range(self.bed.workers)):
            self._check_alive(started, deadline, "the reference")
            time.sleep(0.05)
        go.touch()
        while any(p.poll() is None for p in started):
            self._check_alive(started, deadline, "the reference")
            time.sleep(0.1)
        per_rank = []
        for i in range(self.bed.workers):
            s = json.loads((d / f"r{i}.json").read_text())["step_seconds"]
            skip = min(3, len(s) // 4)  # the first steps warm up; the last may run alone
            per_rank.append(statistics.fmean(s[skip : len(s) - skip]))
        for p in started:
            self.procs.stop(p)
        return {"step_seconds": statistics.fmean(per_rank), "per_rank": per_rank, "steps": self.a.ref_steps}

    def _check_alive(self, procs: list, deadline: float, what: str) -> None:
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"{what} failed: a process exited with an error (logs in {self.tmp})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not finish in time (logs in {self.tmp})")

    # --- flags
    def train_flags(self) -> list[str]:
        """What the workers and the DDP ranks train alike."""
        f = ["--batch-size", str(self.a.batch_size), "--model", self.a.model, "--seed", str(self.a.seed)]
        f += ["--eval-batches", str(self.a.eval_batches)]
        if self.a.block_size:
            f += ["--block-size", str(self.a.block_size)]
        if self.a.data:
            f += ["--data", self.a.data]
        return f + shlex.split(self.a.train_flags)

    def sync_flags(self) -> list[str]:
        f = ["--sync-every", str(self.a.sync_every), "--num-fragments", str(self.a.num_fragments)]
        return f + shlex.split(self.a.sdl_flags)

    # --- the runs
    def run_sdl(self, d: Path) -> dict:
        a, bed = self.a, self.bed
        ready = d / "shard.ready"
        model = ["--model", a.model, "--seed", str(a.seed)]
        if a.block_size:
            model += ["--block-size", str(a.block_size)]
        argv = ["-m", "streamdiloco", "server", "--host", DC_ADDR, "--port", str(SHARD_PORT)]
        argv += ["--http-port", "0", "--ready-file", str(ready), "--min-workers", str(bed.workers)]
        argv += ["--no-checkpoint", "--insecure", *model, *self.sync_flags(), *shlex.split(a.server_flags)]
        shard = self.procs.start(f"{d.name}-shard", in_ns(DC, sys.executable, *argv), env_extra=self.env)
        deadline = time.monotonic() + 120
        while not ready.exists():
            self._check_alive([shard], deadline, "the shard")
            if shard.poll() is not None:
                raise RuntimeError(f"the shard exited:\n{self.procs.tail(f'{d.name}-shard')}")
            time.sleep(0.05)
        names = [f"w{i}" for i in range(bed.workers)]
        procs, watches = [], []
        for i, (ns, w) in enumerate(zip(bed.ns, names, strict=True)):
            argv = ["-m", "streamdiloco", "worker", "--servers", f"{DC_ADDR}:{SHARD_PORT}", "--name", w]
            argv += ["--rank", str(i), "--steps", str(a.steps), "--summary", str(d / f"{w}.json")]
            argv += ["--checkpoint", str(d / f"{w}.pt"), "--checkpoint-every", "0", "--log-every", "10"]
            argv += ["--eval-every", "0"]  # no evaluations inside the training time DDP is compared with
            argv += [*self.train_flags(), *self.sync_flags(), *shlex.split(a.worker_flags)]
            env = self.env
            procs.append(self.procs.start(f"{d.name}-{w}", in_ns(ns, sys.executable, *argv), env_extra=env))
            watches.append(LogWatch(self.procs.logdir / f"{d.name}-{w}.log"))
        train_start: list[float | None] = [None] * bed.workers
        at_start: list[dict | None] = [None] * bed.workers

        def watch() -> None:  # the start of training: its time and the interface's bytes (after the Fetch)
            for i, w in enumerate(watches):
                for line in w.new_lines():
                    if train_start[i] is None and f"{names[i]}: " in line and " params in " in line:
                        train_start[i], at_start[i] = time.time(), bed.counters(i)

        status, t_stop = self._wait(procs + [shard], procs, a.timeout, watch, f"{d.name}-")
        watch()
        for p in procs:
            self.procs.stop(p, timeout=20)  # on a timeout: SIGTERM, the worker stops after its step
        self.procs.stop(shard)
        workers = []
        for i, name in enumerate(names):
            f = d / f"{name}.json"
            s = json.loads(f.read_text()) if f.exists() else {}
            finished = "train_seconds" in s
            steps = a.steps if finished else (s.get("stopped_at_step") or self._last_logged_step(d, name))
            wall = s["train_seconds"] if finished else (t_stop - (train_start[i] or t_stop))
            workers.append(
                {
                    "steps": steps,
                    "train_seconds": wall,
                    "own_compute_utilization": s.get("compute_utilization"),
                    "blocked_seconds": s.get("blocked_seconds"),
                    "eval_loss": s.get("eval_loss"),
                    "train_start_bytes": at_start[i],
                    "summary": s,
                }
            )
        return {"status": status, "workers": workers}

    def _last_logged_step(self, d: Path, name: str) -> int:
        step = 0
        path = self.procs.logdir / f"{d.name}-{name}.log"
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if f"{name} step " in line:
                try:
                    step = int(line.split(f"{name} step ", 1)[1].split("/", 1)[0])
                except ValueError:
                    pass
        return step

    def run_ddp(self, d: Path) -> dict:
        a, bed = self.a, self.bed
        procs = []
        for i, ns in enumerate(bed.ns):
            argv = [str(HERE / "wan_ddp.py"), "--rank", str(i), "--world-size", str(bed.workers)]
            argv += ["--master", f"{bed.addr[0]}:{DDP_PORT}", "--iface", IFACE, "--steps", str(a.steps)]
            argv += ["--summary", str(d / f"rank{i}.json"), *self.train_flags()]
            env = {**self.env, "GLOO_SOCKET_IFNAME": IFACE}
            procs.append(
                self.procs.start(f"{d.name}-rank{i}", in_ns(ns, sys.executable, *argv), env_extra=env)
            )
        status, t_stop = self._wait(procs, procs, a.ddp_timeout, None, f"{d.name}-")
        for p in procs:
            self.procs.stop(p, timeout=5)
        workers = []
        for i in range(bed.workers):
            f = d / f"rank{i}.json"
            s = json.loads(f.read_text()) if f.exists() else {}
            finished = bool(s.get("finished"))
            steps = s.get("steps", 0)
            if finished:
                wall = s["train_seconds"]
            elif "train_start_unix" in s:
                wall = t_stop - s["train_start_unix"]
            else:
                wall = 0.0
            workers.append(
                {
                    "steps": steps,
                    "train_seconds": wall,
                    "own_compute_utilization": None,
                    "blocked_seconds": None,
                    "eval_loss": s.get("eval_loss"),
                    "train_start_bytes": s.get("iface_bytes_at_start"),
                    "summary": {k: v for k, v in s.items() if k != "step_seconds"},
                    "step_seconds_median": statistics.median(s["step_seconds"])
                    if s.get("step_seconds")
                    else None,
                }
            )
        return {"status": status, "workers": workers}

    def _wait(self, watched: list, workers: list, timeout: float, tick, prefix: str) -> tuple[str, float]:
        """Until the workers exit (ok), one of the processes fails (failed) or `timeout` s pass (timed
        out); returns the status and when it was decided."""
        deadline = time.monotonic() + timeout
        while True:
            if tick:
                tick()
            if all(p.poll() is not None for p in workers):
                ok = all(p.returncode == 0 for p in workers)
                if not ok:
                    self._say_tails(prefix)
                return ("ok" if ok else "failed"), time.time()
            if any(p.poll() not in (None, 0) for p in watched):
                self._say_tails(prefix)
                return "failed", time.time()
            if time.monotonic() > deadline:
                return "timed out", time.time()
            time.sleep(0.2)

    def _say_tails(self, prefix: str) -> None:
        for name, _ in self.procs.procs:
            if name.startswith(prefix):
                self.say(self.procs.tail(name, 8))

    def run(self, system: str, rate: float | None, delay_ms: float, t_ref: float) -> dict:
        self.count += 1
        d = self.tmp / f"run{self.count}-{system}"
        d.mkdir()
        before = [self.bed.counters(i) for i in range(self.bed.workers)]
        t0 = time.monotonic()
        res = (self.run_sdl if system == "sdl" else self.run_ddp)(d)
        after = [self.bed.counters(i) for i in range(self.bed.workers)]
        res.update(
            system=system, rate_mbit=rate, delay_ms=delay_ms, t_ref=t_ref, seconds=time.monotonic() - t0
        )
        for i, w in enumerate(res["workers"]):
            w["iface_bytes"] = {k: after[i][k] - before[i][k] for k in ("tx", "rx")}
            if w.get("train_start_bytes") is not None:  # from the start of training on
                w["training_bytes"] = {k: after[i][k] - w["train_start_bytes"][k] for k in ("tx", "rx")}
        return summarize_run(res)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize_run(r: dict) -> dict:
    """The figures of one run (means over the workers), beside its per-worker details."""
    ws = r["workers"]
    steps = min((w["steps"] for w in ws), default=0)
    util = [w["steps"] * r["t_ref"] / w["train_seconds"] if w["train_seconds"] > 0 else 0.0 for w in ws]
    # the same without the run's last step's final sync (every fragment once more, waited for: a one-off
    # cost at the end of a run, a few seconds on a slow link, that a run of thousands of steps does not see)
    steady = [
        w["steps"] * r["t_ref"] / (w["train_seconds"] - fs) if w["train_seconds"] - fs > 0 else 0.0
        for w in ws
        for fs in [(w.get("summary") or {}).get("final_sync_seconds") or 0.0]
    ]
    sps = [w["steps"] / w["train_seconds"] if w["train_seconds"] > 0 else 0.0 for w in ws]

    def per_step(key: str, d: str) -> float | None:
        vals = [w[key][d] / w["steps"] for w in ws if w.get(key) and w["steps"]]
        return statistics.fmean(vals) if vals else None

    finished = r["status"] == "ok"
    r.update(
        steps=steps,
        utilization=_mean(util),
        utilization_steady=_mean(steady),
        final_sync_seconds=_mean([(w.get("summary") or {}).get("final_sync_seconds") or 0.0 for w in ws]),
        own_utilization=_mean([w["own_compute_utilization"] for w in ws]) if finished else None,
        steps_per_s=_mean(sps),
        train_seconds=_mean([w["train_seconds"] for w in ws]),
        up_bytes_per_step=per_step("training_bytes", "tx"),
        down_bytes_per_step=per_step("training_bytes", "rx"),
        up_bytes_per_step_whole_run=per_step("iface_bytes", "tx"),
        down_bytes_per_step_whole_run=per_step("iface_bytes", "rx"),
        blocked_seconds=_mean([w["blocked_seconds"] for w in ws]) if finished else None,
        eval_loss=ws[0]["eval_loss"] if finished and ws else None,
    )
    return r


TABLE_NOTE = """\
Compute utilization: steps × t_ref ÷ wall time of the training loop, where t_ref is the step time of the
same loop without communication, measured at the same point with every worker process running at once.
Without the final sync: the same with the wall time of the run's last step's sync taken out (every fragment
sent and merged once more, waited for: once per run, seconds on a slow link; its own column). DDP has none.
Own (workers): streamdiloco's compute_utilization (its compute time ÷ its training time). KB/step: bytes
through the worker's interface during training (tx up, rx down; Ethernet, IP and TCP headers included),
mean over the workers; results.json has the whole runs too (with the shard's Fetch of the masters, DDP's
first broadcast). A run stopped at its time bound reports the steps it did (its bytes include those of the
step it was in); its eval loss is "—"."""


# --- output -------------------------------------------------------------------------------------------------
def _f(x, fmt: str, none: str = "—") -> str:
    return none if x is None else format(x, fmt)


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def _kb(x: float | None) -> str:
    return "—" if x is None else f"{x / 1e3:.1f}"


def run_line(r: dict) -> str:
    return (
        f"{r['system']:>3} {rate_label(r['rate_mbit']):>13} {r['delay_ms']:g} ms: {r['status']}, "
        f"{r['steps']} steps in {_f(r['train_seconds'], '.1f')} s ({_f(r['steps_per_s'], '.2f')} steps/s), "
        f"utilization {_pct(r['utilization'], 0)} "
        f"(without the final sync {_pct(r['utilization_steady'], 0)}; "
        f"own {_pct(r['own_utilization'], 0)}), "
        f"KB/step up {_kb(r['up_bytes_per_step'])} down {_kb(r['down_bytes_per_step'])}, "
        f"blocked {_f(r['blocked_seconds'], '.1f')} s, eval loss {_f(r['eval_loss'], '.4f')} "
        f"({r['seconds']:.0f} s)"
    )


def results_table(runs: list[dict]) -> str:
    head = (
        "| system | Mbit/s each way | one-way delay | steps | compute utilization | without the final sync "
        "| own (workers) | steps/s | KB/step up | KB/step down | blocked s | final sync s | eval loss "
        "| status |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cells = [
            "streamdiloco" if r["system"] == "sdl" else "DDP (gloo)",
            rate_cell(r["rate_mbit"]),
            f"{r['delay_ms']:g} ms",
            str(r["steps"]),
            _pct(r["utilization"]),
            _pct(r.get("utilization_steady")),
            _pct(r["own_utilization"]),
            _f(r["steps_per_s"], ".2f"),
            _kb(r["up_bytes_per_step"]),
            _kb(r["down_bytes_per_step"]),
            _f(r["blocked_seconds"], ".1f"),
            _f(r.get("final_sync_seconds") if r["system"] == "sdl" else None, ".1f"),
            _f(r["eval_loss"], ".4f"),
            r["status"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_line(rate: float | None, delay_ms: float, c: dict, queue: float = QUEUE) -> str:
    expect = ""
    if rate:
        burst, limit = tbf_params(rate, queue)
        expect = (
            f" (expected ~{0.956 * rate:.3g} Mbit/s of TCP payload; tbf burst {burst} B, limit {limit} B)"
        )
    return (
        f"[{rate_label(rate)}, {delay_ms:g} ms] self-check: round trip to the shard "
        + ", ".join(f"w{i} {x:.1f} ms" for i, x in enumerate(c["rtt_ms"]))
        + (f", w0→w1 {c['rtt_peer_ms']:.1f} ms" if c["rtt_peer_ms"] is not None else "")
        + f" (expected {2 * delay_ms:g}); bulk {c['bulk_bytes'] / 1e6:.2f} MB: "
        f"up {c['up_mbit']:.3g} Mbit/s, down {c['down_mbit']:.3g} Mbit/s{expect}"
    )


def rate_cell(rate: float | None) -> str:
    return "unlimited" if rate is None else format(rate, "g")


def checks_table(points: list[dict]) -> str:
    lines = [
        "| Mbit/s each way | one-way delay | round trip worker→shard (ms) | worker 0→1 (ms) "
        "| up Mbit/s (payload) | down Mbit/s | t_ref (ms/step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        c = p["check"]
        lines.append(
            f"| {rate_cell(p['rate_mbit'])} | {p['delay_ms']:g} ms "
            f"| {', '.join(f'{x:.1f}' for x in c['rtt_ms'])} | {_f(c['rtt_peer_ms'], '.1f')} "
            f"| {c['up_mbit']:.3g} | {c['down_mbit']:.3g} "
            f"| {_f(p.get('reference') and 1e3 * p['reference']['step_seconds'], '.1f')} |"
        )
    return "\n".join(lines)


def series_label(r: dict) -> str:
    """A run's curve: its system, and the streamdiloco flags it ran with beyond the defaults."""
    base = "streamdiloco" if r["system"] == "sdl" else "DDP (gloo)"
    flags = r.get("sdl_flags") if r["system"] == "sdl" else ""
    return f"{base} {flags}" if flags else base


def plot(
    runs: list[dict], path: Path, workers: int, predicted: dict[str, list[tuple[float, float]]] | None = None
) -> Path:
    """Compute utilization against bandwidth (log x; unlimited at the right), per system (and flags) and
    delay; open markers: runs stopped at their time bound. `predicted`: curves of the event model
    (sim/utilization.py), label -> [(Mbit/s or inf, utilization)], drawn thin and dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted({r["rate_mbit"] for r in runs if r["rate_mbit"] is not None})
    x_inf = 4 * finite[-1] if finite else 1.0

    def x(r: dict) -> float:
        return x_inf if r["rate_mbit"] is None else r["rate_mbit"]

    fig, ax = plt.subplots(figsize=(8, 4.8))
    delays = sorted({r["delay_ms"] for r in runs})
    labels = sorted({series_label(r) for r in runs}, key=lambda t: (not t.startswith("streamdiloco"), t))
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:orange"]
    for i, label in enumerate(labels):
        ddp = label.startswith("DDP")
        color, marker = ("tab:red", "s") if ddp else (colors[i % len(colors)], "o")
        for k, delay in enumerate(delays):
            mine = sorted((r for r in runs if series_label(r) == label and r["delay_ms"] == delay), key=x)
            if not mine:
                continue
            ys = [100 * (r["utilization"] or 0.0) for r in mine]
            ax.plot(
                [x(r) for r in mine],
                ys,
                color=color,
                marker=marker,
                linestyle=["-", "--", ":", "-."][k % 4],
                label=f"{label}, {delay:g} ms one-way",
            )
            cut = [(x(r), y) for r, y in zip(mine, ys, strict=True) if r["status"] != "ok"]
            if cut:
                ax.scatter(*zip(*cut, strict=True), marker=marker, color="white", edgecolors=color, zorder=3)
    for j, (label, pts) in enumerate((predicted or {}).items()):
        xs = [x_inf if b == float("inf") else b for b, _ in pts]
        ax.plot(
            xs,
            [100 * u for _, u in pts],
            color="black",
            linewidth=0.8,
            linestyle=["--", ":"][j % 2],
            label=label,
        )
    ax.axhline(95, color="gray", linewidth=1, linestyle=":", label="95%")
    ax.set_xscale("log")
    ax.minorticks_off()
    ticks = finite + [x_inf]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in finite] + ["unlimited"], rotation=45)
    ax.set_xlabel("bandwidth each way (Mbit/s); open markers: stopped early (time bound or failure)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=7)
    ax.set_title(f"Compute utilization across emulated WAN links ({workers} workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def predict_runs(runs: list[dict], settings: dict, policy: str) -> list[tuple[float, float]]:
    """The event model's utilization for streamdiloco's measured points at 25 ms (their t_ref, the model's
    real layout, a whole run of the measured length with its final sync, as the measurement counts it)."""
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.common.modelspec import build_model
    from streamdiloco.sim.utilization import RunModel, simulate

    mine = [r for r in runs if r["system"] == "sdl"]
    if not mine:
        return []
    model = build_model(settings["model"], settings["seed"], settings["block_size"])
    layout = build_layout(model, settings["num_fragments"], "strided")
    values = tuple(f.numel for f in layout.fragments)
    out = []
    for r in sorted(mine, key=lambda r: r["rate_mbit"] or float("inf")):
        bps = float("inf") if r["rate_mbit"] is None else r["rate_mbit"] * 1e6 * 0.956  # TCP payload of tbf
        m = RunModel(
            values,
            r["t_ref"],
            sync_every=settings["sync_every"],
            policy=policy,
            workers=settings["workers"],
            uplink_bps=bps,
            downlink_bps=bps,
            latency=r["delay_ms"] / 1e3,
            steps=settings["steps"],
            final_sync=True,
        )
        out.append((float("inf") if r["rate_mbit"] is None else r["rate_mbit"], simulate(m).utilization))
    return out


_PING = re.compile(  # grpc-core's http2_ping trace: a ping sent, or its ack received, by a client or server
    r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .* (CLIENT|SERVER)\[\w+\]: "
    r"(?:Ping (\d+) sent|received ping ack (\d+))"
)


def ping_answers(lines: Iterable[str]) -> dict[str, list[float]]:
    """Seconds from each HTTP/2 ping sent to its ack, by end (CLIENT: a worker, SERVER: a shard), read from
    grpc-core's trace (a process run with GRPC_TRACE=http2_ping GRPC_VERBOSITY=debug); a ping never
    answered is left out."""
    sent: dict[tuple[str, str], float] = {}
    out: dict[str, list[float]] = {}
    for line in lines:
        m = _PING.match(line)
        if m is None:
            continue
        h, mi, s, end, ping, ack = m.groups()
        t = int(h) * 3600 + int(mi) * 60 + float(s)
        if ping is not None:
            sent[(end, ping)] = t
        elif (end, ack) in sent:
            out.setdefault(end, []).append((t - sent.pop((end, ack))) % 86400)
    return out


def pings(logs: list[Path]) -> int:
    """`python -m benchmarks.wan pings LOG ...`: how long each process's pings waited for their answers."""
    for log in logs:
        with open(log, errors="replace") as f:
            answers = ping_answers(f)
        if not answers:
            print(f"{log}: no ping answered (none sent, or run without GRPC_TRACE=http2_ping)")
        for end, xs in sorted(answers.items()):
            print(
                f"{log} ({end.lower()}): {len(xs)} pings answered in {min(xs):.2f}-{max(xs):.2f} s "
                f"(median {statistics.median(xs):.2f} s)"
            )
    return 0


def combine(dirs: list[Path], out: Path) -> int:
    """One table and one plot from several runs of this script (their results.json), with the event model's
    prediction beside streamdiloco's measured points."""
    runs, settings = [], None
    for d in dirs:
        res = json.loads((d / "results.json").read_text())
        settings = settings or res["settings"]
        for r in res["runs"]:
            runs.append({**r, "sdl_flags": res["settings"].get("sdl_flags", ""), "source": str(d)})
    assert settings is not None
    predicted = {}
    base = [r for r in runs if r["system"] == "sdl" and not r["sdl_flags"] and r["delay_ms"] == 25]
    for policy in ("adaptive", "fixed"):
        pts = predict_runs(base, settings, policy)
        if pts:
            predicted[f"event model, {policy}, 25 ms"] = pts
    out.mkdir(parents=True, exist_ok=True)
    png = plot(runs, out / "utilization.png", settings["workers"], predicted)
    lines = [
        "| series | Mbit/s each way | one-way delay | utilization | without the final sync | event model "
        "| steps/s | KB/step up | KB/step down | final sync s | eval loss | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: (series_label(r), r["delay_ms"], r["rate_mbit"] or float("inf"))):
        pred = ""
        if r in base:
            pred = _pct(dict(predicted["event model, adaptive, 25 ms"]).get(r["rate_mbit"] or float("inf")))
        elif r["system"] == "sdl" and "fixed" in r["sdl_flags"] and r["delay_ms"] == 25:
            pred = _pct(predict_runs([r], settings, "fixed")[0][1])
        lines.append(
            "| "
            + " | ".join(
                [
                    series_label(r),
                    rate_cell(r["rate_mbit"]),
                    f"{r['delay_ms']:g} ms",
                    _pct(r["utilization"]),
                    _pct(r.get("utilization_steady")),
                    pred,
                    _f(r["steps_per_s"], ".2f"),
                    _kb(r["up_bytes_per_step"]),
                    _kb(r["down_bytes_per_step"]),
                    _f(r.get("final_sync_seconds") if r["system"] == "sdl" else None, ".1f"),
                    _f(r["eval_loss"], ".4f"),
                    r["status"],
                ]
            )
            + " |"
        )
    table = "\n".join(lines)
    (out / "combined.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'combined.md'}, {png}")
    return 0


# --- main ---------------------------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float | None]:
    out: list[float | None] = []
    for x in text.split(","):
        x = x.strip().lower()
        if not x:
            continue
        if x in ("unlimited", "inf", "none"):
            out.append(None)
            continue
        v = float(x)
        if not v > 0:
            raise ValueError(f"--rates: a rate must be positive Mbit/s or 'unlimited', got {x!r}")
        out.append(v)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.wan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--rates",
        default=None,
        help=f"Mbit/s each way, comma-separated, 'unlimited': no shaping (default {DEFAULT_RATES})",
    )
    g.add_argument("--delays", default=None, help="one-way delay, ms, comma-separated (default 25,100)")
    g.add_argument(
        "--systems", default="sdl,ddp", help="sdl (streamdiloco), ddp, or both (default %(default)s)"
    )
    g.add_argument(
        "--quick", action="store_true", help=f"rates {QUICK_RATES}, 25 ms, 60 steps, short time bounds"
    )
    g.add_argument(
        "--check-only", action="store_true", help="set up each point and self-check it; no training"
    )
    g.add_argument("--workers", type=int, default=2, help="worker namespaces (and DDP ranks) (default 2)")
    g.add_argument(
        "--queue-ms",
        type=float,
        default=QUEUE * 1e3,
        help="what each link's queue holds, in ms at its rate (default %(default)g; a home modem's: 1000 or "
        "more, which delays everything behind a transfer)",
    )
    g.add_argument(
        "--check-seconds",
        type=float,
        default=2.0,
        help="length of the self-check's bulk transfers (default 2)",
    )
    g.add_argument(
        "--ref-steps", type=int, default=None, help="steps of the no-communication reference (default 40)"
    )
    g.add_argument(
        "--max-wait",
        type=float,
        default=60.0,
        help="seconds to wait, before each point's reference, for other processes to leave the CPUs "
        "(default 60; 0: do not wait)",
    )
    t = p.add_argument_group("training (both systems)")
    t.add_argument("--steps", type=int, default=None, help="inner steps per worker (default 300; --quick 60)")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step (default 16)")
    t.add_argument("--model", default="tiny", help="built-in preset or module.path:factory (default tiny)")
    t.add_argument("--block-size", type=int, default=None, help="context length (default: the preset's)")
    t.add_argument("--seed", type=int, default=0, help="seed for init and data streams (default 0)")
    t.add_argument("--data", default=None, metavar="PATH", help="a text file (default: the built-in plays)")
    t.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end (default 8)")
    t.add_argument(
        "--train-flags",
        default="",
        help="more flags for the workers and the DDP ranks alike: the inner optimizer's, e.g. '--lr 1e-3'",
    )
    s = p.add_argument_group("streamdiloco")
    s.add_argument("--sync-every", type=int, default=30, help="H (default %(default)s)")
    s.add_argument("--num-fragments", type=int, default=5, help="P (default %(default)s)")
    s.add_argument(
        "--sdl-flags",
        default="",
        help="more Streaming DiLoCo flags for the shard and the workers, e.g. '--fragment-sync-delay 3' "
        "(one flag alone: --sdl-flags=--no-final-sync)",
    )
    s.add_argument("--worker-flags", default="", help="more flags for the workers only")
    s.add_argument(
        "--server-flags", default="", help="more flags for the shard only, e.g. '--round-timeout 300'"
    )
    b = p.add_argument_group("time bounds")
    b.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a streamdiloco run may take (default 1200; quick 300)",
    )
    b.add_argument(
        "--ddp-timeout",
        type=float,
        default=None,
        help="seconds a DDP run may take, start-up included (default 300; quick 90): low bandwidth stops it",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", default="benchmarks/results/wan", help="output folder (default %(default)s)")
    o.add_argument("--keep", action="store_true", help="keep the processes' logs (in a temp folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):
        return _internal(argv)
    if argv and argv[0] == "pings":  # no network: ping answer times from kept logs with gRPC's ping trace
        return pings([Path(x) for x in argv[1:]])
    if argv and argv[0] == "combine":  # no network: tables and a plot from earlier runs' results.json
        if len(argv) < 3:
            print("usage: python -m benchmarks.wan combine OUT DIR [DIR ...]", file=sys.stderr)
            return 2
        return combine([Path(d) for d in argv[2:]], Path(argv[1]))
    p = build_parser()
    a = p.parse_args(argv)
    q = a.quick
    a.steps = a.steps or (60 if q else 300)
    a.ref_steps = a.ref_steps or (20 if q else 40)
    a.timeout = a.timeout or (300.0 if q else 1200.0)
    a.ddp_timeout = a.ddp_timeout or (90.0 if q else 300.0)
    try:
        rates = parse_rates(a.rates or (QUICK_RATES if q else DEFAULT_RATES))
        delays = [float(x) for x in (a.delays or ("25" if q else "25,100")).split(",") if x.strip()]
    except ValueError as e:
        p.error(str(e))
    systems = [x.strip() for x in a.systems.split(",") if x.strip()]
    if not set(systems) <= {"sdl", "ddp"} or not systems:
        p.error(f"--systems: choose from sdl, ddp; got {a.systems!r}")
    if not 0 < a.queue_ms <= 60_000:
        p.error(f"--queue-ms must be in (0, 60000], got {a.queue_ms:g}")
    if a.workers < 1 or a.steps < 1 or a.ref_steps < 4:
        p.error("--workers and --steps must be at least 1, --ref-steps at least 4")
    if os.geteuid() != 0:
        p.error("the testbed makes network namespaces: run it as root")
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            p.error(f"`{tool}` is missing: run scripts/system-deps.sh wan (Debian: iproute2, nftables)")

    a.wait_quiet = wait_quiet
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "benchmarks.wan", *argv])
    info = machine()
    say(f"$ {command}")
    say(f"machine: {machine_line(info)}")
    results: dict = {
        "command": command,
        "machine": info,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {k: v for k, v in vars(a).items() if k != "wait_quiet"},
        "points": [],
        "runs": [],
    }

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="wan-bench-"))
    procs = Procs(tmp)
    bed = Testbed(a.workers)
    status = 0
    try:
        if gone := Testbed.remove_all():
            say(f"removed the leftovers of an earlier run: {', '.join(gone)}")
        bed.create()
        say(
            f"testbed: shard in {DC} ({DC_ADDR}), workers in {', '.join(bed.ns)} ({', '.join(bed.addr)}), "
            f"bridge in {HUB}; {len(rates) * len(delays)} points x {systems}, {a.steps} steps"
        )
        sweep = Sweep(a, bed, procs, tmp, say)
        total = len(rates) * len(delays) * (0 if a.check_only else len(systems))
        for delay_ms in delays:
            for rate in rates:
                bed.shape(rate, a.queue_ms / 1e3)
                sweep.start_proxies(delay_ms / 1e3, rate)
                point: dict = {
                    "rate_mbit": rate,
                    "delay_ms": delay_ms,
                    "check": sweep.self_check(rate, delay_ms),
                }
                say(check_line(rate, delay_ms, point["check"], a.queue_ms / 1e3))
                if not a.check_only:
                    point["reference"] = sweep.reference()
                    t_ref = point["reference"]["step_seconds"]
                    say(
                        f"[{rate_label(rate)}, {delay_ms:g} ms] reference without communication: "
                        f"{1e3 * t_ref:.1f} ms/step ({bed.workers} processes at once)"
                    )
                results["points"].append(point)
                for system in [] if a.check_only else systems:
                    bound = a.timeout if system == "sdl" else a.ddp_timeout
                    say(
                        f"[{len(results['runs']) + 1}/{total}] {system} {rate_label(rate)}, {delay_ms:g} ms: "
                        f"running (bound {bound:.0f} s)"
                    )
                    r = sweep.run(system, rate, delay_ms, t_ref)
                    results["runs"].append(r)
                    say(f"[{len(results['runs'])}/{total}] {run_line(r)}")
                    atomic_write_text(out / "results.json", json.dumps(results, indent=2, default=str))
                sweep.stop_proxies()
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every process, removing the testbed")
        status = 130
    except Exception as e:  # noqa: BLE001 (report, clean up, exit non-zero)
        say(f"\nerror: {type(e).__name__}: {e}")
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not stop the clean-up
        procs.stop_all()
        Testbed.remove_all()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if a.keep:
            say(f"kept the processes' logs in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results["seconds"] = time.monotonic() - t0
    md = [
        "# WAN testbed results",
        "",
        f"Command: `{command}`  ",
        f"Run: {results['started']}, {results['seconds']:.0f} s  ",
        f"Machine: {machine_line(info)}",
        "",
        f"{a.workers} workers, model {a.model}, batch {a.batch_size}, {a.steps} steps; streamdiloco H="
        f"{a.sync_every}, P={a.num_fragments}"
        + "".join(
            f"; {name} `{v}`"
            for name, v in (
                ("shard and workers", a.sdl_flags),
                ("workers", a.worker_flags),
                ("shard", a.server_flags),
                ("workers and DDP ranks", a.train_flags),
            )
            if v
        )
        + f". Time bounds: streamdiloco {a.timeout:g} s, DDP {a.ddp_timeout:g} s.",
        "",
        "## Runs",
        "",
        results_table(results["runs"]),
        "",
        TABLE_NOTE,
        "",
        "## Self-checks (per point, before its runs)",
        "",
        checks_table(results["points"]),
        "",
    ]
    png = plot(results["runs"], out / "utilization.png", a.workers) if results["runs"] else None
    if results["runs"]:
        say("\n" + results_table(results["runs"]))
    say(
        f"\n{results['seconds']:.0f}s in all; wrote {out}/results.md, results.json, run.log"
        + (f", {png.name}" if png else "")
    )
    write_results(out, results, md, echo=False)
    return status


if __name__ == "__main__":
    sys.exit(main())
