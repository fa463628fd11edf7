"""The one reader of the `Fetch` RPC: one shard's master slices (fp32) and their rounds, every chunk checked.

A worker's link (resynchronizing, or a joiner taking the run's parameters), `streamdiloco export` and the
tools that read a live run's masters all read Fetch here. `fetch_slices` asks for fragments in an order,
and refuses, with a one-line `FetchError` naming the shard and the fragment, a stream that sends another
fragment than the one due, a chunk out of order or at the wrong offset, a slice of another size than the
layout says (`sizes`, or what `describe` makes of the shard's description of its run), a round that changes
within a fragment, values that are not whole fp32 numbers or not finite (common/chunks.py's MasterAssembly
checks each chunk). A stream that breaks (UNAVAILABLE) is resumed from what was received; a round that
closed meanwhile starts that fragment over. Nothing partial is returned: the caller gets every fragment it
asked for, whole and checked, or the error.

How long a broken stream is tried again is the caller's: up to `attempts` calls (a tool: export; a
reconnect's resync, which the reconnect tries again), on a dropped connection, a full edge
(RESOURCE_EXHAUSTED: server/edge/slots.py made room for a flood's calls) or a stalled call; or, with
`patience`, for as long as the shard answers at least once every `patience` seconds (a worker, whose link
may drop and come back many times while a big model crosses a slow one), on any status that a network or a
shard's restart gives (TRANSIENT): each retry after a backoff (common/backoff.py), resuming. With `stall`, a
call that brings no message for that many seconds is ended and counts as broken: a shard that opens the
stream and sends nothing, or stops halfway, cannot hold the caller (a worker's link) for ever.

It only reads and checks: no knowledge of what the values are for (the link hands them to
worker/linkstate.py, export cuts them into parameters). It never parses a fingerprint itself:
in describe mode the caller's `describe` turns the shard's description into the slice sizes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import grpc
import torch

from streamdiloco.common.backoff import Backoff
from streamdiloco.common.chunks import ChunkError, MasterAssembly
from streamdiloco.common.wire import auth_metadata, bytes_to_values
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

__all__ = ["FetchError", "Fetched", "fetch_slices"]

log = logging.getLogger("streamdiloco.fetch")

# what a network that drops, a shard that restarts (CANCELLED: it stopped mid-stream) or one still busy
# with our broken call's twin (RESOURCE_EXHAUSTED: its Fetch calls per address) answer: worth another try
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)
# what a Fetch of `attempts` calls tries again: a dropped connection, a full edge, a stalled call
RETRY_ATTEMPTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
RETRY_LOG_EVERY = 10  # a retry is logged the first time and every this many


class FetchError(ValueError):
    """A Fetch that failed or brought what does not fit, in one line. `code` and `details`: the gRPC status
    when the call itself failed (say, UNAUTHENTICATED), else None and ""."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, details: str = ""):
        super().__init__(message)
        self.code, self.details = code, details


@dataclass
class Fetched:
    """What a Fetch brought: each fragment's slice and the round of its master (it holds rounds < it); in
    describe mode also the shard's description (`described`: the stream's first chunk)."""

    where: str
    slices: dict[int, torch.Tensor] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)
    described: pb.MasterChunk | None = None

    def masters(self) -> dict[int, tuple[torch.Tensor, int]]:
        """fragment -> (values, round)."""
        return {f: (v, self.rounds[f]) for f, v in self.slices.items()}

    def describe(self) -> str:
        """One line for logs and errors: whose slices, of which fragments, how big, of which rounds."""
        values = sum(v.numel() for v in self.slices.values())
        rounds = ", ".join(f"{f}: {r}" for f, r in self.rounds.items())
        return (
            f"{self.where}: {len(self.slices)} fragment slice(s), {values:,} values "
            f"({values * 4 / 1e6:,.1f} MB), rounds {{{rounds}}}"
        )


