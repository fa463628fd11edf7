"""What a client may make a shard hold is bounded, and running short never stops a shard (issue 13, item 4).

Against real shard processes under an open-file limit of 256 (as the issue's probe ran them): 3,000 Session
streams that never send Hello and 600 silent TCP connections to the gRPC and HTTP ports are closed within
their deadlines while a worker keeps training, rounds keep closing and checkpoints keep being written; the
shard never stops and its log stays small. Sessions that do not read share one unread budget. In-process
(support/inthread.py's shard): the caps per address and in total refuse with a clear status, Fetch refuses
repeated fragments and oversized requests, a 4 MiB codec name is not echoed, undecodable messages get a
throttled line each and no traceback, weights below one token are refused. The pure pieces of
server/trust/bounds.py are pinned on their own. Attackers connect from other loopback addresses (127.0.0.2,
...) than the worker and the test's own status reads (127.0.0.1), as they would from other machines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.wire import PROTOCOL
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.trust.bounds import Limits, PeerCounts, UnreadBudget, peer_host
from streamdiloco.server.trust.fds import RESERVE_FDS
from streamdiloco.server.trust.throttle import LOG_BURST, Throttled
from tests.support.inthread import RPC_TIMEOUT, InThreadShard, push_messages
from tests.support.nano_shard import CFG, GOOD_FP, fingerprint
from tests.support.procs import ROOT, SLACK, Cluster, http_json, wait_until
from tests.support.shards import shard_of

FILES = 256  # the open-file limit the shard processes run under
NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]


class LimitedCluster(Cluster):
    """Shard processes with an open-file limit of FILES (set before they import torch, let alone listen:
    each logs the limit it serves under, and the tests check it)."""

    def start(self, name: str, *args: str) -> subprocess.Popen:
        proc = super().start(name, *args)
        if args[0] == "server":
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (FILES, FILES))
        return proc


@pytest.fixture(autouse=True)
def _room_for_sockets():
    """This process opens hundreds of sockets: its soft open-file limit goes up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    assert want >= 2048, f"the tests need 2048 open files; the hard limit is {hard}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- attackers ------------------------------------------------------------------------------------------
