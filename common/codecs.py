"""Codecs for the values that cross the network: fp32, bf16, int8, 4-bit E3M0 and 2-bit sq2.

One registry (`CODECS`, plain data in common/codecspec.py, which the settings read without torch) and four
functions: `encode`, `decode` (optionally straight into a caller's buffer), `accumulate` (acc += weight *
values, the shard's aggregation) and `add_into` (out += values, the worker's mirror update); and `sumsq` (the
squared norm, which the shard checks each push's size by). The quantized codecs cut the flat vector into
blocks of `block_size` values that share one fp32 scale; E3M0 packs two 4-bit codes per byte (the first
value in the low nibble).

sq2 (MuLoCo's 2-bit statistical quantizer): per block, four bins over the block's mean +- 1.9632 sigma
(inner edges at the mean and at mean +- 0.9816 sigma, the Gaussian's Lloyd-Max thresholds), each value sent as
its bin's 2-bit index (four per byte, the first value in the low bits) and the bins' means as the block's
codebook (4 fp32 in `scales`; 0 for an empty bin). Decoding is a lookup: value = codebook[code]. See
common/sq2.py for how the statistics stay exact, so that every implementation sends the same bytes.

E3M0 (the paper's 4-bit float: 1 sign bit, 3 exponent bits, no mantissa): code 0 is zero and codes 1..7 are
2^-6 .. 2^0 times the block's scale, which is the block's largest magnitude. Rounding is to the nearest level
(ties to the lower level; below 2^-7 to zero) or stochastic (unbiased: E[decode(encode(x))] = x).

Decoding is deterministic on every machine: a level times a scale is one IEEE fp32 multiply of a power of two
(or zero) by an fp32 number, int8 is one IEEE multiply, bf16 -> fp32 is exact. The same bytes give the same
fp32 values on the CPU and on CUDA.

Where the work runs: on the tensor's own device. `encode(x)` with x on CUDA returns an Encoded whose payload
and scales are on that device (the caller ships the packed bytes); `decode`/`accumulate`/`add_into` run on
the payload's device. There is one reference implementation in torch ops (`_encode_torch` and friends) that
runs on any device; on the CPU, single-pass numba kernels (one read of the input, one write of the output,
no temporaries) give bit-identical bytes and values near memory speed. Chunked torch ops with the same bit
tricks measured 92 M values/s for E3M0 encode against 1,990 M/s for a copy on one core (benchmarks/codecs.py
has the kernels' numbers), which is why the CPU path is compiled. Set STREAMDILOCO_CODECS_NUMBA=0 to use
the torch ops on the CPU too (also the fallback when numba cannot be imported).

Stochastic rounding draws one 32-bit seed from the generator per `encode` call (on the generator's device)
and derives value i's uniform number from a counter-based hash, u_i = lowbias32((i + lowbias32(seed)) mod
2^32) >> 8, scaled by 2^-24 (bf16 uses the top 16 bits as its noise). For a uniform seed each u_i is exactly
uniform over its 2^24 levels, so the rounding is unbiased; the same generator state gives the same bytes,
and the CPU kernels and the torch ops compute the same stream.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from streamdiloco.common import topk
from streamdiloco.common.codecspec import CODECS, ROUNDINGS, Codec, lookup_codec  # the registry, torch-free
from streamdiloco.common.kernels import cpu_kernels  # the CPU path's compiled loops
from streamdiloco.common.sq2 import SQ2_MAX_BLOCK, pack2, sq2_quantize, unpack2

# E3M0 magnitudes relative to the block scale: 0, 2^-6, ..., 2^0.
E3M0_LEVELS = torch.tensor([0.0] + [2.0**e for e in range(-6, 1)], dtype=torch.float32)
# the signed value of each 4-bit code (bit 3 is the sign), and of each byte as (low code, high code)
_E3M0_CODE_VALUES = torch.cat([E3M0_LEVELS, -E3M0_LEVELS])
_E3M0_BYTE_VALUES = torch.stack(
    [_E3M0_CODE_VALUES[torch.arange(256) & 0x0F], _E3M0_CODE_VALUES[torch.arange(256) >> 4]], dim=1
)

_NON_FINITE = "cannot encode non-finite values (NaN or inf): the training has diverged"


@dataclass(frozen=True)
class Encoded:
    """A flat fp32 vector in a codec's form: what one push or update carries for one slice."""

    codec: str
    numel: int  # values encoded
    payload: torch.Tensor  # uint8: packed codes or raw little-endian values
    scales: torch.Tensor  # fp32 per block (empty for fp32/bf16)
    block_size: int = 0  # values per scale (0 when the codec has no scales)

    @property
    def nbytes(self) -> int:
        """Bytes of payload and scales: what the codec puts on the wire for these values."""
        return self.payload.numel() + 4 * self.scales.numel()


