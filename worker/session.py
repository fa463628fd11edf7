"""One Session call with a shard at a time, as a worker's link uses it: the request stream, and the reader
thread that assembles the shard's update chunks and tells the link what came, as typed events.

What a session tells (`SessionEvent`): an update that came whole (`UpdateArrived`), the answer to a push
(`ResultArrived`), a Welcome (`WelcomeArrived`), and at its end `SessionEnded` (worth a reconnect) or
`SessionFailed` (the shard broke the rules, or refused for good). Each carries the number of the session it
came on, so that the link can tell a stale one from the current session's.

The shard is not trusted with the worker's memory: update chunks are checked and bounded (`Updates`: rounds
the shard can have closed, a few under way per fragment, values finite and within common/chunks.py's
MAX_ABS_VALUE, the bound the shard holds pushes to), and the reader waits while the link has MAX_UNHANDLED of
its messages still to handle. A shard that breaks these rules ends the session with one line naming it and
the fault (SyncError). This module decides nothing about rounds or pushes (the link and worker/linkstate.py
do) and changes no state of the link: the reader only tells.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from streamdiloco.common.chunks import Assembly, ChunkError
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.wire import from_chunk
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker.linkstate import Parts

# What a shard can make a worker hold (a compromised shard, or a man in the middle on an --insecure link):
MAX_UPDATES_UNDER_WAY = 2  # updates of one fragment whose chunks arrive at once (an honest shard: one)
ROUNDS_AHEAD = 2  # an update's round past the fragment's open round as the session knows it (honest: 0)
MAX_UNHANDLED = 16  # messages the reader has told the link and the link has not handled yet: then it waits


class SyncError(RuntimeError):
    """The session with a shard failed for good: the worker cannot go on syncing."""


class Retry(Exception):
    """A step of (re)connecting failed in a way worth another try."""


JOIN_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,  # shard down or restarting, network gone
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,  # the shard has not noticed yet that our old session is gone
}
RETRYABLE = JOIN_RETRYABLE | {
    grpc.StatusCode.UNAUTHENTICATED,  # at Hello: the Join's session id expired meanwhile
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # we read too slowly and were dropped: resync
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}


# --- what a session tells the link ---------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSaid:
    """A message of the shard's, told on session number `session`: the reader waited for room to tell it,
    and the link gives the room back (`Sessions.handled`) when it takes it."""

    session: int


@dataclass(frozen=True)
class UpdateArrived(ShardSaid):
    """A round's update came whole: its chunks' (offset, Encoded) parts, as they came."""

    fragment: int
    round: int
    parts: Parts


@dataclass(frozen=True)
class ResultArrived(ShardSaid):
    """The shard's answer to a push."""

    result: pb.PushResult


@dataclass(frozen=True)
class WelcomeArrived(ShardSaid):
    """A Welcome (the answer to Ready): where the shard's rounds are."""

    welcome: pb.Welcome


@dataclass(frozen=True)
class SessionEnded:
    """The session ended or broke (`why`, one line): worth a reconnect."""

    session: int
    why: str


@dataclass(frozen=True)
class SessionFailed:
    """The session cannot go on (`why`, one line): the shard refused it for good or broke the rules."""

    session: int
    why: str


SessionEvent = UpdateArrived | ResultArrived | WelcomeArrived | SessionEnded | SessionFailed
Tell = Callable[[SessionEvent], None]


