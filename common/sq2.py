"""sq2, MuLoCo's 2-bit statistical quantizer: the reference in torch ops, on rows of values.

common/codecs.py wraps it into the `sq2` codec (one row a block of --codec-block-size values) and
common/topk.py into top-k's values (one row a chunk's kept values); common/kernels.py's sq2 loops compute
the same bytes on the CPU. Its constants are the ones they must agree on (tests/test_codecs.py checks).
"""

from __future__ import annotations

import torch

# sq2 (2-bit statistical quantization, MuLoCo's): per block, 4 bins with inner edges at mean - t, mean and
# mean + t, t = SQ2_EDGE * the block's standard deviation, each value sent as its bin's 2-bit index and each
# bin's mean (4 fp32 per block, the codebook) beside the payload. 0.9816 sigma is the inner threshold of the
# Lloyd-Max 4-level quantizer of a Gaussian (bins over +-k sigma with k = 2 * 0.9816): with the bins' means as
# the levels it is the MSE-optimal 4-level quantizer on Gaussian values (relative MSE 0.1175).
SQ2_EDGE = 0.9816
# The statistics are exact integer sums (order-free, so the torch ops and the CPU kernels agree to the bit) of
# the block's values on a grid: q = rint(x * 2^(SQ2_GRID_BITS - e)), e the exponent of the block's largest
# magnitude, so |q| <= 2^21 (2^23 for a block of denormals, on their own grid of 2^-149); q^2 summed over a
# block of at most SQ2_MAX_BLOCK values stays below 2^63.
SQ2_GRID_BITS = 20
SQ2_MAX_BLOCK = 1 << 16


def _grid(absmax: torch.Tensor) -> torch.Tensor:
    """2^(SQ2_GRID_BITS - e) per block (fp64, exact), e the exponent of the block's largest magnitude
    (its exponent field minus 127); 2^149 for a block of denormals (and zeros), which makes them exact
    integers below 2^23."""
    field = absmax.view(torch.int32).long() >> 23
    k = torch.where(field > 0, SQ2_GRID_BITS + 127 - field, 149)
    return ((1023 + k) << 52).view(torch.float64)


def sq2_quantize(
    blocks: torch.Tensor, valid: torch.Tensor, absmax: torch.Tensor, u: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sq2 on the rows of `blocks` (the values where `valid`, at least one a row; `absmax`: each row's
    largest magnitude): each row's codebook (rows, 4) fp32 and each value's code (0 where not valid); `u`:
    stochastic rounding's uniform numbers, one per value (None: nearest)."""
    grid = _grid(absmax)
    q = torch.round(blocks.double() * grid.unsqueeze(1)).long() * valid
    m = valid.sum(dim=1).double()
    mean = q.sum(dim=1).double() / m
    var = ((q * q).sum(dim=1).double() / m - mean * mean).clamp(min=0.0)
    t = SQ2_EDGE * var.sqrt()
    qd = q.double()
    idx = (qd >= (mean - t).unsqueeze(1)).long() + (qd >= mean.unsqueeze(1)).long()
    idx += (qd >= (mean + t).unsqueeze(1)).long()
    sel = [(idx == b) & valid for b in range(4)]
    count = torch.stack([c.sum(dim=1) for c in sel], dim=1).double()  # (blocks, 4)
    total = torch.stack([(q * c).sum(dim=1) for c in sel], dim=1).double()
    centre = total / count  # in grid units; NaN for an empty bin (never sent: its entry is 0)
    books = torch.where(count > 0, centre / grid.unsqueeze(1), 0.0).to(torch.float32)
    if u is not None:
        idx = _dither(qd, idx, centre, count, u)
    return books, idx * valid


def pack2(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (a flat integer tensor) packed four a byte, the first in the low bits."""
    codes = codes.to(torch.uint8)
    pad = (-codes.numel()) % 4
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    c = codes.view(-1, 4)
    return (c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)).contiguous()


def unpack2(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` 2-bit codes of a packed byte tensor (int64)."""
    p = packed.long()
    return torch.stack([(p >> sh) & 3 for sh in (0, 2, 4, 6)], dim=1).reshape(-1)[:count]


def _dither(
    qd: torch.Tensor, idx: torch.Tensor, centre: torch.Tensor, count: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Stochastic rounding between codebook entries: a value in bin b above (below) its bin's mean moves to
    bin b + 1 (b - 1), when that bin is not empty, with probability (q - centre_b) / (centre_b+1 - centre_b)
    (mirrored): unbiased between the outer bins' means, which the neighbouring bins' means always bracket."""
    c = centre.gather(1, idx)
    up_ok = (idx < 3) & (count.gather(1, (idx + 1).clamp(max=3)) > 0)
    down_ok = (idx > 0) & (count.gather(1, (idx - 1).clamp(min=0)) > 0)
    c_up = centre.gather(1, (idx + 1).clamp(max=3))
    c_down = centre.gather(1, (idx - 1).clamp(min=0))
    ud = u.double()
    up = up_ok & (qd > c) & (ud < (qd - c) / (c_up - c))
    down = down_ok & (qd < c) & (ud < (c - qd) / (c - c_down))
    return idx + up.long() - down.long()
