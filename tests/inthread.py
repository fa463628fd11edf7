"""A worker's side of a Session, driven by hand from a test: the messages it sends and what the shard
answers, against a shard running in the test's process (tests/test_service.py, tests/test_elastic_units.py).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import grpc

from streamdiloco.common.codecs import Encoded
from streamdiloco.common.wire import to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

RPC_TIMEOUT = 10.0  # every call carries a deadline: nothing here can hang
WAIT = 5.0  # seconds to wait for a message or a server-side condition

END = object()  # what Session.next() gives once the shard has ended the session


class Session:
    """A Session call fed from a queue; a thread moves what the shard sends into an inbox."""

    def __init__(self, stub: pb_grpc.ShardStub, hello: pb.WorkerMessage | None = None):
        self.out: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.sent = 0  # serialized bytes sent after Hello: what the shard counts as the member's msg_in
        self.call = stub.Session(self._requests(), timeout=RPC_TIMEOUT * 3)
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


def push_messages(
    enc: Encoded,
    fragment: int = 0,
    round: int = 0,
    weight: float = 100.0,
    loss: float | None = 3.0,
    values_per_chunk: int = 512,
) -> list[pb.WorkerMessage]:
    header = pb.PushHeader(weight=weight, has_loss=loss is not None, loss=0.0 if loss is None else loss)
    return [
        pb.WorkerMessage(push=pb.Push(chunk=c, header=header if c.seq == 0 else None))
        for c in to_chunks(enc, fragment, round, values_per_chunk)
    ]


@dataclass
class Worker:
    name: str
    session: Session
    join: pb.JoinReply | None = None

    def push(self, msgs: list[pb.WorkerMessage]) -> None:
        for m in msgs:
            self.session.send(m)

    def ready(self, from_rounds=()) -> None:
        self.session.send(pb.WorkerMessage(ready=pb.Ready(from_rounds=list(from_rounds))))
