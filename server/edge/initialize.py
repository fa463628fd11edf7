"""A shard started with `--init from-worker`: no model and no parameters until the first worker sends them.

Until then the shard answers Join with `uninitialized` (and the run's config) and takes one Initialize
stream at a time, from a worker its credentials admit: the worker's model fingerprint first (the shard takes
its layout; its sync settings must be the shard's, and whatever else it holds, the model's hyperparameters
say, becomes part of the shard's fingerprint, so every later worker is checked against it), then the
worker's fp32 values of this shard's slice of every fragment, in order. Everything is checked as it comes:
order, sizes against the fingerprint, finite values; the values are kept apart until the last chunk, so
that a refused or broken upload changes nothing, and what an upload holds grows only with what it sent.
Then the shard's state is built and written to its checkpoint (whose meta.json keeps the fingerprint and
the init hash) before the worker hears back: a restart takes the layout and the values from there, without
the uploader. Once that is done, every later upload gets ALREADY_EXISTS, whenever it was opened: one
Shard, ever.

The first message also names the upload's init hash and every slice's hash (common/inithash.py): the shard
checks that they make the init hash and, with `--init-expect`, that it is the pinned one, before it takes a
value (so a pinned shard takes only the pinned layout, and no more values than it has); then that each of
its slices hashes to what was said. The shard reports the init hash at every Join, so that a worker sees two
shards that took two different uploads.

The only upload slot is held only at a pace (`Pace`): `--init-timeout` seconds without a message that
carries values (empty ones do not count), or an average below `--init-min-rate` bytes of values a second
once the first `--init-timeout` seconds have passed, and the upload is refused, the slot free. So holding
the slot costs bytes: a trickle of one value per `--init-timeout` loses it once its first `--init-timeout`
seconds have passed, and an upload holds it at most `--init-timeout` + its declared bytes / `--init-min-rate`
seconds. While the slot is held, another upload is refused (ABORTED: the worker tries again). With
`--init-expect` an upload that completes can only bring the pinned values, whoever sends them: so up to
MAX_IN_LINE uploads naming the pinned hash wait in line (`UploadSlot`), each for up to twice
`--init-timeout` seconds, and the first of them takes the slot the moment the holder falls behind or
fails, before a new call can.

`PendingShard.dispatch` is the gRPC server's handler: it routes calls to the pending shard until the upload
is in, then to the running Shard's servicer, so the port stays the same and nobody reconnects.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from streamdiloco.common.chunks import out_of_bounds
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import (
    fingerprint_diff,
    layout_from_fingerprint,
    model_fingerprint,
    parse_fingerprint,
)
from streamdiloco.common.fragments import FragmentLayout, slice_ranges
from streamdiloco.common.inithash import HASH_CHARS, combine, parse_init_hash
from streamdiloco.common.statefile import opaque_keys
from streamdiloco.common.wire import bytes_to_values
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.edge.admission import Refusal, Undecodable, abort, admit, credentials, parse, short
from streamdiloco.server.edge.gates import Gates
from streamdiloco.server.edge.service import ShardService, rpc_handlers

if TYPE_CHECKING:
    from streamdiloco.server.shard import Shard

log = logging.getLogger("streamdiloco.shard")

MAX_INIT_VALUES = 1 << 34  # values in one shard's slices that an upload may declare (64 GiB of fp32)
MAX_INIT_CHUNK = 4 << 20  # bytes of values in one InitChunk (workers send about 1 MiB)
MAX_CHUNK_BYTES = 16 << 20  # --chunk-bytes at most (ShardSettings)
MAX_IN_LINE = 4  # pinned uploads that may wait for the slot at once (each holds its first message, <= 5 MiB)

SERVICE = pb.DESCRIPTOR.services_by_name["Shard"].full_name
WAITING = "the shard is waiting for its first worker's parameters (server --init from-worker)"


class InitRefused(ValueError):
    """An upload the shard refuses: nothing changed."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Pace:
    """How fast an upload must go to keep the slot (pure: times are the caller's clock, in seconds): values
    within `grace` seconds of the last ones (--init-timeout), and from `grace` seconds after its first
    message on, `rate` bytes of values a second on average (--init-min-rate). So an upload of B bytes holds
    the slot for at most grace + B / rate seconds, and one that sends nothing for at most `grace`."""

    grace: float
    rate: float

    def due(self, started: float, last_values: float, received: int) -> float:
        """When more values must have come, for an upload that began at `started`, last sent values at
        `last_values` and has sent `received` bytes of them."""
        return min(last_values + self.grace, started + self.grace + received / self.rate)

    def fault(self, started: float, last_values: float, received: int, now: float) -> str:
        """What an upload that let `due` pass did wrong, in a sentence."""
        if now >= last_values + self.grace:
            return f"the upload sent no values for {self.grace:g} s (--init-timeout)"
        return (
            f"the upload fell behind --init-min-rate: {received:,} bytes of values in {now - started:.1f} s, "
            f"and it must average {self.rate:g} bytes a second once its first {self.grace:g} s "
            "(--init-timeout) have passed"
        )