class _Stream:
    """The fragments asked for, their assemblies, and which one is due: the order and resumption rules."""

    def __init__(self, where: str):
        self.where = where
        self.order: list[int] = []  # fragments in the order asked for (set once the sizes are known)
        self.got: dict[int, MasterAssembly] = {}

    def set_sizes(self, sizes: Mapping[int, int]) -> None:
        for f, n in sizes.items():
            try:
                values = torch.empty(n, dtype=torch.float32)
            except RuntimeError as e:  # sizes may come from a description off the network: one line
                raise FetchError(f"cannot hold fragment {f}'s slice ({n:,} values): {str(e)[:120]}") from None
            self.got[f] = MasterAssembly(n, values)
        self.order = list(sizes)

    @property
    def todo(self) -> list[int]:
        return [f for f in self.order if not self.got[f].done]

    def due(self) -> MasterAssembly | None:
        todo = self.todo
        return self.got[todo[0]] if todo else None

    def take(self, m: pb.MasterChunk, first: bool) -> bool:
        """Check and copy one chunk; True when the stream must start over (a resumed fragment's round closed
        while the stream was broken: its chunks so far are of an older master)."""
        todo = self.todo
        if not todo:
            raise FetchError(f"{self.where} sent fragment {m.fragment} where the Fetch was over")
        f, asm = todo[0], self.got[todo[0]]
        if m.fragment != f:
            amid = asm.received > 0 and not first
            raise FetchError(
                f"{self.where} sent fragment {m.fragment} "
                + (f"amid fragment {f}" if amid else f"where fragment {f} was due")
            )
        try:
            asm.add(m.round, m.offset, m.total, bytes_to_values(m.values), m.last)
        except ChunkError as e:
            if e.reason == "round_changed" and first:
                asm.reset()
                return True
            raise FetchError(f"{self.where}: fragment {f}: {e}") from None
        except ValueError as e:  # not whole fp32 numbers
            raise FetchError(f"{self.where}: fragment {f}: {e}") from None
        return False


def fetch_slices(
    stub: pb_grpc.ShardStub,
    sizes: Mapping[int, int] | None = None,
    *,
    where: str,
    describe: Callable[[pb.MasterChunk], Mapping[int, int]] | None = None,
    token: str = "",
    timeout: float | None = None,
    attempts: int = 3,
    on_chunk: Callable[[pb.MasterChunk], None] | None = None,
    patience: float | None = None,
    stop: threading.Event | None = None,
    stall: float | None = None,
) -> Fetched:
    """One shard's master slices, checked (see the module's docstring). Give the fragments as `sizes`
    (fragment -> values in this shard's slice, in the order to fetch them), or `describe`: the shard is
    asked to say which run it serves, and describe(first chunk) returns the sizes of every fragment (a
    ValueError from it is the Fetch's error). `where` ("shard 0 at HOST:PORT") starts every message;
    `timeout` bounds each call (None: none, big models on slow links take long); `stall` (seconds) ends a
    call that brings no message that long (a break, resumed); a broken stream is resumed up to `attempts`
    calls in all, or with `patience` (seconds) until that long passes without a message from the shard (then
    attempts do not count; `stop`, when set, ends the waits between them); `on_chunk` sees every message as
    it comes (bytes counted, progress)."""
    if (sizes is None) == (describe is None):
        raise ValueError("give the slice sizes or a describe function, one of the two")
    stream = _Stream(where)
    if sizes is not None:
        stream.set_sizes(sizes)
    out = Fetched(where)
    retries = _Retries(where, attempts, patience, stop)

    def seen(m: pb.MasterChunk) -> None:
        retries.heard_from()
        if on_chunk is not None:
            on_chunk(m)

    while retries.another():
        known = bool(stream.order)  # the sizes: given, or described by an earlier call
        asm = stream.due()
        if known and asm is None:
            break
        request = pb.FetchRequest(
            token=token,
            fragments=stream.todo,
            offset=asm.received if asm is not None else 0,
            describe=not known,
        )
        call = stub.Fetch(request, metadata=auth_metadata(token), timeout=timeout)
        with _Watchdog(call, stall) as watch:
            try:
                if _read(call, stream, out, describe, watch.heeding(seen)):
                    call.cancel()  # a round closed while the stream was broken: that fragment starts over
                    continue
            except grpc.RpcError as e:
                if watch.fired:  # it sent nothing for `stall` seconds: resumed as a break
                    retries.broken(_STALLED, f"no message for {stall:g} s (the call stalled)", stalled=True)
                else:
                    retries.broken(e.code(), e.details())  # waits before the next call, or raises
                continue
        if not stream.order:
            raise FetchError(f"{where} ended the Fetch without sending anything")
        if stream.todo:  # the shard ended the stream early: a shard's fault, not the network's
            done = len(stream.order) - len(stream.todo)
            raise FetchError(f"{where} ended the Fetch after {done} of {len(stream.order)} fragments")
        break
    if missing := stream.todo:
        raise FetchError(f"{where} did not send all of fragment(s) {missing} in {attempts} Fetch calls")
    for f in stream.order:
        a = stream.got[f]
        out.slices[f], out.rounds[f] = a.values, int(a.round or 0)
    return out


