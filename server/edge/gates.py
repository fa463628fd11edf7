"""The bounds on calls at a shard's gRPC edge, in one object per process: the sessions and Fetch calls held
(in all and per peer address), the calls waiting for their request (the gRPC server's interceptor,
server/edge/slots.py), what was refused by kind (/api/status and /metrics show it), and the throttled log of
what clients can make the shard warn about.

Built from the limits when the process starts, before the shard itself (the shard of `--init from-worker`
is built from the first worker's upload while the interceptor already counts), and shared by the pending
shard and the running one. What it must not do: look at what a request says.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from streamdiloco.server.edge.slots import WaitingCalls
from streamdiloco.server.edge.wiring import peer_counts
from streamdiloco.server.trust.bounds import Limits, PeerCounts, peer_host
from streamdiloco.server.trust.throttle import Throttled

log = logging.getLogger("streamdiloco.shard")


class Gates:
    """See the module's docstring."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.refused: dict[str, int] = {}  # calls refused by a bound, by kind
        self.sessions, self.fetches = peer_counts(limits)
        self.waiting = WaitingCalls(limits, self.refused)  # the gRPC server's interceptor
        self.throttled = Throttled(log)  # warnings a client can cause: a few lines per kind per period

    def count(self, kind: str) -> None:
        """One more call refused for `kind`."""
        self.refused[kind] = self.refused.get(kind, 0) + 1

    @contextlib.asynccontextmanager
    async def holding(self, counts: PeerCounts, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """One of `counts` (sessions or Fetch calls) held for the call's peer while the call runs, or the
        call refused (RESOURCE_EXHAUSTED)."""
        peer = peer_host(context.peer())
        if (why := counts.acquire(peer)) is not None:
            self.count(counts.what)
            self.throttled.warning(counts.what, "refused a call: %s", why)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        try:
            yield
        finally:
            counts.release(peer)
