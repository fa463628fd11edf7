"""Codecs for the values that cross the network: fp32, bf16, int8 and 4-bit E3M0.

One registry (`CODECS`), two functions (`encode`, `decode`). The quantized codecs cut the flat vector into
blocks of `block_size` values that share one fp32 scale; E3M0 packs two 4-bit codes per byte.

E3M0 (the paper's 4-bit float: 1 sign bit, 3 exponent bits, no mantissa): code 0 is zero and codes 1..7 are
2^-6 .. 2^0 times the block's scale, which is the block's largest magnitude. Rounding is to the nearest level
or stochastic (unbiased: E[decode(encode(x))] = x).

Decoding is deterministic on every machine: a level times a scale is a power of two times an fp32 number
(exact), int8 is one IEEE multiply, bf16 -> fp32 is exact. The same bytes give the same fp32 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROUNDINGS = ("nearest", "stochastic")

# E3M0 magnitudes relative to the block scale: 0, 2^-6, ..., 2^0.
E3M0_LEVELS = torch.tensor([0.0] + [2.0**e for e in range(-6, 1)], dtype=torch.float32)
_E3M0_MIDPOINTS = (E3M0_LEVELS[:-1] + E3M0_LEVELS[1:]) / 2
# the signed value of each 4-bit code (bit 3 is the sign), and of each byte as (low code, high code)
_E3M0_CODE_VALUES = torch.cat([E3M0_LEVELS, -E3M0_LEVELS])
_E3M0_BYTE_VALUES = torch.stack(
    [_E3M0_CODE_VALUES[torch.arange(256) & 0x0F], _E3M0_CODE_VALUES[torch.arange(256) >> 4]], dim=1
)


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


@dataclass(frozen=True)
class Codec:
    name: str
    bits: int  # bits per value in the payload
    scaled: bool  # has one fp32 scale per block

    def sizes(self, numel: int, block_size: int) -> tuple[int, int]:
        """(payload bytes, number of fp32 scales) that `encode` gives `numel` values."""
        return (numel * self.bits + 7) // 8, (-(-numel // block_size) if self.scaled else 0)

    def encoded_nbytes(self, numel: int, block_size: int) -> int:
        """The size `encode` will produce, without encoding: payload plus scales."""
        payload, scales = self.sizes(numel, block_size)
        return payload + 4 * scales


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 32, False),
    "bf16": Codec("bf16", 16, False),
    "int8": Codec("int8", 8, True),
    "e3m0": Codec("e3m0", 4, True),
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}: choose one of {', '.join(CODECS)}") from None


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x padded with zeros to whole blocks, shape (num_blocks, block_size)."""
    pad = (-x.numel()) % block_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block_size)


