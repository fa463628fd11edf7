"""The codec registry: each codec's name, bits per value and fp32 side values per block; the roundings.

Plain data without torch, so that the settings (common/config.py) list the codecs in --help and check a
name without importing torch; common/codecs.py holds the encoders and decoders and re-exports these names.
Must not import torch, numpy or anything of this package.

Two kinds of codec. The dense ones (fp32, bf16, int8, e3m0, sq2) send every value at `bits` bits, cut into
blocks of the run's `--codec-block-size` values that carry `scales_per_block` fp32 side values each. The
sparse family `topk<K>_<C>` (chunked top-k, SparseLoCo's) cuts the vector into chunks of C values and sends,
per chunk, the K values of largest magnitude: their positions within the chunk (ceil(log2 C) bits each,
ascending, packed) and their values at 2 bits through sq2's statistical quantizer (whose four bins' means are
the chunk's codebook: 4 fp32). The chunk is the codec's block, named by the codec itself (it does not follow
--codec-block-size, so a top-k uplink and an sq2 downlink keep their own blocks); a last, shorter chunk of n
values keeps ceil(K n / C). `topk` alone is SparseLoCo's setting, topk64_4096 (1.56 %).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

ROUNDINGS = ("nearest", "stochastic")
TOPK_DEFAULT = "topk64_4096"  # what `topk` alone stands for: SparseLoCo's 64 of every 64 x 64 values
TOPK_MAX_CHUNK = 1 << 16  # a chunk's positions fit 16 bits (and its sq2 statistics stay exact)
_TOPK_NAME = re.compile(r"topk([1-9][0-9]{0,5})_([1-9][0-9]{0,5})")


@dataclass(frozen=True)
class Codec:
    name: str
    bits: int  # bits per value in the payload (top-k: per kept value, besides its position)
    # fp32 side values per block of `block_size` values, sent beside the payload (the Encoded's `scales`):
    # 0 for the unblocked codecs, 1 for a scale (int8, e3m0), 4 for sq2's codebook (its bins' means)
    scales_per_block: int
    keep: int = 0  # top-k: values kept per chunk (0: a dense codec)
    chunk: int = 0  # top-k: values per chunk, the codec's own block size

    @property
    def scaled(self) -> bool:
        """Whether the values are cut into blocks that carry fp32 side values (scales or a codebook)."""
        return self.scales_per_block > 0

    @property
    def sparse(self) -> bool:
        """Whether only some values are sent (top-k), each with its position."""
        return self.keep > 0

    @property
    def index_bits(self) -> int:
        """Bits of one position within a chunk (top-k)."""
        return max(1, (self.chunk - 1).bit_length())

    @property
    def density(self) -> float:
        """The fraction of values sent (1 for a dense codec)."""
        return self.keep / self.chunk if self.sparse else 1.0

    def block(self, block_size: int) -> int:
        """The block size an Encoded of this codec carries, given the run's --codec-block-size: top-k's chunk,
        the run's for the other scaled codecs, 0 for fp32 and bf16."""
        if self.sparse:
            return self.chunk
        return block_size if self.scaled else 0

    def kept(self, values: int) -> int:
        """Values a top-k chunk of `values` values sends: K for a whole chunk, ceil(K values / C) else."""
        return -(-self.keep * values // self.chunk)

    def block_payload(self, values: int) -> int:
        """Payload bytes of one top-k chunk of `values` values: the packed positions, then the 2-bit codes."""
        k = self.kept(values)
        return (k * self.index_bits + 7) // 8 + (k * self.bits + 7) // 8

    def alignment(self, block_size: int) -> int:
        """Pieces of an encoded vector (chunks on the wire, the CPU kernels' ranges) start at multiples of
        this many values, so that bytes and scales split cleanly."""
        if self.sparse:
            return self.chunk
        align = block_size if self.scaled else 1
        if self.bits < 8:  # several values per byte (4-bit: two, 2-bit: four)
            align = align * (8 // self.bits) // _gcd(align, 8 // self.bits)
        return max(1, align)

    def payload_offset(self, values: int, block_size: int) -> int:
        """The payload byte where value `values` begins (a multiple of the alignment)."""
        if self.sparse:
            return values // self.chunk * self.block_payload(self.chunk)
        return values * self.bits // 8

    def sizes(self, numel: int, block_size: int) -> tuple[int, int]:
        """(payload bytes, number of fp32 scales) that `encode` gives `numel` values."""
        if self.sparse:
            whole, rest = divmod(numel, self.chunk)
            payload = whole * self.block_payload(self.chunk) + (self.block_payload(rest) if rest else 0)
            return payload, -(-numel // self.chunk) * self.scales_per_block
        return (numel * self.bits + 7) // 8, -(
            -numel // block_size
        ) * self.scales_per_block if self.scaled else 0

    def encoded_nbytes(self, numel: int, block_size: int) -> int:
        """The size `encode` will produce, without encoding: payload plus scales."""
        payload, scales = self.sizes(numel, block_size)
        return payload + 4 * scales

    def bits_per_value(self, block_size: int, numel: int = 1 << 20) -> float:
        """Bits on the wire per value of a large vector, side values and positions included."""
        return 8 * self.encoded_nbytes(numel, block_size) / numel


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 32, 0),
    "bf16": Codec("bf16", 16, 0),
    "int8": Codec("int8", 8, 1),
    "e3m0": Codec("e3m0", 4, 1),
    "sq2": Codec("sq2", 2, 4),  # 2-bit statistical quantization: four bins per block, their means sent
}
CODEC_HELP = f"{', '.join(CODECS)}, or topkK_C (K of every C values; topk: {TOPK_DEFAULT})"


def canonical_codec(name: str) -> str:
    """The codec's name as the wire and the fingerprint carry it (`topk` -> topk64_4096); ValueError naming
    the choices for an unknown or malformed one."""
    return lookup_codec(name).name


@lru_cache(maxsize=64)
def lookup_codec(name: str) -> Codec:
    """The Codec of a name: the registry's, or a top-k family member parsed from its name."""
    if not isinstance(name, str):
        raise ValueError(f"a codec's name must be a string, got {type(name).__name__}")
    spec = CODECS.get(name)
    if spec is not None:
        return spec
    if name == "topk":
        name = TOPK_DEFAULT
    m = _TOPK_NAME.fullmatch(name)
    if m is None:
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise ValueError(f"unknown codec {shown!r}: choose one of {CODEC_HELP}")
    keep, chunk = int(m.group(1)), int(m.group(2))
    if not 2 <= chunk <= TOPK_MAX_CHUNK or not 1 <= keep <= chunk:
        raise ValueError(
            f"codec {name}: top-k keeps K of every C values with 1 <= K <= C and 2 <= C <= {TOPK_MAX_CHUNK}"
        )
    return Codec(name, 2, 4, keep, chunk)
