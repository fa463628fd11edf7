"""The worker's side of run-wide data assignment (--data-pieces): shard 0's ledger (server/storage/ledger.py)
leases this worker numbered pieces of the train split; `PieceStream` trains them in order and reports each
done.

`PieceStream` has `BatchStream`'s interface (next() -> (x, y), state_dict/load_state_dict) over any 1-D
integer token array (numpy, a memmap, or torch): batch_size windows of block_size+1 tokens per step, taken
in order from the pieces it holds (consecutive windows share one token, so every token of a piece but its
first is a target once; a piece's tail shorter than a window is left out); at the end of an epoch, when no
piece is left to fill a batch, the batch is shorter. A piece is reported done once
the batch holding its last window was trained (at the next `next()`, or at `finish()`). The calls to shard
0 (`ShardPieces`, over the link's connection) run on a thread of their own, asking one piece ahead, so the
training thread waits for a piece only when it has none left: at the start, and when every piece of the
epoch is held by others (it then waits, asking each second, until the epoch rolls over; --steps still
ends the run). The reply is the truth: a piece the ledger no longer gives this worker (its lease ended while
it was away) is dropped from the stream, not trained further. What the stream holds of the pieces and what it
reported of them is its `Leases` (plain bookkeeping, no threads).

The worker's checkpoint keeps the held pieces, the window reached in the current one and the done reports
not yet answered, so a resumed worker claims its pieces again and carries on in its piece. `make_stream`
is the worker's one choice of stream: these pieces with --data-pieces, else its own seeded random windows
(worker/data.py's BatchStream), over the text's bytes or a prepared dataset's tokens alike. What this module
must not do: decide which piece is whose (the ledger does) or talk to any shard but 0.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any, Protocol

import grpc
import numpy as np
import torch

from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.worker.connection import ShardConnection, SyncError
from streamdiloco.worker.data import BatchStream, TokenData
from streamdiloco.worker.engine import StopRequested

log = logging.getLogger("streamdiloco.worker")

AHEAD = 1  # pieces asked for beyond the one being trained
MAX_WANT = 8  # the ledger's MAX_HELD
POLL_SECONDS = 1.0  # between asks while the ledger has no piece for this worker
RPC_TIMEOUT = 30.0
MAX_REPORT = 64  # the ledger's bound on the done reports of one ask
BACKOFF = (0.5, 8.0)  # seconds between asks that were answered with a refusal worth retrying: first, most
# answers that a later call may not get, asked again with backoff: the shard restarting or stopping, a
# session being reopened or still passive (UNAVAILABLE until its Ready), a call the shard shed under load
# (RESOURCE_EXHAUSTED: a flood of waiting calls evicted it), a deadline
_RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
_NO_SESSION = "has no open session"  # FAILED_PRECONDITION while the link opens its session again: retried


def _retried(e: grpc.RpcError) -> bool:
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else "") or ""
    return code in _RETRY or (code == grpc.StatusCode.FAILED_PRECONDITION and _NO_SESSION in details)


def refusal_line(e: grpc.RpcError) -> str:
    """What stops the stream, in one line: the status and the shard's words (a hostile shard's words
    cannot start a line of their own in the worker's log)."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else str(e)) or ""
    words = " ".join(details.split())[:300]
    return f"shard 0 refused to assign data: {words} ({code.name if code else 'no status'})"


class PieceSource(Protocol):
    """Shard 0's Pieces RPC: report `done`, claim `held`, hold up to `want` pieces after the call."""

    def ask(self, done: list[int], held: list[int], want: int) -> pb.PiecesReply: ...