class UploadSlot:
    """The only upload slot and the line of uploads waiting for it (asyncio, on the shard's event loop).
    `take` returns a ticket when the slot is free; `wait` stands in line (at most `room` at once) and
    returns one when the holder's `release` hands the slot over, the first in line first; None otherwise.
    A ticket's release hands the slot on once: a second release of it changes nothing."""

    def __init__(self, room: int):
        self.room = room
        self.holder: str | None = None  # the worker whose upload holds the slot
        self.ticket: object | None = None
        self.line: deque[tuple[str, asyncio.Future[object]]] = deque()

    def take(self, worker: str) -> object | None:
        if self.ticket is not None:
            return None
        self.holder, self.ticket = worker, object()
        return self.ticket

    async def wait(self, worker: str, timeout: float) -> object | None:
        """Stand in line for up to `timeout` seconds: the slot's ticket, or None (the line was full, or
        the holder kept the slot). A waiter that leaves (its call ended) just as it was handed the slot
        passes it on."""
        if (ticket := self.take(worker)) is not None or len(self.line) >= self.room:
            return ticket
        handed: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        place = (worker, handed)
        self.line.append(place)
        got = None
        try:
            got = await asyncio.wait_for(asyncio.shield(handed), timeout)
            return got
        except asyncio.TimeoutError:
            return None
        finally:
            if place in self.line:
                self.line.remove(place)
            elif got is None and handed.done():  # handed the slot as it timed out or its call ended
                self.release(handed.result())

    def release(self, ticket: object) -> None:
        """The holder of `ticket` is done: the slot goes to the first in line, or is free."""
        if ticket is not self.ticket:
            return
        self.holder = self.ticket = None
        while self.line:
            worker, handed = self.line.popleft()
            if not handed.done():
                self.holder, self.ticket = worker, object()
                handed.set_result(self.ticket)
                return


def shard_fingerprint(theirs: dict, cfg: SyncConfig) -> tuple[FragmentLayout, dict]:
    """The layout a worker's fingerprint lists and the shard's fingerprint from it (the layout with the
    shard's own sync settings, plus the worker's other keys); InitRefused when the fingerprint is malformed
    or its sync settings are not the shard's."""
    try:
        layout = layout_from_fingerprint(theirs, "the worker's model fingerprint", cfg.fragment_pattern)
    except ValueError as e:
        raise InitRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    # the first worker's seed and model config (opaque_keys) become the run's: later workers must match them
    ours = {**model_fingerprint(layout, cfg), **opaque_keys(theirs)}
    if "model_config" not in theirs:  # a run started from a plain state_dict file: no model config known
        del ours["model_config"]
    if diff := fingerprint_diff(theirs, ours, us="worker", them="shard"):
        raise InitRefused(grpc.StatusCode.FAILED_PRECONDITION, short(diff, 1000))
    return layout, ours