def get_codec(name: str) -> Codec:
    """The Codec of a name (the registry's, or a top-k family member); ValueError naming the choices."""
    return lookup_codec(name)


# --- the public functions --------------------------------------------------------------------------------
def encode(
    x: torch.Tensor,
    codec: str,
    block_size: int = 128,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Encoded:
    """Encode a flat tensor on its own device (payload and scales stay there). Raises ValueError on an
    unknown codec or rounding, a bad block size, or non-finite values. A top-k codec's block is its chunk
    (named by the codec): `block_size` is not used."""
    spec = get_codec(codec)
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}: choose {' or '.join(ROUNDINGS)}")
    if spec.scaled and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if spec.name == "sq2" and block_size > SQ2_MAX_BLOCK:
        raise ValueError(f"sq2 blocks hold at most {SQ2_MAX_BLOCK} values, got block_size {block_size}")
    x = x.detach().reshape(-1)
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    x = x.contiguous()
    stochastic = rounding == "stochastic"
    seed = _draw_seed(generator, x.device) if stochastic else 0
    if spec.sparse:
        return _encode_topk(x, spec, stochastic, seed)
    k = cpu_kernels() if x.device.type == "cpu" else None
    if k is not None and _kernel_fits(spec, block_size):
        return _encode_cpu(k, x, spec, block_size, stochastic, seed)
    return _encode_torch(x, spec, block_size, stochastic, seed)


def _encode_topk(x: torch.Tensor, spec: Codec, stochastic: bool, seed: Any) -> Encoded:
    tk = topk.cpu_kernels() if x.device.type == "cpu" else None
    if tk is None:
        done = topk.encode_torch(x, spec, stochastic, seed, uniform_at)
    else:
        key = int(_hash32(seed)) if stochastic else 0
        done = topk.encode_cpu(
            x, spec, stochastic, key, lambda align, run: in_parallel(x.numel(), align, run)
        )
    if done is None:
        raise ValueError(_NON_FINITE)
    payload, books = done
    return Encoded(spec.name, x.numel(), payload, books, spec.chunk)


