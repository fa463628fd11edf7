"""A running shard: one object, `Shard`, that builds and holds the shard's parts from its `ShardConfig`
(server/config.py) and its state: who is here (the roster), what waits to be written (the outbox), what the
sessions send (the intake), the round runner, the contribution credits and shard 0's data pieces (each
restored from the checkpoint and registered with it), the counters, the dashboard's data, the status and
the metrics. It owns the wiring between them (an update goes to every session; a closing round makes the
pushes still arriving for it late; a push makes its round's close due), the tick, and the reloads of the
credentials.

The gRPC servicer (server/edge/service.py) answers calls over a Shard; status and metrics read the parts
they need (server/observe/status.py's Observed). What this module must not do: answer a call, or decide
what a round does (ShardState, server/rounds/, does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import grpc

from streamdiloco.common.codecs import get_codec
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.edge.gates import Gates
from streamdiloco.server.edge.intake import Intake
from streamdiloco.server.edge.outbox import Outbox
from streamdiloco.server.edge.pieces import LEDGER_WRITER, PieceDesk
from streamdiloco.server.edge.service import ShardService, add_to_server
from streamdiloco.server.edge.wiring import chunk_sizes, unread_budget
from streamdiloco.server.observe.counters import Counters
from streamdiloco.server.observe.dashboard import DashboardData
from streamdiloco.server.observe.metrics import ShardMetrics
from streamdiloco.server.observe.status import Observed, ShardStatus
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.runner import COMPUTE_THREADS, RoundRunner
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.server.storage.coalesced import CoalescedWrites
from streamdiloco.server.storage.credits import Credits
from streamdiloco.server.storage.ledger import Ledger, Pin
from streamdiloco.server.storage.ledgerstate import from_state as ledger_from_state
from streamdiloco.server.storage.ledgerstate import snapshot as ledger_snapshot
from streamdiloco.server.storage.ledgerstate import to_state as ledger_state
from streamdiloco.server.trust.auth import Identity
from streamdiloco.server.trust.roster import Member, Roster

log = logging.getLogger("streamdiloco.shard")

PENDING_PER_SESSION = 4  # Joins not yet followed by a Session: at most this many per --max-sessions
CREDITS_SECONDS = 10.0  # the contribution credits are written at most this often while they change


class Chunks(NamedTuple):
    """Values per message of about --chunk-bytes: a push's (uplink codec), an update's (downlink codec) and
    a Fetch's (fp32) chunks."""

    up: int
    down: int
    fetch: int


