"""Bounds on gRPC calls before their request has arrived: the slots a client can hold without a token.

Join, Fetch and Pieces take one request message, and Initialize a stream whose first message says who
sends it; gRPC itself would read that message before the handler runs, with no deadline, and hold one of
the server's `maximum_concurrent_rpcs` slots meanwhile: streams that never send it froze every new call.
`WaitingCalls`, a server interceptor, reads it instead, as the first message of a stream:
- it must come within `--request-timeout` seconds of the call's start (DEADLINE_EXCEEDED);
- it must be within its method's size (REQUEST_BYTES), checked before it is parsed (RESOURCE_EXHAUSTED);
  the server's own limit on every message (`receive_limit`) is what the largest legitimate message needs,
  a push's chunk or an upload's first message, not 64 MiB;
- calls waiting for it are counted per address (an IPv6 /64): past `--max-waiting-calls-per-peer`, a new
  one is refused (RESOURCE_EXHAUSTED naming the limit); and in all: past `--max-waiting-calls`, one is ended
  (RESOURCE_EXHAUSTED, which a worker's Join, Fetch and Pieces retry with backoff) to make room for the new
  one, so that the server's slots (sized in server/main.py to hold these, the sessions and the Fetches)
  never run out. The one ended is the oldest of the address holding the most waiting calls (server/trust/
  bounds.py's Crowd: among addresses holding as many, of the network, an IPv4 /24 or an IPv6 /48, holding
  the most). A worker's call alone at its address is therefore never ended by a flood from fewer addresses
  than --max-waiting-calls (one of them holds two), however slowly its request arrives within
  --request-timeout; and a flood from more addresses of one /24 or /48 ends its own calls before one alone
  in its network. What this cannot do is spare a call whose request has started to arrive: gRPC hands the
  interceptor whole messages only, so a call whose first bytes are in looks like one that sent nothing.

What it must not do: look at what a request says (the servicer does), or hold a call once its request is
in. Session is not here: its Hello has its own deadline and its streams their own caps
(server/edge/service.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from streamdiloco.server.trust.bounds import Crowd, Limits, PeerCounts, address_group, peer_host
from streamdiloco.server.trust.throttle import Throttled

log = logging.getLogger("streamdiloco.shard")

# bytes of each method's request (Initialize: its first message): Join's and Initialize's carry a model
# fingerprint (about 100 bytes per parameter tensor: well under 1 MiB for a 10B-parameter model), and
# Initialize's up to 4 MiB of values beside it (server/edge/initialize.py's MAX_INIT_CHUNK)
MAX_FINGERPRINT_BYTES = 4 << 20
REQUEST_BYTES = {
    "Join": MAX_FINGERPRINT_BYTES,
    "Fetch": 64 << 10,  # the fragments (at most the run's), an offset, a token
    "Pieces": 64 << 10,  # a token, a hash, at most 64 + 64 piece ids
    "Initialize": MAX_FINGERPRINT_BYTES + (4 << 20),
}
MESSAGE_SLACK = 64 << 10  # a push's chunk beyond its payload and scales: its header and fields


def receive_limit(push_bytes: int) -> int:
    """The server's limit on any message it receives: the largest of a push's chunk (`push_bytes`: its
    payload and scales at most) and the requests above."""
    return max(push_bytes + MESSAGE_SLACK, *REQUEST_BYTES.values())


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class _Waiter:
    """One call waiting for its request; `evicted` is set when the total cap ends it."""

    def __init__(self, peer: str):
        self.peer = peer
        self.evicted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.released = False
        self.crowded = 0  # the calls its address held when it was ended to make room


class WaitingCalls(grpc.aio.ServerInterceptor):
    """The interceptor (see the module's docstring). `refused`: where refusals are counted, by kind (the
    service's, shown in /api/status under bounds)."""

    def __init__(self, limits: Limits, refused: dict[str, int] | None = None):
        self.timeout = limits.request_timeout
        self.total = limits.max_waiting_calls
        # the total is not refused but made room for (one ends): PeerCounts' own total never binds
        self.counts = PeerCounts(
            "calls waiting for their request", limits.max_waiting_calls + 1, limits.max_waiting_calls_per_peer
        )
        self.refused = refused if refused is not None else {}
        self.throttled = Throttled(log)
        self._waiting: Crowd[_Waiter] = Crowd()  # by address: which one makes room

    @property
    def held(self) -> int:
        return self.counts.held

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if isinstance(method, bytes):
            method = method.decode(errors="replace")
        name = method.rpartition("/")[2]
        if handler is None or name not in REQUEST_BYTES:
            return handler
        return self.wrap(name, handler)

    def wrap(self, name: str, h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler as a stream-request one whose first message is read here (raw bytes, checked, then
        parsed by the method's own deserializer)."""
        parse = h.request_deserializer or (lambda b: b)
        ser = h.response_serializer

        async def first(requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext) -> Any:
            data, it = await self.receive(name, requests, context)
            return parse(data), it

        if not h.request_streaming and not h.response_streaming:

            async def unary_unary(requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext) -> Any:
                request, _ = await first(requests, context)
                return await h.unary_unary(request, context)

            return grpc.stream_unary_rpc_method_handler(unary_unary, response_serializer=ser)
        if not h.request_streaming:

            async def unary_stream(requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext):
                request, _ = await first(requests, context)
                async with contextlib.aclosing(h.unary_stream(request, context)) as replies:
                    async for reply in replies:  # closed with the call: the handler's finally runs now
                        yield reply

            return grpc.stream_stream_rpc_method_handler(unary_stream, response_serializer=ser)

        async def rest(head: Any, it: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            yield head
            async for data in it:
                yield parse(data)

        if not h.response_streaming:

            async def stream_unary(requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext) -> Any:
                return await h.stream_unary(rest(*await first(requests, context)), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=ser)

        async def stream_stream(requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext):
            replies = h.stream_stream(rest(*await first(requests, context)), context)
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    yield reply

        return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=ser)

    async def receive(
        self, name: str, requests: AsyncIterable[bytes], context: grpc.aio.ServicerContext
    ) -> tuple[bytes, AsyncIterator[bytes]]:
        """The call's first message, within the deadline and its method's size, and the iterator of the
        rest; or the call is ended."""
        peer = peer_host(context.peer())
        waiter = await self._take_slot(peer, context)
        it = requests.__aiter__()  # not before: gRPC's reader of the stream starts with it
        recv = asyncio.ensure_future(it.__anext__())
        recv.add_done_callback(_retrieve)  # one given up on may still end (the stream's end) later
        try:
            done, _ = await asyncio.wait(
                {recv, waiter.evicted}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:  # the call was cancelled
            recv.cancel()
            raise
        finally:
            self._release(waiter)
        if recv not in done:
            recv.cancel()
            if waiter.evicted.done():
                await self._refuse(
                    context,
                    "evicted",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the shard holds its limit of {self.total} calls waiting for their request "
                    f"(--max-waiting-calls), and {address_group(waiter.peer)} held the most of them "
                    f"({waiter.crowded}): try again",
                )
            await self._refuse(
                context,
                "no_request",
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"a {name} call must send its request within {self.timeout:g} s (--request-timeout)",
            )
        try:
            data = recv.result()
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {name} call ended before its request")
        limit = REQUEST_BYTES[name]
        if len(data) > limit:
            await self._refuse(
                context,
                "request_size",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a {name} request of {len(data):,} bytes is over its limit of {limit:,}",
            )
        return data, it

    async def _take_slot(self, peer: str, context: grpc.aio.ServicerContext) -> _Waiter:
        """A waiting call's slot for the peer (past the total, another call ends: Crowd.crowded), or the
        call is refused (past the peer's own limit)."""
        if (why := self.counts.acquire(peer)) is not None:
            await self._refuse(context, self.counts.what, grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        waiter = _Waiter(peer)
        self._waiting.add(waiter, peer)
        while len(self._waiting) > self.total:  # room for this one: the crowded address's oldest ends
            victim = self._waiting.crowded(sparing=waiter)
            assert victim is not None  # the total is at least 1: another call is held
            victim.crowded = self._waiting.held_from(victim.peer)
            self._release(victim)
            victim.evicted.set_result(None)
        return waiter

    def _release(self, waiter: _Waiter) -> None:
        if not waiter.released:
            waiter.released = True
            self.counts.release(waiter.peer)
            self._waiting.discard(waiter)

    async def _refuse(
        self, context: grpc.aio.ServicerContext, kind: str, code: grpc.StatusCode, why: str
    ) -> None:
        self.refused[kind] = self.refused.get(kind, 0) + 1
        self.throttled.warning(kind, "ended a call from %s: %s", peer_host(context.peer()), why)
        await context.abort(code, why)
