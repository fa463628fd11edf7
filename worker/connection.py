"""One shard's wire, as a worker's link uses it: Join, the Session calls (worker/session.py: the request
stream, and the reader that assembles the shard's update chunks and tells the link typed events), Fetch, and
the bytes counted both ways.

A ShardConnection holds what Join said (the run's config, this shard's index and slices) and the current
session; it decides nothing about rounds or pushes (the link and worker/linkstate.py do) and changes no
state of the link: the session's reader only tells the link what came (`open_session`'s `tell`).
`reconnect` is the backoff loop that joins again and opens a new session until one holds.

The shard is not trusted with the worker's memory or its values: a Join reply is checked before anything
of it is taken (`take_reply`), update chunks are checked and bounded by the session (worker/session.py's
`Updates`), Fetch masters are checked by common/fetch.py. A shard that breaks these rules ends the session
with one line naming it and the fault (SyncError).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch

from streamdiloco.common.backoff import Backoff
from streamdiloco.common.codecs import chunk_alignment
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fetch import TRANSIENT, FetchError, fetch_slices
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.tls import ClientTLS
from streamdiloco.common.wire import PROTOCOL, auth_metadata, make_channel, parse_target
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker.session import (
    JOIN_RETRYABLE,
    Peer,
    Retry,
    Sessions,
    SyncError,
    Tell,
)

log = logging.getLogger("streamdiloco.worker")

JOIN_PROGRESS_EVERY = 5.0  # seconds between "waiting for shard" lines while a first Join finds no shard
# a full edge (server/edge/slots.py ended this call to make room for a flood's, or this address holds its
# limit of calls): a Join is tried again, with backoff (common/backoff.py), within its --join-timeout
JOIN_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
# what a first Join tries again (a reconnect's Join: its Retry)
JOIN_AGAIN = (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAVAILABLE, JOIN_BUSY)
RETRY_LOG_EVERY = 10  # a Join tried again is logged the first time and every this many
# a Fetch call that brings no message for this long is ended and resumed (common/fetch.py's stall): an honest
# shard sends a chunk of --chunk-bytes (1 MiB) in seconds even over a slow link, and a hostile one that
# opens the stream and sends nothing must not hold the link's thread for ever
FETCH_STALL_SECONDS = 60.0


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
        # --reconnect-timeout: seconds a broken session (reconnecting) or Fetch goes on without an answer
        self.patience = patience
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
        self.closed = threading.Event()  # set by close(): waits end, retries stop
        self.traffic = Traffic()
        self.sessions = Sessions(self.traffic.count, self.closed)

    # the bytes on the wire, and the current session (worker/session.py)
    msg_out = property(lambda self: self.traffic.bytes["out"])
    msg_in = property(lambda self: self.traffic.bytes["in"])
    session = property(lambda self: self.sessions.number)  # what the reader of an older one tells is stale
    updates = property(lambda self: self.sessions.updates)  # the current session's updates under way

    def count(self, direction: str, n: int) -> None:
        self.traffic.count(direction, n)

    # --- Join ------------------------------------------------------------------------------------------
    def join(
        self, timeout: float | None = None, reconnecting: bool = False, config_only: bool = False
    ) -> SyncConfig:
        """Join the shard, waiting up to `timeout` for it to be reachable; returns the run's config. SyncError
        if it refuses (a full edge, RESOURCE_EXHAUSTED, is tried again with backoff until `timeout`); when
        `reconnecting`, Retry if it cannot be reached, is full, or still holds our old session.
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
        busy = Backoff()  # the waits after a RESOURCE_EXHAUSTED
        refusals = 0
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
                if reconnecting and code in JOIN_RETRYABLE | {JOIN_BUSY}:
                    raise Retry(f"Join: {code.name}: {e.details()}") from None
                # ALREADY_EXISTS: our own session from before a crash, not yet noticed by the shard (liveness:
                # seconds); UNAVAILABLE: the connection dropped under the call (the channel reconnects);
                # RESOURCE_EXHAUSTED: a full edge (a flood of calls made room, or this address is at its
                # limit) or a bound the shard names: tried again with backoff until `timeout`, then named
                wait = busy.next() if code == JOIN_BUSY else 1.0
                left = give_up - 1 - time.monotonic()  # the last try has a second at least
                if code in JOIN_AGAIN and left > 0:
                    refusals += 1
                    if refusals == 1 or refusals % RETRY_LOG_EVERY == 0:
                        log.info(
                            "shard at %s: Join: %s: %s; trying again in %.1f s (attempt %d)",
                            self.target,
                            code.name,
                            e.details(),
                            wait,
                            refusals,
                        )
                    if self.closed.wait(min(wait, left)):
                        raise SyncError(f"closed while joining the shard at {self.target}") from None
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
    def open_session(self, tell: Tell) -> pb.Welcome:
        """Start a passive session (updates come, no round waits for us), read the shard's Welcome and start
        the session's reader, which tells what comes (worker/session.py's SessionEvent)."""
        assert self.config is not None
        hello = pb.Hello(worker=self.worker, session=self.session_id, passive=True)
        peer = Peer(self.shard, self.target, self.slices, self.config)
        return self.sessions.open(self.stub, self.metadata, hello, peer, tell)

    def handled(self) -> None:
        """The link has handled one message its reader told (an update, a result or a Welcome)."""
        self.sessions.handled()

    def send(self, msg: pb.WorkerMessage) -> None:
        """Queue a message on the current session (sent in order; lost if the session breaks)."""
        self.sessions.send(msg)

    # --- reconnecting ----------------------------------------------------------------------------------
    def reconnect(self, timeout: float, tell: Tell, then: Callable[[pb.Welcome], None]) -> int:
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
                if self.sessions.call is not None:
                    self.sessions.call.cancel()
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
        does not fit (nothing of it is kept), refuses, or stays out of reach that long. A call that brings
        nothing for FETCH_STALL_SECONDS (`patience` if less: a shard that stalls it) is ended, as broken."""
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
                stall=min(FETCH_STALL_SECONDS, self.patience),
            )
        except FetchError as e:
            if patient and e.code in TRANSIENT:
                raise SyncError(f"{e}; giving up after --reconnect-timeout {self.patience:g} s") from None
            raise SyncError(str(e)) from None
        log.debug("fetched %s", got.describe())
        return got.masters()

    def close(self) -> None:
        self.closed.set()
        self.sessions.end()
        self.channel.close()


class Traffic:
    """Serialized protobuf bytes sent and received on a connection's calls (gRPC and HTTP/2 framing not
    included), counted from the threads that send and read them."""

    def __init__(self) -> None:
        self.bytes = {"out": 0, "in": 0}
        self._lock = threading.Lock()

    def count(self, direction: str, n: int) -> None:
        with self._lock:
            self.bytes[direction] += n
