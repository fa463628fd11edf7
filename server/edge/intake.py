"""What a worker sends on its session after Hello, read and handed off: Ready (the member joins the rounds,
through the roster) and pushes, whose chunks are checked here for what ShardState does not check (the codec's
scales, the weight's minimum, the progress a header reports: common/progress.py's check_progress) and handed
to ShardState; every push is answered with a PushResult (through the outbox), and an accepted push's
progress goes to the member's record, the dashboard and the metrics.

What it must not do: write to the network (the outbox queues, the servicer writes), or close rounds itself
(it asks the round runner, `close_due`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from streamdiloco.common.progress import Progress, check_progress, progress_from_proto
from streamdiloco.common.wire import from_chunk
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.edge.admission import Undecodable, short
from streamdiloco.server.edge.outbox import Outbox
from streamdiloco.server.observe.counters import Counters
from streamdiloco.server.observe.dashboard import DashboardData
from streamdiloco.server.observe.metrics import ShardMetrics
from streamdiloco.server.rounds.robust import MIN_WEIGHT
from streamdiloco.server.rounds.state import PushRejected, ShardState
from streamdiloco.server.storage.credits import Credits
from streamdiloco.server.trust.roster import Member, Roster
from streamdiloco.server.trust.throttle import Throttled

log = logging.getLogger("streamdiloco.shard")

MAX_ROUND = 1 << 53


class Intake:
    """A shard's sessions' incoming messages (see the module's docstring)."""

    def __init__(
        self,
        state: ShardState,
        roster: Roster,
        outbox: Outbox,
        counters: Counters,
        metrics: ShardMetrics,
        dashboard: DashboardData,
        throttled: Throttled,
        close_due: Callable[[int | None], None],
        clock: Callable[[], float] = time.monotonic,
        credits: Credits | None = None,
    ) -> None:
        self.state, self.roster, self.outbox, self.counters = state, roster, outbox, counters
        self.metrics, self.dashboard, self.throttled = metrics, dashboard, throttled
        self.close_due, self.clock = close_due, clock
        # the contribution credits: pushes accepted and refused, per worker
        self.credits = credits if credits is not None else Credits(state.layout.num_fragments)
        # (worker, fragment) -> when a push's first chunk came, and the progress and loss its header reported
        self.started: dict[tuple[str, int], tuple[float, Progress, float | None]] = {}

    def forget(self, worker: str | None = None, fragment: int | None = None) -> None:
        """Forget the pushes under way of a worker whose session ended, or of a fragment whose round is
        closing (the rest of them is late)."""
        for key in [k for k in self.started if k[0] == worker or k[1] == fragment]:
            del self.started[key]

    def activate(self, member: Member, from_rounds: list[int] | None = None) -> None:
        self.roster.activate(member, from_rounds)
        log.info("%s joined (%d members)", member.name, len(self.state.members))

    def welcome(self, member: Member) -> pb.ShardMessage:
        st = self.state
        nfrag = st.layout.num_fragments
        return pb.ShardMessage(
            welcome=pb.Welcome(
                rounds=[st.round_of(f) for f in range(nfrag)],
                started=[st.started(f) for f in range(nfrag)],
                member=member.active,
                pushes=[len(st.open[f].contributors) for f in range(nfrag)],
                min_workers=st.min_workers,
            )
        )

    async def read(self, member: Member, it: AsyncIterator[pb.WorkerMessage]) -> None:
        async for msg in it:
            if member.overflowed or member.revoked:
                return
            if isinstance(msg, Undecodable):
                self.counters.bad_messages += 1
                self.throttled.warning("undecodable", "a %s from %s does not parse", msg.kind, member.name)
                self._refuse(member, 0, 0, "bad_message", f"a message of {msg.size} bytes does not parse")
                continue
            size = msg.ByteSize()
            member.msg_in += size
            self.counters.msg_in += size
            kind = msg.WhichOneof("kind")
            if kind == "ready":
                self._on_ready(member, list(msg.ready.from_rounds))
                continue
            if kind != "push":
                self.counters.bad_messages += 1
                self._refuse(
                    member, 0, 0, "bad_message", "only pushes and Ready may follow Hello on a session"
                )
                continue
            self._on_push(member, msg.push)

    def _on_ready(self, member: Member, from_rounds: list[int]) -> None:
        nfrag = self.state.layout.num_fragments
        if from_rounds and (len(from_rounds) != nfrag or max(from_rounds) > MAX_ROUND):
            self.counters.bad_messages += 1
            self._refuse(
                member,
                0,
                0,
                "bad_message",
                f"Ready must name the first round of each of the {nfrag} fragments (or none), "
                f"got {len(from_rounds)} values",
            )
            return
        if not member.active:
            self.activate(member, from_rounds or None)
        self.outbox.send(member, self.welcome(member))

    def _on_push(self, member: Member, push: pb.Push) -> None:
        c, h = push.chunk, push.header
        if (refusal := self._before_copy(member, c)) is not None:
            self._refuse_chunk(member, c, *refusal)
            return
        try:
            part = from_chunk(c)
        except ValueError as e:  # scales that are not whole fp32 numbers: the push is dropped as a whole
            message = f"fragment {c.fragment} round {c.round} chunk {c.seq}: {e}"
            self._refuse_chunk(member, c, "bad_length", message)
            return
        if c.seq == 0 and (refusal := self._header_refusal(c, h)) is not None:
            self._refuse_chunk(member, c, *refusal)
            return
        before = self.state.bytes_received
        loss = h.loss if c.seq == 0 and h.has_loss else None
        try:
            done = self.state.push_chunk(
                member.name,
                c.fragment,
                c.round,
                c.seq,
                c.offset,
                c.total,
                part,
                c.last,
                weight=h.weight if c.seq == 0 else None,
                loss=loss,
                now=self.clock(),
                step_seconds=h.step_seconds or None if c.seq == 0 else None,
            )
        except PushRejected as e:
            self._refuse(member, c.fragment, c.round, e.reason, str(e))
            return
        now = self.clock()
        if c.seq == 0:  # a header the shard took (its loss is finite): kept until the push is whole
            self.started[(member.name, c.fragment)] = (now, progress_from_proto(h), loss)
        if done:
            self._accepted(member, c, now, self.state.bytes_received - before)

    def _before_copy(self, member: Member, c: pb.Chunk) -> tuple[str, str] | None:
        """Why a chunk is refused before its bytes are copied (reason, message), if it is."""
        if not member.active:  # no round may count on a worker that has not said it is ready
            return "not_ready", "send Ready before pushing"
        # a new push must fit in what staging may hold (server/rounds/staging.py)
        why = self.state.staging.check_start(member.name, c.fragment, c.round, c.seq)
        return None if why is None else ("staging_full", f"round {c.round}: {why}")

    @staticmethod
    def _header_refusal(c: pb.Chunk, h: pb.PushHeader) -> tuple[str, str] | None:
        """Why a push's header (its first chunk's) is refused, if it is: ShardState refuses the rest of
        what is not 1..2^53 tokens."""
        where = f"fragment {c.fragment} round {c.round}"
        if 0 < h.weight < MIN_WEIGHT:
            return "bad_weight", (
                f"{where}: push weight must be at least {MIN_WEIGHT:g} token (it counts the tokens trained "
                f"on), got {h.weight}"
            )
        if problem := check_progress(h):
            return "bad_header", f"{where}: {problem}"
        return None

    def _refuse_chunk(self, member: Member, c: pb.Chunk, reason: str, message: str) -> None:
        """Refuse the push the chunk belongs to (once: ShardState drops its later chunks without a word)."""
        if self.state.refuse_chunk(member.name, c.fragment, c.round, c.seq, c.last, reason):
            self._refuse(member, c.fragment, c.round, reason, message)

    def _accepted(self, member: Member, c: pb.Chunk, now: float, nbytes: int) -> None:
        """A whole push the shard took: counted, its progress recorded, its result sent, its round maybe
        due."""
        member.pushes += 1
        self.credits.accepted(member.name)
        self.metrics.push_size.observe(nbytes)
        started = self.started.pop((member.name, c.fragment), None)
        if started is not None:  # the worker's progress, reported with an accepted push
            t0, report, push_loss = started
            self.metrics.push_transfer.observe(max(0.0, now - t0))
            member.step, member.blocked_seconds = report.step, report.blocked_seconds
            member.report = report
            if push_loss is not None:
                member.last_loss = push_loss
            self.dashboard.record_progress(
                member.name, report.step, push_loss, report.blocked_seconds, report
            )
        result = pb.PushResult(
            fragment=c.fragment, round=c.round, accepted=True, pace_seconds=self.roster.pace()
        )
        self.outbox.send(member, pb.ShardMessage(result=result))
        self.close_due(c.fragment)

    def _refuse(self, member: Member, fragment: int, round: int, reason: str, message: str) -> None:
        member.refused += 1
        self.credits.refused(member.name, reason)
        message = short(message)  # it may quote what the worker sent (a codec's name, ...)
        level = logging.INFO if reason == "late" else logging.WARNING
        self.throttled.log(level, reason, "refused a push from %s: %s", member.name, message)
        result = pb.PushResult(fragment=fragment, round=round, accepted=False, reason=reason, message=message)
        self.outbox.send(member, pb.ShardMessage(result=result))