def _uniform(shape: torch.Size, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(shape, generator=generator, dtype=torch.float32)


def encode(
    x: torch.Tensor,
    codec: str,
    block_size: int = 128,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Encoded:
    """Encode a flat tensor (any device; work happens on the CPU in fp32)."""
    spec = get_codec(codec)
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}: choose {' or '.join(ROUNDINGS)}")
    x = x.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    if not torch.isfinite(x).all():
        raise ValueError("cannot encode non-finite values (NaN or inf): the training has diverged")
    n = x.numel()
    stochastic = rounding == "stochastic"
    empty = torch.empty(0, dtype=torch.float32)

    if spec.name == "fp32":
        return Encoded("fp32", n, x.clone().view(torch.uint8), empty)

    if spec.name == "bf16":
        if stochastic:
            # add random low 16 bits to the fp32 pattern, then truncate: rounds the magnitude up with
            # probability equal to the dropped fraction, which is unbiased
            bits = x.view(torch.int32)
            noise = torch.randint(0, 1 << 16, (n,), generator=generator, dtype=torch.int32)
            x = ((bits + noise) & ~0xFFFF).view(torch.float32)
        return Encoded("bf16", n, x.to(torch.bfloat16).view(torch.uint8), empty)

    blocks = _blocks(x, block_size)
    absmax = blocks.abs().amax(dim=1)

    if spec.name == "int8":
        step = absmax / 127.0
        y = blocks / torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(1)
        q = torch.floor(y + _uniform(y.shape, generator)) if stochastic else torch.round(y)
        q = q.clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        return Encoded("int8", n, q.view(torch.uint8).clone(), step, block_size)

    # e3m0
    scale = absmax
    r = blocks.abs() / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    if stochastic:
        lo = (torch.bucketize(r, E3M0_LEVELS, right=True) - 1).clamp_(0, 6)
        lo_v, hi_v = E3M0_LEVELS[lo], E3M0_LEVELS[lo + 1]
        p_up = (r - lo_v) / (hi_v - lo_v)
        idx = lo + (_uniform(r.shape, generator) < p_up).to(lo.dtype)
    else:
        idx = torch.bucketize(r, _E3M0_MIDPOINTS)  # ties go to the lower level
    sign = (blocks < 0) & (idx > 0)  # zero is always +0: one canonical code
    codes = (idx.to(torch.uint8) | (sign.to(torch.uint8) << 3)).reshape(-1)[:n]
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = codes[0::2] | (codes[1::2] << 4)
    return Encoded("e3m0", n, packed.contiguous(), scale, block_size)


def decode(enc: Encoded) -> torch.Tensor:
    """The fp32 values an Encoded stands for (a new CPU tensor of enc.numel values)."""
    n = enc.numel
    if enc.codec == "fp32":
        return enc.payload.view(torch.float32).clone()
    if enc.codec == "bf16":
        return enc.payload.view(torch.bfloat16).to(torch.float32)
    if enc.codec == "int8":
        q = enc.payload.view(torch.int8).to(torch.float32)
        return _blocks(q, enc.block_size).mul_(enc.scales.unsqueeze(1)).reshape(-1)[:n].clone()
    if enc.codec == "e3m0":
        vals = _E3M0_BYTE_VALUES[enc.payload.long()].reshape(-1)[:n]  # one lookup per byte: two values
        return _blocks(vals, enc.block_size).mul_(enc.scales.unsqueeze(1)).reshape(-1)[:n].clone()
    raise ValueError(f"unknown codec {enc.codec!r}: choose one of {', '.join(CODECS)}")


def roundtrip(
    x: torch.Tensor,
    codec: str,
    block_size: int = 128,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """decode(encode(x)): what the receiver will see."""
    return decode(encode(x, codec, block_size, rounding, generator))


# --- chunks: an Encoded cut into pieces of about 1 MiB for the wire -----------------------------------
CHUNK_BYTES = 1 << 20


def chunk_alignment(codec: str, block_size: int) -> int:
    """Chunks start at multiples of this many values, so bytes and scales split cleanly."""
    spec = get_codec(codec)
    align = block_size if spec.scaled else 1
    if spec.bits < 8:  # two values per byte
        align = align * 2 if align % 2 else align
    return max(1, align)


def chunk_values(codec: str, block_size: int, target_bytes: int = CHUNK_BYTES) -> int:
    """Values per chunk: about target_bytes of payload, a multiple of the codec's alignment."""
    align = chunk_alignment(codec, block_size)
    n = target_bytes * 8 // get_codec(codec).bits
    return max(align, n // align * align)


def expected_sizes(codec: str, numel: int, block_size: int) -> tuple[int, int]:
    """(payload bytes, number of scales) that `numel` values take in this codec."""
    return get_codec(codec).sizes(numel, block_size)


def split(enc: Encoded, values_per_chunk: int) -> list[tuple[int, Encoded]]:
    """(offset, part) pieces of enc; each part decodes to the matching values of decode(enc)."""
    spec = get_codec(enc.codec)
    align = chunk_alignment(enc.codec, enc.block_size)
    if values_per_chunk % align:
        raise ValueError(f"values_per_chunk {values_per_chunk} is not a multiple of {align}")
    parts = []
    for lo in range(0, max(enc.numel, 1), values_per_chunk):
        hi = min(enc.numel, lo + values_per_chunk)
        b_lo, b_hi = lo * spec.bits // 8, (hi * spec.bits + 7) // 8
        scales = enc.scales[lo // enc.block_size : -(-hi // enc.block_size)] if spec.scaled else enc.scales
        parts.append((lo, Encoded(enc.codec, hi - lo, enc.payload[b_lo:b_hi], scales, enc.block_size)))
    return parts


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