class SilentSockets:
    """TCP connections to loopback ports that never send a byte; records when the shard closes each."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.opened: dict[socket.socket, float] = {}
        self.closed: dict[socket.socket, float] = {}
        self.port_of: dict[socket.socket, int] = {}

    def open(self, port: int, source: str, n: int) -> None:
        for _ in range(n):
            s = socket.socket()
            s.settimeout(RPC_TIMEOUT)
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
            s.setblocking(False)
            self.opened[s] = time.monotonic()
            self.port_of[s] = port
            self.sel.register(s, selectors.EVENT_READ)

    def poll(self) -> int:
        """Take what the shard sent (gRPC's settings frame) and note the connections it closed; returns how
        many are still open."""
        for key, _ in self.sel.select(timeout=0.2):
            s = key.fileobj
            try:
                data = s.recv(65536)  # type: ignore[union-attr]
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            except BlockingIOError:
                continue
            if not data:
                self.closed[s] = time.monotonic()  # type: ignore[index]
                self.sel.unregister(s)
        return len(self.opened) - len(self.closed)

    def lifetimes(self, port: int) -> list[float]:
        return [
            self.closed[s] - t for s, t in self.opened.items() if self.port_of[s] == port and s in self.closed
        ]

    def close(self) -> None:
        for s in self.opened:
            s.close()
        self.sel.close()


class HellolessSessions:
    """`n` Session streams that never send a message, over `channels` connections, on an event loop in a
    thread of their own, opened `batch` at a time: the next batch once `held()` says the shard holds the
    ones before (a burst of thousands of new streams is refused by gRPC itself in part). Records how and
    when each ended."""

    def __init__(self, target: str, n: int, held, channels: int = 40, batch: int = 250):
        self.target, self.n, self.held, self.channels, self.batch = target, n, held, channels, batch
        self.ended: list[tuple[float, grpc.StatusCode, str]] = []  # (seconds it lived, status, details)
        self.calls: list = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        chans = [
            grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(self.channels)
        ]

        async def one(i: int) -> None:
            t0 = time.monotonic()
            call = pb_grpc.ShardStub(chans[i % self.channels]).Session(timeout=120)
            self.calls.append(call)
            code = await call.code()
            self.ended.append((time.monotonic() - t0, code, await call.details()))

        try:
            tasks = []
            for start in range(0, self.n, self.batch):
                tasks += [
                    asyncio.ensure_future(one(i)) for i in range(start, min(self.n, start + self.batch))
                ]
                opened = len(tasks)
                deadline = time.monotonic() + RPC_TIMEOUT
                while time.monotonic() < deadline and not await asyncio.to_thread(self.held, opened):
                    await asyncio.sleep(0.05)
            await asyncio.gather(*tasks)
        finally:
            for c in chans:
                await c.close()

    def stop(self) -> None:
        if self.thread.is_alive():
            for call in list(self.calls):
                self.loop.call_soon_threadsafe(call.cancel)
        self.thread.join(30)


def _shard_fds(proc: subprocess.Popen) -> int:
    return len(list(Path(f"/proc/{proc.pid}/fd").iterdir()))


def _rss_mib(proc: subprocess.Popen) -> float:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# === real shard processes under a 256-file limit ===========================================================
# a load test (~40 s on 2 cores): `make test-slow`
@pytest.mark.slow
def test_a_flood_of_silent_connections_and_sessions_without_hello_is_closed_while_training_goes_on(tmp_path):
    hello, header = 30.0, 5.0  # long enough to open 3,000 sessions on a loaded machine
    with LimitedCluster(tmp_path) as c:
        target, http = c.shard(
            "shard",
            *NANO,
            *("--hello-timeout", str(hello), "--header-timeout", str(header), "--idle-timeout", "5"),
            *(
                "--max-sessions",
                "4000",
                "--max-sessions-per-peer",
                "4000",
            ),  # all 3,000 wait for their deadline
        )
        assert f"open-file limit {FILES}:" in c.log("shard")
        shard = c.procs["shard"]
        grpc_port = int(target.rsplit(":", 1)[1])
        c.worker(
            "w", [target], *NANO, "--steps", "1000000", "--checkpoint-every", "0", "--log-every", "100000"
        )
        wait_until("the worker's rounds to close", lambda: http_json(http)["rounds_closed"] >= 3, timeout=120)

        def shard_holds(n: int) -> bool:  # the attacker's own view: all it opened are held
            try:
                return http_json(http)["bounds"]["sessions"] >= n + 1
            except OSError:
                return False

        sessions = HellolessSessions(target, 3000, shard_holds)
        socks = SilentSockets()
        try:
            held = wait_until(
                "3,000 sessions without Hello to be held",
                lambda: (st := http_json(http))["bounds"]["sessions"] >= 3001 and st,
                timeout=hello,
            )
            # 300 silent connections to each port, from addresses other than the worker's: gRPC closes
            # those over its connection cap at once, HTTP those over 8 per address
            for i in range(10):
                socks.open(grpc_port, f"127.0.0.{2 + i}", 30)
            for i in range(3):
                socks.open(http, f"127.0.0.{2 + i}", 100)
            t_silent = time.monotonic()
            fds = [_shard_fds(shard)]

            def progress():  # rounds close and checkpoints are written while all of it is held
                fds.append(_shard_fds(shard))
                socks.poll()
                st = http_json(http)
                return (
                    st["bounds"]["sessions"] >= 3001
                    and st["rounds_closed"] >= held["rounds_closed"] + 3
                    and st["checkpoint"]["writes"] >= held["checkpoint"]["writes"] + 3
                )

            wait_until("rounds to close under the flood", progress, timeout=hello)
            wait_until(
                "every silent connection to be closed", lambda: socks.poll() == 0, timeout=hello + SLACK
            )
            sessions.thread.join(hello + SLACK)
            assert not sessions.thread.is_alive(), "sessions without Hello still open"
        finally:
            sessions.stop()
            socks.close()

        codes = {code for _, code, _ in sessions.ended}
        assert len(sessions.ended) == 3000 and codes == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
        assert "a session must start with Hello within 30 s" in sessions.ended[0][2]
        assert max(t for t, _, _ in sessions.ended) <= hello + SLACK
        grpc_lives, http_lives = socks.lifetimes(grpc_port), socks.lifetimes(http)
        assert len(grpc_lives) == len(http_lives) == 300
        assert max(grpc_lives) <= hello + SLACK and max(http_lives) <= header + SLACK
        assert sum(t < 1.0 for t in http_lives) >= 300 - 3 * 8  # over the cap per address: closed at once
        assert sum(t >= header - 0.5 for t in http_lives) >= 3 * 8 - 1  # held until the header deadline
        # connections stayed out of the reserve (what the shard's own files, checkpoints included, use of it
        # at a given moment is a few descriptors)
        assert max(fds) < FILES - RESERVE_FDS // 2, fds

        # after it, as before: the worker trains, the shard holds only the worker's session
        after = http_json(http)
        wait_until(
            "rounds to close after the flood",
            lambda: http_json(http)["rounds_closed"] > after["rounds_closed"],
        )
        st = http_json(http)
        assert st["bounds"]["sessions"] == 1 and st["checkpoint"]["errors"] == 0 and st["ready"]
        assert shard.poll() is None and c.procs["w"].poll() is None
        log = c.log("shard")
        # the worker's rounds log a line each (dozens a second here): what the flood added is the rest
        flood = "\n".join(line for line in log.splitlines() if " closed (" not in line)
        assert len(flood) < 20_000, f"the shard logged {len(flood)} characters besides its rounds"
        for bad in ("Traceback", "Too many open files", "out of system resource", "CRITICAL", "ERROR"):
            assert bad not in log, log[-3000:]
        print(
            f"3,000 sessions ended after {max(t for t, _, _ in sessions.ended):.1f} s at most; silent "
            f"connections after {max(grpc_lives):.1f} s (gRPC), {max(http_lives):.1f} s (HTTP); the shard "
            f"held {max(fds)} descriptors at most; {len(flood)} characters of log besides its rounds"
        )
        # one line per kind of refusal, a few per 10 s, whatever the number of refusals
        assert 1 <= log.count("no Hello within") <= LOG_BURST * (2 + (time.monotonic() - t_silent) // 10)


# a load test (~20 s on 2 cores): `make test-slow`
@pytest.mark.slow
def test_sessions_that_do_not_read_share_one_budget(tmp_path):
    """4 passive sessions that never read their updates: together they hold at most --max-unread-bytes
    (not that much each); the ones furthest behind are ended, the worker goes on."""
    budget = 2_000_000
    with LimitedCluster(tmp_path) as c:
        target, http = c.shard(
            "shard",
            *NANO,
            "--downlink-codec",
            "fp32",
            "--max-unread-bytes",
            str(budget),
            "--min-workers",
            "1",
        )
        shard = c.procs["shard"]
        c.worker(
            "w", [target], *NANO, "--downlink-codec", "fp32", "--steps", "1000000", "--log-every", "100000"
        )
        wait_until("the worker's rounds to close", lambda: http_json(http)["rounds_closed"] >= 3, timeout=120)
        rss_before = _rss_mib(shard)
        fp = json.dumps(fingerprint(SyncConfig(sync_every=6, num_fragments=3, downlink_codec="fp32")))
        readers = NonReaders(target, fp, 4)
        try:
            peak = [0]

            def readers_gone():
                st = http_json(http)
                peak[0] = max(peak[0], st["bounds"]["unread_bytes"])
                names = {m["name"] for m in st["members"]}
                return len(readers.calls) == 4 and not names & set(readers.names) and st

            wait_until("the 4 readers' sessions to start", lambda: len(readers.calls) == 4, timeout=60)
            st = wait_until("the 4 sessions that do not read to be ended", readers_gone, timeout=180)
            rss_after = _rss_mib(shard)
            readers.drain()
        finally:
            readers.stop()
        # a writer waiting for the next message ends the session with the reason; one stuck in a send to a
        # client that takes nothing has its call cut
        ends = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
        assert len(readers.ended) == 4 and {code for code, _ in readers.ended} <= ends, readers.ended
        for code, details in readers.ended:
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "bytes of messages unread (over all sessions) ran out" in details
        assert c.log("shard").count("does not read its updates: dropping it from the member set") >= 1
        assert st["bounds"]["unread_limit"] == budget and peak[0] <= budget
        assert rss_after - rss_before < 200, (rss_before, rss_after)
        rounds = st["rounds_closed"]
        wait_until("rounds to close after", lambda: http_json(http)["rounds_closed"] > rounds)
        assert shard.poll() is None and c.procs["w"].poll() is None
        print(
            f"RSS {rss_before:.0f} -> {rss_after:.0f} MiB; peak unread {peak[0]:,} of {budget:,} bytes; "
            f"the readers saw {readers.ended}"
        )


class NonReaders:
    """`n` workers that Join, open a passive Session and read nothing of what the shard sends until `drain()`:
    then they read what is left and the status the shard ended their session with."""

    def __init__(self, target: str, fingerprint_json: str, n: int):
        self.target, self.fp, self.n = target, fingerprint_json, n
        self.names = [f"reader-{i}" for i in range(n)]
        self.ended: list[tuple[grpc.StatusCode, str]] = []
        self.loop = asyncio.new_event_loop()
        self.calls: list = []
        self._drain: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        self._drain = asyncio.Event()

        async def one(name: str) -> None:
            async with grpc.aio.insecure_channel(
                self.target, options=[("grpc.use_local_subchannel_pool", 1)]
            ) as ch:
                stub = pb_grpc.ShardStub(ch)
                request = pb.JoinRequest(worker=name, fingerprint_json=self.fp, protocol=PROTOCOL)
                reply = await stub.Join(request, timeout=RPC_TIMEOUT)
                call = stub.Session(timeout=300)
                self.calls.append(call)
                await call.write(
                    pb.WorkerMessage(hello=pb.Hello(worker=name, session=reply.session, passive=True))
                )
                await self._drain.wait()  # type: ignore[union-attr]
                try:
                    async for _ in call:
                        pass
                except (grpc.aio.AioRpcError, asyncio.CancelledError):  # how it ended: below
                    pass
                self.ended.append((await call.code(), await call.details() or ""))

        await asyncio.gather(*(one(name) for name in self.names))

    def drain(self) -> None:
        self.loop.call_soon_threadsafe(self._drain.set)  # type: ignore[union-attr]
        self.thread.join(RPC_TIMEOUT)

    def stop(self) -> None:
        if self.thread.is_alive():
            for call in list(self.calls):
                self.loop.call_soon_threadsafe(call.cancel)
            if self._drain is not None:
                self.loop.call_soon_threadsafe(self._drain.set)
        self.thread.join(30)


def test_a_file_limit_too_low_for_the_caps_is_refused_in_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "streamdiloco", "server", "--model", "nano", "--port", "0", "--http-port", "0"]
        + ["--checkpoint-dir", str(tmp_path / "ckpt"), "--max-connections", "500"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES)),
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("streamdiloco: error: the open-file limit (256"), lines
    assert "not --max-connections 500: raise the limit or lower a cap" in lines[0]


# The HTTP listener of server/trust/bounds.py in a process of its own whose descriptors have all been taken
# (something other than connections used them up): it must pause, not spin, and say so in a few lines.
_FULL_PROCESS = """
import asyncio, logging, os, socket, sys
import uvicorn
from fastapi import FastAPI
from streamdiloco.server.trust.bounds import Limits
from streamdiloco.server.httpconn import BoundedH11, HttpListener
from streamdiloco.server.trust.throttle import Throttled

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
app = FastAPI()

@app.get("/ping")
async def ping():
    return {"ok": True}

async def main():
    loop = asyncio.get_running_loop()
    config = uvicorn.Config(app, http=BoundedH11, lifespan="off", log_level="warning")
    config.load()
    server = uvicorn.Server(config)
    task = asyncio.create_task(server._serve(sockets=[]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    make = lambda: BoundedH11(config=config, server_state=server.server_state, app_state={})
    listener = HttpListener(sock, make, Limits(), 100, Throttled())
    listener.start()
    line = loop.run_in_executor(None, sys.stdin.readline)  # its thread now, while a descriptor is free
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print("FULL", sock.getsockname()[1], flush=True)
    await line
    for fd in held:
        os.close(fd)
    print("FREED", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    listener.close()
    server.should_exit = True
    await task

asyncio.run(main())
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_http_listener_out_of_descriptors_pauses_without_spinning_and_serves_once_they_are_back(tmp_path):
    out = open(tmp_path / "full.log", "w+")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-c", _FULL_PROCESS],
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)),
    )
    clients: list[socket.socket] = []
    try:
        log = lambda: (tmp_path / "full.log").read_text()  # noqa: E731
        port = int(
            wait_until("the process to take every descriptor", lambda: "FULL" in log() and log(), 60)
            .split("FULL ")[1]
            .split()[0]
        )
        for _ in range(8):  # as many as one address may hold
            c = socket.create_connection(("127.0.0.1", port), timeout=RPC_TIMEOUT)
            c.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            clients.append(c)
        wait_until("it to run out", lambda: "out of descriptors" in log(), RPC_TIMEOUT)
        cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
        wait_until("two more tries", lambda: log().count("out of descriptors") >= 3, RPC_TIMEOUT)
        busy = (_cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
        assert busy < 0.25, f"the listener used {busy:.0%} of a core while it could not accept"
        proc.stdin.write("free\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        for c in clients:  # every one is served once descriptors are back
            assert c.recv(1000).startswith(b"HTTP/1.1 200"), "a connection was not served"
        lines = [x for x in log().splitlines() if "out of descriptors" in x]
        assert len(lines) == LOG_BURST and "HTTP port: out of descriptors (Too many open files)" in lines[0]
        proc.stdin.write("stop\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        assert proc.wait(RPC_TIMEOUT) == 0, log()
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()


# === in-process shard: refusals over a real channel ======================================================
def _shard(tmp_path, http: bool = False, **limits) -> InThreadShard:
    service = shard_of(CFG, "nano", 0, 1, min_workers=2, chunk_bytes=256, limits=Limits(**limits))
    return InThreadShard(service, tmp_path, GOOD_FP, http=http)


@pytest.fixture
def make_shard(tmp_path, shards):
    """In-process shards of one shard with these limits (the nano run's), shut down after the test."""
    return lambda **kw: shards.add(_shard(tmp_path, **kw))


def test_a_session_without_hello_is_ended_at_its_deadline_and_sessions_over_the_cap_are_refused(make_shard):
    s = make_shard(hello_timeout=1.0, max_sessions_per_peer=2, max_sessions=4)
    t0 = time.monotonic()
    quiet = [s.open_session(None) for _ in range(2)]
    s.wait_for(lambda: s.service.gates.sessions.held == 2, "two sessions to be counted")
    over = s.open_session(None).error()
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert over.details() == "sessions from 127.0.0.1 are at their limit of 2 per address"
    for q in quiet:
        e = q.error()
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert e.details() == "a session must start with Hello within 1 s"
    assert 1.0 <= time.monotonic() - t0 <= 1.0 + SLACK
    s.wait_for(lambda: s.service.gates.sessions.held == 0, "the sessions to be let go")
    w = s.worker("a")  # room again: a worker that says Hello at once is not held to anything
    assert w.welcome is not None
    assert s.status()["bounds"]["refused"] == {"sessions": 1, "no_hello": 2}


def test_http_connections_over_the_caps_are_closed_at_once_and_the_rest_at_the_header_deadline(make_shard):
    s = make_shard(http=True, header_timeout=1.0, max_http_connections=4, max_http_connections_per_peer=2)
    socks = SilentSockets()
    try:
        socks.open(s.http_port, "127.0.0.2", 3)  # the third is over 2 per address
        socks.open(s.http_port, "127.0.0.3", 2)
        socks.open(s.http_port, "127.0.0.4", 1)  # over 4 in total
        wait_until("every connection to be closed", lambda: socks.poll() == 0, timeout=1.0 + SLACK)
        lives = sorted(socks.lifetimes(s.http_port))
        assert all(t < 0.9 for t in lives[:2]) and all(0.9 <= t <= 1.0 + SLACK for t in lives[2:]), lives
    finally:
        socks.close()
    # room again: a whole request is answered; headers that do not end are cut at the deadline
    with socket.create_connection(("127.0.0.1", s.http_port), timeout=RPC_TIMEOUT) as ok:
        ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.recv(1000).startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", s.http_port), timeout=RPC_TIMEOUT) as partial:
        t0 = time.monotonic()
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        assert partial.recv(1000) == b""
        assert 0.9 <= time.monotonic() - t0 <= 1.0 + SLACK


def test_fetch_refuses_repeated_fragments_and_more_fragments_than_the_run_has(make_shard):
    s = make_shard()
    for fragments, words in (
        ([0] * 20000, "a Fetch names at most the run's 3 fragments, got 20000"),
        ([1, 0, 1], "fragment 1 is named twice: name each fragment once"),
    ):
        with pytest.raises(grpc.RpcError) as e:
            s.fetch(fragments)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == words
    assert len(s.fetch([2, 0, 1])) > 3  # each once, in any order: served
    assert s.service.gates.fetches.held == 0


def test_a_4_mib_codec_name_is_not_echoed_into_the_reply_or_the_log(make_shard, caplog):
    s = make_shard()
    a = s.worker("a")
    msgs = push_messages(encode(_delta(s), "e3m0", 128))
    # 4 MiB: a 40 MiB message is over what the shard receives at all (tests/test_trust_slots.py)
    msgs[0].push.chunk.codec = "x" * (4 << 20)
    with caplog.at_level(logging.INFO, logger="streamdiloco"):
        a.push(msgs[:1])
        r = a.session.result()
    assert not r.accepted and r.reason == "bad_codec"
    assert r.message.startswith("fragment 0 round 0 chunk 0: this run's uplink codec is e3m0, got 'xxx")
    assert len(r.message) < 400 and r.message.endswith("characters)")
    assert sum(len(rec.getMessage()) for rec in caplog.records) < 4000


def test_undecodable_messages_get_a_throttled_line_each_kind_and_no_traceback(make_shard, caplog):
    s = make_shard()
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # a field whose length runs past the end
    join = s.channel.unary_unary("/streamdiloco.v1.Shard/Join")
    fetch = s.channel.unary_stream("/streamdiloco.v1.Shard/Fetch")
    with caplog.at_level(logging.INFO):
        for _ in range(50):
            with pytest.raises(grpc.RpcError) as e:
                join(garbage, timeout=RPC_TIMEOUT)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "the JoinRequest (6 bytes) does not parse" in e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                list(fetch(garbage, timeout=RPC_TIMEOUT))
            assert "the FetchRequest (6 bytes) does not parse" in e.value.details()
        session = s.channel.stream_stream("/streamdiloco.v1.Shard/Session")
        with pytest.raises(grpc.RpcError) as e:
            list(session(iter([garbage]), timeout=RPC_TIMEOUT))
        assert "the WorkerMessage (6 bytes) does not parse" in e.value.details()
    lines = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert 1 <= len(lines) <= LOG_BURST, [r.getMessage() for r in lines]
    assert all(r.exc_info is None for r in caplog.records)
    assert s.status()["bad_messages"] == 101


def test_a_push_weight_below_one_token_is_refused(make_shard):
    s = make_shard()
    a, b = s.worker("a"), s.worker("b")
    a.push(push_messages(encode(_delta(s), "e3m0", 128), weight=5e-324))
    r = a.session.result()
    assert not r.accepted and r.reason == "bad_weight"
    assert "push weight must be at least 1 token (it counts the tokens trained on), got 5e-324" in r.message
    assert s.status()["fragments"][0]["contributors"] == []
    b.push(push_messages(encode(_delta(s), "e3m0", 128), weight=1.0))
    assert b.session.result().accepted


def _delta(s: InThreadShard) -> torch.Tensor:
    lo, hi = s.service.state.ranges[0]
    return torch.randn(hi - lo, generator=torch.Generator().manual_seed(1)) * 1e-2


# === the pure pieces =====================================================================================
def test_peer_counts_cap_each_address_and_the_total():
    c = PeerCounts("sessions", total=3, per_peer=2)
    assert c.acquire("a") is None and c.acquire("a") is None
    assert c.acquire("a") == "sessions from a are at their limit of 2 per address"
    assert c.acquire("b") is None
    assert c.acquire("c") == "the shard holds its limit of 3 sessions"
    c.release("a")
    assert c.acquire("c") is None and (c.held, c.by_peer) == (3, {"a": 1, "b": 1, "c": 1})
    for p in ("a", "b", "c"):
        c.release(p)
    assert (c.held, c.by_peer) == (0, {})


def test_the_unread_budget_counts_a_message_queued_to_many_sessions_once():
    b = UnreadBudget(limit=100)
    shared, own = b"u" * 60, b"r" * 30
    for _ in range(5):
        b.add(shared, len(shared))  # one update's bytes, queued to 5 members
    b.add(own, len(own))
    assert b.held == 90 and not b.over
    b.add(b"x" * 20, 20)
    assert b.over
    for _ in range(4):
        b.remove(shared)
    assert b.held == 110
    b.remove(shared)
    assert b.held == 50 and not b.over


def test_throttled_warnings_write_a_few_lines_a_period_and_count_the_rest(caplog):
    now = [0.0]
    t = Throttled(logging.getLogger("test.throttled"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        written = [t.warning("hello", "no Hello from %s", f"10.0.0.{i}") for i in range(100)]
        assert written == [True] * LOG_BURST + [False] * (100 - LOG_BURST)
        assert t.warning("other", "another kind")  # kinds are counted apart
        now[0] = 10.0
        assert t.warning("hello", "no Hello from %s", "10.0.0.200")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == LOG_BURST + 2
    assert (
        msgs[-1] == f"no Hello from 10.0.0.200 ({100 - LOG_BURST} more like it in the last 10 s, not logged)"
    )


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.1.2.3:5678") == "10.1.2.3"
    assert peer_host("ipv6:[2001:db8::1]:443") == "2001:db8::1"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"hello_timeout": 0}, "--hello-timeout must be a number of seconds in (0, 3600], got 0"),
        ({"header_timeout": float("nan")}, "--header-timeout must be a number of seconds"),
        ({"max_sessions": 0}, "--max-sessions must be at least 1, got 0"),
        ({"max_connections": -1}, "--max-connections must be 0 (derived) or positive, got -1"),
        ({"max_sessions_per_peer": 9, "max_sessions": 8}, "cannot be above --max-sessions"),
    ],
)
def test_limits_are_checked_once_with_the_flag_named(kw, words):
    with pytest.raises(ValueError, match=None) as e:
        Limits(**kw)
    assert words in str(e.value)
