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

import threading
from typing import Any

import numpy as np
import torch

from streamdiloco.common import kernels
from streamdiloco.common.codecspec import Codec


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
    x: torch.Tensor, spec: Codec, stochastic: bool, seed: Any, sq2: Any, uniform_at: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(payload, codebooks) of x (flat, contiguous fp32); None on non-finite values. `sq2` and `uniform_at`
    are common/codecs.py's `sq2_quantize` and `uniform_at` (its caller: this module stays below it)."""
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
        b, codes = sq2(kept, valid, absmax, u)
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


# --- the CPU kernels ---------------------------------------------------------------------------------------
_sq2_encoder: Any = None  # the compiled sq2 encoder (kernels.cpu_kernels().encode_sq2), called per chunk
_fma: Any = None


def _nb_read_bits(p: Any, bit: int, width: int) -> Any:
    """`width` (<= 16) bits of the byte array p from bit position `bit`, little-endian."""
    i = bit >> 3
    sh = bit & 7
    v = np.int64(p[i])
    need = (sh + width + 7) >> 3
    if need > 1:
        v |= np.int64(p[i + 1]) << 8
    if need > 2:
        v |= np.int64(p[i + 2]) << 16
    return (v >> sh) & ((1 << width) - 1)


# A chunk's candidates: the values at or above a magnitude threshold, about the r-th largest of _SAMPLE evenly
# spaced values with r chosen so that about 3 k values pass, then moved halfway to the largest magnitude (at
# most 4 times) while more than 2 k pass; when fewer than k pass (an unlucky sample) every value is one. The
# sample decides the cost alone: which values are kept does not depend on it.
_SAMPLE = 64


def _nb_count_at_least(a: Any, f: Any) -> Any:
    """How many of a's values (at most a chunk's: below 2^31) are >= f; counted in int32 lanes."""
    c = np.int32(0)
    for i in range(a.shape[0]):
        c = np.int32(c + np.int32(a[i] >= f))
    return c


def _nb_rank_value(a: Any, r: int, lo: int, hi: int, width: int) -> int:
    """A value f in [lo, hi) with at least r of a's values >= f, within `width` of the largest such (the r-th
    largest value for width 1), by bisection (counting passes, no branches in them); at least r of a's values
    must be >= lo."""
    while hi - lo > width:
        mid = lo + ((hi - lo) >> 1)
        if _nb_count_at_least(a, np.int32(mid)) >= r:
            lo = mid
        else:
            hi = mid
    return lo


