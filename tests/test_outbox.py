"""server/edge/outbox.py: the sessions' queues under one budget of unread bytes. What is queued is counted
once however many sessions hold it; a writer's take gives it back; when the budget runs out the session
furthest behind is dropped through the roster (its queue let go, its writer woken, its call cut if it is
still stuck after STUCK_SECONDS); `next` gives a queued message or None once the session's reader ends.

The roster here is the part of server/trust/roster.py's Roster that the outbox uses (the sessions that still
read, dropping one, the open sessions by name), so that a test holds the members by hand; the roster itself
is tests/test_roster.py's, the whole path over gRPC tests/test_bounds.py's.
"""

from __future__ import annotations

import asyncio

import pytest

from streamdiloco.server.edge import outbox as outbox_module
from streamdiloco.server.edge.outbox import Outbox
from streamdiloco.server.trust.bounds import UnreadBudget
from streamdiloco.server.trust.roster import Member
from streamdiloco.server.trust.throttle import Throttled


class Roster:
    """What the outbox asks of the roster: who still reads, and dropping one."""

    def __init__(self, *members: Member):
        self.open = {m.name: m for m in members}
        self.dropped: list[str] = []

    def reading(self) -> list[Member]:
        return [m for m in self.open.values() if not m.overflowed]

    def drop(self, member: Member) -> None:
        member.overflowed = True
        self.dropped.append(member.name)


def member(name: str) -> Member:
    return Member(name, asyncio.Queue(), joined_at=0.0)


def outbox(limit: int, *members: Member) -> tuple[Outbox, Roster, UnreadBudget]:
    roster, unread = Roster(*members), UnreadBudget(limit)
    return Outbox(roster, unread, Throttled()), roster, unread  # type: ignore[arg-type]


def queued(m: Member) -> list:
    return [m.queue.get_nowait() for _ in range(m.queue.qsize())]


def test_a_message_queued_to_several_sessions_is_counted_once_and_given_back_as_each_takes_it():
    async def run() -> None:
        a, b = member("a"), member("b")
        box, _, unread = outbox(1000, a, b)
        update = bytes(100)  # an update's chunk, serialized once for every session
        box.send(a, update)
        box.send(b, update)
        assert unread.held == 100 and (a.queued_bytes, b.queued_bytes) == (100, 100)
        box.take(a, *a.queue.get_nowait())
        assert unread.held == 100 and a.queued_bytes == 0  # b still holds it
        box.take(b, *b.queue.get_nowait())
        assert unread.held == 0 and b.queued_bytes == 0

    asyncio.run(run())


def test_over_the_budget_the_session_furthest_behind_is_dropped_and_its_queue_let_go():
    async def run() -> None:
        a, b = member("a"), member("b")
        box, roster, unread = outbox(100, a, b)
        box.send(a, bytes(60))
        box.send(b, bytes(30))
        box.send(b, bytes(20))  # 110 held: a, 60 behind, goes
        assert roster.dropped == ["a"] and a.overflowed and a.dropped
        assert unread.held == 50 and a.queued_bytes == 0
        assert queued(a) == [(None, 0)]  # only the wake-up: its writer ends the session
        assert a.ender is not None  # its call is cut if it is still stuck later
        box.send(a, bytes(10))  # nothing more is queued for a dropped session
        assert a.queue.empty() and unread.held == 50
        box.close(a)
        assert a.ender.cancelled()

    asyncio.run(run())


def test_a_message_over_the_budget_with_nobody_left_to_drop_is_queued_all_the_same():
    async def run() -> None:
        a = member("a")
        box, roster, unread = outbox(10, a)
        a.overflowed = True  # being dropped already: not among those that read
        roster.open.clear()
        b = member("b")
        box.send(b, bytes(50))
        assert unread.held == 50 and roster.dropped == [] and b.queue.qsize() == 1

    asyncio.run(run())


def test_a_dropped_session_still_stuck_after_stuck_seconds_has_its_call_cut(monkeypatch):
    monkeypatch.setattr(outbox_module, "STUCK_SECONDS", 0.01)

    async def run() -> None:
        a, b = member("a"), member("b")
        box, _, _ = outbox(10, a, b)
        a.call = asyncio.get_running_loop().create_task(asyncio.Event().wait())  # a writer that never ends
        box.send(a, bytes(20))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(a.call, timeout=10)

    asyncio.run(run())


def test_next_gives_the_queued_message_and_none_once_the_reader_ends():
    async def run() -> None:
        a = member("a")
        box, _, unread = outbox(1000, a)
        reader = asyncio.get_running_loop().create_task(asyncio.Event().wait())
        msg = bytes(40)
        box.send(a, msg)
        assert await box.next(a, reader) == (msg, 40)
        assert unread.held == 0 and a.queued_bytes == 0
        reader.cancel()
        assert await box.next(a, reader) is None  # the worker closed its side
        box.wake(a)
        assert await box.next(a, asyncio.get_running_loop().create_task(asyncio.Event().wait())) == (None, 0)

    asyncio.run(run())


def test_next_cancelled_while_it_waits_leaves_nothing_taken():
    async def run() -> None:
        a = member("a")
        box, _, unread = outbox(1000, a)
        never = asyncio.get_running_loop().create_task(asyncio.Event().wait())
        waiting = asyncio.get_running_loop().create_task(box.next(a, never))
        await asyncio.sleep(0)  # it waits on the empty queue
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        box.send(a, bytes(30))
        assert unread.held == 30 and a.queue.qsize() == 1  # still there for the next writer
        never.cancel()

    asyncio.run(run())
