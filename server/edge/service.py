"""The shard's gRPC servicer: it validates each call, translates it from and to protobuf, and hands off.

Who is admitted: server/edge/admission.py (every Join, the pending shard's too). Who is here:
server/trust/roster.py (Joins, sessions, members: one truth for the rounds, status and pace). What a session's
worker sends after Hello: server/edge/intake.py (Ready, pushes and their checks). What waits to be written,
and the backpressure on it: server/edge/outbox.py. Closing and folding rounds: server/runner.py, on a small
thread pool beside the loop. The status JSON and the dashboard's series: server/observe/status.py. The sizes
of its traffic (values per chunk, the unread budget, calls per peer): server/edge/wiring.py. The rounds
themselves: ShardState (server/rounds/state.py), pure. Who gave what (pushes, rounds, tokens, time connected,
per identity): server/storage/credits.py, told by the sessions here, the intake and the round runner. Join's
reply and Fetch's chunks are made by `join_reply` and `master_chunks` below.

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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Future
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
from streamdiloco.server.edge.intake import Counters, Intake
from streamdiloco.server.edge.outbox import Outbox
from streamdiloco.server.edge.pieces import PieceDesk, not_here
from streamdiloco.server.edge.wiring import chunk_sizes, peer_counts, staged_budget, unread_budget
from streamdiloco.server.observe.dashboard import DashboardData
from streamdiloco.server.observe.metrics import ShardMetrics
from streamdiloco.server.observe.status import ShardStatus
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.runner import RoundRunner
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.server.storage.credits import STATUS_ROWS, Credits
from streamdiloco.server.storage.ledger import Ledger
from streamdiloco.server.trust.auth import Auth, Refused, WorkersFile
from streamdiloco.server.trust.bounds import Limits, PeerCounts, Throttled, peer_host
from streamdiloco.server.trust.roster import Member, Roster

if TYPE_CHECKING:
    import torch

    from streamdiloco.server.edge.slots import WaitingCalls

log = logging.getLogger("streamdiloco.shard")

PENDING_PER_SESSION = 4  # Joins not yet followed by a Session: at most this many per --max-sessions
MAX_TOLD_UNCHECKED = 4096  # worker names remembered as told that this shard checks no token (then: throttled)
CREDITS_SECONDS = 10.0  # the contribution ledger is written at most this often while it changes


class ShardService(pb_grpc.ShardServicer):
    def __init__(
        self,
        state: ShardState,
        fingerprint: dict,
        token: str = "",
        chunk_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
        checkpoint: ShardCheckpoint | None = None,
        auth: Auth | None = None,
        workers_file: WorkersFile | None = None,
        limits: Limits | None = None,
        piece_tokens: int = 1 << 20,
    ) -> None:
        self.state, self.fingerprint, self.clock = state, fingerprint, clock
        self.auth = auth if auth is not None else Auth(token=token)
        self.workers_file = workers_file  # re-read when it changes (tick) or on SIGHUP: revocation
        self.checkpoint = checkpoint
        self.limits = limits = limits or Limits()
        if state.restored_members:  # restarted: the checkpoint's members are waited for a while
            state.expect_back(clock() + state.round_timeout)
        self.up_chunk, self.down_chunk, self.fetch_chunk = chunk_sizes(state.cfg, chunk_bytes)
        self.unread = unread_budget(state.cfg, state.ranges, limits)  # what waits for members to read it
        state.staging.limit = staged_budget(state.staging, limits)  # what pushes arriving may hold
        self.peer_sessions, self.fetches = peer_counts(limits)
        self.refused: dict[str, int] = {}  # calls refused by a bound, by kind
        self.waiting_calls: WaitingCalls | None = None  # calls before their request (serve() sets it)
        self.throttled = Throttled(log)  # warnings a client can cause: a few lines per kind per period
        self._told_unchecked: set[str] = set()  # workers told that this shard checks no token (logged once)
        # Joins, sessions and members, one truth; Joins never followed by a Session are bounded
        self.roster = Roster(state, self.auth, max_pending=PENDING_PER_SESSION * limits.max_sessions)
        self.outbox = Outbox(self.roster, self.unread, self.throttled)  # the sessions' queues, backpressure
        self.counters = counters = Counters()
        self.dashboard = DashboardData()  # closed rounds, samples and workers' progress, over time
        self.view = ShardStatus(self, self.dashboard)  # the status JSON and the dashboard's series
        self.serving = False  # serve() sets it once gRPC listens: /readyz
        self.credits = self._credits()  # the contribution ledger: who gave what (server/storage/credits.py)
        self._credits_saved = clock()
        self._credits_saving: Future | None = None
        self.metrics = metrics = ShardMetrics(self)
        # closes and folds rounds on its thread pool; owns the shard's way down (stopping, fatal)
        dash, credits = self.dashboard, self.credits
        self.rounds = RoundRunner(
            state, checkpoint, metrics, dash, self.down_chunk, self._deliver, self._closing, clock, credits
        )
        # what a session's worker sends after Hello: Ready and pushes, checked and handed off
        self.intake = Intake(
            state, self.roster, self.outbox, counters, metrics, dash, self.throttled, self.close_due, clock,
            credits,
        )  # fmt: skip
        self.pieces = self._piece_desk(piece_tokens) if state.shard == 0 else None  # the data ledger
        self.init_hash = (
            ""  # --init from-worker: the upload's init hash, said at Join (server/edge/initialize.py)
        )
        self.sample()

    def _piece_desk(self, piece_tokens: int) -> PieceDesk:
        """Shard 0's data ledger, as its checkpoint saved it (else a new one), and its Pieces calls."""
        ckpt = self.checkpoint
        saved = ckpt.ledger_state if ckpt is not None else None
        if saved is None:
            ledger = Ledger(piece_tokens)
        else:
            try:
                ledger = Ledger.from_state(
                    saved, piece_tokens, self.clock(), orphan_seconds=self.state.round_timeout
                )
            except ValueError as e:
                raise ValueError(f"checkpoint {ckpt.dir if ckpt else ''}: ledger.json: {e}") from None
        if ckpt is not None:
            ckpt.ledger = lambda: ledger.to_state() if ledger.dataset is not None else None  # with the rest
        return PieceDesk(ledger, self.roster, ckpt.save_ledger if ckpt is not None else None)

    def _credits(self) -> Credits:
        """The contribution ledger as the checkpoint saved it (else a new one), with the rounds the
        checkpoint's load replayed credited unless it had them; saved with the rest of the checkpoint."""
        ckpt, nfrag = self.checkpoint, self.state.layout.num_fragments
        if ckpt is None:
            return Credits(nfrag)
        try:
            saved = ckpt.credits_state
            credits = Credits(nfrag) if saved is None else Credits.from_state(saved, nfrag)
            for fragment, round, credit, why in ckpt.replayed:
                credits.replayed(fragment, round, credit, why)
        except ValueError as e:
            raise ValueError(f"checkpoint {ckpt.dir}: credits.json: {e}; use --fresh") from None
        ckpt.credits = lambda: credits.to_state(self.clock())
        return credits

    def _save_credits(self) -> None:
        """Write the contribution ledger on the pool if it changed, at most every CREDITS_SECONDS (and one
        write at a time); a stop writes it with the rest, and every whole state of a fragment before it."""
        ckpt, now = self.checkpoint, self.clock()
        if ckpt is None or not self.credits.changed or self.rounds.down:
            return
        saving = self._credits_saving is not None and not self._credits_saving.done()
        if saving or now - self._credits_saved < CREDITS_SECONDS:
            return
        self._credits_saved = now
        self._credits_saving = self.rounds.pool.submit(ckpt.save_credits, self.credits.to_state(now))

    @property
    def ready(self) -> bool:
        """Serving, with its state loaded, and not on its way down."""
        return self.serving and not self.rounds.stopping and not self.rounds.fatal

    # --- Join ------------------------------------------------------------------------------------------
    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        if isinstance(request, Undecodable):
            await self._undecodable(request, context)
        if self.rounds.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
        try:
            identity = admit(
                self.auth,
                credentials(context, request.token),
                request.worker,
                request.protocol,
                request.fingerprint_json,
                None if request.config_only else self.fingerprint,
            )
        except Refusal as r:
            self._refused_join(request.worker, r)
            await abort(context, r)
        if request.config_only:  # a worker that takes its settings from the shard asks for them first
            return join_reply(self.state, init_hash=self.init_hash)
        try:
            session = self.roster.join(request.worker, identity, self.clock())
        except Refused as r:
            await abort(context, r)
        return join_reply(self.state, session, self.up_chunk, self.init_hash)

    def _refused_join(self, worker: str, refusal: Refusal) -> None:
        """Log a refused Join that the worker must fix (throttled; an unchecked token once per name: a
        restart policy retries)."""
        shown, why = short(worker, 60), short(refusal.message, 1000)  # both from the client, escaped
        if refusal.kind == "fingerprint":
            self.throttled.warning("join", "refused %s at Join: %s", shown, why)
        elif refusal.kind == "unchecked-token" and worker not in self._told_unchecked:
            if len(self._told_unchecked) < MAX_TOLD_UNCHECKED:
                self._told_unchecked.add(worker)
            self.throttled.warning("unchecked-token", "refused %s at Join: %s", shown, why)

    # --- Session ---------------------------------------------------------------------------------------
    async def Session(
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.ShardMessage | bytes, None]:
        peer = peer_host(context.peer())
        await self._admit(self.peer_sessions, peer, context)
        try:
            async with contextlib.aclosing(self._session(request_iterator, context)) as messages:
                async for msg in messages:
                    yield msg
        finally:
            self.peer_sessions.release(peer)

    async def _admit(self, counts: PeerCounts, peer: str, context: grpc.aio.ServicerContext) -> None:
        """Take one of `counts` for the peer, or refuse the call (RESOURCE_EXHAUSTED)."""
        if (why := counts.acquire(peer)) is not None:
            self.refused[counts.what] = self.refused.get(counts.what, 0) + 1
            self.throttled.warning(counts.what, "refused a call: %s", why)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)

    async def _undecodable(self, msg: Undecodable, context: grpc.aio.ServicerContext) -> None:
        self.counters.bad_messages += 1
        peer = peer_host(context.peer())
        self.throttled.warning("undecodable", "a %s from %s does not parse: %s", msg.kind, peer, msg.error)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the {msg.kind} ({msg.size} bytes) does not parse: {msg.error}"
        )

    async def _session(
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.ShardMessage | bytes, None]:
        it = request_iterator.__aiter__()
        timeout = self.limits.hello_timeout
        try:
            first = await asyncio.wait_for(it.__anext__(), timeout)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            self.refused["no_hello"] = self.refused.get("no_hello", 0) + 1
            self.throttled.warning(
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
        identity = await authenticate(self.auth, context, "", name)  # the session id alone proves nothing
        member = Member(name, asyncio.Queue(), time.time(), call=asyncio.current_task())
        try:
            self.roster.hello(member, first.hello.session, identity, self.clock())
        except Refused as r:
            await abort(context, r)
        self.credits.connected(name, identity.via, self.clock())
        if first.hello.passive:
            log.info("%s connected, passive until it is ready (%d sessions)", name, len(self.roster.open))
        else:
            self.intake.activate(member)
        reader = asyncio.create_task(self.intake.read(member, it))
        try:
            yield self.intake.welcome(member)
            while True:
                if member.revoked:
                    await context.abort(
                        grpc.StatusCode.UNAUTHENTICATED, f"the credential of {name} was revoked"
                    )
                if member.overflowed:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the shard's {self.unread.limit:,} bytes of messages unread (over all sessions) ran "
                        f"out, and {name} had the most of them",
                    )
                if (taken := await self.outbox.next(member, reader)) is None:
                    break  # the worker closed its side, the call broke, or the reader failed
                msg, size = taken
                if msg is None or member.overflowed or member.revoked:
                    continue  # a wake-up: it ends the session at the top of the loop
                member.msg_out += size
                self.counters.msg_out += size
                yield msg
            if reader.done() and not reader.cancelled() and (error := reader.exception()) is not None:
                log.error("session of %s failed", name, exc_info=error)
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"shard error: {type(error).__name__}: {short(str(error))}"
                )
        finally:
            reader.cancel()
            self.outbox.close(member)
            self.intake.forget(worker=name)
            self.roster.leave(member, self.rounds.stopping)
            self.credits.disconnected(name, self.clock())
            log.info("%s left (%d members)", name, len(self.state.members))
            self.close_due()

    # --- credentials ---------------------------------------------------------------------------------------
    def reload_credentials(self, force: bool = False) -> None:
        """Re-read the workers file if it changed (or `force`: SIGHUP); end the sessions of the workers
        whose credential it revoked. A file that does not parse changes nothing (one error line)."""
        wf = self.workers_file
        if wf is None or not (force or wf.changed()):
            return
        try:
            workers = wf.load()
        except ValueError as e:
            log.error("keeping the credentials as they were: %s", e)
            return
        revoked = self.auth.reload(workers)
        log.info(
            "read %s: %d workers%s", wf.path, len(workers), f", revoked {sorted(revoked)}" * bool(revoked)
        )
        self.revoke(revoked)

    def revoke(self, names: Iterable[str]) -> None:
        """End the sessions of these workers and forget their Joins: they must prove a credential again."""
        for member in self.roster.revoke(names):  # rounds, status and pace let go of them at once
            self.outbox.wake(member)  # its writer ends the session
            log.warning("%s: credential revoked, its session ends", member.name)
        self.close_due()

    def pace(self) -> float:
        """The run's pace: the slowest member's reported seconds per inner step (Roster.pace)."""
        return self.roster.pace()

    @property
    def passive_sessions(self) -> int:
        """Connected workers that are not members yet (joining)."""
        return self.roster.passive

    @property
    def members(self) -> dict[str, Member]:
        """The open sessions by name, those being dropped too (Roster.open; the members are
        roster.members())."""
        return self.roster.open

    def sample(self) -> None:
        """One point of the dashboard's time series: cumulative bytes and the member count."""
        self.view.sample()

    async def tick(self) -> None:
        """Close rounds at their deadlines (the round runner); each second, sample the dashboard's time series
        and re-read the workers file if it changed (a revocation takes effect within a second)."""
        await self.rounds.tick(self._each_second)

    def _each_second(self) -> None:
        self.sample()
        self.reload_credentials()
        self._save_credits()
        if self.pieces is not None:
            self.pieces.tick(self.clock())

    def close_due(self, pushed: int | None = None) -> None:
        self.rounds.close_due(pushed)

    def _deliver(self, messages: list[bytes], nbytes: int) -> None:
        """A closed round's update messages, the same bytes to every session."""
        for m in self.roster.sessions():
            for data in messages:
                self.outbox.send(m, data)
            self.counters.codec_out += nbytes

    def _closing(self, fragment: int) -> None:
        self.intake.forget(fragment=fragment)  # pushes still arriving for the closed round are late now

    # --- Fetch -----------------------------------------------------------------------------------------
    async def Fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.MasterChunk, None]:
        if isinstance(request, Undecodable):
            await self._undecodable(request, context)
        peer = peer_host(context.peer())
        await self._admit(self.fetches, peer, context)
        try:
            async with contextlib.aclosing(self._fetch(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.fetches.release(peer)

    async def _fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.MasterChunk, None]:
        st = self.state
        if self.rounds.down:  # a master that a failed checkpoint did not save must not go out
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
        await authenticate(self.auth, context, request.token, None)
        try:
            fragments = fetch_fragments(list(request.fragments), request.offset, st.ranges)
        except Refusal as r:
            await abort(context, r)
        for i, f in enumerate(fragments):
            while (closing := self.rounds.closing.get(f)) is not None:  # its master and round are changing
                self.counters.fetch_waits += 1
                await asyncio.wait({closing})
            start = request.offset if i == 0 else 0  # a master is never changed in place: a snapshot
            for j, msg in enumerate(master_chunks(f, st.round_of(f), st.master(f), start, self.fetch_chunk)):
                if self.rounds.fatal:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
                if request.describe and i == 0 and j == 0:  # which run this is, once per stream
                    msg.fingerprint_json = json.dumps(self.fingerprint)
                    msg.shard, msg.num_shards = st.shard, st.num_shards
                self.counters.fetch_out += msg.ByteSize()
                yield msg

    # --- Pieces ----------------------------------------------------------------------------------------
    async def Pieces(self, request: pb.PiecesRequest, context: grpc.aio.ServicerContext) -> pb.PiecesReply:
        """Shard 0's data ledger (server/edge/pieces.py): authenticated as Fetch is, bound to the caller's
        session."""
        if isinstance(request, Undecodable):
            await self._undecodable(request, context)
        if self.pieces is None:
            await abort(context, not_here(self.state.shard, self.state.num_shards))
        if self.rounds.down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard is stopping")
        await authenticate(self.auth, context, request.token, request.worker)
        try:
            return self.pieces.answer(request, self.clock())
        except Refusal as r:
            await abort(context, r)

    # --- status ----------------------------------------------------------------------------------------
    def status(self, rounds: int = 20, hashes: bool = True, credits: int = STATUS_ROWS) -> dict:
        """The shard's status as JSON data (server/observe/status.py); `hashes`: each fragment's master hash
        too; `credits`: the contribution ledger's rows listed."""
        return self.view.status(rounds, hashes, credits)

    def series(self, since: float = 0.0) -> dict:
        """The dashboard's time series after `since` (a time.time()), with the values of this moment."""
        return self.view.series(since)

    async def hash_masters(self) -> None:
        await self.view.hash_masters()


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


def add_to_server(service: ShardService, server: grpc.aio.Server) -> None:
    name = pb.DESCRIPTOR.services_by_name["Shard"].full_name
    handlers = rpc_handlers(service)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
