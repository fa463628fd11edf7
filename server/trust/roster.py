"""Who is on a shard, in one place: the Joins not yet followed by a Session (server/trust/membership.py's
Sessions), the open sessions, and which of them are members. Every change of membership goes through the
`Roster`, which changes ShardState's members (who the rounds wait for) with it, so that the rounds, the
status page and the run's pace never disagree: a member whose credential is revoked, or that stops reading
its updates, is gone from all three the moment it is dropped, while its session is still ending. The pace
(answered with every accepted push) is the rounds' members' (server/rounds/members.py keeps it).

Pure (the clock is passed in; no I/O, no gRPC): tested without a network. The servicer keeps what a session
needs to run (its queue and task live on the `Member`, but the roster never touches them); what this module
must not do: send, log or wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from streamdiloco.common.progress import Progress
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.trust.auth import Auth, Identity
from streamdiloco.server.trust.membership import PENDING_SECONDS, Sessions


@dataclass
class Member:
    """One open session: a member of the rounds (`active`), or passive until it sends Ready."""

    name: str
    queue: asyncio.Queue
    joined_at: float
    session: str = ""  # the id its Join gave (what a Pieces call presents)
    pushes: int = 0
    refused: int = 0
    last_loss: float | None = None
    msg_in: int = 0
    msg_out: int = 0
    queued_bytes: int = 0  # messages waiting in `queue` for the member to read them
    overflowed: bool = False  # it stopped reading: dropped from the member set, its session is ended
    active: bool = False  # False while passive: it gets updates, no round waits for it (until Ready)
    step: int | None = None  # the progress it reported with its latest push
    blocked_seconds: float | None = None
    # all of the report of its latest accepted push (total steps, tokens, utilization, eval loss, step time)
    report: Progress | None = None
    revoked: bool = False  # its credential was revoked: its session is ended
    call: asyncio.Task | None = None  # the task that runs its session (ended if its writer is stuck)
    ender: asyncio.TimerHandle | None = None  # once it overflowed: ends the call if it has not ended

    @property
    def dropped(self) -> bool:
        """Revoked or overflowed: no longer a member or a session of the shard's, its session ending."""
        return self.overflowed or self.revoked


class Roster:
    """The shard's Joins, sessions and members (see the module's docstring)."""

    def __init__(
        self, state: ShardState, auth: Auth, max_pending: int, pending_seconds: float = PENDING_SECONDS
    ):
        self.state = state
        self.joins = Sessions(auth, pending_seconds, max_pending)  # session ids from Join to Hello
        self.open: dict[str, Member] = {}  # every open session by name, those being dropped too
        self._leaving: list[Callable[[str], object]] = []  # told each member that stops being one

    # --- sessions ------------------------------------------------------------------------------------------
    def join(self, name: str, identity: Identity, now: float, peer: str = "") -> str:
        """A session id for a Join that admission let in from `peer` (its address); Refused while the name
        has a session, or while the run token holds as many other names as it may (Auth.names_allowed).
        Past the pending Joins' bound, one of the address holding the most of them is forgotten
        (server/trust/membership.py)."""
        self._names_allowed(name, identity)
        return self.joins.join(name, identity, now, self.open, peer)

    def hello(self, member: Member, session: str, identity: Identity, now: float) -> None:
        """Open `member`'s session with the id its Join gave (passive until `activate`); Refused, nothing
        changed, unless the id is good for this name and identity (and the run token may hold its name:
        two names may both have Joined before either said Hello)."""
        self._names_allowed(member.name, identity)
        self.joins.hello(session, member.name, identity, now, self.open)
        member.session = session
        self.open[member.name] = member

    def _names_allowed(self, name: str, identity: Identity) -> None:
        """Refused if the run token may not hold `name` besides the names of the open sessions (those being
        dropped aside). Where `identity` is the run token's, every session's is: the run token excludes
        per-worker tokens, and client certificates bind the name."""
        held = (m.name for m in self.sessions())
        if (refused := self.joins.auth.names_allowed(identity, name, held)) is not None:
            raise refused

    def activate(self, member: Member, from_rounds: list[int] | None = None) -> None:
        """The member is ready: rounds that start from now on wait for it (from `from_rounds` on)."""
        member.active = True
        self.state.add_member(member.name, from_rounds)

    def drop(self, member: Member, revoked: bool = False) -> None:
        """The member stopped reading (or, `revoked`, lost its credential): it is no member from now on,
        and its session is to be ended."""
        if revoked:
            member.revoked = True
        else:
            member.overflowed = True
        self.state.remove_member(member.name)  # rounds stop waiting for it
        self._release(member.name)

    def revoke(self, names: Iterable[str]) -> list[Member]:
        """Forget the Joins of `names` and drop their members; returns the sessions to end."""
        gone = [self.open[name] for name in sorted(self.joins.revoke(names, self.open))]
        for member in gone:
            self.drop(member, revoked=True)
        return gone

    def leave(self, member: Member, stopping: bool = False) -> None:
        """The member's session ended. A shard on its way down (`stopping`) keeps it in the rounds' member
        set: its checkpoint names the members, to wait for them after the restart."""
        if self.open.get(member.name) is member:
            del self.open[member.name]
        if not stopping:
            self.state.remove_member(member.name)
            self._release(member.name)

    def when_leaving(self, listener: Callable[[str], object]) -> None:
        """Tell `listener` the name of every member that stops being one (shard 0's data ledger: its pieces
        go back to the pool)."""
        self._leaving.append(listener)

    def _release(self, name: str) -> None:
        """The worker is no member from now on: whoever listens lets go of what it held."""
        for listener in self._leaving:
            listener(name)

    # --- who is here ---------------------------------------------------------------------------------------
    def sessions(self) -> list[Member]:
        """The open sessions that are not being dropped: members and passive ones (what status lists)."""
        return [m for m in self.open.values() if not m.dropped]

    def members(self) -> list[Member]:
        """The members: sessions that are active and not dropped (the rounds wait for exactly these, and
        for the returning members of a restart: ShardState.returning)."""
        return [m for m in self.open.values() if m.active and not m.dropped]

    @property
    def passive(self) -> int:
        """Connected workers that are not members yet (joining)."""
        return sum(not m.active for m in self.sessions())

    def pace(self) -> float:
        """The run's pace as this shard sees it: the slowest member's reported seconds per inner step (what
        a worker with sync_schedule "adaptive" sets its inner steps per schedule step against, and what the
        round rule's grace counts from). Kept in one place, the rounds' members (server/rounds/members.py):
        a member leaves it when it leaves them."""
        return self.state.pace()

    def reading(self) -> list[Member]:
        """The sessions that still read their messages (not overflowed): who may be dropped next when the
        shard's unread budget runs out."""
        return [m for m in self.open.values() if not m.overflowed]