class ShardPieces:
    """The Pieces RPC over the worker's connection to shard 0 (its stub, credentials and current session)."""

    def __init__(self, conn: ShardConnection, train_tokens: int, sha256: str):
        if conn.shard != 0:
            raise ValueError(f"the data ledger is on shard 0, not on {conn.target} (shard {conn.shard})")
        self.conn, self.train_tokens, self.sha256 = conn, train_tokens, sha256

    def ask(self, done: list[int], held: list[int], want: int) -> pb.PiecesReply:
        request = pb.PiecesRequest(
            worker=self.conn.worker,
            session=self.conn.session_id,  # the link's current session (it changes when it reconnects)
            train_tokens=self.train_tokens,
            data_sha256=self.sha256,
            done=done,
            held=held,
            want=want,
        )
        return self.conn.stub.Pieces(request, metadata=self.conn.metadata, timeout=RPC_TIMEOUT)


def token_sha256(tokens: Any) -> str:
    """The sha256 of a token array's bytes (what names the built-in data in the ledger)."""
    import hashlib

    array = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


class Leases:
    """What this worker holds of shard 0's pieces and what it reported of them, as plain bookkeeping (no
    threads: PieceStream's lock guards it). `held`: the pieces leased, (id, start, end) in the order to
    train them, `window` the next window of held[0]; `finished`: pieces whose last window went out in the
    last batch (not trained yet); `pending`: trained to the end, not yet answered by the ledger; `accepted`
    ((epoch, piece)) and `refused`: the ledger's answers to the done reports."""

    def __init__(self, name: str) -> None:
        self.name = name  # the worker's, in the log lines
        self.epoch = 0
        self.held: list[tuple[int, int, int]] = []
        self.window = 0
        self.finished: list[int] = []
        self.pending: list[int] = []
        self.accepted: list[tuple[int, int]] = []
        self.refused: list[int] = []
        self.lease_epoch: dict[int, int] = {}  # the epoch each held piece was leased in
        self.idle = False  # the last answer gave no piece to go on with: ask again after POLL_SECONDS
        self.waiting = False  # the training thread has no piece and the ledger none free for it

    def due(self) -> bool:
        """Whether to ask the ledger now: done reports to make, or fewer than AHEAD pieces ahead."""
        ahead = len(self.held) - 1 if self.held else -1
        return bool(self.pending) or (ahead < AHEAD and not self.idle)

    def claim(self) -> list[int]:
        """The pieces this worker claims as its own: being trained, or trained in the batch under way."""
        return self.finished + [p for p, _, _ in self.held]

    def trained(self) -> bool:
        """The last batch was trained: its finished pieces are to be reported. False if there were none."""
        if not self.finished:
            return False
        self.pending += self.finished
        self.finished = []
        return True

    def next_window(self, block_size: int) -> tuple[int | None, bool]:
        """The start of held[0]'s next window of block_size+1 tokens (None when the piece has no window
        left), and whether that finished the piece (it then moves to `finished`)."""
        p, start, end = self.held[0]
        windows = max(0, (end - start - 1) // block_size)
        taken = None
        if self.window < windows:
            taken = start + self.window * block_size
            self.window += 1
        if self.window < windows:
            return taken, False
        self.finished.append(p)
        self.held.pop(0)
        self.window = 0
        return taken, True

    def apply(self, reply: pb.PiecesReply, done: list[int], data_tokens: int) -> str | None:
        """The ledger's answer to a call that reported `done`, on the current state (the training thread went
        on meanwhile); what is wrong with it, if the stream cannot go on (a piece past the data's end)."""
        self._answered(reply, done)
        granted = {r.id: (r.id, r.start, r.end) for r in reply.held}
        for i, (p, _, _) in enumerate(list(self.held)):
            if p not in granted:
                log.warning("%s: piece %d is no longer ours: dropped", self.name, p)
                if i == 0 and self.held[0][0] == p:
                    self.window = 0
        self.held = [h for h in self.held if h[0] in granted]
        self.finished = [p for p in self.finished if p in granted]
        known = set(self.claim()) | set(self.pending)
        new = [granted[p] for p in (r.id for r in reply.held) if p not in known]
        error = None
        for piece in new:
            self.lease_epoch[piece[0]] = reply.epoch
            if piece[2] - piece[1] > data_tokens:
                error = f"shard 0 leased piece {piece[0]} ending at token {piece[2]}, past this data's end"
        self.held += new
        self.epoch = reply.epoch
        self.idle = not new and len(self.held) <= AHEAD
        waiting = not new and not self.held
        if waiting and not self.waiting:  # once per wait
            log.info(
                "%s: no piece free (%d of %d done in epoch %d): waiting for the epoch to end",
                self.name,
                reply.pieces_done,
                reply.pieces_total,
                reply.epoch,
            )
        self.waiting = waiting
        return error

    def _answered(self, reply: pb.PiecesReply, done: list[int]) -> None:
        """The ledger's answers to the done reports: counted, counted before, or refused."""
        refused, repeated = set(reply.refused), set(reply.repeated)
        for p in done:
            if p in repeated:  # counted before (this worker resumed from a checkpoint older than that)
                self.lease_epoch.pop(p, None)
                log.info("%s: piece %d was counted done before", self.name, p)
            elif p in refused:
                self.refused.append(p)
                log.warning(
                    "%s: piece %d was not ours any more: its done report is not counted", self.name, p
                )
            else:
                epoch = self.lease_epoch.pop(p, reply.epoch)
                self.accepted.append((epoch, p))
                log.info("%s: piece %d of epoch %d done", self.name, p, epoch)
        self.pending = [p for p in self.pending if p not in done]

    def state_dict(self) -> dict:
        return {
            "held": [list(h) for h in self.held],
            "window": self.window,
            "pending": self.pending + self.finished,  # the checkpoint's model has trained them
            "epoch": self.epoch,
            "accepted": [list(e) for e in self.accepted],
            "lease_epoch": dict(self.lease_epoch),
        }

    def load_state_dict(self, s: dict) -> None:
        self.held = [(int(p), int(a), int(b)) for p, a, b in s["held"]]
        self.window, self.epoch = int(s["window"]), int(s["epoch"])
        self.pending, self.finished = [int(p) for p in s["pending"]], []
        self.accepted = [(int(e), int(p)) for e, p in s["accepted"]]
        self.lease_epoch = {int(k): int(v) for k, v in s["lease_epoch"].items()}


class PieceStream:
    """Batches from the pieces shard 0 leases to this worker (see the module's docstring)."""

    def __init__(
        self, tokens: Any, batch_size: int, block_size: int, name: str = "worker", sha256: str | None = None
    ):
        if len(tokens) < block_size + 1:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than a window of {block_size + 1}")
        self.data, self.batch_size, self.block_size, self.name = tokens, batch_size, block_size, name
        self.sha256 = sha256  # what names the data in the ledger (a prepared dataset's); None: token_sha256
        self.position = 0  # batches drawn so far
        self.leases = Leases(name)  # guarded by _cond, like everything the asker and next() share
        self._cond = threading.Condition()
        self._source: PieceSource | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._error: str | None = None
        self.interrupt: threading.Event | None = None  # set: a wait for a piece ends (StopRequested)

    @property
    def accepted(self) -> list[tuple[int, int]]:
        """(epoch, piece) of the done reports the ledger took."""
        with self._cond:
            return list(self.leases.accepted)

    # --- the ledger's side ------------------------------------------------------------------------------
    def start(self, source: PieceSource, interrupt: threading.Event | None = None) -> None:
        """Start asking `source` for pieces, on a thread of its own (after the worker joined)."""
        self._source, self.interrupt = source, interrupt
        if isinstance(source, ShardPieces):
            log.info(
                "%s: pieces of data %s (%d train tokens); shard 0 pins it: --data-sha256 %s --data-tokens %d",
                self.name,
                source.sha256[:12],
                source.train_tokens,
                source.sha256,
                source.train_tokens,
            )
        self._thread = threading.Thread(target=self._asker, name="pieces", daemon=True)
        self._thread.start()

    def _asker(self) -> None:
        backoff = BACKOFF[0]
        leases = self.leases
        while True:
            with self._cond:
                while not self._closed and not leases.due():
                    if not self._cond.wait(POLL_SECONDS) and leases.idle:
                        leases.idle = False  # a second without a piece: ask again
                if self._closed:
                    return
                done, claim = leases.pending[:MAX_REPORT], leases.claim()
                want = min(MAX_WANT, len(leases.finished) + 1 + AHEAD)
            try:
                assert self._source is not None
                reply = self._source.ask(done, claim, want)
            except grpc.RpcError as e:
                if _retried(e) and not self._closed:
                    log.debug("%s: asking shard 0 for pieces: %s; again", self.name, refusal_line(e))
                    self._sleep(backoff * random.uniform(0.5, 1.0))  # jittered: many workers, one shard
                    backoff = min(BACKOFF[1], backoff * 2)
                    continue
                with self._cond:
                    self._error = refusal_line(e)
                    self._cond.notify_all()
                return
            backoff = BACKOFF[0]
            with self._cond:
                self._error = leases.apply(reply, done, len(self.data)) or self._error
                self._cond.notify_all()

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait(seconds)

    # --- the training thread's side ---------------------------------------------------------------------
    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch: the batch before it counts as trained (its finished pieces are reported)."""
        starts: list[int] = []
        leases = self.leases
        with self._cond:
            self._trained()
            while len(starts) < self.batch_size:
                if self._error is not None:
                    raise SyncError(self._error)
                if not leases.held:
                    if starts and leases.idle:  # the epoch's last pieces: a short batch (its pieces are then
                        break  # reported; the others wait for them to end the epoch)
                    if self.interrupt is not None and self.interrupt.is_set():
                        raise StopRequested()
                    self._cond.wait(0.2)
                    continue
                start, finished = leases.next_window(self.block_size)
                if start is not None:
                    starts.append(start)
                if finished:
                    self._cond.notify_all()
        n = self.block_size + 1
        rows = np.stack([np.asarray(self.data[s : s + n]) for s in starts]).astype(np.int64)
        chunk = torch.from_numpy(rows)
        self.position += 1
        return chunk[:, :-1], chunk[:, 1:]

    def _trained(self) -> None:
        if self.leases.trained():
            self._cond.notify_all()

    def finish(self, timeout: float = 30.0) -> bool:
        """The last batch was trained: report its finished pieces and wait (up to `timeout`) for the answer;
        then stop asking. False if the answer did not come."""
        with self._cond:
            self._trained()
            ok = self._cond.wait_for(lambda: not self.leases.pending or self._error is not None, timeout)
        self.close()
        return ok and self._error is None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def summary(self) -> dict:
        """What the worker's summary says of its data: the pieces it trained to the end, as the ledger took
        them ([epoch, piece]), and those refused."""
        with self._cond:
            return {
                "pieces_done": [list(e) for e in self.leases.accepted],
                "pieces_refused": list(self.leases.refused),
                "epoch": self.leases.epoch,
            }

    # --- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._cond:
            return {"pieces": self.leases.state_dict(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        s = state.get("pieces") if isinstance(state, dict) else None
        if not isinstance(s, dict):
            raise ValueError("the checkpoint's data stream is not a PieceStream's (--data-pieces changed?)")
        with self._cond:
            self.leases.load_state_dict(s)
            self.position = int(state.get("position", 0))


TokenStream = BatchStream | PieceStream  # what the worker's loop draws its batches from


def make_stream(
    data: TokenData,
    batch_size: int,
    block_size: int,
    *,
    name: str,
    seed: int,
    rank: int,
    pieces: bool = False,
    ranks: int = 1,
) -> TokenStream:
    """The worker's stream over `data`'s train split (the text's bytes or a prepared dataset's tokens):
    with `pieces` (--data-pieces) the pieces shard 0 leases it, in order (start it with `PieceStream.start`
    once joined), else random windows of its own generator, seeded from (seed, rank). `batch_size`: the
    worker's rows per inner step, all its `ranks`' and micro-batches together."""
    if not pieces:
        return BatchStream(data.train, batch_size, block_size, seed, rank)
    if ranks > 1:
        raise ValueError("--data-pieces: a worker of several ranks (torchrun) does not take pieces yet")
    return PieceStream(data.train, batch_size, block_size, name, data.sha256)
