"""The codec registry: each codec's name, bits per value and whether it has scales, and the rounding modes.

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
