"""Who may open a session on a shard: the session ids that Join hands out, each bound to the name and the
identity that joined, good once and for PENDING_SECONDS; one session per name; and what a revocation
takes back. Pure (the clock is passed in), tested without a network (tests/test_auth.py). The roster
(server/trust/roster.py) holds the one Sessions of a shard, with the open sessions and the members; nothing
else may change them."""

from __future__ import annotations

import secrets
from collections.abc import Container, Iterable
from dataclasses import dataclass

from streamdiloco.server.trust.auth import Auth, Identity, Refused
from streamdiloco.server.trust.bounds import Crowd

PENDING_SECONDS = 300.0  # a Join's session id is good for this long


@dataclass(frozen=True)
class Pending:
    name: str
    identity: Identity
    since: float
    peer: str = ""  # the address the Join came from


class Sessions:
    """Session ids from Join until their Session starts."""

    def __init__(self, auth: Auth, pending_seconds: float = PENDING_SECONDS, max_pending: int = 4096):
        self.auth, self.pending_seconds, self.max_pending = auth, pending_seconds, max_pending
        self.pending: dict[str, Pending] = {}
        self.crowd: Crowd[str] = Crowd()  # the pending ids by the address they came from

    def join(
        self, name: str, identity: Identity, now: float, connected: Container[str], peer: str = ""
    ) -> str:
        """A new session id for `name`, which `identity` proved it may use; Refused while the name has a
        session (`connected`: the names with one). Past `max_pending`, the oldest Join of the address
        (`peer`'s) holding the most is forgotten (Crowd): a flood of Joins from fewer addresses than that
        forgets none of a worker's that is alone at its address."""
        if name in connected:
            raise Refused("already_exists", f"worker {name!r} already has a session on this shard")
        for sid in [sid for sid, p in self.pending.items() if now - p.since > self.pending_seconds]:
            self._forget(sid)  # Joins never followed by a Session
        sid = secrets.token_hex(16)
        self.pending[sid] = Pending(name, identity, now, peer)
        self.crowd.add(sid, peer)
        while len(self.pending) > self.max_pending:
            self._forget(self.crowd.crowded(sparing=sid) or next(iter(self.pending)))
        return sid

    def _forget(self, sid: str) -> None:
        del self.pending[sid]
        self.crowd.discard(sid)

    def hello(self, sid: str, name: str, identity: Identity, now: float, connected: Container[str]) -> None:
        """Take the session id a Hello presents for `name`, with what the Session's own credentials
        proved (`identity`); Refused, with the id left as it was, unless Join gave it to this name and
        identity, not too long ago, and the name has no session."""
        p = self.pending.get(sid)
        if p is None or not name or p.name != name or now - p.since > self.pending_seconds:
            shown = repr(name) if len(name) <= 60 else repr(name[:60]) + "..."
            raise Refused("unauthenticated", f"unknown session for worker {shown}: call Join first")
        if (refused := self.auth.session_allowed(p.identity, identity)) is not None:
            raise refused
        if name in connected:
            raise Refused("already_exists", f"worker {name!r} already has a session")
        self._forget(sid)

    def revoke(self, names: Iterable[str], connected: Iterable[str]) -> set[str]:
        """Forget the Joins of `names`; returns those of them that have a session (to be ended)."""
        names = set(names)
        for sid in [sid for sid, p in self.pending.items() if p.name in names]:
            self._forget(sid)
        return names & set(connected)
