"""What the shard has queued for its sessions to write, and the backpressure on it: one budget of unread
bytes over all sessions (server/trust/bounds.py's UnreadBudget). When it runs out, the session furthest behind
is
dropped (through the roster: it is no member from that moment) and its session is ended; one whose writer
is stuck on a client that takes nothing is cut after STUCK_SECONDS.

Each session has one queue of (message or serialized bytes, size) and one writer (the servicer's Session
generator), which takes what it writes (`next`). What this module must not do: write to the network, or decide
membership beyond dropping a session that does not read.
"""

from __future__ import annotations

import asyncio
import logging

from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.trust.bounds import UnreadBudget
from streamdiloco.server.trust.roster import Member, Roster
from streamdiloco.server.trust.throttle import Throttled

ShardMessage = pb.ShardMessage | bytes  # a message, or its bytes serialized once for every session
STUCK_SECONDS = 5.0  # a session dropped for not reading has this long to end on its own, then it is cut


class Outbox:
    """The sessions' queues under one unread budget (see the module's docstring)."""

    def __init__(self, roster: Roster, unread: UnreadBudget, throttled: Throttled):
        self.roster, self.unread, self.throttled = roster, unread, throttled

    def send(self, member: Member, msg: pb.ShardMessage | bytes) -> None:
        """Queue a message (or its serialized bytes) for a member; one that stops reading is dropped, not
        buffered for ever."""
        if member.overflowed:
            return
        size = len(msg) if isinstance(msg, bytes) else msg.ByteSize()
        self.unread.add(msg, size)
        member.queued_bytes += size
        member.queue.put_nowait((msg, size))
        while self.unread.over:  # one budget for all sessions: the one furthest behind goes first
            reading = self.roster.reading()
            if not reading:  # what is left over is a message a writer is taking: it goes at once
                break
            behind = max(reading, key=lambda m: m.queued_bytes)
            self.roster.drop(behind)  # rounds, status and pace let go of it at once; its session is ended
            self._drop_queue(behind)
            self.throttled.warning(
                "unread", "%s does not read its updates: dropping it from the member set", behind.name
            )
            self.wake(behind)
            # ... unless it is stuck writing to a client that takes nothing: then the call is cut (the client
            # sees CANCELLED); its session's end lets go of the rest
            behind.ender = asyncio.get_running_loop().call_later(STUCK_SECONDS, self._cut, behind)

    @staticmethod
    def wake(member: Member) -> None:
        """Wake the member's writer, so that it ends a session that was dropped."""
        member.queue.put_nowait((None, 0))

    def take(self, member: Member, msg: pb.ShardMessage | bytes | None, size: int) -> None:
        """The writer took `msg` from the member's queue: no longer waiting."""
        if msg is not None:
            self.unread.remove(msg)
            member.queued_bytes -= size

    async def next(self, member: Member, reader: asyncio.Task) -> tuple[ShardMessage | None, int] | None:
        """The member's next queued message and its size, taken (a wake-up's message is None); None when
        `reader` ends first (the worker closed its side, the call broke, or the reader failed). Cancelled
        while it waits, it leaves nothing taken and unwritten."""
        getter = asyncio.create_task(member.queue.get())
        try:
            done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the call was cancelled: no task may outlive the session
            getter.cancel()
            if getter.done() and not getter.cancelled() and (taken := getter.result()[0]) is not None:
                self.unread.remove(taken)  # taken from the queue, never written
            raise
        if getter not in done:
            getter.cancel()
            return None
        msg, size = getter.result()
        self.take(member, msg, size)
        return msg, size

    def close(self, member: Member) -> None:
        """The member's session ends: let go of what is still queued for it."""
        if member.ender is not None:
            member.ender.cancel()
        self._drop_queue(member)

    def _cut(self, member: Member) -> None:
        if self.roster.open.get(member.name) is member and member.call is not None:
            self.throttled.log(logging.INFO, "cut", "%s still does not read: cutting its call", member.name)
            member.call.cancel()

    def _drop_queue(self, member: Member) -> None:
        while not member.queue.empty():
            msg, _ = member.queue.get_nowait()
            if msg is not None:
                self.unread.remove(msg)
        member.queued_bytes = 0