class Updates:
    """A session's updates in the making: the chunks of each (fragment, round) assembled and checked
    (common/chunks.py: order, sizes, codec, values finite and within MAX_ABS_VALUE) until the update is whole.

    What a shard can make it hold is bounded: an update is taken only for a round the shard can have closed
    (up to ROUNDS_AHEAD past the fragment's open round, as the session's Welcome said and the updates since
    moved it on), and at most MAX_UPDATES_UNDER_WAY of one fragment are under way at once; anything else is
    the shard's fault (SyncError, one line naming the shard), not something to keep."""

    def __init__(
        self,
        shard: int,
        slices: list[tuple[int, int]],
        config: SyncConfig,
        welcome: pb.Welcome | None = None,
        where: str = "",
    ):
        self.shard, self.slices, self.config = shard, slices, config
        self.where = where or f"shard {shard}"
        self.rounds = [0] * len(slices)  # per fragment: the open round, as far as this session knows
        self.partial: dict[tuple[int, int], Assembly] = {}
        if welcome is not None:
            self.welcome(welcome)

    def welcome(self, w: pb.Welcome) -> None:
        """A Welcome: the shard's open rounds (one of another length is the link's to refuse)."""
        if len(w.rounds) == len(self.rounds):
            self.rounds = [max(a, int(b)) for a, b in zip(self.rounds, w.rounds, strict=True)]

    def _admit(self, fragment: int, round: int) -> None:
        """SyncError unless an update of `round` may start now (see the class's docstring)."""
        if round > self.rounds[fragment] + ROUNDS_AHEAD:
            raise SyncError(
                f"{self.where} sent an update for round {round} of fragment {fragment}, whose open round is "
                f"{self.rounds[fragment]}: a shard sends the updates of the rounds it closes, in order"
            )
        under_way = sum(1 for f, _ in self.partial if f == fragment)
        if under_way >= MAX_UPDATES_UNDER_WAY:
            raise SyncError(
                f"{self.where} sent {under_way + 1} updates of fragment {fragment} under way at once "
                f"(at most {MAX_UPDATES_UNDER_WAY}): a shard sends one update's chunks at a time"
            )

    @property
    def nbytes(self) -> int:
        """Codec bytes held by the updates under way."""
        return sum(a.nbytes for a in self.partial.values())

    def take(self, c: pb.Chunk) -> tuple[int, int, list] | None:
        """One update chunk; (fragment, round, parts) once the update is whole; SyncError if it is bad."""
        if not 0 <= c.fragment < len(self.slices):
            raise SyncError(f"{self.where} sent an update for unknown fragment {c.fragment}")
        key = (c.fragment, c.round)
        asm = self.partial.get(key)
        if asm is None:
            self._admit(c.fragment, c.round)
            asm = self.partial[key] = Assembly(
                self.slices[c.fragment][1],
                self.config.downlink_codec,
                self.config.codec_block_size,
                what="update",
                role="downlink",
                where=f"slice {self.shard} of fragment {c.fragment}",
            )
        try:
            if not asm.add(c.seq, c.offset, c.total, from_chunk(c), c.last):
                return None
        except (ChunkError, ValueError) as e:
            raise SyncError(
                f"{self.where} sent a malformed update chunk for fragment {c.fragment} round {c.round}: {e}"
            ) from None
        del self.partial[key]
        self.rounds[c.fragment] = max(self.rounds[c.fragment], c.round + 1)
        return c.fragment, c.round, asm.parts


@dataclass(frozen=True)
class Peer:
    """What a session needs to know of its shard, as the latest Join said: its index and address, its
    slices and the run's config."""

    shard: int
    target: str
    slices: list[tuple[int, int]]
    config: SyncConfig

    @property
    def where(self) -> str:
        return f"shard {self.shard} at {self.target}"