class Shard:
    """A running shard (see the module's docstring). `fingerprint`: the model's, that workers must match;
    `checkpoint`: where the state is kept (None: nowhere); `gates`: the bounds on calls (shared with the
    pending shard of --init from-worker, which builds this one from the first upload); `init_hash`: the
    run's starting parameters' hash, said at Join (--init from-worker)."""

    def __init__(
        self,
        config: ShardConfig,
        state: ShardState,
        fingerprint: dict,
        checkpoint: ShardCheckpoint | None = None,
        gates: Gates | None = None,
        init_hash: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.state, self.fingerprint, self.clock = config, state, fingerprint, clock
        self.checkpoint = checkpoint
        self.serving = False  # gRPC listens (run()): /readyz
        self.gates = gates = gates or Gates(config.limits)
        self.init_hash = init_hash or (checkpoint.init_hash if checkpoint is not None else "")
        if state.restored_members:  # restarted: the checkpoint's members are waited for a while
            state.expect_back(clock() + state.round_timeout)
        self.chunks = Chunks(*chunk_sizes(state.cfg, config.server.chunk_bytes))
        max_pending = PENDING_PER_SESSION * config.limits.max_sessions  # Joins never followed by a Session
        self.roster = Roster(state, config.auth, max_pending)  # Joins, sessions and members, one truth
        unread = unread_budget(state.cfg, state.ranges, config.limits)  # what waits for members to read it
        self.outbox = Outbox(self.roster, unread, gates.throttled)  # the sessions' queues, backpressure
        self.counters = Counters()
        self.dashboard = DashboardData()  # closed rounds, samples and workers' progress, over time
        self.credits = self._credits()  # who gave what (server/storage/credits.py)
        self.pieces = self._pieces() if state.shard == 0 else None  # the data ledger's desk
        pool = ThreadPoolExecutor(COMPUTE_THREADS, thread_name_prefix="shard-compute")
        parts = Observed(
            state, self.roster, self.counters, gates, unread, checkpoint, self.credits, self.pieces,
            self.dashboard, pool, clock, lambda: self.ready,
        )  # fmt: skip
        self.view, self.metrics = ShardStatus(parts), ShardMetrics(parts)  # status JSON, /metrics
        # closes and folds rounds on its pool; owns the shard's way down (stopping, fatal)
        self.runner = RoundRunner(
            state, checkpoint, self.metrics, self.dashboard, self.chunks.down, self._deliver,
            self._closing, clock, self.credits, pool,
        )  # fmt: skip
        # what a session's worker sends after Hello: Ready and pushes, checked and handed off
        self.intake = Intake(
            state, self.roster, self.outbox, self.counters, self.metrics, self.dashboard, gates.throttled,
            self.runner.close_due, clock, self.credits,
        )  # fmt: skip
        self._credits_saved: tuple[float, Future | None] = (clock(), None)  # the last write, and its job
        self.view.sample()

    # --- parts restored from the checkpoint, and registered with it ----------------------------------------
    def _credits(self) -> Credits:
        """The contribution credits as the checkpoint saved them (else new ones), with the rounds the
        checkpoint's load replayed credited unless they had them; saved with the rest of the checkpoint."""
        ckpt, nfrag = self.checkpoint, self.state.layout.num_fragments
        if ckpt is None:
            return Credits(nfrag)
        try:
            saved = ckpt.restored("credits")
            credits = Credits(nfrag) if saved is None else Credits.from_state(saved, nfrag)
            for fragment, round, credit, why in ckpt.replayed:
                credits.replayed(fragment, round, credit, why)
        except ValueError as e:
            raise ValueError(f"checkpoint {ckpt.dir}: credits.json: {e}; use --fresh") from None
        ckpt.register("credits", lambda: credits.to_state(self.clock()))
        return credits

    def _pieces(self) -> PieceDesk:
        """Shard 0's data ledger, as its checkpoint saved it (else a new one; the operator's pinned dataset
        bound), and its Pieces calls; the ledger is written (coalesced, off the loop) when it changed."""
        ckpt, settings = self.checkpoint, self.config.pieces
        piece_tokens = settings.piece_tokens
        pinned = Pin(settings.data_sha256, settings.data_tokens) if settings.pinned else None  # --data-sha256
        saved = ckpt.restored("ledger") if ckpt is not None else None
        if saved is None:
            ledger = Ledger(piece_tokens, pinned=pinned)
        else:
            try:
                ledger = ledger_from_state(
                    saved, piece_tokens, self.clock(), orphan_seconds=self.state.round_timeout, pinned=pinned
                )
            except ValueError as e:
                raise ValueError(f"checkpoint {ckpt.dir if ckpt else ''}: ledger.json: {e}") from None
        if ckpt is None:
            return PieceDesk(ledger, self.roster, self.credits, self.state)
        ckpt.register("ledger", lambda: ledger_state(ledger) if ledger.dataset is not None else None)
        writes = CoalescedWrites(
            lambda: ledger.changes,
            lambda: ledger_snapshot(ledger),
            lambda snap: ckpt.save_part("ledger", snap.to_state()),
            LEDGER_WRITER.submit,
        )
        return PieceDesk(ledger, self.roster, self.credits, self.state, writes)

    def _save_credits(self) -> None:
        """Write the contribution credits on the pool if they changed, at most every CREDITS_SECONDS (and
        one write at a time); a stop writes them with the rest, and every whole state of a fragment before
        it."""
        ckpt, now = self.checkpoint, self.clock()
        if ckpt is None or not self.credits.changed or self.runner.down:
            return
        last, saving = self._credits_saved
        if (saving is not None and not saving.done()) or now - last < CREDITS_SECONDS:
            return
        job = self.runner.pool.submit(ckpt.save_part, "credits", self.credits.to_state(now))
        self._credits_saved = (now, job)

    # --- serving --------------------------------------------------------------------------------------------
    def attach(self, server: grpc.aio.Server) -> None:
        """Serve the shard's calls on `server` (server/edge/service.py's servicer)."""
        add_to_server(ShardService(self), server)

    @property
    def push_bytes(self) -> int:
        """The largest push chunk a worker may send (gRPC's receive limit is sized from it)."""
        cfg = self.state.cfg
        return get_codec(cfg.uplink_codec).encoded_nbytes(self.chunks.up, cfg.codec_block_size)

    async def started(self, stop: asyncio.Event, waiting: Callable[[], Awaitable[None]]) -> Shard | None:
        """The shard that serves once gRPC listens: this one, its starting state in its checkpoint (it waits
        for nothing: `waiting` is the pending shard's)."""
        if self.checkpoint is not None:  # a new run's starting state (or an old format's, hashed)
            self.checkpoint.write_initial(self.state)
        return self

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set or a round job fails (then OSError): ticking, and at the end the jobs
        still out drained, so that the last checkpoint is whole. The caller stops gRPC first (`stopping`)."""
        self.serving = True
        tick = asyncio.create_task(self.tick())
        try:
            await _first(stop.wait(), self.runner.failed.wait())
        finally:
            self.runner.stop()  # sessions end now: that must not close rounds with partial pushes
            tick.cancel()

    async def finish(self) -> None:
        """After gRPC stopped: wait for the jobs still out, then write the whole checkpoint (OSError if a
        job or a checkpoint failed: the shard stopped for it)."""
        await self.runner.drain()  # jobs still out give their fragments back: the checkpoint is whole
        if self.pieces is not None:
            await self.pieces.settled()  # the ledger's write in flight goes first: the last one is newer
        if self.runner.fatal:
            raise OSError(self.runner.fatal)
        if self.checkpoint is not None and self.checkpoint.save_all(self.state):
            log.info("shard %d: checkpoint written to %s", self.state.shard, self.checkpoint.dir)

    # --- sessions -------------------------------------------------------------------------------------------
    def open_session(self, member: Member, hello: pb.Hello, identity: Identity) -> None:
        """A session that said Hello: on the roster (Refused if its session id or name does not hold), in the
        credits, and a member at once unless it comes passive (then Ready makes it one)."""
        self.roster.hello(member, hello.session, identity, self.clock())
        self.credits.connected(member.name, identity.via, self.clock())
        if hello.passive:
            log.info(
                "%s connected, passive until it is ready (%d sessions)", member.name, len(self.roster.open)
            )
        else:
            self.intake.activate(member)

    def close_session(self, member: Member) -> None:
        """A session that ended: its queue dropped, its pushes under way forgotten, off the roster (a shard
        on its way down keeps it a member for its checkpoint), and any round it held due now."""
        self.outbox.close(member)
        self.intake.forget(worker=member.name)
        self.roster.leave(member, self.runner.stopping)
        self.credits.disconnected(member.name, self.clock())
        log.info("%s left (%d members)", member.name, len(self.state.members))
        self.close_due()

    # --- the wiring between the parts ----------------------------------------------------------------------
    def _deliver(self, messages: list[bytes], nbytes: int) -> None:
        """A closed round's update messages, the same bytes to every session."""
        for m in self.roster.sessions():
            for data in messages:
                self.outbox.send(m, data)
            self.counters.codec_out += nbytes

    def _closing(self, fragment: int) -> None:
        self.intake.forget(fragment=fragment)  # pushes still arriving for the closed round are late now

    def close_due(self, pushed: int | None = None) -> None:
        """Start closing the rounds that are due (the round runner)."""
        self.runner.close_due(pushed)

    @property
    def ready(self) -> bool:
        """Serving, with its state loaded, and not on its way down."""
        return self.serving and not self.runner.down

    # --- credentials ----------------------------------------------------------------------------------------
    def reload_credentials(self, force: bool = False) -> None:
        """Re-read the workers file if it changed (or `force`: SIGHUP); end the sessions of the workers
        whose credential it revoked. A file that does not parse changes nothing (one error line)."""
        wf = self.config.workers_file
        if wf is None or not (force or wf.changed()):
            return
        try:
            workers = wf.load()
        except ValueError as e:
            log.error("keeping the credentials as they were: %s", e)
            return
        revoked = self.config.auth.reload(workers)
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

    # --- time -----------------------------------------------------------------------------------------------
    async def tick(self) -> None:
        """Close rounds at their deadlines (the round runner); each second, sample the dashboard's time
        series, re-read the workers file if it changed (a revocation takes effect within a second), write
        the credits if they changed, and let shard 0's data ledger take back lapsed leases."""
        await self.runner.tick(self._each_second)

    def _each_second(self) -> None:
        self.view.sample()
        self.reload_credentials()
        self._save_credits()
        if self.pieces is not None:
            self.pieces.tick(self.clock())


async def _first(*waits: Coroutine) -> None:
    """Until the first of `waits` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