class Upload:
    """One worker's upload of this shard's slices, checked chunk by chunk (pure: no gRPC, no I/O)."""

    def __init__(
        self, layout: FragmentLayout, shard: int, num_shards: int, digests: list[bytes] | None = None
    ):
        """`digests`: what each of this shard's slices must hash to (common/inithash.py); None: unchecked."""
        self.layout, self.digests = layout, digests
        self.ranges = [slice_ranges(f.numel, num_shards)[shard] for f in layout.fragments]
        total = sum(hi - lo for lo, hi in self.ranges)
        if total > MAX_INIT_VALUES:
            raise InitRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the fingerprint's model gives this shard {total:,} values, more than it takes "
                f"({MAX_INIT_VALUES:,})",
            )
        self.parts: list[list[torch.Tensor]] = [[] for _ in layout.fragments]
        self.fragment, self.received, self.done = 0, 0, False
        self.bytes_in = 0  # bytes of values taken so far, of the 4 x `total` it declared
        self.hasher = hashlib.sha256()
        self._skip_empty()

    def _want(self) -> int:
        lo, hi = self.ranges[self.fragment]
        return hi - lo

    def _skip_empty(self) -> None:
        """On to the next fragment once this one's slice is complete (and hashes to what was said)."""
        while self.fragment < len(self.ranges) and self.received == self._want():
            if self.digests is not None and self.hasher.digest() != self.digests[self.fragment]:
                raise InitRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"fragment {self.fragment}: this shard's slice does not hash to what the upload's first "
                    "message said: the values are not those of its init hash",
                )
            self.fragment, self.received = self.fragment + 1, 0
            self.hasher = hashlib.sha256()

    def add(self, fragment: int, offset: int, values: bytes, last: bool) -> None:
        if self.done:
            raise InitRefused(grpc.StatusCode.INVALID_ARGUMENT, "a chunk after the last one")
        if values:
            if len(values) > MAX_INIT_CHUNK:
                raise InitRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a chunk of {len(values):,} bytes of values: at most {MAX_INIT_CHUNK:,} a message",
                )
            if self.fragment >= len(self.ranges):
                raise InitRefused(grpc.StatusCode.INVALID_ARGUMENT, "values past the last fragment's slice")
            if (fragment, offset) != (self.fragment, self.received):
                raise InitRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"expected fragment {self.fragment} at offset {self.received}, got fragment {fragment} "
                    f"at offset {offset}: send each fragment's slice in order",
                )
            try:
                x = bytes_to_values(values)
            except ValueError as e:
                raise InitRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if self.received + x.numel() > self._want():
                raise InitRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"fragment {fragment}: more than the {self._want():,} values of this shard's slice",
                )
            if (bad := out_of_bounds(x)) is not None:  # what every worker's Fetch would refuse
                bad = "values that are not finite" if bad.startswith("non-finite") else bad
                raise InitRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"fragment {fragment} at offset {offset}: {bad}"
                )
            self.parts[fragment].append(x)
            self.hasher.update(values)
            self.received += x.numel()
            self.bytes_in += len(values)
            self._skip_empty()
        if last:
            if self.fragment < len(self.ranges):
                raise InitRefused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the upload ended with fragment {self.fragment} at {self.received:,} of its "
                    f"{self._want():,} values",
                )
            self.done = True

    def initial(self) -> list[torch.Tensor]:
        """Full-length fragment vectors holding this shard's slices (what ShardState takes)."""
        out = []
        for i, (f, (lo, hi)) in enumerate(zip(self.layout.fragments, self.ranges, strict=True)):
            vec = torch.zeros(f.numel, dtype=torch.float32)
            if hi > lo:
                vec[lo:hi] = torch.cat(self.parts[i])
            out.append(vec)
        return out


