"""Codecs: round-trip error bounds, packing sizes, deterministic decoding, unbiased stochastic rounding."""

import numpy as np
import pytest
import torch

from streamdiloco.common.codecs import CODECS, E3M0_LEVELS, Encoded, decode, encode, get_codec


def sample(n=10_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many decades, as outer gradients have
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) * 1e-3


def block_scales(x, bs):
    pad = (-x.numel()) % bs
    return torch.cat([x, x.new_zeros(pad)]).view(-1, bs).abs().amax(1).repeat_interleave(bs)[: x.numel()]


def test_fp32_is_exact():
    x = sample()
    assert torch.equal(decode(encode(x, "fp32")), x)


def test_bf16_error_bound():
    x = sample()
    err = (decode(encode(x, "bf16")) - x).abs()
    assert (err <= x.abs() * 2**-8).all()


@pytest.mark.parametrize("bs", [32, 128])
def test_int8_error_bound(bs):
    x = sample()
    step = block_scales(x, bs) / 127
    err = (decode(encode(x, "int8", bs)) - x).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("bs", [16, 128])
def test_e3m0_error_bound(bs):
    x = sample()
    scale = block_scales(x, bs)
    y = decode(encode(x, "e3m0", bs))
    err = (y - x).abs()
    # between two levels 2^k and 2^(k+1) the worst case is the midpoint: relative error 1/3;
    # below the smallest level 2^-6, the absolute error is at most half of it
    bound = torch.maximum(x.abs() / 3, scale * 2**-7)
    assert (err <= bound * (1 + 1e-6)).all()
    # every decoded value is 0 or +-scale * 2^k, k in -6..0
    ratio = (y.abs() / torch.where(scale > 0, scale, 1)).unique()
    assert set(ratio.tolist()) <= set(E3M0_LEVELS.tolist())
    # the largest magnitude of each block is exact
    i = x.abs().argmax()
    assert y[i] == x[i]


def test_e3m0_closed_form_values():
    x = torch.tensor([1.0, -0.5, 0.3, 0.0, -1 / 64, 1 / 200, 0.74, 0.76])
    y = decode(encode(x, "e3m0", block_size=8))
    # 0.3 -> 0.25 (nearer than 0.5), 1/200 -> 0 (below 2^-7), 0.74 -> 0.5, 0.76 -> 1.0
    assert y.tolist() == [1.0, -0.5, 0.25, 0.0, -1 / 64, 0.0, 0.5, 1.0]


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("n", [1, 7, 128, 1001])
def test_sizes_match_the_prediction(codec, n):
    enc = encode(sample(n), codec, block_size=64)
    assert enc.numel == n
    assert enc.nbytes == get_codec(codec).encoded_nbytes(n, 64)
    assert decode(enc).shape == (n,)


def test_e3m0_packs_two_codes_per_byte():
    enc = encode(sample(1000), "e3m0", block_size=100)
    assert enc.payload.numel() == 500 and enc.scales.numel() == 10
    assert enc.nbytes == 500 + 40


@pytest.mark.parametrize("codec", list(CODECS))
def test_decoding_is_deterministic_from_bytes(codec):
    """The same bytes give the same fp32 values: decode from a byte copy, as a receiver would."""
    enc = encode(sample(5000), codec, block_size=128)
    payload = bytes(enc.payload.numpy().tobytes())
    scales = bytes(enc.scales.numpy().tobytes())
    again = Encoded(
        codec,
        enc.numel,
        torch.frombuffer(bytearray(payload), dtype=torch.uint8),
        torch.frombuffer(bytearray(scales), dtype=torch.float32) if scales else torch.empty(0),
        enc.block_size,
    )
    a, b = decode(enc), decode(again)
    assert np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))


@pytest.mark.parametrize("codec", ["int8", "e3m0"])
def test_zero_blocks_and_odd_lengths(codec):
    x = torch.zeros(129)
    x[128] = 3.0
    y = decode(encode(x, codec, block_size=64))
    assert torch.equal(y, x)


def test_non_finite_values_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        encode(torch.tensor([1.0, float("nan")]), "e3m0")


def test_unknown_codec_and_rounding():
    with pytest.raises(ValueError, match="unknown codec 'fp4'"):
        encode(torch.zeros(4), "fp4")
    with pytest.raises(ValueError, match="unknown rounding"):
        encode(torch.zeros(4), "e3m0", rounding="up")


@pytest.mark.parametrize("codec", ["bf16", "int8", "e3m0"])
def test_stochastic_rounding_is_unbiased(codec):
    """Mean of many independent stochastic round-trips converges to x: a z-test on every value.

    For each value the per-trial error has variance <= (hi-lo)^2/4; the mean over T trials is compared with
    a 6-sigma bound, and the pooled mean error over all values with a 5-sigma bound. Nearest rounding, which
    is biased, fails the pooled test on the same data (checked below), so the test can fail.
    """
    torch.manual_seed(0)
    x = torch.rand(256) * 0.9 + 0.05  # values strictly inside the range, in one block
    x[0] = 1.0  # pins the e3m0/int8 scale to 1
    x[1:17] = 0.7  # nearest rounding sends all of these to 0.5: biased
    T = 2000
    g = torch.Generator().manual_seed(1)
    ys = torch.stack([decode(encode(x, codec, 256, "stochastic", g)) for _ in range(T)])
    det = decode(encode(x, codec, 256, "nearest"))
    gap = (ys.max(0).values - ys.min(0).values).clamp_min(1e-12)  # hi - lo per value
    sigma = gap / 2 / T**0.5
    mean_err = ys.mean(0) - x
    assert (mean_err.abs() <= 6 * sigma + 1e-7).all()
    pooled = mean_err.mean()
    pooled_sigma = (sigma**2).sum().sqrt() / len(x)
    assert pooled.abs() <= 5 * pooled_sigma
    # the two modes really differ, and nearest is biased on this data
    assert not torch.equal(ys[0], det)
    if codec == "e3m0":
        assert torch.equal(det[1:17], torch.full((16,), 0.5))
        assert (ys[:, 1:17].mean() - 0.7).abs() < 0.01
