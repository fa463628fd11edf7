"""worker/pieces.py's PieceStream against a real ledger (server/storage/ledger.py) behind a fake RPC: windows
in order from the held pieces, each piece reported done once its last batch was trained, one piece asked
ahead, a lost lease dropped, and the state carried through a checkpoint."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch

from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.storage.ledger import Dataset, Ledger
from streamdiloco.worker import pieces as pieces_module
from streamdiloco.worker.connection import SyncError
from streamdiloco.worker.data import BatchStream, TokenData
from streamdiloco.worker.pieces import PieceStream, make_stream, token_sha256

pytestmark = pytest.mark.timeout(30)


class LedgerSource:
    """The Pieces RPC, as shard 0 answers it, without the network."""

    def __init__(self, ledger: Ledger, worker: str):
        self.ledger, self.worker, self.lock = ledger, worker, threading.Lock()
        self.calls: list[tuple[list[int], list[int], int]] = []

    def ask(self, done, held, want):
        with self.lock:
            self.calls.append((list(done), list(held), want))
            g = self.ledger.ask(self.worker, list(done), list(held), want, 0.0)
        reply = pb.PiecesReply(epoch=g.epoch, pieces_done=g.done, pieces_total=g.total, refused=g.refused)
        reply.held.extend(pb.PieceRange(id=p, start=s, end=e) for p, s, e in g.held)
        return reply


def make(tokens, piece_tokens=40, batch=2, block=4, name="a", ledger=None):
    ledger = ledger or Ledger(piece_tokens)
    ledger.bind(Dataset(len(tokens), piece_tokens, token_sha256(tokens)))
    stream = PieceStream(tokens, batch, block, name)
    source = LedgerSource(ledger, name)
    return ledger, stream, source


def test_windows_in_order_and_each_piece_done_once():
    tokens = np.arange(100, dtype=np.uint16)  # pieces [0,40) [40,80) [80,100): 9, 9 and 4 windows of 5
    ledger, stream, source = make(tokens)
    stream.start(source)
    starts = []
    for _ in range(11):  # 22 windows: every window of the epoch
        x, y = stream.next()
        assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        starts += x[:, 0].tolist()
    assert starts == list(range(0, 36, 4)) + list(range(40, 76, 4)) + list(range(80, 96, 4))
    assert stream.finish(5.0)
    assert sorted(p for _, p in stream.accepted) == [0, 1, 2] and ledger.epoch == 1
    assert all(want <= 3 for _, _, want in source.calls)  # the one trained, one ahead, one finished


def test_torch_tokens_and_a_lost_lease(monkeypatch):
    tokens = torch.arange(200, dtype=torch.int32)
    ledger, stream, source = make(tokens)
    stream.start(source)
    stream.next()
    ledger.release("a")  # its session ended: pieces back to the pool, someone else takes 0
    ledger.ask("b", [], [], 1, 0.0)
    for _ in range(20):
        stream.next()
    assert stream.finish(5.0)
    done = [p for _, p in stream.accepted]
    assert 0 not in done and sorted(set(done)) == sorted(done)


def test_checkpoint_carries_on_in_the_piece():
    tokens = np.arange(100, dtype=np.int64)
    ledger, stream, source = make(tokens)
    stream.start(source)
    for _ in range(3):
        stream.next()
    state = stream.state_dict()
    stream.close()
    again = PieceStream(tokens, 2, 4, "a")
    again.load_state_dict(state)
    again.start(source)
    x, _ = again.next()
    assert x[:, 0].tolist() == [24, 28]  # windows 6 and 7 of piece 0


class Refusal(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_a_session_being_reopened_is_asked_again_and_other_data_stops_the_worker():
    tokens = np.arange(100, dtype=np.int64)
    ledger, stream, source = make(tokens)
    answers = [Refusal(grpc.StatusCode.FAILED_PRECONDITION, "worker 'a' has no open session with that id")]

    class Flaky:
        def ask(self, done, held, want):
            if answers:
                raise answers.pop(0)
            return source.ask(done, held, want)

    stream.start(Flaky())
    x, _ = stream.next()  # asked again after the refusal
    assert x[:, 0].tolist() == [0, 4]
    stream.close()

    other = PieceStream(tokens, 2, 4, "b")
    answers.append(
        Refusal(grpc.StatusCode.FAILED_PRECONDITION, "this run trains data 0f0f... give every worker")
    )
    other.start(Flaky())
    with pytest.raises(SyncError, match="shard 0 refused to assign data: this run trains data"):
        other.next()


def test_a_shed_call_and_a_passive_sessions_refusal_are_asked_again_and_a_refusal_is_one_line(monkeypatch):
    """A call the shard evicted under a flood (RESOURCE_EXHAUSTED) and the refusal of a session not yet
    ready (UNAVAILABLE) are retried with backoff (the worker stopped at the first, issue 37 item 4); what it
    cannot retry stops it with the shard's words on one line, and the status named."""
    monkeypatch.setattr(pieces_module, "BACKOFF", (0.01, 0.04))
    tokens = np.arange(100, dtype=np.int64)
    ledger, stream, source = make(tokens)
    answers = [
        Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls waiting: this one gives way"),
        Refusal(grpc.StatusCode.UNAVAILABLE, "worker 'a': a passive session holds no pieces"),
        Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls waiting: this one gives way"),
    ]
    asked: list[float] = []

    class Flaky:
        def ask(self, done, held, want):
            asked.append(time.monotonic())
            if answers:
                raise answers.pop(0)
            return source.ask(done, held, want)

    stream.start(Flaky())
    x, _ = stream.next()
    assert x[:, 0].tolist() == [0, 4] and len(asked) >= 4
    stream.close()

    other = PieceStream(tokens, 2, 4, "b")
    answers.append(Refusal(grpc.StatusCode.INVALID_ARGUMENT, "want must be in [0, 8]\nERROR forged line"))
    other.start(Flaky())
    with pytest.raises(SyncError) as e:
        other.next()
    assert "\n" not in str(e.value) and str(e.value).endswith("ERROR forged line (INVALID_ARGUMENT)")


def test_make_stream_chooses_pieces_only_with_data_pieces_and_one_rank():
    text = torch.arange(120, dtype=torch.uint8)
    data = TokenData(text[:100], text[100:], 256, None, "the text (bytes)")
    kw = {"name": "a", "seed": 1, "rank": 3}
    windows = make_stream(data, 4, 8, **kw)
    assert isinstance(windows, BatchStream) and windows.batch_size == 4 and windows.block_size == 8
    x, y = windows.next()
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    pieces = make_stream(data, 4, 8, pieces=True, **kw)
    assert isinstance(pieces, PieceStream) and pieces.data is data.train and pieces.name == "a"
    with pytest.raises(ValueError, match="a worker of several ranks"):
        make_stream(data, 4, 8, pieces=True, ranks=2, **kw)