class _Retries:
    """When a broken Fetch is called again (see the module's docstring): up to `attempts` calls in all, or,
    with `patience`, after a backoff each time, for as long as the shard sends a message at least once every
    `patience` seconds; `stop`, when set, ends the waits."""

    def __init__(self, where: str, attempts: int, patience: float | None, stop: threading.Event | None):
        self.where, self.attempts, self.patience = where, attempts, patience
        self.stop = stop or threading.Event()
        self.attempt = 0
        self.backoff = Backoff()
        self.heard = self.broke = time.monotonic()  # when the shard last sent a message, the stream broke

    def another(self) -> bool:
        """Whether to make another call (counted)."""
        if self.patience is None and self.attempt >= self.attempts:
            return False
        self.attempt += 1
        return True

    def heard_from(self) -> None:
        self.heard = time.monotonic()

    def broken(self, code: grpc.StatusCode, details: str | None, stalled: bool = False) -> None:
        """A call failed with `code` and `details` (`stalled`: ended here, as it brought nothing): wait
        before the next, or raise the FetchError that ends the Fetch."""
        details = ((details or "").strip().splitlines() or [""])[0]
        failed = f"Fetch from {self.where} failed: {code.name}: {details}"
        if self.patience is None:
            if (code not in RETRY_ATTEMPTS and not stalled) or self.attempt == self.attempts:
                raise FetchError(failed, code, details) from None
            if self.stop.wait(self.backoff.next()):  # resumed from what was received, after a backoff
                raise FetchError(f"Fetch from {self.where} stopped: the link is closing") from None
            return
        if self.heard > self.broke:  # it went on for a while: the next break waits briefly again
            self.backoff.reset()
        self.broke = time.monotonic()
        silent = self.broke - self.heard
        if code not in TRANSIENT:
            raise FetchError(failed, code, details) from None
        if silent >= self.patience:
            raise FetchError(
                f"Fetch from {self.where}: nothing received for {silent:.0f} s "
                f"(last: {code.name}: {details})",
                code,
                details,
            ) from None
        wait = min(self.backoff.next(), self.patience - silent)
        if self.attempt == 1 or self.attempt % RETRY_LOG_EVERY == 0:
            log.warning(
                "Fetch from %s broke (%s: %s): resuming in %.1f s (attempt %d; giving up after %g s "
                "without a message)",
                self.where,
                code.name,
                details,
                wait,
                self.attempt,
                self.patience,
            )
        if self.stop.wait(wait):
            raise FetchError(f"Fetch from {self.where} stopped: the link is closing") from None


# a call that brought no message for `stall` seconds (ended here): a break, as DEADLINE_EXCEEDED says
_STALLED = grpc.StatusCode.DEADLINE_EXCEEDED


class _Watchdog:
    """Ends `call` (cancels it) once `stall` seconds pass without a message (those its `heeding` sees);
    `fired` says it did. None: never. One thread per call, for the call's life (a `with` block)."""

    def __init__(self, call: grpc.Call, stall: float | None):
        self.call, self.stall = call, stall
        self.fired = False
        self.last = time.monotonic()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def heeding(self, then: Callable[[pb.MasterChunk], None]) -> Callable[[pb.MasterChunk], None]:
        """What sees each message: this watchdog hears it, then `then` sees it."""

        def heard(m: pb.MasterChunk) -> None:
            self.last = time.monotonic()
            then(m)

        return heard

    def __enter__(self) -> _Watchdog:
        if self.stall is not None:
            self._thread = threading.Thread(target=self._watch, name="fetch-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        assert self.stall is not None
        while not self._done.wait(max(0.0, self.last + self.stall - time.monotonic())):
            if time.monotonic() - self.last >= self.stall:
                self.fired = True
                with contextlib.suppress(Exception):
                    self.call.cancel()
                return


def _read(
    call: Iterable[pb.MasterChunk],
    stream: _Stream,
    out: Fetched,
    describe: Callable[[pb.MasterChunk], Mapping[int, int]] | None,
    on_chunk: Callable[[pb.MasterChunk], None] | None,
) -> bool:
    """Read one Fetch call to its end; True when it must start over (see _Stream.take)."""
    first = True
    for m in call:
        if on_chunk is not None:
            on_chunk(m)
        if not stream.order:
            assert describe is not None
            try:
                sizes = describe(m)
            except FetchError:
                raise
            except ValueError as e:
                raise FetchError(str(e)) from None
            if not sizes:
                raise FetchError(f"{stream.where} describes a run without fragments")
            stream.set_sizes(sizes)
            out.described = m
        if stream.take(m, first):
            return True
        first = False
    return False