class PendingShard(pb_grpc.ShardServicer):
    """The shard before its first worker's upload; `make(layout, initial, fingerprint, init_hash)` builds the
    running Shard (with its checkpoint) from it, on a thread. Its handlers are the servicer's (rpc_handlers),
    with Initialize added; its Join admits as the running one does (server/edge/admission.py), less the
    fingerprint, which the upload brings. The config's `init_expect`: the init hash an upload must have
    (--init-expect; None: any); `pace`: how fast an upload must go to keep the slot (--init-timeout,
    --init-min-rate); `slot`: the slot, and with --init-expect its line. It is served as the running shard
    is (serve()): `attach`, `push_bytes`, `started`."""

    def __init__(
        self, config: ShardConfig, gates: Gates, make: Callable[[FragmentLayout, list, dict, str], Shard]
    ):
        self.config, self.gates, self.make = config, gates, make
        self.cfg, self.shard, self.num_shards = config.sync, config.shard, config.num_shards
        self.auth, self.limits = config.auth, config.limits
        self.init_expect = None if config.init_expect is None else parse_init_hash(config.init_expect)
        self.pace = Pace(config.init_timeout, config.init_min_rate)
        # with --init-expect every upload taken is the same values: others may wait in line for the slot
        self.slot = UploadSlot(MAX_IN_LINE if self.init_expect is not None else 0)
        self.running: Shard | None = None  # the shard, once built from the upload and checkpointed
        self.arrived = asyncio.Event()  # set with `running`
        self.handlers = {
            **rpc_handlers(self),
            "Initialize": grpc.stream_unary_rpc_method_handler(
                self.Initialize,
                request_deserializer=parse(pb.InitChunk),
                response_serializer=pb.InitReply.SerializeToString,
            ),
        }
        self.dispatch = _Dispatch(self)

    @property
    def uploader(self) -> str | None:
        """The worker whose upload holds the slot now."""
        return self.slot.holder

    # --- served as the running shard is (serve()) ------------------------------------------------------
    def attach(self, server: grpc.aio.Server) -> None:
        """Serve the pending shard's calls on `server`, then the running shard's (`_Dispatch`)."""
        server.add_generic_rpc_handlers((self.dispatch,))

    @property
    def push_bytes(self) -> int:
        """The largest push chunk any --chunk-bytes may give: the running shard is not built yet."""
        return 2 * MAX_CHUNK_BYTES

    async def started(self, stop: asyncio.Event, waiting: Callable[[], Awaitable[None]]) -> Shard | None:
        """The running shard once the first upload built it (None: stopped before one came); `waiting` is
        awaited first (gRPC starts, the ready file, the log line)."""
        await waiting()
        stopped = asyncio.ensure_future(stop.wait())
        arrived = asyncio.ensure_future(self.arrived.wait())
        try:
            await asyncio.wait({arrived, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            arrived.cancel()
        return self.running

    def _reply(self) -> pb.JoinReply:
        return pb.JoinReply(
            config_json=json.dumps(self.cfg.to_dict()),
            shard=self.shard,
            num_shards=self.num_shards,
            uninitialized=True,
        )

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {request.kind} does not parse")
        try:
            admit(self.auth, credentials(context, request.token), request.worker, request.protocol)
        except Refusal as r:
            await abort(context, r)
        return self._reply()

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAVAILABLE, WAITING)
        yield  # an async generator, as gRPC's stream handlers are

    async def Fetch(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAVAILABLE, WAITING)
        yield

    async def Pieces(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAVAILABLE, WAITING)

    async def Initialize(
        self, request_iterator: AsyncIterator[pb.InitChunk], context: grpc.aio.ServicerContext
    ) -> pb.InitReply:
        if self.running is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "the shard has its parameters already")
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(it.__anext__(), self.limits.hello_timeout)
        except (StopAsyncIteration, asyncio.TimeoutError):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"an upload starts with its fingerprint within {self.limits.hello_timeout:g} s",
            )
        if isinstance(first, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {first.kind} does not parse")
        try:  # only a worker the shard admits, as at Join
            admit(self.auth, credentials(context, first.token), first.worker, None)
        except Refusal as r:
            await abort(context, r)
        if self.running is not None:  # taken while this call waited for its first message: the first stays
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "the shard has its parameters already")
        ticket = None
        try:
            plan = self._plan(first)  # before the slot: a pinned shard lets only the pinned hash wait in line
            ticket = await self._take_slot(first.worker)
            return await self._upload(first, plan, it)
        except InitRefused as e:
            if e.code not in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED):  # not its fault
                log.warning("refused %s's upload of the starting parameters: %s", short(first.worker, 60), e)
            # the slot is handed on before the refusal goes out: a worker that fixes its upload and sends it
            # again at once must not be told that it (its own refused upload) is sending the parameters now
            if ticket is not None:
                self.slot.release(ticket)
            await context.abort(e.code, str(e))
            raise  # not reached
        finally:
            if ticket is not None:
                self.slot.release(ticket)

    async def _take_slot(self, worker: str) -> object:
        """The slot's ticket for this upload; InitRefused when the shard has its parameters or another
        upload holds the slot (with --init-expect, after waiting in line for up to twice --init-timeout)."""
        if self.running is None and (ticket := self.slot.take(worker)) is not None:
            return ticket
        held_by = self.slot.holder
        if self.running is None and self.slot.room:
            ticket = await self.slot.wait(worker, 2 * self.pace.grace)
            if ticket is not None and self.running is not None:
                self.slot.release(ticket)  # the holder's upload was taken: on to the next in line
            elif ticket is not None:
                return ticket
            held_by = self.slot.holder or held_by
        if self.running is not None:
            raise InitRefused(grpc.StatusCode.ALREADY_EXISTS, "the shard has its parameters already")
        line = f", {len(self.slot.line)} more in line" if self.slot.line else ""
        raise InitRefused(
            grpc.StatusCode.ABORTED,
            f"worker {short(held_by or '?', 60)!r} is sending the parameters now{line}: try again in a few "
            "seconds (an upload keeps the slot only while it keeps --init-min-rate)",
        )

    def _plan(self, first: pb.InitChunk) -> tuple[FragmentLayout, dict, str, list[bytes]]:
        """What the first message declares, checked before any value: the layout, the shard's fingerprint
        from it, the init hash and what this shard's slices must hash to."""
        try:
            theirs = parse_fingerprint(first.fingerprint_json)
        except ValueError as e:
            raise InitRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        layout, fingerprint = shard_fingerprint(theirs, self.cfg)
        Upload(layout, self.shard, self.num_shards)  # not more than the shard takes, first
        init_hash, digests = self._claimed(first, layout)
        return layout, fingerprint, init_hash, digests

    async def _receive(self, upload: Upload, first: pb.InitChunk, it: AsyncIterator[pb.InitChunk]) -> None:
        """Take the upload's messages until its last chunk, at `pace`: InitRefused when it falls behind."""
        loop = asyncio.get_running_loop()
        started = last_values = loop.time()  # of the first message, and of the last that carried values
        msg = first
        while True:
            upload.add(msg.fragment, msg.offset, msg.values, msg.last)
            if upload.done:
                return
            if msg.values:
                last_values = loop.time()
            due = self.pace.due(started, last_values, upload.bytes_in)
            try:
                if loop.time() >= due:
                    raise asyncio.TimeoutError
                msg = await asyncio.wait_for(it.__anext__(), due - loop.time())
            except StopAsyncIteration:
                raise InitRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, "the upload ended before its last chunk"
                ) from None
            except asyncio.TimeoutError:
                fault = self.pace.fault(started, last_values, upload.bytes_in, loop.time())
                then = "goes to the next upload in line" if self.slot.line else "is free for another"
                raise InitRefused(grpc.StatusCode.DEADLINE_EXCEEDED, f"{fault}: the slot {then}") from None
            if isinstance(msg, Undecodable):
                raise InitRefused(grpc.StatusCode.INVALID_ARGUMENT, f"the {msg.kind} does not parse")

    async def _upload(
        self,
        first: pb.InitChunk,
        plan: tuple[FragmentLayout, dict, str, list[bytes]],
        it: AsyncIterator[pb.InitChunk],
    ) -> pb.InitReply:
        layout, fingerprint, init_hash, digests = plan
        upload = Upload(layout, self.shard, self.num_shards, digests)
        log.info(
            "shard %d: %s is sending the starting parameters (%s bytes for this shard): the slot is its "
            "while it averages %g bytes a second after its first %g s (--init-min-rate, --init-timeout)",
            self.shard,
            short(first.worker, 60),
            f"{4 * sum(hi - lo for lo, hi in upload.ranges):,}",
            self.pace.rate,
            self.pace.grace,
        )
        await self._receive(upload, first, it)
        if self.running is not None:  # not reached (one upload at a time); never a second service
            raise InitRefused(grpc.StatusCode.ALREADY_EXISTS, "the shard has its parameters already")
        try:  # the state, then its checkpoint, before the worker hears back
            shard = await asyncio.to_thread(self.make, layout, upload.initial(), fingerprint, init_hash)
        except (OSError, ValueError) as e:
            raise InitRefused(
                grpc.StatusCode.INTERNAL, f"the shard could not take the parameters: {e}"
            ) from None
        self.running = shard
        log.info(
            "shard %d: took the layout (%d fragments, %s values in this shard's slices) and the starting "
            "parameters from %s (init hash %s)",
            self.shard,
            layout.num_fragments,
            f"{sum(hi - lo for lo, hi in upload.ranges):,}",
            short(first.worker, 60),
            init_hash,
        )
        self.dispatch.to(ShardService(shard))
        self.arrived.set()
        return pb.InitReply()

    def _claimed(self, first: pb.InitChunk, layout: FragmentLayout) -> tuple[str, list[bytes]]:
        """The upload's init hash and what this shard's slices must hash to, from its first message: the
        slices' hashes must make the init hash, and that must be the pinned one (--init-expect)."""
        if not first.init_hash:
            raise InitRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the upload names no init hash (a worker of this version sends it): upgrade the worker",
            )
        try:
            claimed = parse_init_hash(first.init_hash[: HASH_CHARS * 2], "the upload's init_hash")
            made = combine(layout, self.num_shards, list(first.slice_hashes))
        except ValueError as e:
            raise InitRefused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if made != claimed:
            raise InitRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the upload's slice hashes make init hash {made[:16]}..., not the {claimed[:16]}... "
                "it names",
            )
        if self.init_expect is not None and claimed != self.init_expect:
            raise InitRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the upload's init hash is {claimed[:16]}..., not the {self.init_expect[:16]}... this shard "
                "was told to take (--init-expect): start the worker with the pinned model and seed",
            )
        n = self.num_shards
        return claimed, [first.slice_hashes[f * n + self.shard] for f in range(layout.num_fragments)]


class _Dispatch(grpc.GenericRpcHandler):
    """The gRPC server's handler: the pending shard's methods, then the service's (and Initialize, which
    then answers that the shard has its parameters)."""

    def __init__(self, pending: PendingShard):
        self.pending = pending
        self.handlers = {f"/{SERVICE}/{name}": h for name, h in pending.handlers.items()}

    def to(self, service: pb_grpc.ShardServicer) -> None:
        handlers = {f"/{SERVICE}/{name}": h for name, h in rpc_handlers(service).items()}
        handlers[f"/{SERVICE}/Initialize"] = self.handlers[f"/{SERVICE}/Initialize"]
        self.handlers = handlers  # one assignment: a call sees the old table or the new

    def service(self, handler_call_details):
        return self.handlers.get(handler_call_details.method)
