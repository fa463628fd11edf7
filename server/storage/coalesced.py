"""Writes of one part of a checkpoint off the event loop, coalesced: at most one write in flight, each of the
part's latest state, and a caller that must not answer before what it changed is on disk awaits `durable()`
(without blocking the loop) instead of writing it itself.

The part counts its changes (`version()`); `durable()` returns once a write of a state at least that new
has finished: the write in flight if it started late enough, else the next one, which the first waiter
starts, with the state as it is then, and every later waiter shares. So a burst of N changes costs one or
two writes, not N, and an ask that changed nothing costs none. The snapshot is taken on the loop (it must be
a cheap copy); encoding and writing run on `submit`'s thread.

What this module must not do: know what the part is, or write anything itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

log = logging.getLogger("streamdiloco.shard")

S = TypeVar("S")


class CoalescedWrites(Generic[S]):
    """One part's writes (see the module's docstring): `version()` its change count, `snapshot()` a copy of
    its state (on the loop), `write(snapshot)` on `submit`'s thread (False: it failed)."""

    def __init__(
        self,
        version: Callable[[], int],
        snapshot: Callable[[], S],
        write: Callable[[S], bool],
        submit: Callable[[Callable[[S], bool], S], Future],
    ):
        self.version, self.snapshot, self.write, self.submit = version, snapshot, write, submit
        self.saved = version()  # the change count the last finished write had
        self.writes = 0  # finished writes
        self.failures = 0
        self._inflight: asyncio.Future[bool] | None = None

    @property
    def dirty(self) -> bool:
        return self.saved < self.version()

    async def durable(self) -> bool:
        """Once the state as it is now is written (False: a write failed)."""
        target = self.version()
        while self.saved < target:
            if self._inflight is None:
                self._inflight = asyncio.ensure_future(self._write())
            if not await asyncio.shield(self._inflight):  # a cancelled caller leaves the write going
                return False
        return True

    def kick(self) -> None:
        """Start a write of the latest state if it changed and none is in flight (nobody waits for it)."""
        if self.dirty and self._inflight is None:
            self._inflight = asyncio.ensure_future(self._write())

    async def settled(self) -> None:
        """Until no write is in flight (before another writer, such as the last checkpoint, writes)."""
        while (inflight := self._inflight) is not None:
            await asyncio.shield(inflight)

    async def _write(self) -> bool:
        version, snap = self.version(), self.snapshot()
        try:
            ok = bool(await asyncio.wrap_future(self.submit(self.write, snap)))
        except Exception:  # noqa: BLE001 - the writer logs its own errors; this is one it did not expect
            log.exception("a checkpoint write failed")
            ok = False
        finally:
            self._inflight = None
        if ok:
            self.saved = max(self.saved, version)
            self.writes += 1
        else:
            self.failures += 1
        return ok
