"""A shard serving in a thread of the test's process, and a worker's side of a Session driven by hand:
the messages it sends and what the shard answers (tests/test_service.py, tests/test_elastic_units.py).
The standard nano shard built on it is nano_shard.py's; the shard's thread is the benchmarks' ThreadShard
(benchmarks/harness/inthread.py).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from benchmarks.harness.inthread import ThreadShard
from streamdiloco.common.codecs import Encoded
from streamdiloco.common.tls import ClientTLS, ServerTLS
from streamdiloco.common.wire import PROTOCOL, auth_metadata, make_channel, to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.observe.run_view import Peers
from streamdiloco.server.shard import Shard

RPC_TIMEOUT = 10.0  # every call carries a deadline: nothing here can hang
WAIT = 5.0  # seconds to wait for a message or a server-side condition

END = object()  # what Session.next() gives once the shard has ended the session


class Session:
    """A Session call fed from a queue; a thread moves what the shard sends into an inbox."""

    def __init__(
        self,
        stub: pb_grpc.ShardStub,
        hello: pb.WorkerMessage | None = None,
        metadata=(),
        timeout: float = RPC_TIMEOUT * 3,
    ):
        self.out: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.sent = 0  # serialized bytes sent after Hello: what the shard counts as the member's msg_in
        self.call = stub.Session(self._requests(), timeout=timeout, metadata=metadata)
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()
        if hello is not None:
            self.out.put(hello)

    def _requests(self):
        while True:
            msg = self.out.get()
            if msg is None:
                return
            yield msg

    def _receive(self) -> None:
        try:
            for msg in self.call:
                self.inbox.put(msg)
            self.inbox.put(END)
        except grpc.RpcError as e:
            self.inbox.put(e)

    def send(self, msg: pb.WorkerMessage) -> None:
        self.sent += msg.ByteSize()
        self.out.put(msg)

    def next(self, timeout: float = WAIT):
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"nothing from the shard within {timeout} s") from None

    def next_message(self, kind: str | None = None) -> pb.ShardMessage:
        item = self.next()
        if isinstance(item, grpc.RpcError):
            raise AssertionError(f"the session failed: {item.code().name}: {item.details()}")
        assert item is not END, "the shard ended the session"
        if kind is not None:
            assert item.WhichOneof("kind") == kind, f"expected {kind}, got {item}"
        return item

    def result(self) -> pb.PushResult:
        return self.next_message("result").result

    def update(self) -> list[pb.Chunk]:
        """The chunks of one update, up to and including the one marked last."""
        chunks = [self.next_message("update").update]
        while not chunks[-1].last:
            chunks.append(self.next_message("update").update)
        return chunks

    def error(self) -> grpc.RpcError:
        item = self.next()
        assert isinstance(item, grpc.RpcError), f"expected the session to be refused, got {item}"
        return item

    def close(self) -> None:
        """Half-close (the worker leaves cleanly); cancel if the call does not end."""
        self.out.put(None)
        self.thread.join(WAIT)
        if self.thread.is_alive():
            self.call.cancel()
            self.thread.join(WAIT)

    def cancel(self) -> None:
        """Break the call, as a worker that dies does."""
        self.call.cancel()
        self.out.put(None)  # unblock gRPC's request-consumer thread
        self.thread.join(WAIT)


def refused(fn, *args, **kw) -> grpc.RpcError:
    """The gRPC error that `fn(*args, **kw)` raises (the test fails if it raises none)."""
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    return e.value


def push_messages(
    enc: Encoded,
    fragment: int = 0,
    round: int = 0,
    weight: float = 100.0,
    loss: float | None = 3.0,
    values_per_chunk: int = 512,
    step: int = 0,
    blocked: float = 0.0,
    **progress,
) -> list[pb.WorkerMessage]:
    """A push's messages; `progress`: more PushHeader fields (total_steps, tokens, eval_loss, ...)."""
    header = pb.PushHeader(
        weight=weight,
        has_loss=loss is not None,
        loss=0.0 if loss is None else loss,
        step=step,
        blocked_seconds=blocked,
        **progress,
    )
    return [
        pb.WorkerMessage(push=pb.Push(chunk=c, header=header if c.seq == 0 else None))
        for c in to_chunks(enc, fragment, round, values_per_chunk)
    ]


@dataclass
class Worker:
    name: str
    session: Session
    join: pb.JoinReply | None = None
    welcome: pb.Welcome | None = None  # what the shard answered the Hello

    def push(self, msgs: list[pb.WorkerMessage]) -> None:
        for m in msgs:
            self.session.send(m)

    def ready(self, from_rounds=()) -> None:
        self.session.send(pb.WorkerMessage(ready=pb.Ready(from_rounds=list(from_rounds))))


