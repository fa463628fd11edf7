"""The shard's gRPC servicer: it validates each call, translates it from and to protobuf, and hands off.

It holds the running shard (server/shard.py's Shard, which builds and holds the parts) and nothing else of
its own. Who is admitted: server/edge/admission.py (every Join, the pending shard's too). Who is here: the
shard's roster (server/trust/roster.py). What a session's worker sends after Hello: its intake
(server/edge/intake.py). What waits to be written, and the backpressure on it: its outbox
(server/edge/outbox.py). The bounds on calls: its gates (server/edge/gates.py). Join's reply and Fetch's
chunks are made by `join_reply` and `master_chunks` below.

Threads. The asyncio event loop moves messages and owns ShardState: every call that reads or changes it
runs on the loop, so ShardState needs no locks. The arithmetic of a closing round (fold, outer step,
encoding, checkpoint, serializing the update's messages) runs on the round runner's pool, so health,
status and other sessions are answered while a round closes.

Each worker session has one outgoing queue and one writer (the response generator here); a reader task
(Intake.read) takes the worker's messages. A round's update is serialized once, on the job's thread, and
the same bytes are queued to every session (Session's serializer passes bytes through: `rpc_handlers`).
What this module must not do: decide admission, membership or rounds itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import TYPE_CHECKING

import grpc

from streamdiloco.common.wire import values_to_bytes
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.edge.admission import (
    Refusal,
    Undecodable,
    abort,
    admit,
    authenticate,
    credentials,
    fetch_fragments,
    parse,
    short,
)
from streamdiloco.server.edge.pieces import not_here
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.trust.auth import Refused
from streamdiloco.server.trust.bounds import peer_host
from streamdiloco.server.trust.roster import Member

if TYPE_CHECKING:
    import torch

    from streamdiloco.server.shard import Shard

log = logging.getLogger("streamdiloco.shard")

MAX_TOLD_UNCHECKED = 4096  # worker names remembered as told that this shard checks no token (then: throttled)


class ShardService(pb_grpc.ShardServicer):
    """The gRPC servicer over a running shard (server/shard.py): each call validated, translated and handed
    to the shard's parts."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self._told_unchecked: set[str] = set()  # workers told that this shard checks no token (logged once)

    # --- Join ------------------------------------------------------------------------------------------
    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        sh = self.shard
        if isinstance(request, Undecodable):
            await self._undecodable(request, context)
        if sh.runner.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
        try:
            identity = admit(
                sh.config.auth,
                credentials(context, request.token),
                request.worker,
                request.protocol,
                request.fingerprint_json,
                None if request.config_only else sh.fingerprint,
            )
        except Refusal as r:
            self._refused_join(request.worker, r)
            await abort(context, r)
        if request.config_only:  # a worker that takes its settings from the shard asks for them first
            return join_reply(sh.state, init_hash=sh.init_hash)
        try:
            session = sh.roster.join(request.worker, identity, sh.clock(), peer_host(context.peer()))
        except Refused as r:
            await abort(context, r)
        return join_reply(sh.state, session, sh.chunks.up, sh.init_hash)

    def _refused_join(self, worker: str, refusal: Refusal) -> None:
        """Log a refused Join that the worker must fix (throttled; an unchecked token once per name: a
        restart policy retries)."""
        sh = self.shard
        shown, why = short(worker, 60), short(refusal.message, 1000)  # both from the client, escaped
        if refusal.kind == "fingerprint":
            sh.gates.throttled.warning("join", "refused %s at Join: %s", shown, why)
        elif refusal.kind == "unchecked-token" and worker not in self._told_unchecked:
            if len(self._told_unchecked) < MAX_TOLD_UNCHECKED:
                self._told_unchecked.add(worker)
            sh.gates.throttled.warning("unchecked-token", "refused %s at Join: %s", shown, why)

    # --- Session ---------------------------------------------------------------------------------------
    async def Session(
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.ShardMessage | bytes, None]:
        async with self.shard.gates.holding(self.shard.gates.sessions, context):
            async with contextlib.aclosing(self._session(request_iterator, context)) as messages:
                async for msg in messages:
                    yield msg

    async def _undecodable(self, msg: Undecodable, context: grpc.aio.ServicerContext) -> None:
        sh = self.shard
        sh.counters.bad_messages += 1
        peer = peer_host(context.peer())
        sh.gates.throttled.warning(
            "undecodable", "a %s from %s does not parse: %s", msg.kind, peer, msg.error
        )
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the {msg.kind} ({msg.size} bytes) does not parse: {msg.error}"
        )

    async def _session(
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.ShardMessage | bytes, None]:
        sh = self.shard
        it = request_iterator.__aiter__()
        timeout = sh.config.limits.hello_timeout
        try:
            first = await asyncio.wait_for(it.__anext__(), timeout)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            sh.gates.count("no_hello")
            sh.gates.throttled.warning(
                "hello", "ended a session from %s: no Hello within %g s", peer_host(context.peer()), timeout
            )
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"a session must start with Hello within {timeout:g} s"
            )
        if isinstance(first, Undecodable):
            await self._undecodable(first, context)
        if first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a session starts with Hello")
        name = first.hello.worker
        identity = await authenticate(
            sh.config.auth, context, "", name
        )  # the session id alone proves nothing
        member = Member(name, asyncio.Queue(), time.time(), call=asyncio.current_task())
        try:
            sh.open_session(member, first.hello, identity)
        except Refused as r:
            await abort(context, r)
        reader = asyncio.create_task(sh.intake.read(member, it))
        try:
            yield sh.intake.welcome(member)
            while True:
                if member.revoked:
                    await context.abort(
                        grpc.StatusCode.UNAUTHENTICATED, f"the credential of {name} was revoked"
                    )
                if member.overflowed:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the shard's {sh.outbox.unread.limit:,} bytes of messages unread (over all "
                        f"sessions) ran out, and {name} had the most of them",
                    )
                if (taken := await sh.outbox.next(member, reader)) is None:
                    break  # the worker closed its side, the call broke, or the reader failed
                msg, size = taken
                if msg is None or member.overflowed or member.revoked:
                    continue  # a wake-up: it ends the session at the top of the loop
                member.msg_out += size
                sh.counters.msg_out += size
                yield msg
            if reader.done() and not reader.cancelled() and (error := reader.exception()) is not None:
                log.error("session of %s failed", name, exc_info=error)
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"shard error: {type(error).__name__}: {short(str(error))}"
                )
        finally:
            reader.cancel()
            sh.close_session(member)

    # --- Fetch -----------------------------------------------------------------------------------------
    async def Fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.MasterChunk, None]:
        sh = self.shard
        if isinstance(request, Undecodable):
            await self._undecodable(request, context)
        async with sh.gates.holding(sh.gates.fetches, context):
            async with contextlib.aclosing(self._fetch(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.MasterChunk, None]:
        sh = self.shard
        st = sh.state
        if sh.runner.down:  # a master that a failed checkpoint did not save must not go out
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
        await authenticate(sh.config.auth, context, request.token, None)
        try:
            fragments = fetch_fragments(list(request.fragments), request.offset, st.ranges)
        except Refusal as r:
            await abort(context, r)
        for i, f in enumerate(fragments):
            while (closing := sh.runner.closing.get(f)) is not None:  # its master and round are changing
                sh.counters.fetch_waits += 1
                await asyncio.wait({closing})
            start = request.offset if i == 0 else 0  # a master is never changed in place: a snapshot
            for j, msg in enumerate(master_chunks(f, st.round_of(f), st.master(f), start, sh.chunks.fetch)):
                if sh.runner.fatal:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
                if request.describe and i == 0 and j == 0:  # which run this is, once per stream
                    msg.fingerprint_json = json.dumps(sh.fingerprint)
                    msg.shard, msg.num_shards = st.shard, st.num_shards
                sh.counters.fetch_out += msg.ByteSize()
                yield msg

    # --- Pieces ----------------------------------------------------------------------------------------
    async def Pieces(self, request: pb.PiecesRequest, context: grpc.aio.ServicerContext) -> pb.PiecesReply:
        """Shard 0's data ledger (server/edge/pieces.py): authenticated as Fetch is, bound to the caller's
        session."""
        sh = self.shard
        if isinstance(request, Undecodable):
            await self._undecodable(request, context)
        if sh.pieces is None:
            await abort(context, not_here(sh.state.shard, sh.state.num_shards))
        if sh.runner.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
        await authenticate(sh.config.auth, context, request.token, request.worker)
        try:
            return await sh.pieces.answer(request, sh.clock())
        except Refusal as r:
            await abort(context, r)


def join_reply(
    state: ShardState, session: str | None = None, chunk_values: int = 0, init_hash: str = ""
) -> pb.JoinReply:
    """Join's reply: the run's settings and this shard's place in it (and the run's init hash, if the shard
    took a worker's upload); with a session (not for a Join that asks for the settings alone), the shard's
    slices, the open rounds and the values per push chunk too."""
    st = state
    reply = pb.JoinReply(
        config_json=json.dumps(st.cfg.to_dict()),
        shard=st.shard,
        num_shards=st.num_shards,
        init_hash=init_hash,
    )
    if session is not None:
        reply.slices.extend(pb.SliceRange(offset=lo, length=hi - lo) for lo, hi in st.ranges)
        reply.rounds.extend(st.round_of(f) for f in range(st.layout.num_fragments))
        reply.session, reply.chunk_values = session, chunk_values
    return reply


def master_chunks(
    fragment: int, round: int, master: torch.Tensor, start: int, step: int
) -> Iterator[pb.MasterChunk]:
    """A fragment's master slice from value `start` on, as Fetch's chunks of at most `step` values (one
    empty chunk from the end of the slice on)."""
    n = master.numel()
    for lo in range(start, n, step) if start < n else [n]:
        hi = min(n, lo + step)
        yield pb.MasterChunk(
            fragment=fragment,
            round=round,
            offset=lo,
            total=n,
            values=values_to_bytes(master[lo:hi]),
            last=hi == n,
        )


def _serialize(msg: pb.ShardMessage | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def rpc_handlers(service: pb_grpc.ShardServicer) -> dict[str, grpc.RpcMethodHandler]:
    """A servicer's Join, Session, Fetch and Pieces as the generated add_ShardServicer_to_server registers
    them, except that a Session reply may also be bytes already serialized (an update's chunks: serialized
    once per round, the same bytes written to every member). The one table: the pending shard of `--init
    from-worker` (server/edge/initialize.py) takes it for its own methods and adds Initialize."""
    return {
        "Join": grpc.unary_unary_rpc_method_handler(
            service.Join,
            request_deserializer=parse(pb.JoinRequest),
            response_serializer=pb.JoinReply.SerializeToString,
        ),
        "Session": grpc.stream_stream_rpc_method_handler(
            service.Session, request_deserializer=parse(pb.WorkerMessage), response_serializer=_serialize
        ),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            service.Fetch,
            request_deserializer=parse(pb.FetchRequest),
            response_serializer=pb.MasterChunk.SerializeToString,
        ),
        "Pieces": grpc.unary_unary_rpc_method_handler(
            service.Pieces,
            request_deserializer=parse(pb.PiecesRequest),
            response_serializer=pb.PiecesReply.SerializeToString,
        ),
    }


def add_to_server(service: pb_grpc.ShardServicer, server: grpc.aio.Server) -> None:
    name = pb.DESCRIPTOR.services_by_name["Shard"].full_name
    handlers = rpc_handlers(service)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
