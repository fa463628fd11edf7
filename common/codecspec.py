"""The codec registry: each codec's name, bits per value and fp32 side values per block; the roundings.

Plain data without torch, so that the settings (common/config.py) list the codecs in --help and check a
name without importing torch; common/codecs.py holds the encoders and decoders and re-exports these names.
Must not import torch, numpy or anything of this package.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class Codec:
    name: str
    bits: int  # bits per value in the payload
    # fp32 side values per block of `block_size` values, sent beside the payload (the Encoded's `scales`):
    # 0 for the unblocked codecs, 1 for a scale (int8, e3m0), 4 for sq2's codebook (its bins' means)
    scales_per_block: int

    @property
    def scaled(self) -> bool:
        """Whether the values are cut into blocks that carry fp32 side values (scales or a codebook)."""
        return self.scales_per_block > 0

    def sizes(self, numel: int, block_size: int) -> tuple[int, int]:
        """(payload bytes, number of fp32 scales) that `encode` gives `numel` values."""
        return (numel * self.bits + 7) // 8, -(-numel // block_size) * self.scales_per_block

    def encoded_nbytes(self, numel: int, block_size: int) -> int:
        """The size `encode` will produce, without encoding: payload plus scales."""
        payload, scales = self.sizes(numel, block_size)
        return payload + 4 * scales


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 32, 0),
    "bf16": Codec("bf16", 16, 0),
    "int8": Codec("int8", 8, 1),
    "e3m0": Codec("e3m0", 4, 1),
    "sq2": Codec("sq2", 2, 4),  # 2-bit statistical quantization: four bins per block, their means sent
}