def decode(enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values an Encoded stands for, on the payload's device. With `out` (a contiguous fp32 tensor
    of enc.numel values on that device, say a slice of a larger buffer) they are written into it and `out`
    is returned; without, a new tensor is returned."""
    spec = _check_encoded(enc)
    if out is None:
        out = torch.empty(enc.numel, dtype=torch.float32, device=enc.payload.device)
    else:
        _check_target(enc, out, "out", (torch.float32,))
    k = cpu_kernels() if out.device.type == "cpu" else None
    if spec.sparse:
        _apply_topk(spec, enc, out, 0.0, 0)
    elif k is not None and spec.scaled and _kernel_fits(spec, enc.block_size):
        _apply_cpu(k, enc, out, 0.0, 0)
    else:
        _decode_torch(enc, out)
    return out


def accumulate(enc: Encoded, acc: torch.Tensor, weight: float, overwrite: bool = False) -> None:
    """acc += weight * decode(enc), in acc's dtype (fp64 or fp32), in place: bit-identical to
    `acc.add_(decode(enc).to(acc.dtype), alpha=weight)` (one fused multiply-add per value), without the
    temporaries (one pass on the CPU). `overwrite`: as if acc were zeros first (its values are not read)."""
    spec = _check_encoded(enc)
    _check_target(enc, acc, "acc", (torch.float64, torch.float32))
    weight = float(weight)
    k = cpu_kernels() if acc.device.type == "cpu" else None
    if spec.sparse:
        _apply_topk(spec, enc, acc, weight, 2 if overwrite else 1)
    elif k is not None and _kernel_fits(spec, enc.block_size):
        _apply_cpu(k, enc, acc, weight, 2 if overwrite else 1)
    else:
        if overwrite:
            acc.zero_()
        acc.add_(_decode_torch(enc).to(acc.dtype), alpha=weight)


def divide_into(acc: torch.Tensor, divisor: float, out: torch.Tensor) -> None:
    """out = acc / divisor (acc fp64, out fp32 of the same size): the same values as
    `torch.div(acc, divisor, out=out)`, in one pass on the CPU."""
    k = cpu_kernels() if acc.device.type == "cpu" else None
    if (
        k is None
        or acc.dtype != torch.float64
        or out.dtype != torch.float32
        or out.device != acc.device
        or not (acc.is_contiguous() and out.is_contiguous())
    ):
        torch.div(acc, divisor, out=out)
        return
    if out.numel() != acc.numel():
        raise ValueError(f"out must hold {acc.numel()} values, got {out.numel()}")
    k.divide_into(acc.numpy(), np.float64(divisor), out.numpy())


def add_into(enc: Encoded, out: torch.Tensor) -> None:
    """out += decode(enc) in fp32, in place: bit-identical to `out.add_(decode(enc))` (the mirror update)."""
    spec = _check_encoded(enc)
    _check_target(enc, out, "out", (torch.float32,))
    k = cpu_kernels() if out.device.type == "cpu" else None
    if spec.sparse:
        _apply_topk(spec, enc, out, 1.0, 1)
    elif k is not None and _kernel_fits(spec, enc.block_size):
        _apply_cpu(k, enc, out, 1.0, 1)  # fma(v, 1, a) is a + v rounded once: the same as an add
    else:
        out.add_(_decode_torch(enc))


def sumsq(enc: Encoded) -> float:
    """The sum of the squares of the values an Encoded stands for, in fp64, without decoding it (a 4-bit
    block's is its codes' squared levels, summed exactly, times its scale squared): the shard measures each
    push's norm with it as the chunks arrive. Values are bounded (at most 1e30), so it cannot overflow."""
    spec = _check_encoded(enc)
    if spec.sparse:
        return _sumsq_topk(spec, enc)
    k = cpu_kernels() if enc.payload.device.type == "cpu" else None
    if k is None or not _kernel_fits(spec, enc.block_size):
        return float(_decode_torch(enc).to(torch.float64).square().sum())
    p = enc.payload.contiguous().numpy()
    s = enc.scales.contiguous().numpy()
    bs = enc.block_size if spec.scaled else 1

    def run(a: int, b: int) -> float:
        if enc.codec == "fp32":
            return k.sumsq_f32(p.view(np.float32)[a:b])
        if enc.codec == "bf16":
            return k.sumsq_bf16(p.view(np.uint16)[a:b])
        if enc.codec == "int8":
            return k.sumsq_int8(p.view(np.int8)[a:b], s[a // bs : -(-b // bs)], bs, b - a)
        if enc.codec == "sq2":
            return k.sumsq_sq2(p[a // 4 : (b + 3) // 4], s[a // bs * 4 : -(-b // bs) * 4], bs, b - a)
        return k.sumsq_e3m0(p[a // 2 : (b + 1) // 2], s[a // bs : -(-b // bs)], bs, b - a)

    return float(sum(in_parallel(enc.numel, chunk_alignment(enc.codec, bs), run)))


def roundtrip(
    x: torch.Tensor,
    codec: str,
    block_size: int = 128,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """decode(encode(x)): what the receiver will see."""
    return decode(encode(x, codec, block_size, rounding, generator))


def warm_up(codecs: tuple[str, ...] = ("e3m0",), block_size: int = 128) -> None:
    """Compile (or load from numba's cache) the CPU kernels these codecs use, on a tiny input: a worker or
    shard calls it before its first round, so that the first send, merge or close does not pay for it
    (0.2-0.8 s per kernel when not cached). Cheap when already done; a no-op without the kernels."""
    if cpu_kernels() is None:
        return
    x = torch.linspace(-1.0, 1.0, 2 * block_size)
    for name in codecs:
        for rounding in ROUNDINGS:
            enc = encode(x, name, block_size, rounding, torch.Generator().manual_seed(0))
        out = decode(enc)
        add_into(enc, out)
        accumulate(enc, torch.zeros(enc.numel, dtype=torch.float64), 0.5)
        sumsq(enc)


def _kernel_fits(spec: Codec, block_size: int) -> bool:
    """Whether the CPU kernels take this codec at this block size: every block starts on a byte (a block
    size of whole bytes, and even), else the torch ops do the work."""
    return not spec.scaled or spec.sparse or block_size % max(2, 8 // spec.bits) == 0


def _check_encoded(enc: Encoded) -> Codec:
    """The codec of a well-formed Encoded; ValueError naming what is wrong otherwise (decoding must never
    read past a buffer, whatever a peer sent)."""
    spec = get_codec(enc.codec)
    if enc.numel < 0:
        raise ValueError(f"numel must be >= 0, got {enc.numel}")
    if enc.payload.dtype != torch.uint8 or enc.payload.dim() != 1:
        raise ValueError(
            f"payload must be a flat uint8 tensor, got {enc.payload.dtype} {tuple(enc.payload.shape)}"
        )
    if spec.sparse and enc.block_size != spec.chunk:
        raise ValueError(
            f"{enc.codec} is cut into chunks of {spec.chunk} values, got block size {enc.block_size}"
        )
    if spec.scaled:
        if enc.block_size < 1:
            raise ValueError(f"{enc.codec} needs a block size >= 1, got {enc.block_size}")
        if enc.scales.dtype != torch.float32 or enc.scales.dim() != 1:
            raise ValueError(
                f"scales must be a flat fp32 tensor, got {enc.scales.dtype} {tuple(enc.scales.shape)}"
            )
        if enc.scales.device != enc.payload.device:
            raise ValueError(f"scales on {enc.scales.device} but payload on {enc.payload.device}")
    nbytes, nscales = spec.sizes(enc.numel, max(1, enc.block_size))
    if enc.payload.numel() != nbytes or (spec.scaled and enc.scales.numel() != nscales):
        raise ValueError(
            f"{enc.numel} {enc.codec} values take {nbytes} payload bytes and {nscales} scales, "
            f"got {enc.payload.numel()} and {enc.scales.numel()}"
        )
    if spec.sparse and (bad := topk.problem(enc.payload, spec, enc.numel)) is not None:
        raise ValueError(bad)
    return spec


def _check_target(enc: Encoded, t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.numel() != enc.numel or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor of {enc.numel} values, got {tuple(t.shape)}")
    if t.device != enc.payload.device:
        raise ValueError(
            f"{name} is on {t.device} but the payload on {enc.payload.device}: move the bytes first"
        )


# --- stochastic rounding's random numbers ------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _mul32(x: Any, c: int) -> Any:
    """(x * c) mod 2^32 for x in [0, 2^32) and a 32-bit constant, without overflowing int64 (works on
    Python ints and int64 tensors alike)."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & _MASK32


def _hash32(x: Any) -> Any:
    """lowbias32 (Wellons): a bijection of [0, 2^32) with good avalanche; ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _draw_seed(generator: torch.Generator | None, device: torch.device) -> Any:
    """One 32-bit seed from the generator (on the generator's own device): a Python int when it lives on the
    CPU, else a one-element tensor moved to `device` (no host sync)."""
    gdev = generator.device if generator is not None else device
    seed = torch.randint(0, 1 << 32, (1,), generator=generator, device=gdev, dtype=torch.int64)
    if seed.device.type == "cpu":
        return int(seed)
    return seed.to(device)


def _uniform_bits(seed: Any, count: int, device: torch.device) -> torch.Tensor:
    """The 32-bit hash values of elements 0..count-1 (int64 tensor on `device`)."""
    return _hash32((torch.arange(count, dtype=torch.int64, device=device) + _hash32(seed)) & _MASK32)


def _uniform(seed: Any, count: int, device: torch.device) -> torch.Tensor:
    """u_i in [0, 1), multiples of 2^-24, fp32."""
    return uniform_at(seed, torch.arange(count, dtype=torch.int64, device=device))


def uniform_at(seed: Any, i: torch.Tensor) -> torch.Tensor:
    """u_i of the elements `i` (an int64 tensor of positions): the same numbers as `_uniform`'s."""
    return (_hash32((i + _hash32(seed)) & _MASK32) >> 8).to(torch.float32) * (2.0**-24)


# --- the reference: torch ops on any device ----------------------------------------------------------------
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    t = _TABLES.get((name, device))
    if t is None:
        src = {"levels": E3M0_LEVELS, "bytes": _E3M0_BYTE_VALUES}[name]
        t = _TABLES[(name, device)] = src.to(device)
    return t


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x padded with zeros to whole blocks, shape (num_blocks, block_size)."""
    pad = (-x.numel()) % block_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block_size)


def _encode_torch(x: torch.Tensor, spec: Codec, block_size: int, stochastic: bool, seed: Any) -> Encoded:
    """The reference encoder: torch ops on x's device (x flat, contiguous fp32)."""
    n, dev = x.numel(), x.device
    empty = torch.empty(0, dtype=torch.float32, device=dev)
    if not spec.scaled:
        if not bool(torch.isfinite(x).all()):
            raise ValueError(_NON_FINITE)
        if spec.name == "fp32":
            return Encoded("fp32", n, x.clone().view(torch.uint8), empty)
        if stochastic:
            # add random low 16 bits to the fp32 pattern, then truncate: rounds the magnitude up with
            # probability equal to the dropped fraction, which is unbiased
            noise = (_uniform_bits(seed, n, dev) >> 16).to(torch.int32)
            x = ((x.view(torch.int32) + noise) & ~0xFFFF).view(torch.float32)
        return Encoded("bf16", n, x.to(torch.bfloat16).view(torch.uint8), empty)

    blocks = _blocks(x, block_size)
    mag = blocks.abs()
    absmax = mag.amax(dim=1)  # NaN propagates: one check on the scales covers every value
    if not bool(torch.isfinite(absmax).all()):
        raise ValueError(_NON_FINITE)
    if spec.name == "sq2":
        return _encode_sq2_torch(blocks, absmax, n, block_size, stochastic, seed)
    u = _uniform(seed, blocks.numel(), dev).view(blocks.shape) if stochastic else None

    if spec.name == "int8":
        step = absmax / 127.0
        y = blocks / torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(1)
        q = torch.floor(y + u) if u is not None else torch.round(y)
        q = q.clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        return Encoded("int8", n, q.view(torch.uint8).clone(), step, block_size)

    # e3m0: the level index from the fp32 bits of r = |x| / scale (0 < r <= 1 for the nonzero values)
    scale = absmax
    r = mag / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    rb = r.view(torch.int32)
    if u is not None:
        # the level below r (0 under 2^-6, at most 6), then up with probability (r - lo) / (hi - lo)
        lo = torch.where(rb >= 0x3C800000, (rb >> 23) - 120, 0).clamp_(max=6).long()
        levels = _table("levels", dev)
        lo_v, hi_v = levels[lo], levels[lo + 1]
        idx = lo + (u < (r - lo_v) / (hi_v - lo_v)).long()
    else:
        # nearest: adding 0x3FFFFF to the bits and keeping the exponent rounds the mantissa (ties down);
        # 2^-7 < r < 2^-6 goes to level 1 and r <= 2^-7 (midpoint 2^-7 included) to zero
        idx = torch.where(rb > 0x3C000000, (((rb + 0x3FFFFF) >> 23) - 120).clamp_(min=1), 0)
    sign = (blocks < 0) & (idx > 0)  # zero is always +0: one canonical code
    codes = (idx.to(torch.uint8) | (sign.to(torch.uint8) << 3)).reshape(-1)[:n]
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = codes[0::2] | (codes[1::2] << 4)
    return Encoded("e3m0", n, packed.contiguous(), scale, block_size)


def _encode_sq2_torch(
    blocks: torch.Tensor, absmax: torch.Tensor, n: int, block_size: int, stochastic: bool, seed: Any
) -> Encoded:
    """The reference sq2 encoder (common/sq2.py): every statistic an exact integer sum on the grid, every
    step from the sums one IEEE fp64 operation, so that the CPU kernel computes the same bytes."""
    dev = blocks.device
    valid = (torch.arange(blocks.numel(), device=dev) < n).view(blocks.shape)
    u = _uniform(seed, blocks.numel(), dev).view(blocks.shape) if stochastic else None
    books, idx = sq2_quantize(blocks, valid, absmax, u)
    return Encoded("sq2", n, pack2(idx.reshape(-1)[:n]), books.reshape(-1).contiguous(), block_size)


def _decode_torch(enc: Encoded, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference decoder: torch ops on the payload's device, into `out` when given."""
    n = enc.numel
    if enc.codec == "fp32":
        vals = enc.payload.view(torch.float32)
    elif enc.codec == "bf16":
        vals = enc.payload.view(torch.bfloat16).to(torch.float32)
    elif enc.codec == "int8":
        q = enc.payload.view(torch.int8).to(torch.float32)
        vals = _blocks(q, enc.block_size).mul_(enc.scales.unsqueeze(1)).reshape(-1)[:n]
    elif enc.codec == "sq2":
        codes = unpack2(enc.payload, n)
        block = torch.arange(n, device=enc.payload.device) // enc.block_size
        vals = enc.scales[block * 4 + codes]  # each value is its block's codebook entry
    elif enc.codec == "e3m0":
        lut = _table("bytes", enc.payload.device)
        vals = lut[enc.payload.long()].reshape(-1)[:n]  # one lookup per byte: two values
        vals = _blocks(vals, enc.block_size).mul_(enc.scales.unsqueeze(1)).reshape(-1)[:n]
    else:
        raise ValueError(f"unknown codec {enc.codec!r}: choose one of {', '.join(CODECS)}")
    if out is None:
        return vals.clone() if enc.codec == "fp32" else vals.contiguous()
    return out.copy_(vals)


# --- the CPU path: numba kernels, one pass each -----------------------------------------------------------
def _encode_cpu(
    k: Any, x: torch.Tensor, spec: Codec, block_size: int, stochastic: bool, seed: int
) -> Encoded:
    n = x.numel()
    xi = x.numpy().view(np.int32)
    key = int(_hash32(seed)) if stochastic else 0
    nbytes, nscales = spec.sizes(n, block_size)
    payload = torch.empty(nbytes, dtype=torch.uint8)
    scales = torch.empty(nscales, dtype=torch.float32)
    pn, sn = payload.numpy(), scales.numpy()
    bs = block_size if spec.scaled else 1

    def run(a: int, b: int) -> bool:
        """Values [a, b) (a on a block boundary): the same bytes as encoding the whole at once."""
        xs = xi[a:b]
        if spec.name == "fp32":
            return k.copy_check(xs, pn.view(np.int32)[a:b])
        if spec.name == "bf16":
            return k.encode_bf16(xs, pn.view(np.uint16)[a:b], key, stochastic, a)
        ss = sn[a // bs : -(-b // bs)]
        if spec.name == "int8":
            return k.encode_int8(xs, xs.view(np.float32), bs, pn.view(np.int8)[a:b], ss, key, stochastic, a)
        if spec.name == "sq2":
            books = sn[a // bs * 4 : -(-b // bs) * 4]
            return k.encode_sq2(
                xs, xs.view(np.float32), bs, pn[a // 4 : (b + 3) // 4], books, key, stochastic, a
            )
        return k.encode_e3m0(xs, xs.view(np.float32), bs, pn[a // 2 : (b + 1) // 2], ss, key, stochastic, a)

    if any(in_parallel(n, chunk_alignment(spec.name, bs), run)):
        raise ValueError(_NON_FINITE)
    return Encoded(
        spec.name, n, payload, scales if spec.scaled else scales[:0], block_size if spec.scaled else 0
    )


# Tensors of at least this many values are encoded and decoded by several threads (the kernels release the
# GIL), each on a range of whole blocks: 25M values take 1/threads of the time. STREAMDILOCO_CODEC_THREADS
# sets the count (default: the CPUs, at most 4).
PARALLEL_VALUES = 1 << 21
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def codec_threads() -> int:
    env = os.environ.get("STREAMDILOCO_CODEC_THREADS", "")
    return max(1, int(env)) if env.isdigit() else max(1, min(4, os.cpu_count() or 1))


def in_parallel(n: int, align: int, run: Callable[[int, int], Any]) -> list[Any]:
    """run(a, b) over ranges covering [0, n) that start at multiples of `align` (even: two 4-bit codes per
    byte), on the codec threads when n is large; the results in order."""
    global _POOL
    threads = codec_threads() if n >= PARALLEL_VALUES else 1
    if threads == 1:
        return [run(0, n)]
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(codec_threads(), thread_name_prefix="codec")
    step = -(-n // threads)
    unit = align * 2 if align % 2 else align
    step = -(-step // unit) * unit
    return list(_POOL.map(lambda a: run(a, min(n, a + step)), range(0, n, step)))


def _apply_cpu(k: Any, enc: Encoded, out: torch.Tensor, weight: float, mode: int) -> None:
    """mode 0: out = values; mode 1: out = fma(values, weight, out) in out's dtype (torch's add_ with alpha
    rounds weight to out's dtype first, then fuses); mode 2: out = fma(values, weight, +0)."""
    w = np.float64(weight) if out.dtype == torch.float64 else np.float32(weight)
    o = out.numpy()
    p = enc.payload.contiguous().numpy()
    s = enc.scales.contiguous().numpy()
    bs = enc.block_size if get_codec(enc.codec).scaled else 1

    def run(a: int, b: int) -> None:
        if enc.codec == "fp32":
            k.apply_f32(p.view(np.float32)[a:b], o[a:b], w, mode)
        elif enc.codec == "bf16":
            k.apply_bf16(p.view(np.uint16)[a:b], o[a:b], w, mode)
        elif enc.codec == "int8":
            k.apply_int8(p.view(np.int8)[a:b], s[a // bs : -(-b // bs)], bs, b - a, o[a:b], w, mode)
        elif enc.codec == "sq2":
            books = s[a // bs * 4 : -(-b // bs) * 4]
            k.apply_sq2(p[a // 4 : (b + 3) // 4], books, bs, b - a, o[a:b], w, mode)
        else:
            k.apply_e3m0(p[a // 2 : (b + 1) // 2], s[a // bs : -(-b // bs)], bs, b - a, o[a:b], w, mode)

    in_parallel(enc.numel, chunk_alignment(enc.codec, bs), run)


def _apply_topk(spec: Codec, enc: Encoded, out: torch.Tensor, weight: float, mode: int) -> None:
    """decode / add_into / accumulate of a top-k Encoded (positions already checked): only the kept values
    are touched in modes 1 and 2's sums (mode 0 and 2 zero the rest)."""
    tk = topk.cpu_kernels() if out.device.type == "cpu" else None
    if tk is None:
        topk.apply_torch(enc.payload, enc.scales, spec, enc.numel, out, weight, mode)
        return
    w = np.float64(weight) if out.dtype == torch.float64 else np.float32(weight)
    o, p, s = out.numpy(), enc.payload.contiguous().numpy(), enc.scales.contiguous().numpy()
    full, c = spec.block_payload(spec.chunk), spec.chunk

    def run(a: int, b: int) -> bool:
        books = s[a // c * 4 : -(-b // c) * 4]
        return tk.apply(
            p[a // c * full :], books, c, spec.keep, spec.index_bits, full, b - a, o[a:b], w, mode
        )

    if any(in_parallel(enc.numel, c, run)):
        raise ValueError(f"a {enc.codec} position is past its chunk's values")


def _sumsq_topk(spec: Codec, enc: Encoded) -> float:
    tk = topk.cpu_kernels() if enc.payload.device.type == "cpu" else None
    if tk is None:
        return topk.sumsq_torch(enc.payload, enc.scales, spec, enc.numel)
    p, s = enc.payload.contiguous().numpy(), enc.scales.contiguous().numpy()
    return float(
        tk.sumsq(p, s, spec.chunk, spec.keep, spec.index_bits, spec.block_payload(spec.chunk), enc.numel)
    )


def fused_outer_step_available(codec: str, block_size: int, device: torch.device) -> bool:
    """Whether `outer_step` runs (else the caller runs the torch ops)."""
    return codec in ("e3m0", "int8") and block_size % 2 == 0 and device.type == "cpu" and bool(cpu_kernels())


def outer_step(
    g: torch.Tensor | Callable[[int, int, torch.Tensor], None],
    buf: torch.Tensor | None,
    first: bool,
    old: torch.Tensor,
    residual: torch.Tensor,
    new: torch.Tensor,
    momentum: float,
    lr: float,
    nesterov: bool,
    codec: str,
    block_size: int,
    rounding: str,
    generator: torch.Generator | None,
    fill_values: int = 1 << 16,
) -> Encoded | None:
    """The fused outer step (see above) on flat fp32 CPU tensors: updates `buf` (the momentum, None without
    momentum; `first`: set it to g) and `residual` in place, writes the new master into `new` and returns
    the encoded update; bit-identical to the torch ops in OuterOptimizer. `g` is the mean outer gradient, or
    a function fill(lo, hi, out) that writes its values [lo, hi) into `out` (fp32): then it is asked for
    `fill_values` values at a time (a multiple of the block size), each block stepped while it is in cache,
    and the whole gradient never exists. None, changing nothing, where it does not apply (no kernels,
    another device, a codec other than e3m0 or int8, an odd block size): the caller runs the torch ops.
    Raises ValueError on non-finite values."""
    if not fused_outer_step_available(codec, block_size, old.device):
        return None
    k, spec = cpu_kernels(), get_codec(codec)
    n = old.numel()
    stochastic = rounding == "stochastic"
    seed = _draw_seed(generator, old.device) if stochastic else 0
    key = int(_hash32(seed)) if stochastic else 0
    nbytes, nscales = spec.sizes(n, block_size)
    payload = torch.empty(nbytes, dtype=torch.uint8)
    scales = torch.empty(nscales, dtype=torch.float32)
    pn, sn = payload.numpy(), scales.numpy()
    int8 = codec == "int8"
    filled = callable(g)
    arrays = [t.numpy() for t in (buf if buf is not None else old, old, residual, new)]
    mom, neglr = np.float32(momentum), np.float32(-lr)
    chunk = block_size * max(1, 16384 // block_size)
    unit = max(chunk, fill_values // chunk * chunk) if filled else chunk

    def step(a: int, b: int, ga: Any) -> bool:
        ba, oa, ra, na = (x[a:b] for x in arrays)
        pa = pn[a:b] if int8 else pn[a // 2 : (b + 1) // 2]
        sa = sn[a // block_size : -(-b // block_size)]
        return k.outer(ga, ba, oa, ra, na, pa, sa, block_size, mom, neglr, nesterov, first, key, stochastic,
                       a, chunk, int8)  # fmt: skip

    def run(a: int, b: int) -> bool:
        if not filled:
            return step(a, b, g.numpy()[a:b])  # type: ignore[union-attr]
        block = torch.empty(min(unit, b - a), dtype=torch.float32)
        for lo in range(a, b, unit):
            hi = min(b, lo + unit)
            g(lo, hi, block[: hi - lo])  # type: ignore[operator]
            if step(lo, hi, block.numpy()[: hi - lo]):
                return True
        return False

    if any(in_parallel(n, unit, run)):
        raise ValueError(_NON_FINITE)
    return Encoded(codec, n, payload, scales, block_size)


# --- chunks: an Encoded cut into pieces of about 1 MiB for the wire -----------------------------------
CHUNK_BYTES = 1 << 20


def chunk_alignment(codec: str, block_size: int) -> int:
    """Chunks start at multiples of this many values, so bytes and scales split cleanly."""
    return get_codec(codec).alignment(block_size)


def chunk_values(codec: str, block_size: int, target_bytes: int = CHUNK_BYTES) -> int:
    """Values per chunk: about target_bytes of payload, a multiple of the codec's alignment."""
    spec = get_codec(codec)
    align = chunk_alignment(codec, block_size)
    if spec.sparse:  # whole chunks of about target_bytes (payload and codebooks)
        return max(1, target_bytes // spec.encoded_nbytes(spec.chunk, spec.chunk)) * spec.chunk
    n = target_bytes * 8 // spec.bits
    return max(align, n // align * align)


def expected_sizes(codec: str, numel: int, block_size: int) -> tuple[int, int]:
    """(payload bytes, number of scales) that `numel` values take in this codec."""
    return get_codec(codec).sizes(numel, block_size)


def split(enc: Encoded, values_per_chunk: int) -> list[tuple[int, Encoded]]:
    """(offset, part) pieces of enc; each part decodes to the matching values of decode(enc)."""
    align = chunk_alignment(enc.codec, enc.block_size)
    if values_per_chunk % align:
        raise ValueError(f"values_per_chunk {values_per_chunk} is not a multiple of {align}")
    return [
        (lo, piece(enc, lo, min(enc.numel, lo + values_per_chunk)))
        for lo in range(0, max(enc.numel, 1), values_per_chunk)
    ]


def piece(enc: Encoded, lo: int, hi: int) -> Encoded:
    """Values [lo, hi) of enc, as views of its payload and scales. lo must be a multiple of the codec's
    chunk alignment (hi too, unless it is enc.numel), so that bytes and blocks split cleanly."""
    if lo == 0 and hi == enc.numel:
        return enc
    spec = get_codec(enc.codec)
    b_lo = spec.payload_offset(lo, enc.block_size)
    b_hi = b_lo + spec.sizes(hi - lo, enc.block_size)[0]
    return Encoded(enc.codec, hi - lo, enc.payload[b_lo:b_hi], block_scales(enc, lo, hi), enc.block_size)


def block_scales(enc: Encoded, lo: int, hi: int) -> torch.Tensor:
    """The fp32 side values (scales, codebooks) of the blocks that values [lo, hi) of enc fall in (lo on a
    block boundary): a view of enc.scales; all of them (none) for a codec without blocks."""
    spec = get_codec(enc.codec)
    if not spec.scaled:
        return enc.scales
    per = spec.scales_per_block
    return enc.scales[lo // enc.block_size * per : -(-hi // enc.block_size) * per]


def concat(parts: list[Encoded]) -> Encoded:
    """The inverse of `split`: one Encoded from its pieces, in order."""
    first = parts[0]
    return Encoded(
        first.codec,
        sum(p.numel for p in parts),
        torch.cat([p.payload for p in parts]),
        torch.cat([p.scales for p in parts]),
        first.block_size,
    )