def _nb_encode_topk(xi: Any, C: int, K: int, ib: int, full: int, payload: Any, books: Any, key: int,
                    stochastic: bool, base: int) -> bool:  # fmt: skip
    """Chunks of xi (an int32 view of fp32 values; the first on a chunk boundary): per chunk, the magnitudes
    (a NaN or inf anywhere is kept, so the chunk is refused), the candidates at or above a sampled threshold
    (in position order), the k-th largest of their magnitudes by bisection, the candidates above it and the
    first of those equal to it (ties go to the lower position: the torch reference's keys, magnitude << 16 |
    65535 - position), their positions ascending, packed, and their values through the compiled sq2
    encoder."""
    n = xi.shape[0]
    mag = np.empty(C, np.int32)
    cand = np.empty(C, np.int32)
    cmag = np.empty(C, np.int32)
    pos = np.empty(C + 1, np.int64)
    samp = np.empty(_SAMPLE, np.int32)
    kv = np.empty(K, np.int32)
    kf = kv.view(np.float32)
    for b in range(books.shape[0] // 4):
        lo = b * C
        m = min(C, n - lo)
        kk = (K * m + C - 1) // C
        xb = xi[lo : lo + m]
        mb = mag[:m]
        amax = 0
        for j in range(m):
            v = xb[j] & 0x7FFFFFFF
            mb[j] = v
            amax = max(amax, v)
        if amax >= 0x7F800000:  # a NaN or inf outranks every finite value: it would be kept
            return True
        thr = 0
        if m >= 4 * _SAMPLE and 4 * kk <= m:
            step = m // _SAMPLE
            for s in range(_SAMPLE):
                samp[s] = mb[s * step]
            r = min(3 * kk * _SAMPLE // m + 1, _SAMPLE)
            thr = _nb_rank_value(samp, r, 0, amax + 1, 1 << 16)  # within 2^-7 of it
            above = _nb_count_at_least(mb, np.int32(thr))
            if above < kk:
                thr = 0
            else:  # halve the gap to the largest magnitude while far more than k values pass
                top = amax + 1
                for _ in range(4):
                    if above <= 2 * kk:
                        break
                    mid = thr + ((top - thr) >> 1)
                    a = _nb_count_at_least(mb, np.int32(mid))
                    if a >= kk:
                        thr, above = mid, a
                    else:
                        top = mid
        c: Any = 0  # (annotated for mypy only: local annotations are not in the bytecode numba compiles)
        t32 = np.int32(thr)
        for j in range(m):
            cand[c] = j
            c += np.int64(mb[j] >= t32)
        cm = cmag[:c]
        for i in range(c):
            cm[i] = mb[cand[i]]
        # the k-th largest magnitude f, and how many of the values of magnitude f are kept (the first ones:
        # ties go to the lower position)
        f = _nb_rank_value(cm, kk, thr, amax + 1, 1)
        ties = kk - _nb_count_at_least(cm, np.int32(f + 1))
        t: Any = 0
        for i in range(c):
            v = cm[i]
            eq = np.int64(v == f)
            pos[t] = cand[i]
            t += np.int64(v > f) | (eq & np.int64(ties > 0))
            ties -= eq
        nib = (kk * ib + 7) >> 3
        off = b * full
        pb = payload[off : off + nib]
        pb[:] = 0
        for t in range(kk):
            p = pos[t]
            kv[t] = xb[p]
            bit = t * ib
            i = bit >> 3
            sh = bit & 7
            v = p << sh
            pb[i] |= np.uint8(v & 0xFF)
            if (sh + ib + 7) >> 3 > 1:
                pb[i + 1] |= np.uint8((v >> 8) & 0xFF)
            if (sh + ib + 7) >> 3 > 2:
                pb[i + 2] |= np.uint8((v >> 16) & 0xFF)
        codes = payload[off + nib : off + nib + ((kk + 3) >> 2)]
        _sq2_encoder(kv[:kk], kf[:kk], kk, codes, books[4 * b : 4 * b + 4], key, stochastic, base + lo)
    return False


def _nb_apply_topk(payload: Any, books: Any, C: int, K: int, ib: int, full: int, n: int, out: Any, w: Any,
                   mode: int) -> bool:  # fmt: skip
    """mode 0: out = values; 1: out[p] = fma(value, w, out[p]) at the kept positions; 2: as 1 on +0. Never
    writes past a chunk (True: a position out of range, nothing written from it). Per chunk the positions
    and values are read first, then written in a loop of independent updates (a sparse add into a buffer
    larger than the caches waits on memory: the short loop keeps more of its reads in flight)."""
    z = w - w
    bad = False
    pp = np.empty(K, np.int64)
    vv = np.empty(K, books.dtype)
    for b in range(books.shape[0] // 4):
        lo = b * C
        m = min(C, n - lo)
        kk = (K * m + C - 1) // C
        nib = (kk * ib + 7) >> 3
        off = b * full
        pb = payload[off : off + nib]
        cb = payload[off + nib : off + nib + ((kk + 3) >> 2)]
        lut = books[4 * b : 4 * b + 4]
        ob = out[lo : lo + m]
        c = 0
        for t in range(kk):
            p = _nb_read_bits(pb, t * ib, ib)
            if p >= m:
                bad = True
                continue
            pp[c] = p
            vv[c] = lut[(cb[t >> 2] >> ((t & 3) << 1)) & 3]
            c += 1
        if mode != 1:
            for j in range(m):
                ob[j] = z
        if mode == 0:
            for t in range(c):
                ob[pp[t]] = vv[t]
        else:
            for t in range(c):
                q = pp[t]
                ob[q] = _fma(vv[t], w, ob[q])
    return bad


def _nb_sumsq_topk(payload: Any, books: Any, C: int, K: int, ib: int, full: int, n: int) -> float:
    total = 0.0
    for b in range(books.shape[0] // 4):
        m = min(C, n - b * C)
        kk = (K * m + C - 1) // C
        nib = (kk * ib + 7) >> 3
        cb = payload[b * full + nib : b * full + nib + ((kk + 3) >> 2)]
        for t in range(kk):
            v = np.float64(books[4 * b + ((cb[t >> 2] >> ((t & 3) << 1)) & 3)])
            total += v * v
    return total


def _nb_check_topk(payload: Any, C: int, K: int, ib: int, full: int, n: int) -> int:
    """The first chunk whose positions are not strictly ascending and below its values, or -1."""
    for b in range(-(-n // C)):
        m = min(C, n - b * C)
        kk = (K * m + C - 1) // C
        pb = payload[b * full : b * full + ((kk * ib + 7) >> 3)]
        prev = -1
        for t in range(kk):
            p = _nb_read_bits(pb, t * ib, ib)
            if p <= prev or p >= m:
                return b
            prev = p
    return -1


_KERNELS: Any = None
_LOCK = threading.Lock()


def cpu_kernels() -> Any:
    """The compiled top-k kernels, or None where the torch ops do the work (as common/kernels.py's)."""
    global _KERNELS
    if _KERNELS is None:
        with _LOCK:
            if _KERNELS is None:
                _KERNELS = _load() or False
    return _KERNELS or None


def _load() -> Any:
    k = kernels.cpu_kernels()
    if k is None:
        return None
    import numba

    g = globals()
    g["_sq2_encoder"], g["_fma"] = k.encode_sq2, kernels._fma
    jit = kernels._jit_compiler(numba)
    for name in ("_nb_read_bits", "_nb_rank_value", "_nb_count_at_least"):
        g[name] = jit(g[name], inline="always")

    class TopK:
        encode = jit(_nb_encode_topk)
        apply = jit(_nb_apply_topk)
        sumsq = jit(_nb_sumsq_topk)
        check = jit(_nb_check_topk)

    return TopK


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
