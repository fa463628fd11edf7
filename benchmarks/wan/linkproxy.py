"""The WAN testbed's processes inside the namespaces (`python -m benchmarks.wan _ROLE ...`): the delaying
proxy of each worker namespace (`_proxy`: every TCP connection a worker opens to the testbed is redirected
to it; it forwards each chunk, each way, d seconds after it arrived, in order) and the two ends of each
point's self-check (`_check-server`: echo, sink and source; `_check`: round trips and bulk transfers, its
figures printed as JSON).

They run in the namespaces the testbed made (testbed.py) and touch no other network; the sweep (sweep.py)
starts and stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import socket
import statistics
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from benchmarks.wan.testbed import MARK, MiB

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
ROLES = ("_proxy", "_check-server", "_check")


async def _serve(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    host: str,
    port: int,
    ready: str | None,
    backlog: int = 100,
) -> None:
    """Serve `handle` on host:port until SIGTERM or SIGINT; once listening, write our pid to `ready`."""
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(handle, host, port, backlog=backlog)
    if ready:
        Path(ready).write_text(str(os.getpid()))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


# --- the delaying proxy -------------------------------------------------------------------------------------
def proxy_limit(delay: float, rate_mbit: float | None) -> int:
    """Bytes the proxy may hold per direction: about what the path holds in flight, never a throttle."""
    if rate_mbit is None:
        return 64 * MiB
    return max(256 << 10, int(2 * rate_mbit * 1e6 / 8 * (delay + 0.05)))


def original_dst(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (nftables' redirect keeps it as SO_ORIGINAL_DST)."""
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
    """The proxy on 127.0.0.1:port: each connection to the address it was meant for, delayed both ways."""
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

    await _serve(handle, "127.0.0.1", port, ready, backlog=256)


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

    await _serve(handle, host, port, ready)


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
    """Round trips to --target (and --peer), bulk up and down (--bytes); the figures as JSON on stdout."""
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


def run_role(argv: list[str]) -> int:
    """`python -m benchmarks.wan _ROLE ...`: run one of the ROLES to its end."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan (internal)")
    p.add_argument("role", choices=ROLES)
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
