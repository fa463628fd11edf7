"""The CPU codec kernels: single-pass numba functions for encode, decode, accumulate, sumsq and the
shard's fused outer step, compiled on first use.

common/codecs.py and common/topk.py are their only callers: they own the formats, check the arguments and
cut the work into ranges of whole blocks; this module holds the loops alone (top-k's too: its encoder has
sq2's compiled into it, and numba stamps a function's disk cache with its own file alone, so they share
one). Bit-identical to the torch reference (the tests compare them byte for byte). `cpu_kernels()` returns
the compiled namespace, or None where numba is missing or STREAMDILOCO_CODECS_NUMBA=0 switches it off. Must
not import torch: its inputs are numpy views.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

# The kernels are plain functions here and compiled on first use (numba's import costs 0.4 s, so processes
# that never encode on the CPU do not pay it). `_f2i`, `_i2f`, `_i2d` (bit casts) and `_fma` (a fused
# multiply-add, which is what torch's add_ with alpha computes) are numba intrinsics put in place by
# `_load_kernels`.
_f2i: Any = None
_i2f: Any = None
_i2d: Any = None
_fma: Any = None
_U16 = np.uint64(16)
_U15 = np.uint64(15)
_U8 = np.uint64(8)
_UM32 = np.uint64(0xFFFFFFFF)
_UH1 = np.uint64(0x7FEB352D)
_UH2 = np.uint64(0x846CA68B)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_F127 = np.float32(127.0)
_FM127 = np.float32(-127.0)
_F2M6 = np.float32(2.0**-6)
_F2M24 = np.float32(2.0**-24)
# sq2's bin edges and statistics grid: the same numbers as common/codecs.py's SQ2_EDGE and SQ2_GRID_BITS
# (tests/test_codecs.py checks they agree; this module may not import that one)
SQ2_EDGE = 0.9816
SQ2_GRID_BITS = 20


def _nb_hash(key: Any, i: Any) -> Any:
    """lowbias32((i + key) mod 2^32) as uint64: the same stream as `_uniform_bits`."""
    h = (np.uint64(i) + np.uint64(key)) & _UM32
    h ^= h >> _U16
    h = (h * _UH1) & _UM32
    h ^= h >> _U15
    h = (h * _UH2) & _UM32
    h ^= h >> _U16
    return h


def _nb_block_absmax(xb: Any) -> Any:
    """The largest |x| bit pattern of a block's int32 view (>= 0x7F800000 when any is NaN or inf)."""
    amax = 0
    for j in range(xb.shape[0]):
        amax = max(amax, xb[j] & 0x7FFFFFFF)
    return amax


