"""Chunked top-k (the `topk<K>_<C>` codecs of common/codecspec.py): the reference in torch ops and the CPU
kernels, bit-identical.

Format, per chunk of C values (the codec's block; a last chunk of m < C values keeps k = ceil(K m / C)):
the k positions (within the chunk) of the values of largest magnitude, strictly ascending, each in
ceil(log2 C) bits, packed into a little-endian bit stream (the first position in the lowest bits) of
ceil(k bits / 8) bytes; then their k values, in the same order, as sq2's 2-bit codes (four a byte); the
chunk's 4 fp32 codebook entries are its `scales`. Every other value is zero. Which values are kept is exact:
the order is by magnitude (the fp32 bit pattern without its sign), ties to the lower position; sq2's
statistics are taken over the k kept values (common/codecs.py's, to the bit), and stochastic rounding's
uniform number for the t-th kept value of the chunk starting at value s is u_(s + t).

Decoding writes only the kept positions: `add_into` and `accumulate` touch k values a chunk, so the shard
adds M sparse pushes without densifying them. A position past the chunk's values is never written whatever a
peer sent (`problem` finds it, and positions that are not strictly ascending, before anything is used).

common/codecs.py is the only caller: it checks the arguments and cuts the work into ranges of whole chunks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from streamdiloco.common import kernels
from streamdiloco.common.codecspec import Codec
from streamdiloco.common.sq2 import sq2_quantize


# --- the reference: torch ops on any device ----------------------------------------------------------------
def _rows(spec: Codec, n: int) -> list[tuple[int, int, int]]:
    """(first chunk, number of chunks, values per chunk) of the whole chunks and of a last shorter one."""
    whole, rest = divmod(n, spec.chunk)
    rows = [(0, whole, spec.chunk)] if whole else []
    if rest:
        rows.append((whole, 1, rest))
    return rows


def _pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, k) non-negative integers below 2^width -> (rows, ceil(k width / 8)) bytes: each row a
    little-endian bit stream, the first value in the lowest bits."""
    rows, k = values.shape
    shifts = torch.arange(width, device=values.device)
    bits = ((values.unsqueeze(-1) >> shifts) & 1).reshape(rows, k * width)
    pad = (-(k * width)) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(rows, pad)], dim=1)
    weights = torch.tensor([1 << i for i in range(8)], device=values.device)
    return (bits.view(rows, -1, 8) * weights).sum(dim=2).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """The inverse of `_pack_bits`: (rows, k) int64."""
    rows = packed.shape[0]
    bits = (packed.long().unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1
    bits = bits.reshape(rows, -1)[:, : k * width].reshape(rows, k, width)
    return (bits << torch.arange(width, device=packed.device)).sum(dim=2)


def encode_torch(
    x: torch.Tensor, spec: Codec, stochastic: bool, seed: Any, uniform_at: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(payload, codebooks) of x (flat, contiguous fp32); None on non-finite values. `uniform_at` is
    common/codecs.py's (its caller: this module stays below it)."""
    n, dev = x.numel(), x.device
    payload, books = [], []
    for first, count, m in _rows(spec, n):
        xs = x[first * spec.chunk : first * spec.chunk + count * m].view(count, m)
        mag = xs.view(torch.int32).long() & 0x7FFFFFFF
        kk = spec.kept(m)
        key = (mag << 16) | (0xFFFF - torch.arange(m, device=dev))  # unique: ties go to the lower position
        top = torch.topk(key, kk, dim=1).indices
        if bool((mag.gather(1, top) >= 0x7F800000).any()):  # a NaN or inf is larger than any finite value
            return None
        pos = top.sort(dim=1).values
        kept = xs.gather(1, pos)
        absmax = kept.abs().amax(dim=1)
        starts = (first + torch.arange(count, device=dev)) * spec.chunk
        u = uniform_at(seed, starts.unsqueeze(1) + torch.arange(kk, device=dev)) if stochastic else None
        valid = torch.ones_like(kept, dtype=torch.bool)
        b, codes = sq2_quantize(kept, valid, absmax, u)
        packed = _pack_bits(codes, 2)  # four codes a byte, the first lowest: sq2's packing, row by row
        payload.append(
            torch.cat([_pack_bits(pos, spec.index_bits), packed.to(torch.uint8)], dim=1).reshape(-1)
        )
        books.append(b.reshape(-1))
    if not payload:
        return torch.empty(0, dtype=torch.uint8, device=dev), torch.empty(0, dtype=torch.float32, device=dev)
    return torch.cat(payload), torch.cat(books)


def _parse_torch(
    payload: torch.Tensor, books: torch.Tensor, spec: Codec, n: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(global positions, values) of each row group of an Encoded's payload (torch ops)."""
    out = []
    at = 0
    for first, count, m in _rows(spec, n):
        kk = spec.kept(m)
        nib, per = (kk * spec.index_bits + 7) // 8, spec.block_payload(m)
        rows = payload[at : at + count * per].view(count, per)
        at += count * per
        pos = _unpack_bits(rows[:, :nib], kk, spec.index_bits)
        codes = _unpack_bits(rows[:, nib:], kk, 2)
        lut = books[first * 4 : (first + count) * 4].view(count, 4)
        vals = lut.gather(1, codes)
        starts = (first + torch.arange(count, device=payload.device)) * spec.chunk
        out.append(((starts.unsqueeze(1) + pos).reshape(-1), vals.reshape(-1)))
    return out


def problem_torch(payload: torch.Tensor, spec: Codec, n: int) -> str | None:
    """What is wrong with the positions of a payload of the right size, or None (torch ops)."""
    at = 0
    for first, count, m in _rows(spec, n):
        kk = spec.kept(m)
        nib, per = (kk * spec.index_bits + 7) // 8, spec.block_payload(m)
        pos = _unpack_bits(payload[at : at + count * per].view(count, per)[:, :nib], kk, spec.index_bits)
        at += count * per
        bad = (pos >= m).any(dim=1)
        if kk > 1:
            bad |= (pos[:, 1:] <= pos[:, :-1]).any(dim=1)
        if bool(bad.any()):
            return _problem_words(first + int(bad.nonzero()[0, 0]), m)
    return None


def _problem_words(chunk: int, m: int) -> str:
    return (
        f"top-k chunk {chunk}: its positions must be strictly ascending and below its {m} values "
        "(a position repeated, out of order or out of range)"
    )


def apply_torch(payload: torch.Tensor, books: torch.Tensor, spec: Codec, n: int, out: torch.Tensor,
                weight: float, mode: int) -> None:  # fmt: skip
    """mode 0: out = the values; 1: out[kept] += weight * value (one fused multiply-add each, the same as
    torch's add_ with alpha); 2: as 1 on zeros."""
    if mode != 1:
        out.zero_()
    for pos, vals in _parse_torch(payload, books, spec, n):
        if mode == 0:
            out[pos] = vals
        else:
            sub = out[pos]
            sub.add_(vals.to(out.dtype), alpha=weight)
            out[pos] = sub


def sumsq_torch(payload: torch.Tensor, books: torch.Tensor, spec: Codec, n: int) -> float:
    return float(sum(float(v.double().square().sum()) for _, v in _parse_torch(payload, books, spec, n)))


# --- the CPU kernels (common/kernels.py's `topk` namespace: in that module, so that numba's cache of the
# top-k encoder, which has sq2's encoder compiled into it, is stamped by the file that holds both) ---------
def cpu_kernels() -> Any:
    """The compiled top-k kernels, or None where the torch ops do the work (as common/kernels.py's)."""
    k = kernels.cpu_kernels()
    return None if k is None else k.topk


def problem(payload: torch.Tensor, spec: Codec, n: int) -> str | None:
    """What is wrong with a well-sized top-k payload's positions (the first chunk that is wrong), or None."""
    k = cpu_kernels() if payload.device.type == "cpu" else None
    if k is None:
        return problem_torch(payload, spec, n)
    full = spec.block_payload(spec.chunk)
    bad = k.check(payload.contiguous().numpy(), spec.chunk, spec.keep, spec.index_bits, full, n)
    return None if bad < 0 else _problem_words(bad, min(spec.chunk, n - bad * spec.chunk))


def encode_cpu(
    x: torch.Tensor, spec: Codec, stochastic: bool, key: int, run_ranges: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(payload, codebooks) by the kernels over ranges of whole chunks (`run_ranges(align, run)` runs
    run(a, b) over them and returns the results); None on non-finite values."""
    k = cpu_kernels()
    n = x.numel()
    nbytes, nscales = spec.sizes(n, spec.chunk)
    payload = torch.empty(nbytes, dtype=torch.uint8)
    books = torch.empty(nscales, dtype=torch.float32)
    pn, bn, xi = payload.numpy(), books.numpy(), x.numpy().view(np.int32)
    full = spec.block_payload(spec.chunk)

    def run(a: int, b: int) -> bool:
        c = a // spec.chunk
        return k.encode(xi[a:b], spec.chunk, spec.keep, spec.index_bits, full, pn[c * full :],
                        bn[c * 4 : -(-b // spec.chunk) * 4], key, stochastic, a)  # fmt: skip

    if any(run_ranges(spec.chunk, run)):
        return None
    return payload, books
