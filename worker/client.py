"""The worker's side of the wire: one background link per shard, and the Transport the engine uses.

Each ShardLink joins its shard, then keeps a bidirectional Session open. Its threads:
- the link's own thread owns what the link holds (worker/linkstate.py: rounds held, kept pushes, arrived
  updates, the resync diff) and is the only one that changes it; everything else posts work to it (`_post`)
  or asks it and gets a future (`_ask`). It sends pushes, hands updates over as they arrive (one future per
  (fragment, round) that the engine waits on), and reconnects when a session breaks;
- a reader per session reads the shard's messages, assembles update chunks (common/chunks.py, the same
  assembler as the shard's) and posts whole updates, results and Welcomes to the link's thread.
GrpcTransport bundles the links of all S shards, ordered by shard index, and is what SyncEngine calls.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from streamdiloco.common.chunks import Assembly, ChunkError
from streamdiloco.common.codecs import Encoded, chunk_alignment, warm_up
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fetch import FetchError, fetch_slices
from streamdiloco.common.fragments import slice_ranges
from streamdiloco.common.metrics import PUSH_OUTCOMES, push_outcome
from streamdiloco.common.pace import valid_step_seconds
from streamdiloco.common.schedule import joining_step, sends_through
from streamdiloco.common.tls import ClientTLS
from streamdiloco.common.wire import (
    PROTOCOL,
    auth_metadata,
    from_chunk,
    make_channel,
    parse_target,
    to_chunks,
    values_to_bytes,
)
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker.engine import StopRequested, SyncEngine, settle
from streamdiloco.worker.linkstate import Kept, LinkState, Master, ShardBehind, Update
from streamdiloco.worker.report import Progress

__all__ = [
    "GrpcTransport",
    "Master",
    "ShardLink",
    "StopRequested",
    "SyncError",
    "Update",
    "adopt_sync",
    "connect",
    "given_sync",
    "initialize_shard",
    "probe_shard",
    "wait_initialized",
]

log = logging.getLogger("streamdiloco.worker")

MAX_BACKOFF = 8.0  # seconds between reconnect attempts, at most (before jitter)
JOIN_PROGRESS_EVERY = 5.0  # seconds between "waiting for shard" lines while a first Join finds no shard
# the settings a worker that takes them from the shard says it took (the others follow them, or are the
# shard's own: the outer optimizer)
ADOPTED_LOG = (
    "sync_every",
    "num_fragments",
    "fragment_pattern",
    "fragment_sync_delay",
    "fragment_update_alpha",
    "uplink_codec",
    "downlink_codec",
    "codec_block_size",
)


class SyncError(RuntimeError):
    """The session with a shard failed for good: the worker cannot go on syncing."""


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


class _Retry(Exception):
    """A step of (re)connecting failed in a way worth another try."""


_STOP = object()  # ends the link's thread


class ShardLink:
    """One shard: Join, a Session that stays open, and its resumption when it breaks.

    Pushes are kept (encoded) until their round's update is taken. When the session breaks, the link's
    thread reconnects with exponential backoff and jitter: Join again, open a passive session, compare the
    shard's rounds with what this worker holds, fetch any slice it missed rounds of (the engine then takes
    that Master in place of the missed updates), become a member again, and send again every kept push
    whose round is still open. A shard restarted from its checkpoint thereby gets back every push it lost.
    """

    def __init__(
        self,
        target: str,
        worker: str,
        fingerprint: dict,
        token: str = "",
        join_timeout: float = 60.0,
        reconnect_timeout: float = 600.0,
        tls: ClientTLS | None = None,
    ):
        self.target, self.worker, self.token = parse_target(target), worker, token
        self.fingerprint, self.join_timeout, self.reconnect_timeout = (
            fingerprint,
            join_timeout,
            reconnect_timeout,
        )
        self.metadata = auth_metadata(token)  # on every call: a session id alone proves nothing
        self.tls = tls
        self.channel = make_channel(self.target, tls)
        self.stub = pb_grpc.ShardStub(self.channel)
        # set by Join (the caller's thread before start(), then only the link's thread)
        self.config: SyncConfig | None = None
        self.probed: tuple[int, int, bool] | None = (
            None  # a config_only Join's shard, num_shards, uninitialized
        )
        self.shard = self.num_shards = self.chunk_values = 0
        self.slices: list[tuple[int, int]] = []
        self.state: LinkState | None = None
        self._session_id = ""
        # the link's thread and what only it touches
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._call: Any = None
        self._session = 0  # the current session's number: messages of an older one are ignored
        self._connected = False  # a session is open and this worker is a member on it
        self._welcome: pb.Welcome | None = None  # the latest Welcome (answer to Hello or Ready)
        self._want_member = False  # ready() was called: a reconnect makes us a member again
        self._wanted: dict[tuple[int, int], list[Future]] = {}  # the engine's requests for updates
        self._on_member: list[Future] = []  # ready() calls waiting for the shard's Welcome as a member
        self._on_flushed: list[Future] = []  # flush() calls waiting for every push's answer
        self._sent_at: dict[tuple[int, int], float] = {}
        self.join_from: list[int] | None = None  # first rounds a joining worker pushes (see join_run)
        self.schedule: Callable[[], list[int]] | None = None  # the engine's next round of each fragment
        # read from any thread
        self.error: str | None = None
        self.refusals: list[pb.PushResult] = []
        self.reconnects = 0
        self.resent = 0
        self.results = dict.fromkeys(PUSH_OUTCOMES, 0)  # answers to pushes, by outcome (for /metrics)
        self.pace_seconds = (
            0.0  # the run's pace, as the shard's latest accepting answer said (common/pace.py)
        )
        self.progress: Callable[[], Progress] = Progress  # what each push's header reports (dashboards)
        self.on_answer: Callable[[float], None] | None = None  # gets seconds from a push's send to its answer
        self._bytes = {"out": 0, "in": 0}
        self._bytes_lock = threading.Lock()
        self._closing = False
        self._closed = threading.Event()  # wakes the reconnect backoff when the link closes

    @property
    def msg_out(self) -> int:
        return self._bytes["out"]

    @property
    def msg_in(self) -> int:
        return self._bytes["in"]

    def _count(self, direction: str, n: int) -> None:
        with self._bytes_lock:
            self._bytes[direction] += n

    # --- connecting ------------------------------------------------------------------------------------
    def join(
        self, timeout: float | None = None, reconnecting: bool = False, config_only: bool = False
    ) -> SyncConfig:
        """Join the shard, waiting up to `timeout` for it to be reachable; returns the run's config. SyncError
        if it refuses; when `reconnecting`, _Retry if it cannot be reached (or still holds our old session).
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
                    raise _Retry(f"Join: {code.name}: {e.details()}") from None
                if code == grpc.StatusCode.ALREADY_EXISTS and time.monotonic() < give_up - 1:
                    # our own session from before a crash, not yet noticed by the shard (keepalive: < 1 min)
                    log.info("shard at %s: %s; trying again", self.target, e.details())
                    self._closed.wait(1.0)
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise SyncError(self._no_answer(timeout)) from None
                raise SyncError(f"shard at {self.target} refused Join: {code.name}: {e.details()}") from None
        try:
            config = SyncConfig.from_dict(json.loads(reply.config_json))
        except (ValueError, TypeError) as e:
            raise SyncError(f"shard at {self.target} sent a config this worker cannot read: {e}") from None
        if config_only:
            self.probed = (reply.shard, reply.num_shards, reply.uninitialized)
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
        if self.state is None:
            self.state = LinkState(len(slices))
        self._session_id = reply.session
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
                    if self._closing:
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

    def open_session(self) -> pb.Welcome:
        """Start a passive session (updates come, no round waits for us), read the shard's Welcome and start
        the session's reader."""
        self._outbox.put(None)  # ends the previous session's request stream, if any
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox = outbox
        call = self.stub.Session(self._requests(outbox, self._session_id), metadata=self.metadata)
        try:
            first = next(call)
        except StopIteration:
            raise _Retry("the shard ended the session at once") from None
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise _Retry(f"Session: {e.code().name}: {e.details()}") from None
            raise SyncError(
                f"shard {self.shard} at {self.target} refused the session: {e.code().name}: {e.details()}"
            ) from None
        self._count("in", first.ByteSize())
        w = first.welcome
        n = len(self.slices)
        if first.WhichOneof("kind") != "welcome" or not len(w.rounds) == len(w.started) == len(w.pushes) == n:
            call.cancel()
            raise SyncError(f"shard {self.shard} at {self.target} did not start the session with a Welcome")
        self._call = call
        self._session += 1
        self._welcome = w
        threading.Thread(
            target=self._read, args=(self._session, call), name=f"shard{self.shard}-rx", daemon=True
        ).start()
        return w

    def start(self, state: dict | None = None, held: list[int] | None = None) -> None:
        """Join, restore a checkpoint's `state` (and the rounds `held` in the mirror) if given, open a
        passive session and start the link's thread."""
        self.join()
        assert self.state is not None
        if state is not None:
            if state["shard"] != self.shard:
                raise SyncError(
                    f"{self.target} is shard {self.shard}, the checkpoint's link to it was shard "
                    f"{state['shard']}: give --servers in the same order as before"
                )
            assert held is not None
            self.state.load_state_dict(state, held)
        try:
            self.open_session()
        except _Retry as e:
            raise SyncError(f"shard at {self.target}: {e}") from None
        self._thread = threading.Thread(target=self._loop, name=f"shard{self.shard}-link", daemon=True)
        self._thread.start()

    def _requests(self, outbox: queue.SimpleQueue, session: str) -> Iterator[pb.WorkerMessage]:
        hello = pb.WorkerMessage(hello=pb.Hello(worker=self.worker, session=session, passive=True))
        self._count("out", hello.ByteSize())
        yield hello
        while True:
            msg = outbox.get()
            if msg is None:
                return
            self._count("out", msg.ByteSize())
            yield msg

    # --- the link's thread -----------------------------------------------------------------------------
    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Have the link's thread run fn(*args), after what was posted before."""
        self._inbox.put((fn, args, None))

    def _ask(self, fn: Callable[..., Any], *args: Any) -> Future:
        """A future of fn(*args), run on the link's thread."""
        fut: Future = Future()
        if self._thread is None:  # not started (or a test driving the state alone): run it here
            fut.set_result(fn(*args))
        else:
            self._inbox.put((fn, args, fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                break
            fn, args, fut = item
            try:
                result = fn(*args)
                if fut is not None:
                    fut.set_result(result)
            except BaseException as e:  # never end silently: the engine would wait for ever
                if fut is not None:
                    fut.set_exception(e)
                elif not self._closing:
                    self._fail(
                        e.args[0]
                        if isinstance(e, SyncError)
                        else f"shard {self.shard} at {self.target}: {type(e).__name__}: {e}"
                    )
        self._fail_waiters(self.error or f"the link to shard {self.shard} is closed")

    def _read(self, session: int, call: Any) -> None:
        """A session's reader: assembles update chunks and posts what it reads to the link's thread."""
        partial: dict[tuple[int, int], Assembly] = {}
        why = f"shard {self.shard} at {self.target} ended the session"
        try:
            for msg in call:
                self._count("in", msg.ByteSize())
                kind = msg.WhichOneof("kind")
                if kind == "update":
                    done = self._assemble(partial, msg.update)
                    if done is not None:
                        self._post(self._on_update, session, *done)
                elif kind == "result":
                    self._post(self._on_result, session, msg.result)
                elif kind == "welcome":
                    self._post(self._on_welcome, session, msg.welcome)
        except grpc.RpcError as e:
            why = f"session with shard {self.shard} at {self.target} broke: {e.code().name}: {e.details()}"
            if e.code() not in RETRYABLE and not self._closing:
                why = why.replace("broke", "failed")
                self._post(self._fail_session, session, why)
                return
        except SyncError as e:
            self._post(self._fail_session, session, str(e))
            return
        except Exception as e:  # a malformed message must not end the thread silently
            self._post(
                self._fail_session,
                session,
                f"shard {self.shard} sent what this worker cannot read: {type(e).__name__}: {e}",
            )
            return
        self._post(self._on_ended, session, why)

    def _assemble(self, partial: dict[tuple[int, int], Assembly], c: pb.Chunk) -> tuple | None:
        """Reader: take one update chunk; (fragment, round, parts) once the update is whole."""
        if not 0 <= c.fragment < len(self.slices):
            raise SyncError(f"shard {self.shard} sent an update for unknown fragment {c.fragment}")
        assert self.config is not None
        key = (c.fragment, c.round)
        asm = partial.get(key)
        if asm is None:
            asm = partial[key] = Assembly(
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
                f"shard {self.shard} sent a malformed update chunk for fragment {c.fragment} round "
                f"{c.round}: {e}"
            ) from None
        del partial[key]
        return c.fragment, c.round, asm.parts

    # --- on the link's thread: what the shard says -----------------------------------------------------
    def _on_update(self, session: int, fragment: int, round: int, parts: list) -> None:
        assert self.state is not None
        if session == self._session and self.state.on_update(fragment, round, parts):
            self._hand_over()

    def _on_welcome(self, session: int, w: pb.Welcome) -> None:
        assert self.state is not None
        n = len(self.slices)
        if session != self._session:
            return
        if len(w.rounds) != n or len(w.started) != n or len(w.pushes) != n:
            raise SyncError(f"shard {self.shard} sent a Welcome for {len(w.rounds)} fragments")
        self._welcome = w
        if w.member and not self._connected:
            # a member (again): send every kept push whose round is still open (after a reconnect or a
            # resume; the shard had them only if it says "duplicate")
            for f, r, push in self.state.to_resend(list(w.rounds)):
                self._send_push(f, r, push)
                self.resent += 1
            self._connected = True
            for fut in self._on_member:
                settle(fut, w)
            self._on_member.clear()

    def _on_result(self, session: int, r: pb.PushResult) -> None:
        assert self.state is not None
        if session != self._session:
            return
        self.state.awaiting.discard((r.fragment, r.round))
        self.results[push_outcome(None if r.accepted else r.reason)] += 1
        sent = self._sent_at.pop((r.fragment, r.round), None)
        self._check_flushed()
        if r.accepted and r.pace_seconds != self.pace_seconds:
            # a shard that announces a pace no worker can have is ignored (common/pace.py bounds it)
            self.pace_seconds = r.pace_seconds if valid_step_seconds(r.pace_seconds) else 0.0
        if sent is not None and r.accepted and self.on_answer is not None:
            self.on_answer(time.perf_counter() - sent)
        if r.accepted:
            return
        self.refusals.append(r)
        if r.reason == "late":  # the round closed without us: its update still comes, and we apply it
            log.warning("shard %d: %s", self.shard, r.message)
        elif r.reason == "duplicate":  # sent before a reconnect and already in the round: nothing lost
            log.info("shard %d already has this worker's push: %s", self.shard, r.message)
        else:
            self._fail(f"shard {self.shard} refused a push ({r.reason}): {r.message}")

    def _on_ended(self, session: int, why: str) -> None:
        if session != self._session or self._closing or self.error:
            return
        assert self.state is not None
        self._connected = False
        self.state.awaiting.clear()
        self._sent_at.clear()
        self._check_flushed()
        log.warning("%s; reconnecting", why)
        self._reconnect()

    def _fail_session(self, session: int, message: str) -> None:
        if session == self._session:
            self._fail(message)

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            log.error(message)
        self._fail_waiters(message)

    def _fail_waiters(self, message: str) -> None:
        for futs in self._wanted.values():
            for fut in futs:
                settle(fut, exc=SyncError(message))
        self._wanted.clear()
        for fut in self._on_member:
            settle(fut, exc=SyncError(message))
        self._on_member.clear()
        self._check_flushed()

    def _hand_over(self) -> None:
        """Give every wanted update that is here to whoever waits for it."""
        assert self.state is not None
        for key in sorted(self._wanted):
            if self.state.available(*key):
                update = self.state.take(*key)
                for fut in self._wanted.pop(key):
                    settle(fut, update)

    # --- reconnecting ----------------------------------------------------------------------------------
    def _reconnect(self) -> None:
        """Join again, resynchronize and become a member (if we were one); fails the link when time runs
        out. Attempts are spaced by exponential backoff with jitter (0.5 s doubling to MAX_BACKOFF, each
        times a random 0.5..1), so that many workers do not all come at once; during each, the Join waits
        for the channel, which connects as soon as the shard is back (gRPC retries every 0.25..4 s)."""
        give_up = time.monotonic() + self.reconnect_timeout
        delay = 0.5
        attempt = 0
        while not self._closing:
            attempt += 1
            window = max(0.5, min(delay * random.uniform(0.5, 1.0), give_up - time.monotonic()))
            t0 = time.monotonic()
            try:
                self.join(timeout=window, reconnecting=True)
                welcome = self.open_session()
                self._resync(welcome)
                if self._want_member:  # the answer's Welcome sends the kept pushes again
                    self._outbox.put(self._ready_message())
                self.reconnects += 1
                log.info("reconnected to shard %d at %s (attempt %d)", self.shard, self.target, attempt)
                return
            except _Retry as e:
                if self._call is not None:
                    self._call.cancel()
                if time.monotonic() >= give_up:
                    raise SyncError(
                        f"shard {self.shard} at {self.target} unreachable for {self.reconnect_timeout:g} s "
                        f"(last: {e}); giving up"
                    ) from None
                if attempt == 1 or attempt % 10 == 0:
                    log.info(
                        "shard %d at %s: %s; still trying (attempt %d)", self.shard, self.target, e, attempt
                    )
                self._closed.wait(max(0.0, window - (time.monotonic() - t0)))  # a quick refusal: wait it out
                delay = min(delay * 2, MAX_BACKOFF)

    def _resync(self, welcome: pb.Welcome) -> None:
        """Compare the shard's rounds with ours; fetch the slices of fragments whose rounds we missed."""
        assert self.state is not None
        try:
            behind = self.state.behind(list(welcome.rounds))
        except ShardBehind as e:
            raise SyncError(
                f"shard {self.shard} at {self.target} is at round {e.theirs} of fragment {e.fragment}, but "
                f"this worker already has round {e.ours - 1}: the shard restarted from an older checkpoint "
                "than its last round; restart the run from the shards' checkpoints and the workers' --resume"
            ) from None
        if not behind:
            return
        log.info(
            "shard %d closed rounds of fragment(s) %s while this worker was away: fetching those slices",
            self.shard,
            behind,
        )
        try:
            fetched = self.fetch(behind)
        except SyncError as e:
            raise _Retry(str(e)) from None
        for f, (values, rnd) in fetched.items():
            self.state.on_fetched(f, values, rnd)
        self._hand_over()

    def _ready_message(self) -> pb.WorkerMessage:
        """Ready, naming the first round of each fragment this worker will push (none: every round)."""
        assert self.state is not None
        if self.schedule is not None:
            first = self.state.first_rounds(list(self.schedule()))
        else:
            first = list(self.join_from or [])
        return pb.WorkerMessage(ready=pb.Ready(from_rounds=first))

    # --- on the link's thread: what the engine and the transport ask -----------------------------------
    def _become_member(self, fut: Future) -> None:
        self._want_member = True
        if self.error:
            settle(fut, exc=SyncError(self.error))
            return
        self._on_member.append(fut)
        self._outbox.put(self._ready_message())

    def _keep_push(self, fragment: int, round: int, push: Kept) -> None:
        assert self.state is not None
        if self.state.keep(fragment, round, push) and self._connected:
            self._send_push(fragment, round, push)

    def _send_push(self, fragment: int, round: int, push: Kept) -> None:
        assert self.state is not None
        p = self.progress()
        header = pb.PushHeader(
            weight=push.weight,
            has_loss=push.loss is not None,
            loss=push.loss or 0.0,
            step=p.step,
            blocked_seconds=p.blocked_seconds,
            total_steps=p.total_steps,
            tokens=p.tokens,
            has_utilization=p.compute_utilization is not None,
            compute_utilization=p.compute_utilization or 0.0,
            has_eval_loss=p.eval_loss is not None,
            eval_loss=p.eval_loss or 0.0,
            eval_step=p.eval_step,
            step_seconds=p.step_seconds or 0.0,
        )
        for chunk in to_chunks(push.enc, fragment, round, self.chunk_values):
            self._outbox.put(
                pb.WorkerMessage(push=pb.Push(chunk=chunk, header=header if chunk.seq == 0 else None))
            )
        self.state.awaiting.add((fragment, round))
        self._sent_at[(fragment, round)] = time.perf_counter()

    def _want(self, fragment: int, round: int, fut: Future) -> None:
        if self.error:
            settle(fut, exc=SyncError(self.error))
            return
        self._wanted.setdefault((fragment, round), []).append(fut)
        self._hand_over()

    def _flush(self, fut: Future) -> None:
        self._on_flushed.append(fut)
        self._check_flushed()

    def _check_flushed(self) -> None:
        assert self.state is not None
        if self._on_flushed and (not self.state.awaiting or not self._connected or self.error):
            for fut in self._on_flushed:
                settle(fut, not self.state.awaiting)
            self._on_flushed.clear()

    def _install(self, fetched: dict[int, tuple[torch.Tensor, int]]) -> list[int]:
        """A joiner set its parameters from `fetched`; returns the rounds its mirror holds, per fragment."""
        assert self.state is not None
        for f, (_, rnd) in fetched.items():
            self.state.installed(f, rnd)
        return [fetched[f][1] for f in range(len(self.slices))]

    def _view(self) -> tuple[list[int], list[bool], list[bool]]:
        """Where this shard is, as of now: its Welcome moved on by the updates that came since."""
        assert self.state is not None and self._welcome is not None
        w = self._welcome
        rounds, started = list(w.rounds), list(w.started)
        short = [s and n < w.min_workers for s, n in zip(w.started, w.pushes, strict=True)]
        held = [(f, c - 1) for f, c in enumerate(self.state.covered) if c > 0]
        for f, r in [*self.state.arrived, *held]:
            if r + 1 > rounds[f]:
                rounds[f], started[f], short[f] = r + 1, False, False
        return rounds, started, short

    # --- what other threads call -----------------------------------------------------------------------
    def ready(self, timeout: float = 60.0) -> pb.Welcome:
        """Become a member: rounds that start from now on wait for this worker's pushes (from the rounds
        `_ready_message` names). Pushes kept from before are sent again when the shard says so."""
        fut: Future = Future()
        self._post(self._become_member, fut)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            raise SyncError(f"shard {self.shard} at {self.target} did not answer Ready") from None

    def push(self, fragment: int, round: int, enc: Encoded, weight: float, loss: float | None) -> None:
        """Send a push (now, or after the reconnect under way) and keep it until its round's update."""
        if self.error:
            raise SyncError(self.error)
        self._post(self._keep_push, fragment, round, Kept(enc, weight, loss))

    def want(self, fragment: int, round: int) -> Future:
        """A future of the round's update (an Update: see LinkState.take), set as soon as it is here; it
        fails with SyncError when the link fails for good."""
        fut: Future = Future()
        self._post(self._want, fragment, round, fut)
        return fut

    def wait_update(self, fragment: int, round: int, timeout: float | None = None) -> Update:
        """Block until the round's update is here and take it (tools and tests; the engine uses want())."""
        try:
            return self.want(fragment, round).result(timeout)
        except FutureTimeout:
            raise SyncError(
                f"no update for fragment {fragment} round {round} from shard {self.shard}"
            ) from None

    def inspect(self, fn: Callable[[LinkState], Any], timeout: float | None = None) -> Any:
        """fn(state) run on the link's thread, the state's one writer (a consistent look; tools and tests)."""

        def look() -> Any:
            if self.state is None:
                raise SyncError(f"the link to shard {self.shard} has not joined: no state to inspect")
            return fn(self.state)

        return self._ask(look).result(timeout)

    def install(self, fetched: dict[int, tuple[torch.Tensor, int]]) -> list[int]:
        """Take fetched master slices as the rounds this link holds; returns their rounds (joining)."""
        return self._ask(self._install, fetched).result()

    def view(self) -> tuple[list[int], list[bool], list[bool]]:
        """Where the run is, as this shard says: per fragment the open round, whether it has started and
        whether it is short of its quorum (see GrpcTransport._view)."""
        return self._ask(self._view).result()

    def resync(self, timeout: float | None = None) -> None:
        """Compare what this link holds with the shard's last Welcome and fetch or resend what differs."""
        assert self._welcome is not None, "resync needs a session"
        try:
            self._ask(self._resync, self._welcome).result(timeout)
        except _Retry as e:
            raise SyncError(str(e)) from None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every push sent on this session has its PushResult (for a clean stop)."""
        fut: Future = Future()
        self._post(self._flush, fut)
        try:
            return bool(fut.result(timeout))
        except FutureTimeout:
            return False

    def state_dict(self) -> dict:
        """What a worker checkpoint keeps of the link: the pushes not yet answered by an update (the rounds
        its mirror holds are in the engine's part)."""
        assert self.state is not None
        state = self._ask(self.state.state_dict).result()
        return {"target": self.target, "shard": self.shard, **state}

    def fetch(
        self, fragments: list[int] | None = None, attempts: int = 3
    ) -> dict[int, tuple[torch.Tensor, int]]:
        """The current master slices (fp32) and their rounds, every chunk checked against this link's slices
        (common/fetch.py: order, sizes, rounds, finite values), resuming from the last chunk received if the
        stream breaks. SyncError when the shard sends what does not fit: nothing of it is kept."""
        want = list(fragments) if fragments is not None else list(range(len(self.slices)))
        try:
            got = fetch_slices(
                self.stub,
                {f: self.slices[f][1] for f in want},
                where=f"shard {self.shard} at {self.target}",
                token=self.token,
                attempts=attempts,
                on_chunk=lambda m: self._count("in", m.ByteSize()),
            )
        except FetchError as e:
            raise SyncError(str(e)) from None
        log.debug("fetched %s", got.describe())
        return got.masters()

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._closed.set()
        self._outbox.put(None)
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
        if self._call is not None:
            self._call.cancel()
        self.channel.close()


class GrpcTransport:
    """The engine's Transport over gRPC: one ShardLink per shard, ordered by shard index."""

    def __init__(self, links: list[ShardLink]):
        by_index = sorted(links, key=lambda link: link.shard)
        num = by_index[0].num_shards
        if [link.shard for link in by_index] != list(range(num)) or any(
            link.num_shards != num for link in by_index
        ):
            got = ", ".join(f"{link.target} is shard {link.shard}/{link.num_shards}" for link in links)
            raise SyncError(f"--servers must list each of the run's shards once: {got}")
        self.links, self.num_shards = by_index, num
        self.installed: list[list[int]] = []  # a joiner's fetched rounds, per fragment and shard

    @classmethod
    def open(
        cls,
        targets: list[str],
        worker: str,
        fingerprint: dict,
        token: str = "",
        join_timeout: float = 60.0,
        reconnect_timeout: float = 600.0,
        states: list[dict] | None = None,
        held: list[list[int]] | None = None,
        tls: ClientTLS | None = None,
    ) -> GrpcTransport:
        """Join every shard and open a passive session with each (nobody waits for us yet); with `states`
        (a worker checkpoint's links, in shard order) and `held` (its engine's mirror rounds, per fragment
        and shard), each link first takes back what it held."""
        if states is not None and len(states) != len(targets):
            raise SyncError(
                f"the checkpoint has links to {len(states)} shards, --servers names {len(targets)}"
            )
        links: list[ShardLink] = []
        try:
            for i, t in enumerate(targets):
                links.append(ShardLink(t, worker, fingerprint, token, join_timeout, reconnect_timeout, tls))
                links[-1].start(
                    None if states is None else states[i],
                    None if held is None else [h[i] for h in held],
                )
            return cls(links)
        except BaseException:
            for link in links:
                link.close()
            raise

    def join_run(
        self,
        fragment_vectors: Callable[[list[torch.Tensor]], None],
        prepare: Callable[[], None] | None = None,
    ) -> int:
        """A new worker: fetch every master slice (after the sessions opened, so no update is missed), hand
        the full fragments to `fragment_vectors(list of tensors)`, pick the step to start counting from (0
        for a run that has not synced yet) and become a member of every shard from the first round it will
        push. Returns that step; `installed` then holds the rounds of the fetched slices."""
        cfg = self.links[0].config
        assert cfg is not None
        parts = [link.fetch() for link in self.links]
        per_link = [link.install(part) for link, part in zip(self.links, parts, strict=True)]
        self.installed = [list(r) for r in zip(*per_link, strict=True)]
        fragment_vectors([torch.cat([p[f][0] for p in parts]) for f in range(len(parts[0]))])
        if prepare is not None:  # what the caller does before its first step, done before anyone waits for us
            prepare()
        start = joining_step([self._view()], cfg)
        first = [sends_through(f, start, cfg) for f in range(cfg.num_scheduled_fragments)]
        for link in self.links:
            link.join_from = first  # rounds before these: no shard waits for us; we take their updates
            link.ready()
        return start

    def _view(self) -> tuple[list[int], list[bool], list[bool]]:
        """Where the run is, as of now: per fragment the open round, whether it is in progress and whether it
        is short of its quorum, from each shard's Welcome moved on by the updates that came since. Shards
        can disagree (a push that reached one shard and not another, from a worker that died between):
        then the shard that is behind counts, so that a joiner pushes the round it still needs."""
        per_shard = [link.view() for link in self.links]
        out: tuple[list[int], list[bool], list[bool]] = ([], [], [])
        for f in range(len(per_shard[0][0])):
            low = min(v[0][f] for v in per_shard)
            behind = [v for v in per_shard if v[0][f] == low]
            out[0].append(low)
            out[1].append(all(v[1][f] for v in behind))
            out[2].append(any(v[2][f] for v in behind))
        return out

    def resume(self, schedule: Callable[[], list[int]]) -> None:
        """A worker restarted from its checkpoint (its links loaded in open()): fetch the slices of rounds
        that closed meanwhile, become a member from the next round it pushes (`schedule()`: the engine's
        next round of each fragment), and send again the kept pushes whose rounds are still open."""
        for link in self.links:
            link.schedule = schedule
            link.resync()
        for link in self.links:
            link.ready()

    def follow(self, schedule: Callable[[], list[int]]) -> None:
        """After a reconnect, become a member from the next round `schedule()` says each fragment sends."""
        for link in self.links:
            link.schedule = schedule

    def first_rounds(self, num_fragments: int) -> list[int]:
        """Per fragment, the first round not yet in the mirror on every shard."""
        covered = [link.inspect(lambda st: list(st.covered)) for link in self.links]
        return [min(c[f] for c in covered) for f in range(num_fragments)]

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        for link, enc in zip(self.links, slices, strict=True):
            link.push(fragment, round, enc, weight, loss)

    def update(self, fragment: int, round: int) -> Future:
        """A future of the round's update: one Update per shard slice, once every slice is here."""
        return gather([link.want(fragment, round) for link in self.links])

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (up to `timeout` in all) until every push sent has been answered."""
        deadline = time.monotonic() + timeout
        return all([link.flush(max(0.0, deadline - time.monotonic())) for link in self.links])

    def state_dict(self) -> list[dict]:
        return [link.state_dict() for link in self.links]

    @property
    def pace_seconds(self) -> float:
        """The run's pace (the slowest member's seconds per inner step) as the shards last said: the largest
        of their answers (each sees the same members, a moment apart); 0.0 before any said one."""
        return max(link.pace_seconds for link in self.links)

    @property
    def reconnects(self) -> int:
        return sum(link.reconnects for link in self.links)

    @property
    def resent(self) -> int:
        return sum(link.resent for link in self.links)

    def report_progress(self, progress: Callable[[], Progress]) -> None:
        """What every push's header reports (steps, blocked time, tokens, eval loss...), for the dashboard."""
        for link in self.links:
            link.progress = progress

    def on_push_answered(self, on_answer: Callable[[float], None]) -> None:
        """`on_answer` gets the seconds from each push's send to the shard's acceptance (for /metrics)."""
        for link in self.links:
            link.on_answer = on_answer

    @property
    def results(self) -> dict[str, int]:
        """Answers to this worker's pushes, by outcome, over all shards."""
        return {k: sum(link.results[k] for link in self.links) for k in PUSH_OUTCOMES}

    @property
    def message_bytes(self) -> tuple[int, int]:
        """Serialized protobuf bytes sent and received (gRPC and HTTP/2 framing not included)."""
        return sum(link.msg_out for link in self.links), sum(link.msg_in for link in self.links)

    def close(self) -> None:
        for link in self.links:
            link.close()


def gather(futures: list[Future]) -> Future:
    """One future of the results of all `futures` (in order); it fails as soon as one of them fails."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def on_done(f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if f.cancelled():
            settle(out, exc=SyncError("cancelled"))
        elif f.exception() is not None:
            settle(out, exc=f.exception())
        elif last:
            settle(out, [x.result() for x in futures])

    for f in futures:
        f.add_done_callback(on_done)
    return out


SYNC_FIELDS = frozenset(SyncConfig.__dataclass_fields__)
SCHEDULE_FIELDS = ("sync_every", "num_fragments", "fragment_sync_delay")  # valid or not only together


def chosen_sync_fields(sync: SyncConfig | None, sync_set: frozenset[str] | None) -> frozenset[str]:
    """The SyncConfig fields a worker set itself (the rest it takes from the shard): `sync_set` as given
    (every name must be a field), or, when None, the fields in which `sync` differs from SyncConfig()'s
    defaults (none when there is no `sync`)."""
    if sync_set is not None:
        if unknown := sorted(set(sync_set) - SYNC_FIELDS):
            raise ValueError(f"sync_set names {unknown[0]!r}, which is not a SyncConfig field")
        return frozenset(sync_set)
    if sync is None:
        return frozenset()
    default = SyncConfig()
    return frozenset(f for f in SYNC_FIELDS if getattr(sync, f) != getattr(default, f))


def given_sync(values: dict) -> SyncConfig:
    """A SyncConfig of the settings a user gave (`values`: field -> value) over the defaults, checked as a
    whole only where it can be: a setting may be valid with the shard's alone (H=12 goes with the shard's
    P=3, not with the default P=5), so a combination the defaults do not take is kept unchecked for
    connect(), which checks it with the shard's settings in (adopt_sync)."""
    try:
        return SyncConfig(**values)
    except ValueError:
        if unknown := sorted(set(values) - SYNC_FIELDS):
            raise ValueError(f"unknown sync config field {unknown[0]!r}") from None
        # what is wrong on its own (a codec's name, alpha out of [0, 1]...) is said now
        SyncConfig(**{k: x for k, x in values.items() if k not in SCHEDULE_FIELDS})
        unchecked = object.__new__(SyncConfig)
        for f, x in {**SyncConfig().to_dict(), **values}.items():
            object.__setattr__(unchecked, f, x)  # frozen: set as its __init__ would
        return unchecked


def adopt_sync(
    mine: SyncConfig, shards: SyncConfig, chosen: frozenset[str], where: str = "the shard"
) -> SyncConfig:
    """The worker's settings: its own for the `chosen` fields, the shard's for every other. ValueError (one
    line) when the two do not make a valid config together (say, tau set to 8 with the shard's H of 6).
    Where a chosen field that is in the fingerprint differs from the shard's, Join refuses as ever."""
    values = {f: getattr(mine if f in chosen else shards, f) for f in SYNC_FIELDS}
    try:
        return SyncConfig(**values)
    except ValueError as e:
        raise ValueError(f"the settings given do not go with those of {where}: {e}") from None


@dataclass(frozen=True)
class ShardInfo:
    """What a shard says before a worker joins: the run's settings, its index, and whether it still waits
    for its first worker's parameters (server --init from-worker)."""

    config: SyncConfig
    shard: int
    num_shards: int
    uninitialized: bool


def probe_shard(
    target: str, worker: str, token: str = "", timeout: float = 60.0, tls: ClientTLS | None = None
) -> ShardInfo:
    """The shard's ShardInfo (a Join that asks only for the run's config)."""
    link = ShardLink(target, worker, {}, token, timeout, tls=tls)
    try:
        config = link.join(config_only=True)
        assert link.probed is not None
        return ShardInfo(config, *link.probed)
    finally:
        link.close()


INIT_CHUNK_VALUES = 1 << 18  # fp32 values per Initialize message: 1 MiB


def initialize_shard(
    target: str,
    worker: str,
    fingerprint: dict,
    vectors: list[torch.Tensor],
    info: ShardInfo,
    token: str = "",
    timeout: float = 60.0,
    tls: ClientTLS | None = None,
) -> bool:
    """Send this worker's starting parameters (`vectors`: its fragments, flat) to a shard that has none: its
    slice of each fragment, after the fingerprint. True once the shard has them (and has written them to its
    checkpoint); False when another worker's upload got there first (this one then joins as any worker and
    is checked against that worker's fingerprint). SyncError when the shard refuses them."""
    first = {"worker": worker, "token": token, "fingerprint_json": json.dumps(fingerprint)}

    def chunks():
        head = first
        for f, vec in enumerate(vectors):
            lo, hi = slice_ranges(vec.numel(), info.num_shards)[info.shard]
            for a in range(lo, hi, INIT_CHUNK_VALUES):
                b = min(hi, a + INIT_CHUNK_VALUES)
                yield pb.InitChunk(**head, fragment=f, offset=a - lo, values=values_to_bytes(vec[a:b]))
                head = {}
        yield pb.InitChunk(**head, last=True)

    give_up = time.monotonic() + timeout
    with make_channel(parse_target(target), tls) as channel:
        try:
            pb_grpc.ShardStub(channel).Initialize(chunks(), metadata=auth_metadata(token), timeout=timeout)
            log.info("%s: sent its starting parameters to the shard at %s, which had none", worker, target)
            return True
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.ALREADY_EXISTS:
                return False
            if code != grpc.StatusCode.ABORTED:  # ABORTED: another worker is sending them now
                raise SyncError(
                    f"shard at {target} refused this worker's starting parameters: {code.name}: {e.details()}"
                ) from None
    wait_initialized(target, worker, token, max(0.1, give_up - time.monotonic()), tls)
    return False


def wait_initialized(
    target: str, worker: str, token: str = "", timeout: float = 60.0, tls: ClientTLS | None = None
) -> None:
    """Wait until another worker's upload has given the shard its parameters; SyncError after `timeout`."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if not probe_shard(target, worker, token, max(0.1, give_up - time.monotonic()), tls).uninitialized:
            return
        time.sleep(0.2)
    raise SyncError(
        f"the shard at {target} still has no parameters after {timeout:g} s: if the worker that was sending "
        "them stopped, start every shard again with --fresh"
    )


def connect(
    model: torch.nn.Module,
    servers: list[str] | str,
    sync: SyncConfig | None = None,
    total_steps: int | None = None,
    name: str | None = None,
    token: str = "",
    seed: int = 0,
    rank: int = 0,
    join_timeout: float = 60.0,
    reconnect_timeout: float = 600.0,
    resume: dict | None = None,
    interrupt: threading.Event | None = None,
    prepare: Callable[[], None] | None = None,
    tls: ClientTLS | None = None,
    blocks_path: str | None = None,
    fragments: Sequence[Sequence[str]] | None = None,
    sync_set: frozenset[str] | None = None,
) -> SyncEngine:
    """Join a run around your own model and loop. Joins every shard (the model's fingerprint must match
    theirs), sets the model's parameters to the run's global ones, and returns the SyncEngine: call its
    `step(tokens, loss)` right after every `inner_optimizer.step()`, and `close()` at the end.

    A run in progress is joined too: the engine then starts counting at the run's current step
    (`engine.step_count`), so that its sends line up with the other workers'; take part from there.
    The Streaming DiLoCo settings (H, P, the fragment pattern, tau, alpha, the codecs, ...) are the shard's,
    except those this worker sets: the fields named in `sync_set`, with their values from `sync` (default
    for `sync_set`: the fields in which `sync` differs from SyncConfig(); pass frozenset() to take every
    setting from the shard, or every field's name to take none). One set here that the shards must agree
    on (H, P, the pattern, the codecs) and that differs from theirs is refused at Join with the difference;
    tau, alpha and the merge settings are this worker's own, the shard's only their default. The settings
    in force are `engine.cfg`; for settings that are valid only with the shard's (H=12 with its P=3),
    pass given_sync({"sync_every": 12}). A shard that has no parameters yet (server --init from-worker) gets
    this worker's. `total_steps` lets the engine sync every fragment at the last step (final_sync).
    `resume` is a worker checkpoint's dict (see worker/run.py): the engine and the links continue from it,
    and the model keeps its parameters.
    `prepare()`, if given, is called once the model holds the global parameters and before any shard waits
    for this worker (say, to evaluate them): slow work there does not hold up the others. `tls`: connect
    over TLS (the run's CA; for mutual TLS this worker's certificate), see common/tls.py. `join_timeout`:
    seconds to wait for each shard to answer (the worker CLI's --join-timeout); while none does, a line says
    so every few seconds.

    The fragments: by default the model's largest nn.ModuleList holds its blocks, split into P-1 fragments,
    and every other parameter makes the last one. `blocks_path="encoder.layers"` names the ModuleList (for a
    model with several, or whose largest list is not its blocks). `fragments=[["embed", "head"],
    ["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]` groups the parameters yourself: each group (names
    of parameters or of modules, whose parameters all go with it) syncs together as one fragment, and what
    no group names makes one more, the last; P (`sync.num_fragments`) must equal the fragments made. The
    shards must build the same layout: start them with the same --blocks-path or --fragments (the
    fingerprint carries the layout, and a shard with another refuses this worker by saying so)."""
    import os
    import socket

    from streamdiloco.common.fingerprint import model_fingerprint
    from streamdiloco.common.fragments import build_layout, flatten, fragment_params, unflatten_into

    wrapper = type(model).__name__
    if wrapper in ("DistributedDataParallel", "FullyShardedDataParallel") or wrapper.startswith("FSDP"):
        raise ValueError(
            f"a {wrapper}-wrapped model is a worker of several ranks: call "
            "streamdiloco.worker.group.connect_group(model, servers, ...) on every rank instead of connect()"
        )
    chosen = chosen_sync_fields(sync, sync_set)
    sync = sync or SyncConfig()
    targets = [s.strip() for s in servers.split(",")] if isinstance(servers, str) else list(servers)
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    infos = [probe_shard(t, name, token, join_timeout, tls) for t in targets]
    if chosen != SYNC_FIELDS:  # the run's settings first: the fingerprint is made with them
        sync = adopt_sync(sync, infos[0].config, chosen, f"the shard at {targets[0]}")
        if taken := [f for f in ADOPTED_LOG if f not in chosen]:
            log.info(
                "%s: from the shard at %s: %s",
                name,
                targets[0],
                ", ".join(f"{f}={getattr(sync, f)}" for f in taken),
            )
    else:
        sync = SyncConfig(**sync.to_dict())  # checked as a whole (given_sync may have left it unchecked)
    layout = build_layout(model, sync.num_fragments, sync.fragment_pattern, blocks_path, fragments)
    fingerprint = model_fingerprint(layout, sync, seed)
    if any(info.uninitialized for info in infos):  # server --init from-worker: ours, if we are the first
        vectors = [flatten(fragment_params(model, f)) for f in layout.fragments]
        # one worker's values in every shard: only a worker that found no shard initialized and got its
        # upload into the first sends to the others; the rest wait (the shards hold no mix of two workers')
        ours = all(info.uninitialized for info in infos)
        for t, info in zip(targets, infos, strict=True):
            if info.uninitialized and ours:
                ours = initialize_shard(t, name, fingerprint, vectors, info, token, join_timeout, tls)
            elif info.uninitialized:
                wait_initialized(t, name, token, join_timeout, tls)
        del vectors
    warm_up(tuple({sync.uplink_codec, sync.downlink_codec}), sync.codec_block_size)  # not in round 1
    transport = GrpcTransport.open(
        targets,
        name,
        fingerprint,
        token,
        join_timeout,
        reconnect_timeout,
        states=None if resume is None else resume["links"],
        held=None if resume is None else resume["engine"]["mirror_rounds"],
        tls=tls,
    )
    try:
        for link in transport.links:
            want = [slice_ranges(frag.numel, link.num_shards)[link.shard] for frag in layout.fragments]
            if [(lo, lo + n) for lo, n in link.slices] != want:
                raise SyncError(f"shard {link.shard} at {link.target} sent slices that do not fit this model")

        def set_params(vectors: list[torch.Tensor]) -> None:
            with torch.no_grad():
                for frag, vec in zip(layout.fragments, vectors, strict=True):
                    unflatten_into(vec, fragment_params(model, frag))

        start = 0
        if resume is None:
            start = transport.join_run(set_params, prepare)
            if total_steps is not None and start >= total_steps:
                raise SyncError(
                    f"the run is at step {start}, past total_steps={total_steps}: nothing left to do"
                )
        engine = SyncEngine(
            model,
            layout,
            sync,
            transport,
            total_steps=total_steps,
            seed=seed,
            rank=rank,
            start_step=start,
            interrupt=interrupt,
        )
        if resume is not None:
            engine.load_state_dict(resume["engine"])
            # before resume(): the pushes it sends again report the resumed step, not 0
            transport.report_progress(engine.progress)
            transport.resume(engine.next_rounds)
            log.info("%s resumes at step %d", name, engine.step_count)
            return engine
        engine.set_mirror_rounds(transport.installed)
        transport.report_progress(engine.progress)
        transport.follow(engine.next_rounds)
        if start:
            log.info("%s joins the run in progress at step %d", name, start)
            engine.catch_up(transport.first_rounds(layout.num_fragments))
        return engine
    except BaseException:
        transport.close()
        raise
