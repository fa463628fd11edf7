"""A TCP proxy on loopback that throttles what a client sends: a slow uplink, for faults in the middle of a
push. Runs its own asyncio loop in a thread; `close()` ends every connection it made."""

from __future__ import annotations

import asyncio
import threading


class ThrottledProxy:
    def __init__(self, target_port: int, up_bytes_per_second: float, chunk: int = 1024):
        self.target_port, self.rate, self.chunk = target_port, up_bytes_per_second, chunk
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.bytes_up = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._flowing: asyncio.Event | None = None
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        if not started.wait(10):
            raise RuntimeError("proxy did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, throttle: bool) -> None:
            try:
                while data := await src.read(self.chunk if throttle else 1 << 16):
                    if throttle:
                        await self._flowing.wait()  # type: ignore[union-attr]
                        self.bytes_up += len(data)
                        await asyncio.sleep(len(data) / self.rate)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    def pause(self) -> None:
        """Stop forwarding what the client sends (a link that stalls; the connection stays open)."""
        self.loop.call_soon_threadsafe(self._flowing.clear)  # type: ignore[union-attr]

    def resume(self) -> None:
        self.loop.call_soon_threadsafe(self._flowing.set)  # type: ignore[union-attr]

    def close(self) -> None:
        async def shut() -> None:
            self._flowing.set()  # type: ignore[union-attr]
            self.server.close()
            for w in self._writers:
                w.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self) -> ThrottledProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
