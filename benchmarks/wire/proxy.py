"""Part (a)'s counting proxies: TCP proxies on 127.0.0.1, one per shard, run by an asyncio loop in a
background thread of the benchmark's process, that count every byte each way and parse the HTTP/2 frames and
gRPC messages they forward, so that the bytes split into the codec's payload and scales, protobuf fields,
gRPC's 5-byte prefixes, HTTP/2 frame headers, HEADERS, flow control, pings and settings, and the Join and
Fetch calls.

A parser error never breaks the forwarding (it is recorded in `H2Side.error`); the proxy never changes,
delays or drops a byte. A proxy sees the TCP payload only: TCP/IP headers are not in its figures.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from streamdiloco.protos import streamdiloco_pb2 as pb

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
    """One proxied connection: its two directions and the RPC of each stream (from its first message)."""

    def __init__(self, target: str):
        self.target = target
        self.kinds: dict[int, str] = {}
        self.up, self.down = H2Side(self, True), H2Side(self, False)
        self.open = True

    def close(self) -> None:
        """Both ends are gone: nothing more will be counted."""
        self.open = False

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
                conn.close()
                return
            try:
                await asyncio.gather(self._pump(reader, uw, conn.up), self._pump(ur, writer, conn.down))
            except asyncio.CancelledError:  # stop(): end quietly (asyncio's server callback reads our result)
                pass
            finally:
                conn.close()
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
