"""Chunk assembly: the one place that validates the chunks of an encoded slice and puts them back together,
for the shard (a worker's push) and the worker (a shard's update, a Fetch of a master) alike.

A slice travels as chunks (common.wire.to_chunks): chunk `seq` holds values [offset, offset + numel) of a
`total`-value slice, in the run's codec, with `last` on the final one. `Assembly` takes the chunks of one
slice in order and refuses, with a `ChunkError` and without changing anything, a chunk that is out of order,
repeated, at the wrong offset, of another length, codec or block size, misaligned, whose payload or scales
do not match its codec, or whose values are not finite or could overflow a sum. It keeps the chunks as they
came (encoded: a 4-bit push stays 4-bit) and decodes them straight into place, or adds them, weighted, into
an accumulator, without concatenating them first. `MasterAssembly` does the same for the fp32 chunks of a
Fetch, which can be resumed from where a broken stream stopped; its values keep to the same bound.

Pure: no networking, no threads, no clocks. Messages name the problem; callers prefix where it happened
("fragment 3 round 7 chunk 2: ...") and map `reason` to their own errors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from streamdiloco.common.codecs import (
    Encoded,
    accumulate,
    add_into,
    chunk_alignment,
    concat,
    decode,
    get_codec,
    piece,
)
from streamdiloco.common.topk import problem as topk_problem

# No value a chunk stands for may exceed this in magnitude (a push on the shard; an update or a fetched master
# on the worker), so that no weighted sum of accepted chunks, mean, outer step or mirror can overflow: outer
# gradients and updates are parameter differences, and parameters, far below 1e30.
MAX_ABS_VALUE = 1e30
# The largest level of each scaled codec, relative to its block's scale (int8: 127 steps, e3m0: 2^0; sq2's
# codebook holds the values themselves).
_TOP_LEVEL = {"int8": 127.0, "e3m0": 1.0, "sq2": 1.0}  # (and 1.0 for top-k's codebooks)
# what a codec's fp32 side values are called in a refusal
_SIDE_VALUE = {"int8": "scale", "e3m0": "scale"}  # sq2's and top-k's: codebook values


class ChunkError(ValueError):
    """A chunk that does not fit the slice being assembled; the assembly is unchanged."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        # short machine-readable cause, as the shard's PushResult carries it: bad_chunk (order), bad_offset,
        # bad_length (sizes, alignment, last), bad_codec (codec, block size), bad_scale, bad_value, bad_round
        self.reason = reason


def out_of_bounds(values: torch.Tensor, max_abs: float = MAX_ABS_VALUE) -> str | None:
    """What is wrong with fp32 parameter values from the wire (a Fetch's master, an Initialize upload), in
    words ("non-finite values", "values above 1e+30 in magnitude"); None when every one is finite and at most
    `max_abs` in magnitude: parameters are far below the bound that updates keep to."""
    top = float(values.abs().amax()) if values.numel() else 0.0  # NaN and inf survive abs, amax
    if not math.isfinite(top):
        return "non-finite values"
    if top > max_abs:
        return f"values above {max_abs:g} in magnitude"
    return None


