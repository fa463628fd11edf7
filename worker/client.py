"""The worker's side of the wire: one background session per shard, and the Transport the engine uses.

Each ShardLink joins its shard, then keeps a bidirectional Session open: pushes are cut into chunks and
queued (the training thread never waits for the network), and a receiver thread assembles the updates that
come down and wakes whoever waits for them. GrpcTransport bundles the links of all S shards, ordered by
shard index, and is what SyncEngine calls.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from streamdiloco.common.codecs import Encoded, chunk_alignment, concat, expected_sizes, get_codec
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.metrics import PUSH_OUTCOMES, push_outcome
from streamdiloco.common.schedule import joining_step, sends_through
from streamdiloco.common.wire import (
    PROTOCOL,
    bytes_to_values,
    from_chunk,
    make_channel,
    parse_target,
    to_chunks,
)
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

log = logging.getLogger("streamdiloco.worker")


WAIT_LOG_SECONDS = 30.0  # log while waiting this long for an update
MAX_BACKOFF = 8.0  # seconds between reconnect attempts, at most (before jitter)


class SyncError(RuntimeError):
    """The session with a shard failed for good: the worker cannot go on syncing."""


@dataclass(frozen=True)
class Master:
    """A master slice fetched to resynchronize: the mirror's slice becomes `values`, which hold every round
    of the fragment before `round` (in place of the updates this worker missed)."""

    values: torch.Tensor
    round: int


# What an update is, to the engine: an Encoded update to add to the mirror, a Master to replace the mirror's
# slice with, or None: nothing to do (the mirror already holds that round, from a fetch).
Update = Encoded | Master | None

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


class StopRequested(Exception):
    """The worker was asked to stop (SIGTERM, Ctrl+C) while it waited for an update; nothing was taken."""


class ShardLink:
    """One shard: Join, a Session that stays open, and its resumption when it breaks.

    Pushes are kept (encoded) until their round's update arrives. When the session breaks, a background
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
    ):
        self.target, self.worker, self.token = parse_target(target), worker, token
        self.fingerprint, self.join_timeout, self.reconnect_timeout = (
            fingerprint,
            join_timeout,
            reconnect_timeout,
        )
        self.channel = make_channel(self.target)
        self.stub = pb_grpc.ShardStub(self.channel)
        self._cond = threading.Condition()
        self._sync_lock = threading.Lock()  # one resync (or a joiner's install of its fetch) at a time
        self._updates: dict[tuple[int, int], Encoded] = {}
        self._partial: dict[tuple[int, int], list[Encoded]] = {}
        self._masters: dict[int, Master] = {}  # fetched on resync, not yet taken by the engine
        self._unacked: dict[tuple[int, int], tuple[Encoded, float, float | None]] = {}
        self._awaiting_result: set[tuple[int, int]] = set()  # sent on this session, no PushResult yet
        self.refusals: list[pb.PushResult] = []
        self.error: str | None = None
        self.msg_out = 0
        self.msg_in = 0
        self.reconnects = 0
        self.resent = 0
        self.results = dict.fromkeys(PUSH_OUTCOMES, 0)  # answers to pushes, by outcome (for /metrics)
        self.progress: Callable[[], tuple[int, float]] = lambda: (0, 0.0)  # (step, blocked s) for headers
        self.on_answer: Callable[[float], None] | None = None  # gets seconds from a push's send to its answer
        self._sent_at: dict[tuple[int, int], float] = {}
        self._closing = False
        self._closed = threading.Event()  # wakes the reconnect backoff when the link closes
        self.interrupt: threading.Event | None = None  # set by a stop request: waits for updates give up
        self._connected = False  # a session is open and this worker is a member on it
        self._welcome: pb.Welcome | None = None  # the latest Welcome (answer to Hello or Ready)
        self._want_member = False  # ready() was called: a reconnect makes us a member again
        self.join_from: list[int] | None = None  # first rounds a joining worker pushes (see join_run)
        self.schedule = None  # () -> the next round each fragment sends (the engine's, once there is one)
        self._outbox: queue.Queue = queue.Queue()
        self._call = None
        self._receiver: threading.Thread | None = None
        self.config: SyncConfig | None = None
        self.shard = self.num_shards = self.chunk_values = 0
        self.slices: list[tuple[int, int]] = []
        self.covered: list[int] = []  # rounds < covered[f] are in the mirror (fetched), per fragment
        self._applied_cover: list[int] = []  # covered, counting only fetched masters the engine has taken
        self.merged: list[int] = []  # rounds < merged[f] have been merged by the engine

    # --- connecting ------------------------------------------------------------------------------------
    def join(self, timeout: float | None = None, reconnecting: bool = False) -> None:
        """Join the shard, waiting up to `timeout` for it to be reachable. SyncError if it refuses; when
        `reconnecting`, _Retry if it cannot be reached (or still holds our old session)."""
        timeout = self.join_timeout if timeout is None else timeout
        give_up = time.monotonic() + timeout
        request = pb.JoinRequest(
            worker=self.worker,
            token=self.token,
            fingerprint_json=json.dumps(self.fingerprint),
            protocol=PROTOCOL,
        )
        while True:
            try:
                reply = self.stub.Join(
                    request,
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
                    raise SyncError(f"no answer from a shard at {self.target} within {timeout:g} s") from None
                raise SyncError(f"shard at {self.target} refused Join: {code.name}: {e.details()}") from None
        try:
            config = SyncConfig.from_dict(json.loads(reply.config_json))
        except (ValueError, TypeError) as e:
            raise SyncError(f"shard at {self.target} sent a config this worker cannot read: {e}") from None
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
        if not self.covered:
            self.covered = [0] * len(slices)
            self._applied_cover = [0] * len(slices)
            self.merged = [0] * len(slices)
        self._session_id = reply.session

    def open_session(self) -> pb.Welcome:
        """Start a passive session (updates come, no round waits for us) and return the shard's Welcome."""
        outbox: queue.Queue = queue.Queue()
        self._outbox.put(None)  # ends the previous session's request stream, if any
        self._outbox = outbox
        call = self.stub.Session(self._requests(outbox, self._session_id))
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
        self.msg_in += first.ByteSize()
        w = first.welcome
        n = len(self.slices)
        if first.WhichOneof("kind") != "welcome" or not len(w.rounds) == len(w.started) == len(w.pushes) == n:
            call.cancel()
            raise SyncError(f"shard {self.shard} at {self.target} did not start the session with a Welcome")
        self._call = call
        return first.welcome

    def start(self, state: dict | None = None) -> None:
        """Join, restore a checkpoint's `state` if given, open a passive session and start the receiver."""
        self.join()
        if state is not None:
            if state["shard"] != self.shard:
                raise SyncError(
                    f"{self.target} is shard {self.shard}, the checkpoint's link to it was shard "
                    f"{state['shard']}: give --servers in the same order as before"
                )
            self.load_state_dict(state)
        try:
            self._welcome = self.open_session()
        except _Retry as e:
            raise SyncError(f"shard at {self.target}: {e}") from None
        self._receiver = threading.Thread(target=self._run, name=f"shard{self.shard}-rx", daemon=True)
        self._receiver.start()

    def _ready_message(self) -> pb.WorkerMessage:
        """Ready, naming the first round of each fragment this worker will push (none: every round)."""
        if self.schedule is not None:
            first = list(self.schedule())
            for f, r in self._unacked:
                first[f] = min(first[f], r)
        else:
            first = list(self.join_from or [])
        return pb.WorkerMessage(ready=pb.Ready(from_rounds=first))

    def ready(self, timeout: float = 60.0) -> pb.Welcome:
        """Become a member: rounds that start from now on wait for this worker's pushes (from the rounds
        `_ready_message` names). Pushes kept from before are sent again when the shard says so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._want_member = True
            self._outbox.put(self._ready_message())
            while not self._connected:
                if self.error:
                    raise SyncError(self.error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SyncError(f"shard {self.shard} at {self.target} did not answer Ready")
                self._cond.wait(min(left, 0.25))
            assert self._welcome is not None
            return self._welcome

    def _requests(self, outbox: queue.Queue, session: str):
        hello = pb.WorkerMessage(hello=pb.Hello(worker=self.worker, session=session, passive=True))
        self.msg_out += hello.ByteSize()
        yield hello
        while True:
            msg = outbox.get()
            if msg is None:
                return
            self.msg_out += msg.ByteSize()
            yield msg

    # --- the receiver thread: read the session; when it breaks, reconnect --------------------------------
    def _run(self) -> None:
        while True:
            problem = self._receive()
            if self._closing or self.error:
                return
            with self._cond:
                self._connected = False
                self._awaiting_result.clear()
                self._sent_at.clear()
                self._partial.clear()  # half an update: it comes again whole, or a fetch replaces it
            log.warning("%s; reconnecting", problem)
            try:
                self._reconnect()
            except SyncError as e:
                self._fail(str(e))
                return
            except Exception as e:  # never end silently: the training thread would wait for ever
                self._fail(
                    f"reconnecting to shard {self.shard} at {self.target} failed: {type(e).__name__}: {e}"
                )
                return

    def _receive(self) -> str:
        """Read the session until it ends; returns why it ended."""
        try:
            for msg in self._call:  # type: ignore[union-attr]
                self.msg_in += msg.ByteSize()
                kind = msg.WhichOneof("kind")
                if kind == "update":
                    self._on_update(msg.update)
                elif kind == "result":
                    self._on_result(msg.result)
                elif kind == "welcome":
                    self._on_welcome(msg.welcome)
            return f"shard {self.shard} at {self.target} ended the session"
        except grpc.RpcError as e:
            if e.code() in RETRYABLE or self._closing:
                return (
                    f"session with shard {self.shard} at {self.target} broke: {e.code().name}: {e.details()}"
                )
            self._fail(
                f"session with shard {self.shard} at {self.target} failed: {e.code().name}: {e.details()}"
            )
        except SyncError as e:
            self._fail(str(e))
        except Exception as e:  # a malformed message must not end the thread silently
            self._fail(f"shard {self.shard} sent what this worker cannot read: {type(e).__name__}: {e}")
        return "failed"

    def _reconnect(self) -> None:
        """Join again, resynchronize and become a member (if we were one); SyncError when time runs out.

        Attempts are spaced by exponential backoff with jitter (0.5 s doubling to MAX_BACKOFF, each times
        a random 0.5..1), so that many workers do not all come at once; during each, the Join waits for the
        channel, which connects as soon as the shard is back (gRPC retries the connection every 0.25..4 s)."""
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
                with self._cond:
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

    def _have(self, fragment: int) -> int:
        """Rounds of a fragment this worker holds the effect of, without gaps: merged, fetched, or here."""
        m = self._masters.get(fragment)
        h = max(self.covered[fragment], self.merged[fragment], m.round if m else 0)
        while (fragment, h) in self._updates:
            h += 1
        return h

    def _resync(self, welcome: pb.Welcome) -> None:
        """Compare the shard's rounds with ours; fetch the slices of fragments whose rounds we missed."""
        with self._sync_lock:
            self._resync_locked(welcome)

    def _resync_locked(self, welcome: pb.Welcome) -> None:
        with self._cond:
            have = [self._have(f) for f in range(len(self.slices))]
            # updates that came on this session after its Welcome say the shard is further on
            theirs = list(welcome.rounds)
            for f, r in self._updates:
                theirs[f] = max(theirs[f], r + 1)
        behind = []
        for f, (t, ours) in enumerate(zip(theirs, have, strict=True)):
            if t < ours:
                raise SyncError(
                    f"shard {self.shard} at {self.target} is at round {t} of fragment {f}, but this "
                    f"worker already has round {ours - 1}: the shard restarted from an older checkpoint than "
                    "its last round; restart the run from the shards' checkpoints and the workers' --resume"
                )
            if t > ours:
                behind.append(f)
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
        with self._cond:
            for f, (values, rnd) in fetched.items():
                if rnd <= self.covered[f]:
                    continue  # what we hold is as new already
                self._masters[f] = Master(values, rnd)
                self.covered[f] = rnd
                for key in [k for k in self._updates if k[0] == f and k[1] < rnd]:
                    del self._updates[key]
                for key in [k for k in self._unacked if k[0] == f and k[1] < rnd]:
                    del self._unacked[key]
            self._cond.notify_all()

    def _fail(self, message: str) -> None:
        with self._cond:
            self.error = message
            self._cond.notify_all()
        log.error(message)

    def _on_welcome(self, w: pb.Welcome) -> None:
        n = len(self.slices)
        if len(w.rounds) != n or len(w.started) != n or len(w.pushes) != n:
            raise SyncError(f"shard {self.shard} sent a Welcome for {len(w.rounds)} fragments")
        with self._cond:
            self._welcome = w
            if w.member and not self._connected:
                # a member (again): send every kept push whose round is still open (after a reconnect or
                # a resume; the shard had them only if it says "duplicate")
                for (f, r), (enc, weight, loss) in sorted(self._unacked.items()):
                    if r >= w.rounds[f]:
                        self._send_push(f, r, enc, weight, loss)
                        self.resent += 1
                self._connected = True
            self._cond.notify_all()

    def _on_result(self, r: pb.PushResult) -> None:
        with self._cond:
            self._awaiting_result.discard((r.fragment, r.round))
            self.results[push_outcome(None if r.accepted else r.reason)] += 1
            sent = self._sent_at.pop((r.fragment, r.round), None)
            self._cond.notify_all()
        if sent is not None and r.accepted and self.on_answer is not None:
            self.on_answer(time.perf_counter() - sent)
        if r.accepted:
            return
        if r.reason == "late":  # the round closed without us: its update still comes, and we apply it
            log.warning("shard %d: %s", self.shard, r.message)
        elif r.reason == "duplicate":  # sent before a reconnect and already in the round: nothing lost
            log.info("shard %d already has this worker's push: %s", self.shard, r.message)
        else:
            self.refusals.append(r)
            self._fail(f"shard {self.shard} refused a push ({r.reason}): {r.message}")
            return
        self.refusals.append(r)

    def _on_update(self, c: pb.Chunk) -> None:
        key = (c.fragment, c.round)
        if not 0 <= c.fragment < len(self.slices):
            raise SyncError(f"shard {self.shard} sent an update for unknown fragment {c.fragment}")
        assert self.config is not None
        want_total = self.slices[c.fragment][1]
        parts = self._partial.setdefault(key, [])
        at = sum(p.numel for p in parts)
        if c.codec != self.config.downlink_codec or c.block_size != (
            self.config.codec_block_size if get_codec(self.config.downlink_codec).scaled else 0
        ):
            raise SyncError(
                f"shard {self.shard} sent an update in {c.codec!r} with block size {c.block_size}"
            )
        part = from_chunk(c)
        payload, scales = expected_sizes(c.codec, c.numel, c.block_size or 1)
        align = chunk_alignment(c.codec, self.config.codec_block_size)
        if (
            (not c.last and c.numel % align)  # a chunk boundary inside a block would shift the codes
            or c.total != want_total
            or c.offset != at
            or c.seq != len(parts)
            or part.payload.numel() != payload
            or part.scales.numel() != scales
            or c.last != (at + c.numel == want_total)
        ):
            raise SyncError(
                f"shard {self.shard} sent a malformed update chunk for fragment {c.fragment} round {c.round}"
            )
        parts.append(part)
        if c.last:
            del self._partial[key]
            with self._cond:
                if c.round >= max(self.covered[c.fragment], self.merged[c.fragment]):
                    self._updates[key] = concat(parts)  # older rounds are in the mirror already
                self._cond.notify_all()

    # --- what the transport calls ----------------------------------------------------------------------
    def _send_push(self, fragment: int, round: int, enc: Encoded, weight: float, loss: float | None) -> None:
        step, blocked = self.progress()
        header = pb.PushHeader(
            weight=weight, has_loss=loss is not None, loss=loss or 0.0, step=step, blocked_seconds=blocked
        )
        for chunk in to_chunks(enc, fragment, round, self.chunk_values):
            self._outbox.put(
                pb.WorkerMessage(push=pb.Push(chunk=chunk, header=header if chunk.seq == 0 else None))
            )
        self._awaiting_result.add((fragment, round))
        self._sent_at[(fragment, round)] = time.perf_counter()

    def push(self, fragment: int, round: int, enc: Encoded, weight: float, loss: float | None) -> None:
        """Send a push (now, or after the reconnect under way) and keep it until its round's update."""
        with self._cond:
            if self.error:
                raise SyncError(self.error)
            if round < self.covered[fragment]:
                return  # the round closed while we were away; the fetched master holds it
            self._unacked[(fragment, round)] = (enc, weight, loss)
            if self._connected:
                self._send_push(fragment, round, enc, weight, loss)

    def _available(self, fragment: int, round: int) -> bool:
        return round < self.covered[fragment] or (fragment, round) in self._updates

    def has_update(self, fragment: int, round: int) -> bool:
        with self._cond:
            return self._available(fragment, round)

    def wait_available(self, fragment: int, round: int, timeout: float | None = None) -> None:
        """Block until the round's update (or a fetched master holding it) is here. Raises SyncError if the
        link failed for good, StopRequested if `interrupt` was set meanwhile; takes nothing either way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        next_log = time.monotonic() + WAIT_LOG_SECONDS
        with self._cond:
            while not self._available(fragment, round):
                if self.error:
                    raise SyncError(self.error)
                if self.interrupt is not None and self.interrupt.is_set():
                    raise StopRequested()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise SyncError(
                        f"no update for fragment {fragment} round {round} from shard {self.shard}"
                    )
                if now >= next_log:
                    next_log = now + WAIT_LOG_SECONDS
                    log.info(
                        "still waiting for fragment %d round %d from shard %d%s (a round waits for every "
                        "member's push or its deadline, and for --min-workers members)",
                        fragment,
                        round,
                        self.shard,
                        "" if self._connected else ", reconnecting",
                    )
                self._cond.wait(0.25 if deadline is None else max(0.0, min(0.25, deadline - now)))

    def take(self, fragment: int, round: int) -> Update:
        """The round's update, once wait_available said it is here: Encoded, a Master (after a resync), or
        None (the mirror has that round already). The round's push is then answered: it is let go."""
        with self._cond:
            out: Update
            if round < self.covered[fragment]:
                out = self._masters.pop(fragment, None)
                if out is not None:
                    self._applied_cover[fragment] = self.covered[fragment]
            else:
                out = self._updates.pop((fragment, round))
            self.merged[fragment] = max(self.merged[fragment], round + 1)
            for key in [k for k in self._updates if k[0] == fragment and k[1] <= round]:
                del self._updates[key]
            for key in [k for k in self._unacked if k[0] == fragment and k[1] <= round]:
                del self._unacked[key]
            return out

    def wait_update(self, fragment: int, round: int, timeout: float | None = None) -> Update:
        self.wait_available(fragment, round, timeout)
        return self.take(fragment, round)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every push sent on this session has its PushResult (for a clean stop)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._awaiting_result and self._connected and not self.error:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return not self._awaiting_result

    def state_dict(self) -> dict:
        """What a worker checkpoint keeps: rounds held and the pushes not yet answered by an update."""
        with self._cond:
            return {
                "target": self.target,
                "shard": self.shard,
                "covered": list(self._applied_cover),  # a fetched master not yet taken is not in the mirror
                "merged": list(self.merged),
                "unacked": [
                    {"fragment": f, "round": r, "enc": vars(enc).copy(), "weight": w, "loss": loss}
                    for (f, r), (enc, w, loss) in sorted(self._unacked.items())
                ],
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self._updates.clear()
            self._masters.clear()
            self._partial.clear()
            self.covered = list(state["covered"])
            self._applied_cover = list(state["covered"])
            self.merged = list(state["merged"])
            self._unacked = {
                (u["fragment"], u["round"]): (Encoded(**u["enc"]), u["weight"], u["loss"])
                for u in state["unacked"]
            }

    def fetch(
        self, fragments: list[int] | None = None, attempts: int = 3
    ) -> dict[int, tuple[torch.Tensor, int]]:
        """The current master slices (fp32) and their rounds, resuming from the last chunk received if the
        stream breaks."""
        want = list(fragments) if fragments is not None else list(range(len(self.slices)))
        got: dict[int, list[torch.Tensor]] = {f: [] for f in want}
        rounds: dict[int, int] = {}  # the round each fragment's chunks so far belong to
        done: set[int] = set()
        for attempt in range(attempts):
            todo = [f for f in want if f not in done]
            if not todo:
                break
            offset = sum(t.numel() for t in got[todo[0]])
            try:
                request = pb.FetchRequest(fragments=todo, offset=offset, token=self.token)
                call = self.stub.Fetch(request)  # no deadline: big models on slow links take long
                for m in call:
                    self.msg_in += m.ByteSize()
                    if m.fragment not in got or m.offset != sum(t.numel() for t in got[m.fragment]):
                        raise SyncError(
                            f"shard {self.shard} sent fragment {m.fragment} out of order in Fetch"
                        )
                    if rounds.setdefault(m.fragment, m.round) != m.round:
                        # a round closed between a broken stream and its resumption: fetch it anew
                        got[m.fragment], rounds[m.fragment] = [], m.round
                        call.cancel()
                        break
                    got[m.fragment].append(bytes_to_values(m.values))
                    if m.last:
                        done.add(m.fragment)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED:
                    continue  # we cancelled it, to start the fragment again
                if attempt + 1 == attempts or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise SyncError(
                        f"Fetch from shard {self.shard} failed: {e.code().name}: {e.details()}"
                    ) from None
                time.sleep(0.5 * (attempt + 1))
        out = {f: torch.cat(got[f]) if got[f] else torch.empty(0) for f in want}
        for f, t in out.items():
            if t.numel() != self.slices[f][1] or f not in rounds:
                raise SyncError(
                    f"shard {self.shard} sent {t.numel()} values of fragment {f}, want {self.slices[f][1]}"
                )
        return {f: (t, rounds[f]) for f, t in out.items()}

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._closed.set()
        self._outbox.put(None)
        if self._receiver is not None:
            self._receiver.join(timeout)
            if self._receiver.is_alive() and self._call is not None:
                self._call.cancel()
                self._receiver.join(timeout)
        elif self._call is not None:
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
        interrupt: threading.Event | None = None,
    ) -> GrpcTransport:
        """Join every shard and open a passive session with each (nobody waits for us yet); with `states`
        (a worker checkpoint's links, in shard order), each link first takes back what it held."""
        if states is not None and len(states) != len(targets):
            raise SyncError(
                f"the checkpoint has links to {len(states)} shards, --servers names {len(targets)}"
            )
        links: list[ShardLink] = []
        try:
            for i, t in enumerate(targets):
                links.append(ShardLink(t, worker, fingerprint, token, join_timeout, reconnect_timeout))
                links[-1].interrupt = interrupt
                links[-1].start(None if states is None else states[i])
            return cls(links)
        except BaseException:
            for link in links:
                link.close()
            raise

    def join_run(self, fragment_vectors, prepare=None) -> int:
        """A new worker: fetch every master slice (after the sessions opened, so no update is missed), hand
        the full fragments to `fragment_vectors(list of tensors)`, pick the step to start counting from (0
        for a run that has not synced yet) and become a member of every shard from the first round it will
        push. Returns that step."""
        cfg = self.links[0].config
        assert cfg is not None
        parts = [link.fetch() for link in self.links]
        for link, part in zip(self.links, parts, strict=True):
            with link._sync_lock, link._cond:
                for f in range(len(link.slices)):
                    rnd = part[f][1]
                    link._applied_cover[f] = rnd  # the caller sets the parameters from these
                    if link.covered[f] > rnd:
                        continue  # a reconnect meanwhile fetched a newer master: the engine takes it later
                    link.covered[f] = rnd
                    link._masters.pop(f, None)  # older than what we fetched, if any
                for key in [k for k in link._updates if k[1] < link.covered[k[0]]]:
                    del link._updates[key]  # closed before the fetch: in the master already
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
        per_shard = []
        for link in self.links:
            with link._cond:
                w = link._welcome
                assert w is not None
                rounds, started = list(w.rounds), list(w.started)
                short = [s and n < w.min_workers for s, n in zip(w.started, w.pushes, strict=True)]
                for f, r in [*link._updates, *((f, c - 1) for f, c in enumerate(link.covered) if c > 0)]:
                    if r + 1 > rounds[f]:
                        rounds[f], started[f], short[f] = r + 1, False, False
                per_shard.append((rounds, started, short))
        out: tuple[list[int], list[bool], list[bool]] = ([], [], [])
        for f in range(len(per_shard[0][0])):
            low = min(v[0][f] for v in per_shard)
            behind = [v for v in per_shard if v[0][f] == low]
            out[0].append(low)
            out[1].append(all(v[1][f] for v in behind))
            out[2].append(any(v[2][f] for v in behind))
        return out

    def resume(self, schedule) -> None:
        """A worker restarted from its checkpoint (its links loaded in open()): fetch the slices of rounds
        that closed meanwhile, become a member from the next round it pushes (`schedule()`: the engine's
        next round of each fragment), and send again the kept pushes whose rounds are still open."""
        for link in self.links:
            link.schedule = schedule
            assert link._welcome is not None
            try:
                link._resync(link._welcome)
            except _Retry as e:
                raise SyncError(str(e)) from None
        for link in self.links:
            link.ready()

    def follow(self, schedule) -> None:
        """After a reconnect, become a member from the next round `schedule()` says each fragment sends."""
        for link in self.links:
            link.schedule = schedule

    def first_rounds(self, num_fragments: int) -> list[int]:
        """Per fragment, the first round not yet in the mirror on every shard."""
        return [min(link.covered[f] for link in self.links) for f in range(num_fragments)]

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        for link, enc in zip(self.links, slices, strict=True):
            link.push(fragment, round, enc, weight, loss)

    def update(self, fragment: int, round: int) -> list[Update]:
        for link in self.links:  # wait for every slice first: a stop request then takes nothing at all
            link.wait_available(fragment, round)
        return [link.take(fragment, round) for link in self.links]

    def ready(self, fragment: int, round: int) -> bool:
        return all(link.has_update(fragment, round) for link in self.links)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (up to `timeout` in all) until every push sent has been answered."""
        deadline = time.monotonic() + timeout
        return all([link.flush(max(0.0, deadline - time.monotonic())) for link in self.links])

    def state_dict(self) -> list[dict]:
        return [link.state_dict() for link in self.links]

    @property
    def reconnects(self) -> int:
        return sum(link.reconnects for link in self.links)

    @property
    def resent(self) -> int:
        return sum(link.resent for link in self.links)

    def report_progress(self, progress: Callable[[], tuple[int, float]]) -> None:
        """What every push's header reports: (inner steps done, seconds blocked so far), for the dashboard."""
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


def fetch_masters(targets: list[str], token: str = "", timeout: float = 60.0) -> list[torch.Tensor]:
    """The run's global parameters, fragment by fragment, read from the shards listed in shard order
    (no Join: Fetch is read-only). For tools and tests; workers fetch through their links."""
    per_shard: list[dict[int, list[torch.Tensor]]] = []
    for target in targets:
        with make_channel(parse_target(target)) as channel:
            got: dict[int, list[torch.Tensor]] = {}
            for m in pb_grpc.ShardStub(channel).Fetch(pb.FetchRequest(token=token), timeout=timeout):
                got.setdefault(m.fragment, []).append(bytes_to_values(m.values))
            per_shard.append(got)
    return [torch.cat([torch.cat(s[f]) for s in per_shard]) for f in sorted(per_shard[0])]


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
    prepare=None,
):
    """Join a run around your own model and loop. Joins every shard (the model's fingerprint must match
    theirs), sets the model's parameters to the run's global ones, and returns the SyncEngine: call its
    `step(tokens, loss)` right after every `inner_optimizer.step()`, and `close()` at the end.

    A run in progress is joined too: the engine then starts counting at the run's current step
    (`engine.step_count`), so that its sends line up with the other workers'; take part from there.
    `sync` must equal the shards' Streaming DiLoCo settings (default: SyncConfig()); `total_steps` lets the
    engine sync every fragment at the last step (final_sync). `resume` is a worker checkpoint's dict (see
    worker/run.py): the engine and the links continue from it, and the model keeps its parameters.
    `prepare()`, if given, is called once the model holds the global parameters and before any shard waits
    for this worker (say, to evaluate them): slow work there does not hold up the others."""
    import os
    import socket

    from streamdiloco.common.fingerprint import model_fingerprint
    from streamdiloco.common.fragments import build_layout, fragment_params, slice_ranges, unflatten_into
    from streamdiloco.worker.engine import SyncEngine

    sync = sync or SyncConfig()
    targets = [s.strip() for s in servers.split(",")] if isinstance(servers, str) else list(servers)
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    layout = build_layout(model, sync.num_fragments, sync.fragment_pattern)
    transport = GrpcTransport.open(
        targets,
        name,
        model_fingerprint(layout, sync),
        token,
        join_timeout,
        reconnect_timeout,
        states=None if resume is None else resume["links"],
        interrupt=interrupt,
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

        if resume is not None:
            engine = SyncEngine(model, layout, sync, transport, total_steps=total_steps, seed=seed, rank=rank)
            engine.load_state_dict(resume["engine"])
            # before resume(): the pushes it sends again report the resumed step, not 0
            transport.report_progress(lambda: (engine.step_count, engine.blocked_seconds))
            transport.resume(engine.next_rounds)
            log.info("%s resumes at step %d", name, engine.step_count)
            return engine
        start = transport.join_run(set_params, prepare)
        if total_steps is not None and start >= total_steps:
            raise SyncError(f"the run is at step {start}, past total_steps={total_steps}: nothing left to do")
        engine = SyncEngine(
            model, layout, sync, transport, total_steps=total_steps, seed=seed, rank=rank, start_step=start
        )
        transport.report_progress(lambda: (engine.step_count, engine.blocked_seconds))
        transport.follow(engine.next_rounds)
        if start:
            log.info("%s joins the run in progress at step %d", name, start)
            engine.catch_up(transport.first_rounds(layout.num_fragments))
        return engine
    except BaseException:
        transport.close()
        raise