class InThreadShard(ThreadShard):
    """A shard (`serve`) on an event loop in a thread of its own (benchmarks/harness/inthread.py), on port
    `port` (0: any); with `http`, its HTTP app too, on `http_port`; with `tls`, both over TLS (the test's
    channel then trusts `client`); `peers`: the run's shards for its dashboard's run view. Adds the test's
    channel, the worker's side of Join, Session and Fetch, and reads of the shard's state."""

    def __init__(
        self,
        service: Shard,
        tmp_path: Path,
        fingerprint_json: str,
        token: str = "",
        port=0,
        http: bool = False,
        tls: ServerTLS | None = None,
        client: ClientTLS | None = None,
        peers: Peers | None = None,
    ):
        super().__init__(service, tmp_path, port, http, tls, peers)
        self.fingerprint_json, self.token, self.client = fingerprint_json, token, client
        self.down = False
        self.channel = make_channel(self.target, client)
        self.stub = pb_grpc.ShardStub(self.channel)
        self.sessions: list[Session] = []

    def shutdown(self, stop_first: bool = False) -> None:
        """End the test's sessions and stop the shard; `stop_first`: stop the shard while the sessions are
        open, as a shard that is killed does (no session's end closes a round then)."""
        if self.down:
            return
        self.down = True
        if not stop_first:
            for s in self.sessions:
                s.cancel()
        self.channel.close()
        try:
            self.close()
        finally:
            for s in self.sessions:
                s.cancel()

    # --- reading the shard's state on its own loop ---
    def wait_for(self, cond, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not self.on_loop(cond):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def quiesce(self, w: Worker) -> None:
        """Wait until the shard has read everything this worker sent on its session."""
        self.wait_for(
            lambda: (m := self.service.roster.open.get(w.name)) is not None and m.msg_in == w.session.sent,
            f"the shard to read all of {w.name}'s messages",
        )

    def status(self, **kw) -> dict:
        return self.on_loop(lambda: self.service.view.status(**kw))

    def member_state(self, name: str) -> str:
        return next(m["state"] for m in self.status()["members"] if m["name"] == name)

    def snapshot(self) -> dict:
        """Everything a refused push must leave unchanged."""

        def snap() -> dict:
            st, status = self.service.state, self.service.view.status()
            json.dumps(status, allow_nan=False)  # what /api/status serves stays valid JSON
            return {
                "fragments": [(f["round"], f["master_hash"], f["contributors"]) for f in status["fragments"]],
                "sums": [
                    (
                        st.sum(f).numpy().tobytes(),
                        r.weight,
                        r.loss_sum,
                        r.loss_weight,
                        r.expected,
                        r.started_at,
                    )
                    for f, r in enumerate(st.open)
                ],
                "staged": sorted(st.staged),
                "accepted": st.pushes_accepted,
                "codec_in": st.bytes_received,
                "rounds_closed": st.rounds_closed,
                "members": sorted(st.members),
                "progress": {w: list(points) for w, points in self.service.dashboard.progress.items()},
            }

        return self.on_loop(snap)

    # --- clients ---
    def join(self, name: str, fp: str | None = None, token: str | None = None, protocol: int = PROTOCOL):
        request = pb.JoinRequest(
            worker=name,
            token=self.token if token is None else token,
            fingerprint_json=self.fingerprint_json if fp is None else fp,
            protocol=protocol,
        )
        return self.stub.Join(request, timeout=RPC_TIMEOUT)

    def open_session(self, hello: pb.WorkerMessage | None, token: str | None = None) -> Session:
        """A Session call; its metadata carries `token` (default: the shard's run token), as a worker's do."""
        s = Session(self.stub, hello, auth_metadata(self.token if token is None else token))
        self.sessions.append(s)
        return s

    def worker(self, name: str, passive: bool = False, token: str | None = None) -> Worker:
        """Join and open a session (a member at once, or passive until it sends Ready)."""
        reply = self.join(name, token=token)
        hello = pb.WorkerMessage(hello=pb.Hello(worker=name, session=reply.session, passive=passive))
        s = self.open_session(hello, token)
        welcome = s.next_message("welcome").welcome
        assert list(welcome.rounds) == list(reply.rounds)
        return Worker(name, s, reply, welcome)

    def fetch(self, fragments=(), offset: int = 0, token: str | None = None) -> list[pb.MasterChunk]:
        request = pb.FetchRequest(
            fragments=list(fragments), offset=offset, token=self.token if token is None else token
        )
        return list(self.stub.Fetch(request, timeout=RPC_TIMEOUT))
