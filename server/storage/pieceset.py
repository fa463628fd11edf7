"""A set of piece numbers 0..size-1 as a bitmap: what the data ledger (server/storage/ledger.py) keeps of an
epoch's done pieces. One bit per piece, so that a ledger of 2^20 pieces holds and saves 128 KiB (zlib and
base64 on disk: a full or empty epoch is a few hundred bytes) where a table of numbers took 42 MB of JSON.

`encode`/`decode` are the checkpoint's text form ("z1:" then base64 of the zlib-compressed bitmap); `decode`
checks the length, the padding bits and the size it decompresses to (a bomb is refused, not inflated).

Pure: no I/O, no clock. What it must not do: know whose pieces they are (the ledger counts that).
"""

from __future__ import annotations

import base64
import binascii
import re
import zlib
from collections.abc import Iterator

PREFIX = "z1:"  # the encoding's name and version: zlib over the bitmap, little-endian bits in each byte
_NOT_FULL = re.compile(rb"[^\xff]")  # a byte with a piece not in the set


class PieceSet:
    """Pieces 0..size-1, each in the set or not (see the module's docstring)."""

    def __init__(self, size: int, bits: bytearray | None = None):
        if size < 0:
            raise ValueError(f"a set of pieces has a size of 0 or more, got {size}")
        self.size = size
        self.bits = bytearray((size + 7) // 8) if bits is None else bits
        self.count = int.from_bytes(self.bits, "little").bit_count()

    def __contains__(self, piece: int) -> bool:
        return 0 <= piece < self.size and bool(self.bits[piece >> 3] & (1 << (piece & 7)))

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        """The pieces in the set, lowest first."""
        for i, byte in enumerate(self.bits):
            if byte:
                yield from (i * 8 + b for b in range(8) if byte & (1 << b))

    def add(self, piece: int) -> None:
        if not 0 <= piece < self.size:
            raise ValueError(f"piece {piece} is outside 0..{self.size - 1}")
        mask = 1 << (piece & 7)
        if not self.bits[piece >> 3] & mask:
            self.bits[piece >> 3] |= mask
            self.count += 1

    def copy(self) -> PieceSet:
        return PieceSet(self.size, bytearray(self.bits))

    def first_missing(self, start: int) -> int | None:
        """The lowest piece >= start that is not in the set (None: every one from start on is)."""
        piece = start
        while piece < self.size:
            if piece & 7 == 0:  # a whole byte at a time through the full stretches
                m = _NOT_FULL.search(self.bits, piece >> 3)
                if m is None:
                    return None
                piece = m.start() * 8
            if piece not in self:
                return piece if piece < self.size else None
            piece += 1
        return None

    def encode(self) -> str:
        """The set as text for a JSON checkpoint."""
        return PREFIX + base64.b64encode(zlib.compress(bytes(self.bits), 1)).decode("ascii")

    @classmethod
    def decode(cls, text: object, size: int) -> PieceSet:
        """A set that `encode` wrote for `size` pieces; ValueError (one line) when it is not one."""
        if not isinstance(text, str) or not text.startswith(PREFIX):
            raise ValueError(f"a set of pieces is {PREFIX!r} and base64, got {str(text)[:40]!r}")
        nbytes = (size + 7) // 8
        try:
            packed = base64.b64decode(text[len(PREFIX) :], validate=True)
            z = zlib.decompressobj()
            bits = bytearray(z.decompress(packed, nbytes + 1))  # never more than the size asks for
            whole = z.eof and not z.unconsumed_tail and not z.unused_data
        except (binascii.Error, zlib.error) as e:
            raise ValueError(f"a set of pieces does not decode ({e})") from None
        if len(bits) != nbytes or not whole:
            raise ValueError(f"a set of pieces is not {nbytes} bytes long (for {size} pieces)")
        if size % 8 and bits and bits[-1] >> (size % 8):
            raise ValueError(f"a set of pieces names a piece past the last one ({size - 1})")
        return cls(size, bits)
