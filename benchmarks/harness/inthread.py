"""A shard serving in a thread of this process: `ThreadShard`, the real gRPC server (server/main.py's
`serve`) on an event loop of its own, for the benchmarks that count what a shard sees (benchmarks/bytes.py)
and for the tests that drive one by hand (tests/support/inthread.py builds its InThreadShard on it).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from streamdiloco.common.tls import ServerTLS
from streamdiloco.server.main import serve
from streamdiloco.server.observe.run_view import Peers
from streamdiloco.server.shard import Shard

START_WAIT = 20.0  # seconds for the shard to bind its ports
WAIT = 5.0  # seconds for a read on the shard's loop, or a condition waited for


class ThreadShard:
    """`service` served on 127.0.0.1, port `port` (0: any), on an event loop in a thread of its own; with
    `http`, its HTTP app too (on any port); with `tls`, both over TLS; `peers`: the run's shards for its
    dashboard's run view. `target` is HOST:PORT for a channel; `close()` stops it."""

    def __init__(
        self,
        service: Shard,
        workdir: Path,
        port: int = 0,
        http: bool = False,
        tls: ServerTLS | None = None,
        peers: Peers | None = None,
    ):
        self.service = service
        self.tls, self.peers = tls, peers
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        self.failure: BaseException | None = None
        ready = workdir / f"ready-{id(self)}-{time.monotonic_ns()}.json"
        self.thread = threading.Thread(target=self._run, args=(str(ready), port, http), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_WAIT
        while not ready.exists():
            if self.failure is not None:
                raise RuntimeError(f"the shard failed to start: {self.failure!r}")
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the shard did not start")
            time.sleep(0.01)
        ports = json.loads(ready.read_text())
        self.port, self.http_port = ports["grpc_port"], ports["http_port"]
        self.target = f"127.0.0.1:{self.port}"

    def _run(self, ready: str, port: int, http: bool) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.stop = asyncio.Event()
            where: dict[str, Any] = dict(host="127.0.0.1", port=port, http_port=0 if http else None)
            config = replace(self.service.config, **where, ready_file=ready, tls=self.tls, peers=self.peers)
            await serve(self.service, config, self.stop)

        try:
            self.loop.run_until_complete(main())
        except BaseException as e:  # noqa: BLE001 - reported by whoever waits for the shard
            self.failure = e
        finally:  # as asyncio.run does: end what is left (the shard's own cancelled tasks), then close
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def on_loop(self, fn: Any, timeout: float = WAIT) -> Any:
        """fn() run on the shard's loop (its state's one writer): a consistent read."""

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def counters(self, name: str) -> tuple[int, int]:
        """(message bytes in, out) of the open member `name`: serialized protobuf, as status reports them."""

        def read() -> tuple[int, int]:
            m = self.service.roster.open[name]
            return m.msg_in, m.msg_out

        return self.on_loop(read)

    def close(self, timeout: float = 15.0) -> None:
        """Stop serving and wait for the thread; RuntimeError if it does not stop or the shard failed."""
        if self.stop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise RuntimeError("the shard did not stop")
        if self.failure is not None:
            raise RuntimeError(f"the shard failed: {self.failure!r}")