# The kernels index per-block slices from 0: indices known to be nonnegative let LLVM vectorize the loops
# (with `out[lo + j]` numba's negative-index wraparound kept them scalar, 4x slower).
def _nb_encode_e3m0(
    xi: Any, xf: Any, bs: int, payload: Any, scales: Any, key: int, stochastic: bool, base: int
) -> bool:
    n = xi.shape[0]
    codes = np.zeros(bs, np.uint8)
    for b in range(scales.shape[0]):
        lo = b * bs
        m = min(bs, n - lo)
        amax = _nb_block_absmax(xi[lo : lo + m])
        if amax >= 0x7F800000:
            return True
        s = _i2f(amax)
        scales[b] = s
        d = s if amax != 0 else _F1
        xb = xf[lo : lo + m]
        if stochastic:
            for j in range(m):
                v = xb[j]
                r = abs(v) / d
                rb = _f2i(r)
                lvl = min((rb >> 23) - 120, 6) if rb >= 0x3C800000 else 0
                lo_v = _i2f((lvl + 120) << 23) if lvl > 0 else _F0
                gap = lo_v if lvl > 0 else _F2M6
                u = np.float32(_nb_hash(key, base + lo + j) >> _U8) * _F2M24
                c = lvl + (1 if u < (r - lo_v) / gap else 0)
                codes[j] = c | (8 if v < _F0 and c > 0 else 0)
        else:
            for j in range(m):
                v = xb[j]
                rb = _f2i(abs(v) / d)
                c = max(((rb + 0x3FFFFF) >> 23) - 120, 1) if rb > 0x3C000000 else 0
                codes[j] = c | (8 if v < _F0 and c > 0 else 0)
        if m & 1:
            codes[m] = 0
        pb = payload[lo >> 1 : (lo >> 1) + ((m + 1) >> 1)]
        for j in range(pb.shape[0]):
            pb[j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return False


def _nb_encode_int8(
    xi: Any, xf: Any, bs: int, q: Any, scales: Any, key: int, stochastic: bool, base: int
) -> bool:
    n = xi.shape[0]
    for b in range(scales.shape[0]):
        lo = b * bs
        m = min(bs, n - lo)
        amax = _nb_block_absmax(xi[lo : lo + m])
        if amax >= 0x7F800000:
            return True
        step = _i2f(amax) / _F127
        scales[b] = step
        d = step if step > _F0 else _F1
        xb = xf[lo : lo + m]
        qb = q[lo : lo + m]
        if stochastic:
            for j in range(m):
                u = np.float32(_nb_hash(key, base + lo + j) >> _U8) * _F2M24
                qb[j] = np.int8(min(max(np.floor(xb[j] / d + u), _FM127), _F127))
        else:
            for j in range(m):
                qb[j] = np.int8(min(max(np.rint(xb[j] / d), _FM127), _F127))
    return False


def _nb_sq2_stats(xf: Any, grid: Any, q: Any) -> tuple[int, int]:
    """q[j] = rint(x[j] * grid) (exact: grid is a power of two, |q| <= 2^23) and the sums of q and q^2.
    `grid` is fp32 where it fits (twice the lanes of fp64), else fp64: the product is exact either way."""
    s1: Any = 0  # (annotated for mypy only: local annotations are not in the bytecode numba compiles)
    s2: Any = 0
    for j in range(xf.shape[0]):
        v = np.int32(np.rint(xf[j] * grid))
        q[j] = v
        w = np.int64(v)
        s1 += w
        s2 += w * w
    return s1, s2


def _nb_sq2_codes(q: Any, k0: Any, k1: Any, k2: Any, codes: Any) -> tuple[Any, ...]:
    """Each value's bin (how many of the integer edges k0 <= k1 <= k2 it is at or above) into `codes`, and the
    sums of q and the counts at or above each edge, over at most 128 values: int32 sums are exact (|q| <=
    2^23) and take twice the lanes of int64."""
    a0 = np.int32(0)
    a1 = np.int32(0)
    a2 = np.int32(0)
    n0 = np.int32(0)
    n1 = np.int32(0)
    n2 = np.int32(0)
    for j in range(q.shape[0]):
        v = q[j]
        g0, g1, g2 = np.int32(v >= k0), np.int32(v >= k1), np.int32(v >= k2)
        a0 = np.int32(a0 + (v & -g0))
        a1 = np.int32(a1 + (v & -g1))
        a2 = np.int32(a2 + (v & -g2))
        n0 = np.int32(n0 + g0)
        n1 = np.int32(n1 + g1)
        n2 = np.int32(n2 + g2)
        codes[j] = np.uint8(g0 + g1 + g2)
    return a0, a1, a2, n0, n1, n2


def _nb_sq2_pack(words: Any, pb: Any) -> None:
    """Four 2-bit codes a byte, the first lowest, from the codes' bytes read four at a time (little-endian
    uint32 words: byte i of a word is its code i)."""
    for j in range(pb.shape[0]):
        w = words[j]
        pb[j] = np.uint8((w & 3) | ((w >> 6) & 0xC) | ((w >> 12) & 0x30) | ((w >> 18) & 0xC0))


def _nb_sq2_dither(q: Any, codes: Any, e: Any, count: Any, key: int, base: int) -> None:
    """Stochastic rounding between neighbouring bins' means (codecs._sq2_dither, value for value), without
    branches: each value's bin mean and its neighbours' by selects, both moves' tests computed, at most one
    true. `e`: the four bins' means (grid units), `count`: their counts."""
    e0, e1, e2, e3 = e[0], e[1], e[2], e[3]
    h0, h1, h2, h3 = count[0] > 0, count[1] > 0, count[2] > 0, count[3] > 0
    for j in range(q.shape[0]):
        c = np.int64(codes[j])
        qd = np.float64(q[j])
        ce = e0 if c == 0 else (e1 if c == 1 else (e2 if c == 2 else e3))
        cu = e1 if c == 0 else (e2 if c == 1 else e3)  # bin c + 1's mean (c < 3)
        cd = e0 if c == 1 else (e1 if c == 2 else e2)  # bin c - 1's mean (c > 0)
        ok_up = ((c == 0) & h1) | ((c == 1) & h2) | ((c == 2) & h3)
        ok_down = ((c == 1) & h0) | ((c == 2) & h1) | ((c == 3) & h2)
        u = np.float64(np.float32(_nb_hash(key, base + j) >> _U8) * _F2M24)
        up = ok_up & (qd > ce) & (u < (qd - ce) / (cu - ce))
        down = ok_down & (qd < ce) & (u < (ce - qd) / (ce - cd))
        codes[j] = np.uint8(c + np.int64(up) - np.int64(down))


# sq2 encodes blocks in groups of about this many values: first each block's grid, sums and edges, then each
# block's codes and codebook, so that one block's chain of divisions and square root (the edges, then the
# bins' means) runs beside the next block's vector loops instead of stalling them.
_SQ2_GROUP = 2048


def _nb_encode_sq2(
    xi: Any, xf: Any, bs: int, payload: Any, books: Any, key: int, stochastic: bool, base: int
) -> bool:
    """sq2 (codecs._encode_sq2_torch, to the bit): per block the grid's integer sums give the mean and the
    standard deviation, the bins and their means (the codebook, 4 fp32), then the 2-bit codes, four a byte."""
    n = xi.shape[0]
    nb = books.shape[0] // 4
    g = max(1, min(nb, _SQ2_GROUP // bs))
    q = np.empty(g * bs, np.int32)
    codes = np.zeros((g * bs + 7) & ~3, np.uint8)  # whole uint32 words, 4 past the last code
    words = codes.view(np.uint32)
    edges = np.empty(4 * g, np.int64)  # per block: k0, k1, k2 and the sum of q
    invs = np.empty(g, np.float64)
    centre = np.zeros(4, np.float64)
    count = np.zeros(4, np.int64)
    for first in range(0, nb, g):
        gn = min(g, nb - first)
        for i in range(gn):
            lo = (first + i) * bs
            m = min(bs, n - lo)
            amax = _nb_block_absmax(xi[lo : lo + m])
            if amax >= 0x7F800000:
                return True
            field = amax >> 23
            gexp = SQ2_GRID_BITS + 127 - field if field > 0 else 149
            grid = _i2d(np.int64(1023 + gexp) << 52)
            invs[i] = _i2d(np.int64(1023 - gexp) << 52)
            qb = q[i * bs : i * bs + m]
            if gexp <= 127:
                s1, s2 = _nb_sq2_stats(xf[lo : lo + m], np.float32(grid), qb)
            else:  # blocks below 2^-107: 2^gexp is past fp32's range
                s1, s2 = _nb_sq2_stats(xf[lo : lo + m].astype(np.float64), grid, qb)
            md = np.float64(m)
            mean = np.float64(s1) / md
            t = SQ2_EDGE * np.sqrt(max(np.float64(s2) / md - mean * mean, 0.0))
            # for an integer q, q >= e exactly when q >= ceil(e); the edges lie within the values' range
            edges[4 * i] = np.int64(np.ceil(mean - t))
            edges[4 * i + 1] = np.int64(np.ceil(mean))
            edges[4 * i + 2] = np.int64(np.ceil(mean + t))
            edges[4 * i + 3] = s1
        for i in range(gn):
            b = first + i
            lo = b * bs
            m = min(bs, n - lo)
            k0, k1, k2 = np.int32(edges[4 * i]), np.int32(edges[4 * i + 1]), np.int32(edges[4 * i + 2])
            s1 = edges[4 * i + 3]
            a0, a1, a2, n0, n1, n2 = 0, 0, 0, 0, 0, 0
            for at in range(0, m, 128):
                hi = min(at + 128, m)
                at_ = i * bs + at
                b0, b1, b2, c0, c1, c2 = _nb_sq2_codes(q[at_ : i * bs + hi], k0, k1, k2, codes[at:hi])
                a0 += b0
                a1 += b1
                a2 += b2
                n0 += c0
                n1 += c1
                n2 += c2
            c0, c1, c2, c3 = m - n0, n0 - n1, n1 - n2, n2
            inv = invs[i]  # 1 / grid exactly: multiplying by it is the same as dividing
            e0 = np.float64(s1 - a0) / np.float64(c0) if c0 > 0 else 0.0
            e1 = np.float64(a0 - a1) / np.float64(c1) if c1 > 0 else 0.0
            e2 = np.float64(a1 - a2) / np.float64(c2) if c2 > 0 else 0.0
            e3 = np.float64(a2) / np.float64(c3) if c3 > 0 else 0.0
            books[4 * b] = np.float32(e0 * inv)
            books[4 * b + 1] = np.float32(e1 * inv)
            books[4 * b + 2] = np.float32(e2 * inv)
            books[4 * b + 3] = np.float32(e3 * inv)
            if stochastic:
                centre[0], centre[1], centre[2], centre[3] = e0, e1, e2, e3
                count[0], count[1], count[2], count[3] = c0, c1, c2, c3
                _nb_sq2_dither(q[i * bs : i * bs + m], codes[:m], centre, count, key, base + lo)
            for j in range(m, m + 4):
                codes[j] = 0
            pb = payload[lo >> 2 : (lo >> 2) + ((m + 3) >> 2)]
            _nb_sq2_pack(words[: pb.shape[0]], pb)
    return False


def _nb_apply_sq2(payload: Any, books: Any, bs: int, n: int, out: Any, w: Any, mode: int) -> None:
    z = w - w  # +0 in out's type: as if out were zeros
    for b in range(books.shape[0] // 4):
        lut = books[4 * b : 4 * b + 4]
        lo = b * bs
        m = min(bs, n - lo)
        pb = payload[lo >> 2 : (lo >> 2) + ((m + 3) >> 2)]
        ob = out[lo : lo + m]
        if mode == 0:
            for j in range(m):
                ob[j] = lut[(pb[j >> 2] >> ((j & 3) << 1)) & 3]
        elif mode == 1:
            for j in range(m):
                ob[j] = _fma(lut[(pb[j >> 2] >> ((j & 3) << 1)) & 3], w, ob[j])
        else:
            for j in range(m):
                ob[j] = _fma(lut[(pb[j >> 2] >> ((j & 3) << 1)) & 3], w, z)


def _nb_sumsq_sq2(payload: Any, books: Any, bs: int, n: int) -> float:
    """Each block's codes counted, times their codebook entries squared (in fp64)."""
    total = 0.0
    counts = np.zeros(4, np.int64)
    for b in range(books.shape[0] // 4):
        lo = b * bs
        m = min(bs, n - lo)
        counts[:] = 0
        for j in range(lo, lo + m):
            counts[(payload[j >> 2] >> ((j & 3) << 1)) & 3] += 1
        for i in range(4):
            v = np.float64(books[4 * b + i])
            total += np.float64(counts[i]) * (v * v)
    return total


def _nb_copy_check(xi: Any, out: Any) -> bool:
    amax = 0
    for i in range(xi.shape[0]):
        v = xi[i]
        out[i] = v
        amax = max(amax, v & 0x7FFFFFFF)
    return amax >= 0x7F800000


def _nb_encode_bf16(xi: Any, out: Any, key: int, stochastic: bool, base: int) -> bool:
    amax = 0
    if stochastic:
        for i in range(xi.shape[0]):
            v = xi[i]
            amax = max(amax, v & 0x7FFFFFFF)
            out[i] = ((v & 0xFFFFFFFF) + np.int64(_nb_hash(key, base + i) >> _U16)) >> 16
    else:
        for i in range(xi.shape[0]):
            v = xi[i]
            amax = max(amax, v & 0x7FFFFFFF)
            bits = v & 0xFFFFFFFF
            out[i] = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even, as torch
    return amax >= 0x7F800000


def _nb_e3m0_value(c: Any) -> Any:
    """The fp32 value of a 4-bit code at scale 1: +-2^(e-7) for e = c & 7 > 0, else +-0."""
    e = c & 7
    return _i2f((((e + 120) << 23) if e else 0) | ((c & 8) << 28))


def _nb_apply_e3m0(payload: Any, scales: Any, bs: int, n: int, out: Any, w: Any, mode: int) -> None:
    for b in range(scales.shape[0]):
        s = scales[b]
        lo = b * bs
        m = min(bs, n - lo)
        pb = payload[lo >> 1 : (lo >> 1) + ((m + 1) >> 1)]
        ob = out[lo : lo + m]
        if mode == 0:
            for j in range(m >> 1):
                byte = pb[j]
                ob[2 * j] = _nb_e3m0_value(byte & 15) * s
                ob[2 * j + 1] = _nb_e3m0_value(byte >> 4) * s
        elif mode == 1:
            for j in range(m >> 1):
                byte = pb[j]
                ob[2 * j] = _fma(_nb_e3m0_value(byte & 15) * s, w, ob[2 * j])
                ob[2 * j + 1] = _fma(_nb_e3m0_value(byte >> 4) * s, w, ob[2 * j + 1])
        else:
            z = w - w  # +0 in out's type: as if out were zeros
            for j in range(m >> 1):
                byte = pb[j]
                ob[2 * j] = _fma(_nb_e3m0_value(byte & 15) * s, w, z)
                ob[2 * j + 1] = _fma(_nb_e3m0_value(byte >> 4) * s, w, z)
        if m & 1:
            v = _nb_e3m0_value(pb[m >> 1] & 15) * s
            ob[m - 1] = v if mode == 0 else _fma(v, w, ob[m - 1] if mode == 1 else w - w)


def _nb_apply_int8(q: Any, scales: Any, bs: int, n: int, out: Any, w: Any, mode: int) -> None:
    for b in range(scales.shape[0]):
        s = scales[b]
        lo = b * bs
        m = min(bs, n - lo)
        qb = q[lo : lo + m]
        ob = out[lo : lo + m]
        if mode == 0:
            for j in range(m):
                ob[j] = np.float32(qb[j]) * s
        elif mode == 1:
            for j in range(m):
                ob[j] = _fma(np.float32(qb[j]) * s, w, ob[j])
        else:
            z = w - w
            for j in range(m):
                ob[j] = _fma(np.float32(qb[j]) * s, w, z)


def _nb_apply_f32(vals: Any, out: Any, w: Any, mode: int) -> None:
    if mode == 0:
        for i in range(vals.shape[0]):
            out[i] = vals[i]
    elif mode == 1:
        for i in range(vals.shape[0]):
            out[i] = _fma(vals[i], w, out[i])
    else:
        z = w - w
        for i in range(vals.shape[0]):
            out[i] = _fma(vals[i], w, z)


def _nb_apply_bf16(vals: Any, out: Any, w: Any, mode: int) -> None:
    if mode == 0:
        for i in range(vals.shape[0]):
            out[i] = _i2f(np.int64(vals[i]) << 16)
    elif mode == 1:
        for i in range(vals.shape[0]):
            out[i] = _fma(_i2f(np.int64(vals[i]) << 16), w, out[i])
    else:
        z = w - w
        for i in range(vals.shape[0]):
            out[i] = _fma(_i2f(np.int64(vals[i]) << 16), w, z)


# each byte's two E3M0 codes' squared levels (at scale 1), summed: exact in fp64 (powers of two 2^-12..1)
_E3M0_LEVEL_SQUARES = np.array([0.0] + [4.0**e for e in range(-6, 1)], dtype=np.float64)
_E3M0_CODE_SQUARES = np.concatenate([_E3M0_LEVEL_SQUARES] * 2)  # bit 3 (the sign) squares away
_E3M0_BYTE_SQUARES = _E3M0_CODE_SQUARES[np.arange(256) & 0x0F] + _E3M0_CODE_SQUARES[np.arange(256) >> 4]


def _nb_sumsq_e3m0(payload: Any, scales: Any, bs: int, n: int) -> float:
    total = 0.0
    for b in range(scales.shape[0]):
        lo = b * bs
        m = min(bs, n - lo)
        base = lo >> 1
        acc = 0.0
        for j in range(m >> 1):
            acc += _E3M0_BYTE_SQUARES[payload[base + j]]
        if m & 1:
            acc += _E3M0_BYTE_SQUARES[payload[base + (m >> 1)] & 15]  # the low code alone
        s = np.float64(scales[b])
        total += acc * (s * s)
    return total


def _nb_sumsq_int8(q: Any, scales: Any, bs: int, n: int) -> float:
    total = 0.0
    for b in range(scales.shape[0]):
        lo = b * bs
        s = scales[b]
        for j in range(lo, min(lo + bs, n)):
            v = np.float64(np.float32(q[j]) * s)  # the decoded value, as `decode` rounds it
            total += v * v
    return total


def _nb_sumsq_f32(vals: Any) -> float:
    total = 0.0
    for i in range(vals.shape[0]):
        v = np.float64(vals[i])
        total += v * v
    return total


def _nb_sumsq_bf16(vals: Any) -> float:
    total = 0.0
    for i in range(vals.shape[0]):
        v = np.float64(_i2f(np.int64(vals[i]) << 16))
        total += v * v
    return total


def _nb_divide_into(acc: Any, d: Any, out: Any) -> None:
    for i in range(acc.shape[0]):
        out[i] = np.float32(acc[i] / d)


# The outer step of a shard (common/outer.py), fused: per chunk of values that stays in cache, Nesterov SGD
# (torch.optim.SGD's ops and roundings: buf = buf * mu + g; d = fma(buf, mu, g); theta = fma(d, -lr, old)),
# v = (theta - old) + residual, encoding v (the kernels above, on the same ranges and stream), decoding it
# back, residual = v - u_hat and new = old + u_hat: seven passes over memory become one.
# (slices indexed from 0: see the note above _nb_encode_e3m0)
def _nb_outer_v(g: Any, buf: Any, old: Any, res: Any, v: Any, mom: Any, neglr: Any, nesterov: bool,
                first: bool) -> None:  # fmt: skip
    m = v.shape[0]
    if mom == _F0:
        for j in range(m):
            o = old[j]
            v[j] = (_fma(g[j], neglr, o) - o) + res[j]
    elif first:
        for j in range(m):
            gj = g[j]
            buf[j] = gj
            d = _fma(gj, mom, gj) if nesterov else gj
            o = old[j]
            v[j] = (_fma(d, neglr, o) - o) + res[j]
    elif nesterov:
        for j in range(m):
            gj = g[j]
            t = buf[j] * mom
            b = t + gj
            buf[j] = b
            o = old[j]
            v[j] = (_fma(_fma(b, mom, gj), neglr, o) - o) + res[j]
    else:
        for j in range(m):
            t = buf[j] * mom
            b = t + g[j]
            buf[j] = b
            o = old[j]
            v[j] = (_fma(b, neglr, o) - o) + res[j]


def _nb_outer_finish(v: Any, u: Any, old: Any, res: Any, new: Any) -> None:
    for j in range(v.shape[0]):
        res[j] = v[j] - u[j]
        new[j] = old[j] + u[j]


def _nb_outer(g: Any, buf: Any, old: Any, res: Any, new: Any, payload: Any, scales: Any, bs: int,
              mom: Any, neglr: Any, nesterov: bool, first: bool, key: int, stochastic: bool,
              base: int, chunk: int, int8: bool) -> bool:  # fmt: skip
    """The fused step over one range: e3m0 (`payload` packed codes) or int8 (`payload` viewed as int8)."""
    n = g.shape[0]
    v = np.empty(chunk, np.float32)
    u = np.empty(chunk, np.float32)
    vi = v.view(np.int32)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        hi = lo + m
        _nb_outer_v(g[lo:hi], buf[lo:hi], old[lo:hi], res[lo:hi], v[:m], mom, neglr, nesterov, first)
        sb = scales[lo // bs : (lo + m + bs - 1) // bs]
        if int8:
            qb = payload[lo:hi].view(np.int8)
            if _nb_encode_int8(vi[:m], v[:m], bs, qb, sb, key, stochastic, base + lo):
                return True
            _nb_apply_int8(qb, sb, bs, m, u[:m], _F0, 0)
        else:
            pb = payload[lo // 2 : (lo + m + 1) // 2]
            if _nb_encode_e3m0(vi[:m], v[:m], bs, pb, sb, key, stochastic, base + lo):
                return True
            _nb_apply_e3m0(pb, sb, bs, m, u[:m], _F0, 0)
        _nb_outer_finish(v[:m], u[:m], old[lo:hi], res[lo:hi], new[lo:hi])
    return False


# --- chunked top-k (common/topk.py owns the format; these are its loops) ------------------------------------
_sq2_encoder: Any = None  # the compiled sq2 encoder, which the top-k encoder calls per chunk


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


def _nb_topk_threshold(mb: Any, kk: int, amax: int, samp: Any) -> int:
    """A magnitude that at least kk of mb's values reach and not many more (0 where the chunk is small or
    the sample unlucky: every value is then a candidate)."""
    m = mb.shape[0]
    if m < 4 * _SAMPLE or 4 * kk > m:
        return 0
    step = m // _SAMPLE
    for s in range(_SAMPLE):
        samp[s] = mb[s * step]
    r = min(3 * kk * _SAMPLE // m + 1, _SAMPLE)
    thr = _nb_rank_value(samp, r, 0, amax + 1, 1 << 16)  # within 2^-7 of it
    above = _nb_count_at_least(mb, np.int32(thr))
    if above < kk:
        return 0
    top = amax + 1  # halve the gap to the largest magnitude while far more than k values pass
    for _ in range(4):
        if above <= 2 * kk:
            break
        mid = thr + ((top - thr) >> 1)
        a = _nb_count_at_least(mb, np.int32(mid))
        if a >= kk:
            thr, above = mid, a
        else:
            top = mid
    return thr


def _nb_pack_positions(pb: Any, pos: Any, kk: int, ib: int) -> None:
    """pos[:kk] (each below 2^ib) into pb as a little-endian stream of ib-bit fields."""
    pb[:] = 0
    for t in range(kk):
        bit = t * ib
        i = bit >> 3
        sh = bit & 7
        v = pos[t] << sh
        pb[i] |= np.uint8(v & 0xFF)
        if (sh + ib + 7) >> 3 > 1:
            pb[i + 1] |= np.uint8((v >> 8) & 0xFF)
        if (sh + ib + 7) >> 3 > 2:
            pb[i + 2] |= np.uint8((v >> 16) & 0xFF)


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
        thr = _nb_topk_threshold(mb, kk, amax, samp)
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
        _nb_pack_positions(payload[off : off + nib], pos, kk, ib)
        for t in range(kk):
            kv[t] = xb[pos[t]]
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


_KERNELS: Any = None  # None: not loaded yet; False: unavailable (no numba, or switched off)
_KERNELS_LOCK = threading.Lock()


def cpu_kernels() -> Any:
    """The compiled CPU kernels (a namespace), or None when the torch ops must do the work."""
    global _KERNELS
    if _KERNELS is None:
        with _KERNELS_LOCK:
            if _KERNELS is None:
                _KERNELS = _load_kernels()
    return _KERNELS or None


def _load_kernels() -> Any:
    if os.environ.get("STREAMDILOCO_CODECS_NUMBA", "1") == "0":
        return False
    try:
        import numba
        from llvmlite import ir
        from numba.core import types
        from numba.extending import intrinsic
    except ImportError:
        return False
    g = globals()
    g["_f2i"], g["_i2f"], g["_i2d"], g["_fma"] = _bit_intrinsics(ir, types, intrinsic)
    jit = _jit_compiler(numba)
    inlined = (
        "_nb_hash",
        "_nb_block_absmax",
        "_nb_e3m0_value",
    )
    for name in inlined:
        g[name] = jit(g[name], inline="always")
    for name in ("_nb_sq2_stats", "_nb_sq2_codes", "_nb_sq2_pack", "_nb_sq2_dither"):
        g[name] = jit(g[name], inline="always")
    return _compiled_kernels(jit)


def _bit_intrinsics(ir: Any, types: Any, intrinsic: Any) -> tuple[Any, Any, Any, Any]:
    """numba intrinsics `_f2i`, `_i2f`, `_i2d` (bit casts) and `_fma` (a fused multiply-add), for the
    kernels."""

    @intrinsic
    def f2i(typingctx: Any, x: Any) -> Any:
        if x != types.float32:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(32))

        return types.int32(types.float32), codegen

    @intrinsic
    def i2f(typingctx: Any, x: Any) -> Any:
        """The fp32 number whose bits are the low 32 bits of an int64."""
        if x != types.int64:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())

        return types.float32(types.int64), codegen

    @intrinsic
    def i2d(typingctx: Any, x: Any) -> Any:
        """The fp64 number whose bits are an int64's."""
        if x != types.int64:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.DoubleType())

        return types.float64(types.int64), codegen

    @intrinsic
    def fma(typingctx: Any, v: Any, w: Any, acc: Any) -> Any:
        """fma(v, w, acc) = v * w + acc rounded once, in acc's float type (v widened exactly)."""
        if not (isinstance(v, types.Float) and w == acc and isinstance(acc, types.Float)):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            a, b, c = args
            if a.type != c.type:
                a = builder.fpext(a, c.type)
            return builder.fma(a, b, c)

        return acc(v, w, acc), codegen

    return f2i, i2f, i2d, fma


def _jit_compiler(numba: Any) -> Any:
    """numba.njit with the kernels' options, cached on disk where a writable place for the cache exists."""
    opts: dict[str, Any] = {"nogil": True, "error_model": "numpy", "boundscheck": False}

    def jit(fn: Any, **extra: Any) -> Any:
        fn = getattr(fn, "py_func", fn)  # loaded before (a test reloads): compile the Python function again
        try:
            return numba.njit(cache=True, **opts, **extra)(fn)
        except RuntimeError:  # no writable place for the cache: compile in memory
            return numba.njit(**opts, **extra)(fn)

    return jit


def _compiled_kernels(jit: Any) -> Any:
    """The namespace `cpu_kernels()` returns: each kernel compiled by `jit`."""

    class Kernels:
        encode_e3m0 = jit(_nb_encode_e3m0)
        encode_int8 = jit(_nb_encode_int8)
        encode_bf16 = jit(_nb_encode_bf16)
        encode_sq2 = jit(_nb_encode_sq2)
        apply_sq2 = jit(_nb_apply_sq2)
        sumsq_sq2 = jit(_nb_sumsq_sq2)
        copy_check = jit(_nb_copy_check)
        apply_e3m0 = jit(_nb_apply_e3m0)
        apply_int8 = jit(_nb_apply_int8)
        apply_f32 = jit(_nb_apply_f32)
        apply_bf16 = jit(_nb_apply_bf16)
        divide_into = jit(_nb_divide_into)
        sumsq_e3m0 = jit(_nb_sumsq_e3m0)
        sumsq_int8 = jit(_nb_sumsq_int8)
        sumsq_f32 = jit(_nb_sumsq_f32)
        sumsq_bf16 = jit(_nb_sumsq_bf16)
        outer = _compiled_outer(jit, encode_e3m0, encode_int8, apply_e3m0, apply_int8)
        topk = _compiled_topk(jit, encode_sq2)

    return Kernels


def _compiled_topk(jit: Any, encode_sq2: Any) -> Any:
    """common/topk.py's kernels, compiled: the encoder calls the compiled sq2 encoder by global name."""
    g = globals()
    g["_sq2_encoder"] = encode_sq2
    for name in ("_nb_read_bits", "_nb_rank_value", "_nb_count_at_least", "_nb_topk_threshold"):
        g[name] = jit(g[name], inline="always")
    g["_nb_pack_positions"] = jit(_nb_pack_positions, inline="always")

    class TopK:
        encode = jit(_nb_encode_topk)
        apply = jit(_nb_apply_topk)
        sumsq = jit(_nb_sumsq_topk)
        check = jit(_nb_check_topk)

    return TopK


def _compiled_outer(jit: Any, encode_e3m0: Any, encode_int8: Any, apply_e3m0: Any, apply_int8: Any) -> Any:
    """The fused outer step, compiled: it calls the compiled encode and apply kernels by global name."""
    g = globals()
    g["_nb_encode_e3m0"], g["_nb_encode_int8"] = encode_e3m0, encode_int8
    g["_nb_apply_e3m0"], g["_nb_apply_int8"] = apply_e3m0, apply_int8
    for name in ("_nb_outer_v", "_nb_outer_finish"):
        g[name] = jit(g[name], inline="always")
    return jit(_nb_outer)