class Sessions:
    """A shard connection's Session calls, one at a time (see the module's docstring): the current one's
    number, call and request queue, its updates under way, and the room the link has left to be told more.
    `count(direction, bytes)` counts the serialized messages both ways; `closed`, once set, ends the waits."""

    def __init__(self, count: Callable[[str, int], None], closed: threading.Event) -> None:
        self.count, self.closed = count, closed
        self.number = 0  # the current session's number: what the reader of an older one tells is stale
        self.call: Any = None
        self.updates: Updates | None = None  # the current session's updates under way (its reader's)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # messages told and not handled yet (the link calls handled()): a reader that is this far ahead of
        # the link waits, so that a shard cannot fill the link's queue while the link is busy (a Fetch)
        self._unhandled = threading.Semaphore(MAX_UNHANDLED)

    def open(
        self, stub: pb_grpc.ShardStub, metadata: Any, hello: pb.Hello, peer: Peer, tell: Tell
    ) -> pb.Welcome:
        """Start a session with `hello`, read the shard's Welcome and start the session's reader, which
        tells what comes (see the module's docstring). Retry or SyncError when it does not start."""
        self._outbox.put(None)  # ends the previous session's request stream, if any
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = outbox
        call = stub.Session(self._requests(outbox, hello), metadata=metadata)
        try:
            first = next(call)
        except StopIteration:
            raise Retry("the shard ended the session at once") from None
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise Retry(f"Session: {e.code().name}: {e.details()}") from None
            raise SyncError(f"{peer.where} refused the session: {e.code().name}: {e.details()}") from None
        self.count("in", first.ByteSize())
        w = first.welcome
        n = len(peer.slices)
        if first.WhichOneof("kind") != "welcome" or not len(w.rounds) == len(w.started) == len(w.pushes) == n:
            call.cancel()
            raise SyncError(f"{peer.where} did not start the session with a Welcome")
        self.call = call
        self.number += 1
        threading.Thread(
            target=self._read,
            args=(self.number, call, tell, w, peer),
            name=f"shard{peer.shard}-rx",
            daemon=True,
        ).start()
        return w

    def handled(self) -> None:
        """The link has handled one message its reader told (a ShardSaid)."""
        self._unhandled.release()

    def _room(self, number: int) -> bool:
        """Wait until the link has handled enough of what was told; False once this session is over."""
        while not self._unhandled.acquire(timeout=0.5):
            if self.closed.is_set() or number != self.number:
                return False
        return True

    def send(self, msg: pb.WorkerMessage) -> None:
        """Queue a message on the current session (sent in order; lost if the session breaks)."""
        self._outbox.put(msg)

    def _requests(self, outbox: queue.SimpleQueue, hello: pb.Hello) -> Iterator[pb.WorkerMessage]:
        first = pb.WorkerMessage(hello=hello)
        self.count("out", first.ByteSize())
        yield first
        while True:
            msg = outbox.get()
            if msg is None:
                return
            self.count("out", msg.ByteSize())
            yield msg

    def _read(self, number: int, call: Any, tell: Tell, welcome: pb.Welcome, peer: Peer) -> None:
        """A session's reader: tells what it reads, then how the session ended (see the module's
        docstring)."""
        updates = self.updates = Updates(peer.shard, peer.slices, peer.config, welcome, peer.where)
        why = f"{peer.where} ended the session"
        try:
            for msg in call:
                self.count("in", msg.ByteSize())
                said = self._said(number, msg, updates)
                if said is not None:
                    if not self._room(number):
                        return
                    tell(said)
        except grpc.RpcError as e:
            why = f"session with {peer.where} broke: {e.code().name}: {e.details()}"
            if e.code() not in RETRYABLE and not self.closed.is_set():
                tell(SessionFailed(number, why.replace("broke", "failed")))
                return
        except SyncError as e:
            tell(SessionFailed(number, str(e)))
            return
        except Exception as e:  # a malformed message must not end the thread silently
            why = f"shard {peer.shard} sent what this worker cannot read: {type(e).__name__}: {e}"
            tell(SessionFailed(number, why))
            return
        tell(SessionEnded(number, why))

    @staticmethod
    def _said(
        number: int, msg: pb.ShardMessage, updates: Updates
    ) -> UpdateArrived | ResultArrived | WelcomeArrived | None:
        """What one message of the shard's tells the link (None: nothing yet, or nothing for the link)."""
        kind = msg.WhichOneof("kind")
        if kind == "update":
            done = updates.take(msg.update)
            return None if done is None else UpdateArrived(number, *done)
        if kind == "result":
            return ResultArrived(number, msg.result)
        if kind == "welcome":
            updates.welcome(msg.welcome)
            return WelcomeArrived(number, msg.welcome)
        return None

    def end(self) -> None:
        """End the current session (its request stream and its call)."""
        self._outbox.put(None)
        if self.call is not None:
            self.call.cancel()
