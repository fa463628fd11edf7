"""One shard's wire, as a worker's link uses it: Join, a Session's request stream, the reader that assembles
the shard's update chunks, Fetch, and the bytes counted both ways.

A ShardConnection holds what Join said (the run's config, this shard's index and slices) and the current
session's outbox; it decides nothing about rounds or pushes (the link and worker/linkstate.py do) and
changes no state of the link: its reader thread only tells the link what came (`open_session`'s `tell`).
`reconnect` is the backoff loop that joins again and opens a new session until one holds.

The shard is not trusted with the worker's memory or its values: a Join reply is checked before anything
of it is taken (`take_reply`), update chunks are checked and bounded (`Updates`: rounds the shard can have
closed, a few under way per fragment, values finite and within common/chunks.py's MAX_ABS_VALUE, the bound
the shard holds pushes to), Fetch masters are checked by common/fetch.py, and the reader waits while the
link has MAX_UNHANDLED of its messages still to handle. A shard that breaks these rules ends the session
with one line naming it and the fault (SyncError).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch

from streamdiloco.common.backoff import Backoff
from streamdiloco.common.chunks import Assembly, ChunkError
from streamdiloco.common.codecs import chunk_alignment
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fetch import TRANSIENT, FetchError, fetch_slices
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.tls import ClientTLS
from streamdiloco.common.wire import PROTOCOL, auth_metadata, from_chunk, make_channel, parse_target
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

log = logging.getLogger("streamdiloco.worker")

JOIN_PROGRESS_EVERY = 5.0  # seconds between "waiting for shard" lines while a first Join finds no shard
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


class ShardConnection:
    """Join, Sessions and Fetch with one shard (see the module's docstring)."""

    def __init__(
        self,
        target: str,
        worker: str,
        fingerprint: dict,
        *,
        token: str = "",
        join_timeout: float = 60.0,
        tls: ClientTLS | None = None,
        link: LinkSettings | None = None,
        patience: float = 600.0,
    ):
        self.target, self.worker, self.token = parse_target(target), worker, token
        self.fingerprint, self.join_timeout, self.tls = fingerprint, join_timeout, tls
        self.patience = patience  # seconds a broken Fetch goes on without a message (--reconnect-timeout)
        self.metadata = auth_metadata(token)  # on every call: a session id alone proves nothing
        self.channel = make_channel(self.target, tls, link)
        self.stub = pb_grpc.ShardStub(self.channel)
        # set by Join (the caller's thread before the link starts, then only the link's thread)
        self.config: SyncConfig | None = None
        self.probed: tuple[int, int, bool, str] | None = (
            None  # a config_only Join's shard, num_shards, uninitialized, init hash
        )
        self.shard = self.num_shards = self.chunk_values = 0
        self.slices: list[tuple[int, int]] = []
        self.session_id = ""
        self.session = 0  # the current session's number: what the reader of an older one tells is stale
        self.call: Any = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._bytes = {"out": 0, "in": 0}
        self._bytes_lock = threading.Lock()
        self.closed = threading.Event()  # set by close(): waits end, retries stop
        self.updates: Updates | None = None  # the current session's updates under way (its reader's)
        # messages told and not handled yet (the link calls handled()): a reader that is this far ahead of
        # the link waits, so that a shard cannot fill the link's queue while the link is busy (a Fetch)
        self._unhandled = threading.Semaphore(MAX_UNHANDLED)

    @property
    def msg_out(self) -> int:
        return self._bytes["out"]

    @property
    def msg_in(self) -> int:
        return self._bytes["in"]

    def count(self, direction: str, n: int) -> None:
        with self._bytes_lock:
            self._bytes[direction] += n

    # --- Join ------------------------------------------------------------------------------------------
    def join(
        self, timeout: float | None = None, reconnecting: bool = False, config_only: bool = False
    ) -> SyncConfig:
        """Join the shard, waiting up to `timeout` for it to be reachable; returns the run's config. SyncError
        if it refuses; when `reconnecting`, Retry if it cannot be reached (or still holds our old session).
        `config_only`: only ask for the run's config (no fingerprint, no session; the link stays unjoined)."""
        timeout = self.join_timeout if timeout is None else timeout
        give_up = time.monotonic() + timeout
        if not reconnecting:
            self._wait_for_shard(give_up, timeout)
        request = pb.JoinRequest(
            worker=self.worker,
            token=self.token,
            fingerprint_json="" if config_only else json.dumps(self.fingerprint),
            protocol=PROTOCOL,
            config_only=config_only,
        )
        while True:
            try:
                reply = self.stub.Join(
                    request,
                    metadata=self.metadata,
                    timeout=max(0.1, give_up - time.monotonic()),
                    wait_for_ready=True,  # the shard may be starting: the call waits for the channel
                )
                break
            except grpc.RpcError as e:
                code = e.code()
                if reconnecting and code in JOIN_RETRYABLE:
                    raise Retry(f"Join: {code.name}: {e.details()}") from None
                # ALREADY_EXISTS: our own session from before a crash, not yet noticed by the shard (liveness:
                # seconds); UNAVAILABLE: the connection dropped under the call (the channel reconnects)
                if code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAVAILABLE) and (
                    time.monotonic() < give_up - 1
                ):
                    log.info("shard at %s: Join: %s; trying again", self.target, e.details())
                    self.closed.wait(1.0)
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise SyncError(self._no_answer(timeout)) from None
                raise SyncError(f"shard at {self.target} refused Join: {code.name}: {e.details()}") from None
        return self.take_reply(reply, config_only)

    def take_reply(self, reply: pb.JoinReply, config_only: bool = False) -> SyncConfig:
        """Check a Join's reply and take what it says (the run's config, this shard's index, slices and
        chunk size); SyncError, with nothing taken, when it is unusable or (on a rejoin) another run's."""
        try:
            raw = json.loads(reply.config_json)
            if not isinstance(raw, dict):
                raise ValueError(f"a JSON {type(raw).__name__}, not an object")
            config = SyncConfig.from_dict(raw)
        except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as e:
            raise SyncError(
                f"shard at {self.target} sent a config this worker cannot read: {str(e)[:200]}"
            ) from None
        if config_only:
            self.probed = (reply.shard, reply.num_shards, reply.uninitialized, reply.init_hash)
            return config
        if reply.uninitialized:
            raise SyncError(
                f"the shard at {self.target} has no parameters yet (server --init from-worker): connect() "
                "sends them"
            )
        slices = [(s.offset, s.length) for s in reply.slices]
        if self.config is not None and (
            config != self.config
            or slices != self.slices
            or (reply.shard, reply.num_shards) != (self.shard, self.num_shards)
        ):
            raise SyncError(
                f"the shard at {self.target} came back as another run: shard index, slices or config differ"
            )
        align = chunk_alignment(config.uplink_codec, config.codec_block_size)
        if (
            not reply.num_shards
            or reply.shard >= reply.num_shards
            or not reply.chunk_values
            or reply.chunk_values % align
        ):
            raise SyncError(
                f"shard at {self.target} sent an unusable Join reply (shard {reply.shard} of "
                f"{reply.num_shards}, {reply.chunk_values} values per chunk)"
            )
        self.config, self.shard, self.num_shards = config, reply.shard, reply.num_shards
        self.slices, self.chunk_values = slices, reply.chunk_values
        self.session_id = reply.session
        return config

    def _wait_for_shard(self, give_up: float, timeout: float) -> None:
        """Wait until the channel connects, saying so every JOIN_PROGRESS_EVERY seconds: a shard not started
        yet, or a wrong address, is not 60 s of silence. SyncError naming the address and the flag when
        `give_up` passes."""
        start = time.monotonic()
        ready = grpc.channel_ready_future(self.channel)
        try:
            while True:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise SyncError(self._no_answer(timeout))
                try:
                    ready.result(timeout=min(JOIN_PROGRESS_EVERY, left))
                    return
                except grpc.FutureTimeoutError:
                    if self.closed.is_set():
                        raise SyncError(f"closed while waiting for the shard at {self.target}") from None
                    if give_up - time.monotonic() > 0:
                        log.info(
                            "waiting for shard at %s (retrying, %.0fs of --join-timeout %gs)",
                            self.target,
                            time.monotonic() - start,
                            timeout,
                        )
        finally:
            ready.cancel()

    def _no_answer(self, timeout: float) -> str:
        hint = (
            " (over TLS: does it serve TLS, does its certificate name this host, is it signed by --tls-ca, "
            "and does it take this worker's certificate?)"
            if self.tls
            else ": is it running, and is the address right?"
        )
        return f"no shard answered at {self.target} within --join-timeout {timeout:g}s{hint}"

    # --- the session -----------------------------------------------------------------------------------
    def open_session(self, tell: Callable[..., None]) -> pb.Welcome:
        """Start a passive session (updates come, no round waits for us), read the shard's Welcome and start
        the session's reader, which calls tell(kind, session number, ...) for what comes: ("update",
        fragment, round, parts) once an update is whole, ("result", PushResult), ("welcome", Welcome), and
        at its end ("ended", why) or ("failed", why) when the session cannot go on."""
        self._outbox.put(None)  # ends the previous session's request stream, if any
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = outbox
        call = self.stub.Session(self._requests(outbox, self.session_id), metadata=self.metadata)
        try:
            first = next(call)
        except StopIteration:
            raise Retry("the shard ended the session at once") from None
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise Retry(f"Session: {e.code().name}: {e.details()}") from None
            raise SyncError(
                f"shard {self.shard} at {self.target} refused the session: {e.code().name}: {e.details()}"
            ) from None
        self.count("in", first.ByteSize())
        w = first.welcome
        n = len(self.slices)
        if first.WhichOneof("kind") != "welcome" or not len(w.rounds) == len(w.started) == len(w.pushes) == n:
            call.cancel()
            raise SyncError(f"shard {self.shard} at {self.target} did not start the session with a Welcome")
        self.call = call
        self.session += 1
        threading.Thread(
            target=self._read, args=(self.session, call, tell, w), name=f"shard{self.shard}-rx", daemon=True
        ).start()
        return w

    def handled(self) -> None:
        """The link has handled one message its reader told (an update, a result or a Welcome)."""
        self._unhandled.release()

    def _room(self, session: int) -> bool:
        """Wait until the link has handled enough of what was told; False once this session is over."""
        while not self._unhandled.acquire(timeout=0.5):
            if self.closed.is_set() or session != self.session:
                return False
        return True

    def send(self, msg: pb.WorkerMessage) -> None:
        """Queue a message on the current session (sent in order; lost if the session breaks)."""
        self._outbox.put(msg)

    def _requests(self, outbox: queue.SimpleQueue, session: str) -> Iterator[pb.WorkerMessage]:
        hello = pb.WorkerMessage(hello=pb.Hello(worker=self.worker, session=session, passive=True))
        self.count("out", hello.ByteSize())
        yield hello
        while True:
            msg = outbox.get()
            if msg is None:
                return
            self.count("out", msg.ByteSize())
            yield msg

    def _read(self, session: int, call: Any, tell: Callable[..., None], welcome: pb.Welcome) -> None:
        """A session's reader: assembles update chunks and tells what it reads (see open_session)."""
        assert self.config is not None
        where = f"shard {self.shard} at {self.target}"
        updates = self.updates = Updates(self.shard, self.slices, self.config, welcome, where)
        why = f"{where} ended the session"
        try:
            for msg in call:
                self.count("in", msg.ByteSize())
                kind = msg.WhichOneof("kind")
                told: tuple = ()
                if kind == "update":
                    done = updates.take(msg.update)
                    if done is not None:
                        told = ("update", session, *done)
                elif kind == "result":
                    told = ("result", session, msg.result)
                elif kind == "welcome":
                    updates.welcome(msg.welcome)
                    told = ("welcome", session, msg.welcome)
                if told:
                    if not self._room(session):
                        return
                    tell(*told)
        except grpc.RpcError as e:
            why = f"session with shard {self.shard} at {self.target} broke: {e.code().name}: {e.details()}"
            if e.code() not in RETRYABLE and not self.closed.is_set():
                why = why.replace("broke", "failed")
                tell("failed", session, why)
                return
        except SyncError as e:
            tell("failed", session, str(e))
            return
        except Exception as e:  # a malformed message must not end the thread silently
            tell(
                "failed",
                session,
                f"shard {self.shard} sent what this worker cannot read: {type(e).__name__}: {e}",
            )
            return
        tell("ended", session, why)

    # --- reconnecting ----------------------------------------------------------------------------------
    def reconnect(self, timeout: float, tell: Callable[..., None], then: Callable[[pb.Welcome], None]) -> int:
        """Join again and open a new session, then then(its Welcome), until all three succeed; returns the
        attempts it took. SyncError after `timeout` seconds, or at once when the shard refuses for good.
        Attempts are spaced by exponential backoff with jitter (common/backoff.py), so that many workers do
        not all come at once; during each, the Join waits for the channel, which connects as soon as the shard
        is back (gRPC retries every 0.25..4 s). A Retry from `then` (say, a Fetch that broke) counts as a
        failed attempt."""
        give_up = time.monotonic() + timeout
        backoff = Backoff()
        attempt = 0
        while not self.closed.is_set():
            attempt += 1
            window = max(0.5, min(backoff.next(), give_up - time.monotonic()))
            t0 = time.monotonic()
            try:
                self.join(timeout=window, reconnecting=True)
                then(self.open_session(tell))
                return attempt
            except Retry as e:
                if self.call is not None:
                    self.call.cancel()
                if time.monotonic() >= give_up:
                    raise SyncError(
                        f"shard {self.shard} at {self.target} unreachable for {timeout:g} s (last: {e}); "
                        "giving up"
                    ) from None
                if attempt == 1 or attempt % 10 == 0:
                    log.info(
                        "shard %d at %s: %s; still trying (attempt %d)", self.shard, self.target, e, attempt
                    )
                self.closed.wait(max(0.0, window - (time.monotonic() - t0)))  # a quick refusal: wait it out
        return attempt

    # --- Fetch ---------------------------------------------------------------------------------------------
    def fetch(
        self, fragments: list[int] | None = None, patient: bool = True
    ) -> dict[int, tuple[torch.Tensor, int]]:
        """The current master slices (fp32) and their rounds, every chunk checked against this shard's slices
        (common/fetch.py: order, sizes, rounds, finite values), resuming from the last chunk received if the
        stream breaks: when `patient`, after a backoff, as often as it takes, until `patience` seconds pass
        without a message from the shard (a link that drops and comes back, a shard that restarts); else
        three calls (a reconnect's resync: the reconnect tries again). SyncError when the shard sends what
        does not fit (nothing of it is kept), refuses, or stays out of reach that long."""
        want = list(fragments) if fragments is not None else list(range(len(self.slices)))
        try:
            got = fetch_slices(
                self.stub,
                {f: self.slices[f][1] for f in want},
                where=f"shard {self.shard} at {self.target}",
                token=self.token,
                on_chunk=lambda m: self.count("in", m.ByteSize()),
                patience=self.patience if patient else None,
                stop=self.closed,
            )
        except FetchError as e:
            if patient and e.code in TRANSIENT:
                raise SyncError(f"{e}; giving up after --reconnect-timeout {self.patience:g} s") from None
            raise SyncError(str(e)) from None
        log.debug("fetched %s", got.describe())
        return got.masters()

    def close(self) -> None:
        self.closed.set()
        self._outbox.put(None)
        if self.call is not None:
            self.call.cancel()
        self.channel.close()