def _shown(text: str, limit: int = 40) -> str:
    """Text a client sent, as a message quotes it: its first `limit` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


class Assembly:
    """One encoded slice of `total` values arriving in chunks (a push on the shard, an update on the
    worker). `block_size` is the run's codec block size (unscaled codecs carry 0 in their chunks).

    `what` ("push", "update"), `role` ("uplink", "downlink") and `where` ("slice 0") only word the messages.
    """

    def __init__(
        self,
        total: int,
        codec: str,
        block_size: int,
        *,
        what: str = "push",
        role: str = "uplink",
        where: str = "the slice",
        max_abs: float = MAX_ABS_VALUE,
    ):
        spec = get_codec(codec)
        self.total, self.codec = total, codec
        self.block_size = spec.block(block_size)  # what every chunk must carry (top-k: its chunk)
        self.align = chunk_alignment(codec, block_size)
        self.what, self.role, self.where, self.max_abs = what, role, where, max_abs
        self.parts: list[tuple[int, Encoded]] = []  # (offset, part), in order
        self.received = 0  # values so far: the next chunk's offset
        self.nbytes = 0  # codec bytes (payload + scales) so far

    @property
    def next_seq(self) -> int:
        return len(self.parts)

    @property
    def done(self) -> bool:
        return self.received == self.total

    # --- taking chunks ---------------------------------------------------------------------------------
    def expect(self, seq: int, offset: int) -> None:
        """ChunkError unless chunk `seq` at `offset` is the one that comes next (its place only)."""
        if self.done:
            raise ChunkError("bad_chunk", f"chunk {seq} after the last chunk of the {self.what}")
        if not self.parts:
            if seq != 0 or offset != 0:
                raise ChunkError(
                    "bad_chunk",
                    f"{_a(self.what)} starts with chunk 0 at offset 0, got chunk {seq} at {offset}",
                )
            return
        if seq < self.next_seq:
            raise ChunkError("bad_chunk", f"chunk {seq} repeated (next expected is {self.next_seq})")
        if seq != self.next_seq:
            raise ChunkError("bad_chunk", f"chunk out of order: expected chunk {self.next_seq}")
        if offset != self.received:
            raise ChunkError("bad_offset", f"offset {offset}, expected {self.received}")

    def check(self, seq: int, offset: int, total: int, part: Encoded, last: bool) -> None:
        """ChunkError unless the chunk fits: its place, the slice's length, codec, block size, alignment,
        payload and scale sizes, and values that are finite and at most `max_abs` in magnitude."""
        self.expect(seq, offset)
        if total != self.total:
            raise ChunkError(
                "bad_length", f"{self.where} has {self.total} values, the {self.what} says {total}"
            )
        if part.codec != self.codec:
            raise ChunkError(
                "bad_codec", f"this run's {self.role} codec is {self.codec}, got {_shown(part.codec)}"
            )
        if part.block_size != self.block_size:
            raise ChunkError("bad_codec", f"block size must be {self.block_size}, got {part.block_size}")
        end = offset + part.numel
        if part.numel < 1 or end > total:
            raise ChunkError("bad_length", f"values [{offset}, {end}) do not fit a {total}-value slice")
        if last != (end == total):
            raise ChunkError("bad_length", f"chunk ends at {end} of {total} but last is {str(last).lower()}")
        if not last and part.numel % self.align:
            raise ChunkError(
                "bad_length",
                f"a chunk other than the last must hold a multiple of {self.align} values, got {part.numel}",
            )
        spec = get_codec(part.codec)
        want_payload, want_scales = spec.sizes(part.numel, self.block_size or 1)
        if part.payload.numel() != want_payload or part.scales.numel() != want_scales:
            raise ChunkError(
                "bad_length",
                f"{part.numel} {part.codec} values need {want_payload} payload bytes and {want_scales} "
                f"scales, got {part.payload.numel()} and {part.scales.numel()}",
            )
        if part.payload.dtype != torch.uint8 or part.scales.dtype != torch.float32:
            raise ChunkError("bad_codec", "payload must be bytes (uint8) and scales fp32")
        if spec.scaled:
            side = _SIDE_VALUE.get(part.codec, "codebook value")
            top = float(part.scales.abs().amax()) if want_scales else 0.0  # NaN and inf survive abs, amax
            if not math.isfinite(top):
                raise ChunkError("bad_scale", f"the chunk has a non-finite {side}")
            top *= _TOP_LEVEL.get(part.codec, 1.0)
            if top > self.max_abs:
                raise ChunkError(
                    "bad_scale",
                    f"the chunk's {side}s allow values up to {top:.3g}, above {self.max_abs:g}",
                )
            if spec.sparse and (bad := topk_problem(part.payload, spec, part.numel)) is not None:
                raise ChunkError("bad_value", bad)
        else:
            top = float(decode(part).abs().amax())
            if not math.isfinite(top):
                raise ChunkError("bad_value", "the chunk holds non-finite values")
            if top > self.max_abs:
                raise ChunkError("bad_value", f"the chunk holds values above {self.max_abs:g} in magnitude")

    def add(self, seq: int, offset: int, total: int, part: Encoded, last: bool) -> bool:
        """Take the next chunk (ChunkError, with nothing changed, if it does not fit). True: the slice is
        complete."""
        self.check(seq, offset, total, part, last)
        self.parts.append((offset, part))
        self.received += part.numel
        self.nbytes += part.nbytes
        return last

    # --- using the slice -------------------------------------------------------------------------------
    def encoded(self) -> Encoded:
        """The whole slice as one Encoded (the parts joined: a copy, unless it came in one chunk)."""
        self._need_done()
        return self.parts[0][1] if len(self.parts) == 1 else concat([p for _, p in self.parts])

    def pieces(self, lo: int = 0, hi: int | None = None) -> Iterator[tuple[int, Encoded]]:
        """(offset, piece) covering values [lo, hi) of what has arrived, as views of the chunks. lo and hi
        must be multiples of `align` (hi may also be the end of what has arrived)."""
        hi = self.received if hi is None else hi
        if not 0 <= lo <= hi <= self.received:
            raise ValueError(f"values [{lo}, {hi}) are not within the {self.received} received")
        if lo % self.align or (hi % self.align and hi != self.received):
            raise ValueError(f"[{lo}, {hi}) does not start and end at multiples of {self.align}")
        for offset, part in self.parts:
            end = offset + part.numel
            if end <= lo:
                continue
            if offset >= hi:
                break
            a, b = max(lo, offset), min(hi, end)
            yield a, piece(part, a - offset, b - offset)

    def decode_into(self, out: torch.Tensor, lo: int = 0) -> None:
        """out[:] = the values [lo, lo + out.numel()), decoded in place (out: fp32)."""
        for at, p in self.pieces(lo, lo + out.numel()):
            decode(p, out=out[at - lo : at - lo + p.numel])

    def add_into(self, out: torch.Tensor, lo: int = 0) -> None:
        """out += the values [lo, lo + out.numel()) (out: fp32, say a mirror's slice)."""
        for at, p in self.pieces(lo, lo + out.numel()):
            add_into(p, out[at - lo : at - lo + p.numel])

    def accumulate_into(self, acc: torch.Tensor, weight: float, lo: int = 0, overwrite: bool = False) -> None:
        """acc += weight * the values [lo, lo + acc.numel()) (acc: fp64, the shard's sum); `overwrite`: as if
        acc were zeros (the values must all have arrived)."""
        if overwrite and lo + acc.numel() > self.received:
            raise ValueError(f"values [{lo}, {lo + acc.numel()}) have not all arrived")
        for at, p in self.pieces(lo, lo + acc.numel()):
            accumulate(p, acc[at - lo : at - lo + p.numel], weight, overwrite)  # one pass, no temporaries

    def _need_done(self) -> None:
        if not self.done:
            raise ValueError(f"the {self.what} is incomplete: {self.received} of {self.total} values")


class MasterAssembly:
    """One fragment slice's fp32 master arriving as the chunks of a Fetch stream, written straight into
    `out` (allocated if not given), every value finite and at most `max_abs` in magnitude (so that a mirror
    set from it, plus the updates that follow, stays finite). The stream may break and be resumed at
    `received`; if the shard's round changes between chunks, `add` refuses with reason "round_changed" and
    the caller starts over (`reset`)."""

    def __init__(
        self,
        total: int,
        out: torch.Tensor | None = None,
        *,
        where: str = "the slice",
        max_abs: float = MAX_ABS_VALUE,
    ):
        if out is not None and (out.dtype != torch.float32 or out.numel() != total):
            raise ValueError(f"out must hold {total} fp32 values")
        self.total, self.where, self.max_abs = total, where, max_abs
        self.values = out if out is not None else torch.empty(total, dtype=torch.float32)
        self.round: int | None = None  # the round of the master, from its first chunk
        self.received = 0

    @property
    def done(self) -> bool:
        return self.round is not None and self.received == self.total

    def reset(self) -> None:
        self.round, self.received = None, 0

    def check(self, round: int, offset: int, total: int, values: torch.Tensor, last: bool) -> None:
        if self.round is not None and round != self.round:
            raise ChunkError("round_changed", f"round {round} after chunks of round {self.round}: start over")
        if self.done:
            raise ChunkError("bad_chunk", f"a chunk at {offset} after the last one")
        if offset != self.received:
            raise ChunkError("bad_offset", f"offset {offset}, expected {self.received}")
        if total != self.total:
            raise ChunkError("bad_length", f"{self.where} has {self.total} values, the shard says {total}")
        if values.dtype != torch.float32:
            raise ChunkError("bad_codec", f"master values must be fp32, got {values.dtype}")
        end = offset + values.numel()
        if end > total or (values.numel() == 0 and total > 0):
            raise ChunkError("bad_length", f"values [{offset}, {end}) do not fit a {total}-value slice")
        if last != (end == total):
            raise ChunkError("bad_length", f"chunk ends at {end} of {total} but last is {str(last).lower()}")
        if (bad := out_of_bounds(values, self.max_abs)) is not None:
            raise ChunkError("bad_value", f"the chunk holds {bad}")

    def add(self, round: int, offset: int, total: int, values: torch.Tensor, last: bool) -> bool:
        """Copy the next chunk's values into place (ChunkError, with nothing changed, if it does not fit).
        True: the master is complete."""
        self.check(round, offset, total, values, last)
        self.values[offset : offset + values.numel()].copy_(values)
        self.round = round
        self.received += values.numel()
        return last
