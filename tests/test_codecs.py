"""Codecs: exactly today's bytes and values (the pre-fast-path implementation is kept below as the spec),
the CPU kernels equal to the torch reference, round-trip error bounds, packing sizes, deterministic decoding,
unbiased and reproducible stochastic rounding, fused accumulate/add_into, clear errors; CUDA equal to CPU
(skipped without a GPU)."""

import math
import threading

import numpy as np
import pytest
import torch

from streamdiloco.common import codecs, kernels, sq2
from streamdiloco.common.codecs import (
    CODECS,
    E3M0_LEVELS,
    ROUNDINGS,
    Encoded,
    accumulate,
    add_into,
    concat,
    decode,
    encode,
    get_codec,
    split,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
QUANTIZED = ["int8", "e3m0", "sq2"]


def sample(n=10_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many decades, as outer gradients have
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) * 1e-3


def block_scales(x, bs):
    pad = (-x.numel()) % bs
    return torch.cat([x, x.new_zeros(pad)]).view(-1, bs).abs().amax(1).repeat_interleave(bs)[: x.numel()]


def bits(t):
    """A tensor's exact bit patterns (so -0.0 differs from 0.0 and NaNs compare)."""
    t = t.contiguous()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(as_int).cpu()


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# --- today's implementation, kept as the spec for nearest rounding and for decoding ----------------------
_LEVELS = torch.tensor([0.0] + [2.0**e for e in range(-6, 1)], dtype=torch.float32)
_MIDPOINTS = (_LEVELS[:-1] + _LEVELS[1:]) / 2
_CODE_VALUES = torch.cat([_LEVELS, -_LEVELS])
_BYTE_VALUES = torch.stack(
    [_CODE_VALUES[torch.arange(256) & 0x0F], _CODE_VALUES[torch.arange(256) >> 4]], dim=1
)


def _ref_blocks(x, block_size):
    pad = (-x.numel()) % block_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block_size)


def ref_encode(x, codec, block_size=128):
    """Nearest rounding as `encode` did before the fast path: (payload, scales)."""
    x = x.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()
    assert torch.isfinite(x).all()
    n = x.numel()
    empty = torch.empty(0, dtype=torch.float32)
    if codec == "fp32":
        return x.clone().view(torch.uint8), empty
    if codec == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8), empty
    if codec == "sq2":
        return ref_sq2(x, block_size)
    blocks = _ref_blocks(x, block_size)
    absmax = blocks.abs().amax(dim=1)
    if codec == "int8":
        step = absmax / 127.0
        y = blocks / torch.where(step > 0, step, torch.ones_like(step)).unsqueeze(1)
        q = torch.round(y).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        return q.view(torch.uint8).clone(), step
    scale = absmax
    r = blocks.abs() / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    idx = torch.bucketize(r, _MIDPOINTS)  # ties go to the lower level
    sign = (blocks < 0) & (idx > 0)
    codes = (idx.to(torch.uint8) | (sign.to(torch.uint8) << 3)).reshape(-1)[:n]
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return (codes[0::2] | (codes[1::2] << 4)).contiguous(), scale


def ref_sq2(x, block_size):
    """sq2 written out block by block in numpy (its own implementation of the format, to check the codec's):
    (payload, codebooks)."""
    xs = x.double().numpy()
    books, codes = [], []
    for lo in range(0, len(xs), block_size):
        b = xs[lo : lo + block_size]
        amax = float(np.abs(b).max())
        # the grid: 2^(20 - e), e the exponent of the largest magnitude; 2^149 for denormals and zeros
        grid = 2.0 ** (20 - (math.frexp(amax)[1] - 1)) if amax >= 2.0**-126 else 2.0**149
        q = np.rint(b * grid).astype(np.int64)
        mean = float(q.sum()) / len(q)
        t = 0.9816 * math.sqrt(max(float((q * q).sum()) / len(q) - mean * mean, 0.0))
        idx = (q >= mean - t).astype(np.int64) + (q >= mean) + (q >= mean + t)
        for k in range(4):
            sel = q[idx == k]
            books.append(np.float32(float(sel.sum()) / len(sel) / grid) if len(sel) else np.float32(0.0))
        codes.extend(idx.tolist())
    codes += [0] * (-len(codes) % 4)
    c = np.array(codes, dtype=np.uint8).reshape(-1, 4)
    packed = c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)
    return torch.from_numpy(packed.astype(np.uint8)), torch.tensor(np.array(books, dtype=np.float32))


def ref_decode(codec, n, payload, scales, block_size):
    """Decoding as it was before the fast path (sq2: its codebook entry, by the spec)."""
    if codec == "sq2":
        p = payload.long()
        code = torch.stack([(p >> s) & 3 for s in (0, 2, 4, 6)], 1).reshape(-1)[:n]
        return scales[torch.arange(n) // block_size * 4 + code].clone()
    if codec == "fp32":
        return payload.view(torch.float32).clone()
    if codec == "bf16":
        return payload.view(torch.bfloat16).to(torch.float32)
    if codec == "int8":
        q = payload.view(torch.int8).to(torch.float32)
        return _ref_blocks(q, block_size).mul_(scales.unsqueeze(1)).reshape(-1)[:n].clone()
    vals = _BYTE_VALUES[payload.long()].reshape(-1)[:n]
    return _ref_blocks(vals, block_size).mul_(scales.unsqueeze(1)).reshape(-1)[:n].clone()


def nextafter(x, direction):
    return torch.nextafter(x, torch.full_like(x, direction))


def edge_inputs():
    """name -> values: random, zeros, exact ties, their neighbours, denormals, huge values, odd lengths."""
    g = torch.Generator().manual_seed(3)
    out = {
        "random": sample(10_007, seed=1),
        "wide": torch.randn(4099, generator=g) * torch.exp(torch.randn(4099, generator=g) * 8),
    }
    out["zeros"] = torch.zeros(300)
    out["negative zeros"] = -torch.zeros(257)
    # e3m0 midpoints at scale 1 (2^-7 goes to zero, 1.5 * 2^-k and 0.75 to the lower level) and neighbours
    mids = torch.tensor([2.0**-7] + [1.5 * 2.0**e for e in range(-6, -1)] + [0.75])
    ties = torch.cat(
        [mids, nextafter(mids, 0.0), nextafter(mids, 2.0), torch.tensor([2.0**-6, 2.0**-8, 1.0])]
    )
    e = torch.cat([torch.tensor([1.0]), ties, -ties])
    out["e3m0 ties"] = e
    out["e3m0 ties scaled"] = e * 3.0e-5  # scale not a power of two: r = |x| / scale rounds
    # int8 ties: absmax 127 gives step 1, so k + 0.5 is an exact tie (to even)
    k = torch.arange(-127, 127, dtype=torch.float32) + 0.5
    out["int8 ties"] = torch.cat([torch.tensor([127.0]), k, nextafter(k, 1000.0), nextafter(k, -1000.0)])
    out["denormals"] = torch.randn(515, generator=g) * 1e-40
    out["denormal scale"] = torch.tensor([1e-45, -3e-45, 7e-45, 0.0, 1.2e-38, -1e-40] * 21)
    out["below scale"] = torch.cat([torch.tensor([1e30]), torch.randn(300, generator=g) * 1e-10])
    out["huge"] = torch.randn(333, generator=g).clamp(-1, 1) * 3.4e38
    out["one"] = torch.tensor([-2.5])
    out["three"] = torch.tensor([0.1, -0.3, 0.0])
    out["empty"] = torch.zeros(0)
    return out


EDGES = edge_inputs()


# --- exactly today's bytes and values ----------------------------------------------------------------------
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("bs", [2, 16, 100, 128, 7])
@pytest.mark.parametrize("name", list(EDGES))
def test_nearest_bytes_and_values_equal_the_spec(codec, bs, name):
    x = EDGES[name]
    enc = encode(x, codec, bs)
    payload, scales = ref_encode(x, codec, bs)
    assert same(enc.payload, payload)
    assert same(enc.scales, scales)
    assert enc.numel == x.numel() and enc.codec == codec
    assert enc.block_size == (bs if get_codec(codec).scaled else 0)
    assert same(decode(enc), ref_decode(codec, x.numel(), payload, scales, bs))
    # the torch reference (the CUDA path) gives the same bytes and values on the CPU
    ref = codecs._encode_torch(x, get_codec(codec), bs, False, 0)
    assert same(ref.payload, payload) and same(ref.scales, scales)
    assert same(codecs._decode_torch(enc), decode(enc))


@pytest.mark.parametrize("codec", QUANTIZED)
@pytest.mark.parametrize("bs", [2, 64, 128, 9])
def test_any_bytes_decode_to_the_spec_values(codec, bs):
    """Decoding is defined on every byte pattern and any scale (negative, zero, denormal, huge)."""
    g = torch.Generator().manual_seed(bs)
    for n in (1, 2, 3, 127, 128, 129, 5001):
        nbytes, nscales = get_codec(codec).sizes(n, bs)
        payload = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        scales = torch.randn(nscales, generator=g) * torch.exp(torch.randn(nscales, generator=g) * 20)
        scales[::5] = 0.0
        scales[1::7] = 1e-44
        enc = Encoded(codec, n, payload, scales, bs)
        assert same(decode(enc), ref_decode(codec, n, payload, scales, bs))
        assert same(codecs._decode_torch(enc), ref_decode(codec, n, payload, scales, bs))


@pytest.mark.parametrize("codec", list(CODECS))
def test_decode_into_a_slice_of_a_buffer(codec):
    x = sample(1000)
    enc = encode(x, codec, 100)
    buf = torch.full((1300,), 7.0)
    out = decode(enc, out=buf[100:1100])
    assert out.data_ptr() == buf[100:].data_ptr()
    assert same(buf[100:1100], decode(enc))
    assert (buf[:100] == 7.0).all() and (buf[1100:] == 7.0).all()
    # the chunks of a split decode into their places
    buf2 = torch.empty(1000)
    for lo, part in split(enc, codecs.chunk_alignment(codec, 100) * 3):
        decode(part, out=buf2[lo : lo + part.numel])
    assert same(buf2, decode(enc))
    assert same(decode(concat([p for _, p in split(enc, 200)])), decode(enc))


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("bs", [128, 7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_accumulate_equals_add_with_alpha(codec, bs, dtype):
    g = torch.Generator().manual_seed(2)
    for n in (1, 3, 255, 4097):
        x = sample(n, seed=n)
        enc = encode(x, codec, bs)
        acc0 = torch.randn(n, generator=g, dtype=dtype)
        for weight in (0.3, 1.0, 7.0, 1e-3, 12345.678):
            want = acc0.clone().add_(decode(enc).to(dtype), alpha=weight)
            got = acc0.clone()
            accumulate(enc, got, weight)
            assert same(got, want), (n, weight)
        # and into a slice of a bigger accumulator
        big = torch.zeros(n + 10, dtype=dtype)
        accumulate(enc, big[5 : 5 + n], 0.5)
        assert same(big[5 : 5 + n], torch.zeros(n, dtype=dtype).add_(decode(enc).to(dtype), alpha=0.5))
        assert (big[:5] == 0).all() and (big[5 + n :] == 0).all()


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("bs", [128, 7])
def test_add_into_equals_add(codec, bs):
    g = torch.Generator().manual_seed(4)
    for n in (1, 3, 255, 4097):
        enc = encode(sample(n, seed=n), codec, bs)
        out0 = torch.randn(n, generator=g) * 1e-3
        got = out0.clone()
        add_into(enc, got)
        assert same(got, out0.clone().add_(decode(enc)))


# --- stochastic rounding ---------------------------------------------------------------------------------
def test_the_hash_is_lowbias32():
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    assert [codecs._hash32(x) for x in xs] == [lowbias32(x) for x in xs]
    assert codecs._hash32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]
    u = codecs._uniform_bits(0xDEADBEEF, 9, torch.device("cpu")).tolist()
    assert u == [lowbias32((i + lowbias32(0xDEADBEEF)) & 0xFFFFFFFF) for i in range(9)]


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("bs", [2, 128, 100])
def test_stochastic_kernels_equal_the_torch_reference(codec, bs):
    for name in ("random", "wide", "e3m0 ties", "denormals", "three", "empty"):
        x = EDGES[name]
        enc = encode(x, codec, bs, "stochastic", torch.Generator().manual_seed(5))
        seed = codecs._draw_seed(torch.Generator().manual_seed(5), torch.device("cpu"))
        ref = codecs._encode_torch(x, get_codec(codec), bs, True, seed)
        assert same(enc.payload, ref.payload) and same(enc.scales, ref.scales), name


@pytest.mark.parametrize("codec", ["bf16", "int8", "e3m0", "sq2"])
def test_stochastic_rounding_is_reproducible(codec):
    x = sample(3001)
    a = encode(x, codec, 128, "stochastic", torch.Generator().manual_seed(9))
    b = encode(x, codec, 128, "stochastic", torch.Generator().manual_seed(9))
    assert same(a.payload, b.payload) and same(a.scales, b.scales)
    g = torch.Generator().manual_seed(9)
    first, second = (encode(x, codec, 128, "stochastic", g) for _ in range(2))
    assert same(first.payload, a.payload) and not same(second.payload, a.payload)
    torch.manual_seed(1)
    c = encode(x, codec, 128, "stochastic")  # the default generator
    torch.manual_seed(1)
    assert same(encode(x, codec, 128, "stochastic").payload, c.payload)


def test_stochastic_e3m0_rounds_to_a_neighbouring_level():
    x = sample(20_000)
    scale = block_scales(x, 128)
    r = (decode(encode(x, "e3m0", 128, "stochastic", torch.Generator().manual_seed(0))) / scale).double()
    a = (x / scale).double()
    levels = E3M0_LEVELS.double()
    below = levels[(torch.bucketize(a.abs(), levels, right=True) - 1).clamp(0, 6)]
    above = levels[(torch.bucketize(a.abs(), levels, right=True)).clamp(1, 7)]
    assert ((r.abs() == below) | (r.abs() == above)).all()
    assert ((r == 0) | (r.sign() == a.sign())).all()


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


def test_stochastic_rounding_on_a_small_value_is_unbiased():
    """Below the smallest level (r < 2^-6) e3m0 rounds between 0 and 2^-6, and int8 near zero: still exact
    in expectation, over many seeds for one fixed value."""
    x = torch.tensor([1.0, 0.003, -0.0041, 0.25 + 2.0**-10])
    T = 20_000
    g = torch.Generator().manual_seed(2)
    for codec in ("e3m0", "int8"):
        ys = torch.stack([decode(encode(x, codec, 4, "stochastic", g)) for _ in range(T)]).double()
        gap = (ys.max(0).values - ys.min(0).values).clamp_min(1e-12)
        assert ((ys.mean(0) - x.double()).abs() <= 6 * gap / 2 / T**0.5).all(), codec


# --- error bounds, sizes, determinism (unchanged behaviour) ------------------------------------------------
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


def heavy_tailed(n=1 << 16, seed=0):
    """Student-t values with 3 degrees of freedom (finite variance, heavy tails), as outer gradients have."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g)
    chi2 = sum(torch.randn(n, generator=g) ** 2 for _ in range(3))
    return z / (chi2 / 3).sqrt()


def relative_mse(y, x):
    return float((y.double() - x.double()).square().sum() / x.double().square().sum())


@pytest.mark.parametrize("bs", [64, 128])
def test_sq2_error_bound_on_gaussian_and_heavy_tailed_values(bs):
    """sq2's relative MSE: measured 0.112 (Gaussian) and 0.25 (Student-t 3) at block 128, against e3m0's
    0.037 and 0.028 (two bits less per value); the Lloyd-Max bound on Gaussian values is 0.1175, which
    per-block statistics beat. The bounds below leave a little room and fail for a quantizer that is off."""
    gauss = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    heavy = heavy_tailed()
    assert relative_mse(decode(encode(gauss, "sq2", bs)), gauss) < 0.12
    assert relative_mse(decode(encode(heavy, "sq2", bs)), heavy) < 0.30
    assert relative_mse(decode(encode(gauss, "e3m0", bs)), gauss) < 0.05  # e3m0 beside it, 4 bits
    # a linear 2-bit quantizer (4 levels over the block's range) on the same values is far worse
    scale = block_scales(heavy, bs)
    linear = (torch.round((heavy / scale + 1) * 1.5).clamp(0, 3) / 1.5 - 1) * scale
    assert relative_mse(linear, heavy) > 2 * relative_mse(decode(encode(heavy, "sq2", bs)), heavy)


def test_sq2_values_are_their_bins_means():
    """Every decoded value is one of its block's 4 codebook entries, each entry is the mean of the values
    coded to it (to the grid's 2^-20 of the block's largest magnitude), so each block's sum is kept."""
    x = sample(1000)
    enc = encode(x, "sq2", 100)
    y = decode(enc)
    books = enc.scales.view(-1, 4)
    for b in range(10):
        xb, yb = x[b * 100 : (b + 1) * 100].double(), y[b * 100 : (b + 1) * 100]
        assert set(yb.tolist()) <= set(books[b].tolist())
        top = float(xb.abs().max())
        for v in yb.unique():
            assert abs(float(xb[yb == v].mean()) - float(v)) <= top * 2**-19
        assert abs(float(yb.double().sum() - xb.sum())) <= 100 * top * 2**-19
        # bins in order: the codes of larger values are not smaller
        order = xb.argsort()
        codes = torch.tensor([books[b].tolist().index(v) for v in yb[order].tolist()])
        assert (codes.diff() >= 0).all() or len(set(books[b].tolist())) < 4


def test_sq2_constant_and_single_value_blocks_are_kept_to_the_grid():
    """A block of one value is sent as that value to within the grid (2^-20 of it), exactly when the value
    needs few bits."""
    for x in (
        torch.full((256,), 0.375),
        torch.tensor([5.0]),
        torch.zeros(64),
        torch.full((4,), -(2.0**-140)),
    ):
        assert torch.equal(decode(encode(x, "sq2", 128)), x)
    for x in (torch.full((256,), 0.3), torch.full((130,), -7e-3), torch.full((9,), 3e-39)):
        assert ((decode(encode(x, "sq2", 128)) - x).abs() <= x.abs() * 2**-20).all()


def test_sq2_stochastic_rounding_is_unbiased_between_the_outer_means():
    """The codebook is the nearest rounding's (the same for every seed); a value between the lowest and the
    highest bin's means rounds to a neighbouring entry with the probability that makes it exact in
    expectation (a z-test per value, as for the other codecs); nearest rounding fails the pooled test."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    books = encode(x, "sq2", 256).scales
    inside = (x > books[0]) & (x < books[3])
    T = 2000
    g = torch.Generator().manual_seed(1)
    encs = [encode(x, "sq2", 256, "stochastic", g) for _ in range(T)]
    assert all(torch.equal(e.scales, books) for e in encs)
    ys = torch.stack([decode(e) for e in encs])[:, inside].double()
    xi = x[inside].double()
    gap = (ys.max(0).values - ys.min(0).values).clamp_min(1e-12)
    sigma = gap / 2 / T**0.5
    mean_err = ys.mean(0) - xi
    assert (mean_err.abs() <= 6 * sigma + 1e-7).all()
    pooled_sigma = (sigma**2).sum().sqrt() / len(xi)
    assert mean_err.mean().abs() <= 5 * pooled_sigma
    det = (decode(encode(x, "sq2", 256))[inside].double() - xi).abs()
    assert det.mean() > 10 * pooled_sigma  # nearest rounding's per-value error: far from exact


@pytest.mark.parametrize("bs", [252, 256, 1020, 1024, 4096])
def test_sq2_large_blocks_give_the_spec_bytes(bs):
    """Blocks whose grid sums pass 2^31 (from 2^10 values at the top of the grid, 2^8 of denormals): the
    kernel's sums do not overflow, the bytes are the spec's."""
    g = torch.Generator().manual_seed(bs)
    # random blocks, and blocks of values at the top of the grid (2^21 - 1 and 2^23 - 1 each)
    top, denormal = torch.full((2 * bs,), 2.0 - 2.0**-20), torch.full((2 * bs,), 2.0**-126 - 2.0**-149)
    for x in (
        torch.randn(3 * bs + 4, generator=g) * 1e3,
        torch.randn(3 * bs, generator=g) * 1e-39,
        top,
        denormal,
    ):
        enc = encode(x, "sq2", bs)
        payload, books = ref_sq2(x, bs)
        assert same(enc.payload, payload) and same(enc.scales, books)


def test_sq2_constants_and_limits():
    assert kernels.SQ2_EDGE == sq2.SQ2_EDGE and kernels.SQ2_GRID_BITS == sq2.SQ2_GRID_BITS
    assert get_codec("sq2").sizes(1001, 128) == (251, 32)  # 4 codes a byte, 4 fp32 per block
    assert get_codec("sq2").encoded_nbytes(1 << 20, 128) == (1 << 18) + 4 * 4 * 8192  # 2.5 bits a value
    with pytest.raises(ValueError, match="at most 65536"):
        encode(torch.zeros(10), "sq2", sq2.SQ2_MAX_BLOCK + 2)
    # the largest block's sums cannot overflow: 2^16 values at the largest grid value (2^23 for denormals)
    assert sq2.SQ2_MAX_BLOCK * (2**23) ** 2 < 2**63


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


@pytest.mark.parametrize("codec", ["int8", "e3m0", "sq2"])
def test_zero_blocks_and_odd_lengths(codec):
    x = torch.zeros(129)
    x[128] = 3.0
    y = decode(encode(x, codec, block_size=64))
    assert torch.equal(y, x)


def test_inputs_of_other_dtypes_and_layouts():
    x = sample(1000)
    want = encode(x, "e3m0")
    assert same(encode(x.double(), "e3m0").payload, want.payload)
    assert same(encode(x.view(10, 100), "e3m0").payload, want.payload)
    assert same(encode(torch.stack([x, x], 1)[:, 0], "e3m0").payload, want.payload)  # strided
    assert same(encode(x.clone().requires_grad_(), "e3m0").payload, want.payload)
    assert same(encode(x.bfloat16(), "int8").payload, encode(x.bfloat16().float(), "int8").payload)


def test_decoding_from_threads_at_once():
    """The CPU kernels release the GIL; concurrent calls give the same values as one at a time."""
    encs = [encode(sample(50_000, seed=i), "e3m0") for i in range(4)]
    want = [decode(e) for e in encs]
    got: list = [None] * 4
    acc = [torch.zeros(50_000, dtype=torch.float64) for _ in range(4)]

    def work(i):
        got[i] = decode(encs[i])
        for _ in range(5):
            accumulate(encs[i], acc[i], 0.5)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert same(got[i], want[i])
        assert same(acc[i], want[i].double() * 2.5)


# --- clear errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("bs", [128, 7])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_non_finite_values_are_refused(codec, bad, bs, rounding):
    for n, at in ((2, 1), (300, 0), (300, 299), (300, 150)):
        x = sample(n)
        x[at] = bad
        with pytest.raises(ValueError, match="non-finite"):
            encode(x, codec, bs, rounding)
        with pytest.raises(ValueError, match="non-finite"):
            codecs._encode_torch(x, get_codec(codec), bs, rounding == "stochastic", 1)


def test_unknown_codec_and_rounding():
    with pytest.raises(ValueError, match="unknown codec 'fp4'"):
        encode(torch.zeros(4), "fp4")
    with pytest.raises(ValueError, match="unknown rounding"):
        encode(torch.zeros(4), "e3m0", rounding="up")
    with pytest.raises(ValueError, match="block_size"):
        encode(torch.zeros(4), "e3m0", block_size=0)
    with pytest.raises(ValueError, match="unknown codec 'fp4'"):
        decode(Encoded("fp4", 4, torch.zeros(2, dtype=torch.uint8), torch.zeros(1)))


def test_malformed_encoded_is_refused_before_reading():
    enc = encode(sample(1000), "e3m0", 100)
    bad = {
        "short payload": Encoded("e3m0", 1000, enc.payload[:-1], enc.scales, 100),
        "long payload": Encoded("e3m0", 1000, torch.cat([enc.payload, enc.payload[:1]]), enc.scales, 100),
        "missing scales": Encoded("e3m0", 1000, enc.payload, enc.scales[:-1], 100),
        "wrong block size": Encoded("e3m0", 1000, enc.payload, enc.scales, 50),
        "zero block size": Encoded("e3m0", 1000, enc.payload, enc.scales, 0),
        "payload dtype": Encoded("e3m0", 1000, enc.payload.to(torch.int16), enc.scales, 100),
        "scales dtype": Encoded("e3m0", 1000, enc.payload, enc.scales.double(), 100),
        "numel": Encoded("e3m0", 1002, enc.payload, enc.scales, 100),
        "fp32 payload": Encoded("fp32", 10, torch.zeros(39, dtype=torch.uint8), torch.empty(0)),
    }
    for name, e in bad.items():
        with pytest.raises(ValueError):
            decode(e)
        with pytest.raises(ValueError):
            accumulate(e, torch.zeros(e.numel, dtype=torch.float64), 1.0)
        with pytest.raises(ValueError):
            add_into(e, torch.zeros(e.numel))
        assert name


def test_bad_targets_are_refused():
    enc = encode(sample(1000), "e3m0", 100)
    with pytest.raises(ValueError, match="1000 values"):
        decode(enc, out=torch.empty(999))
    with pytest.raises(ValueError, match="contiguous"):
        decode(enc, out=torch.empty(2000)[::2])
    with pytest.raises(ValueError, match="float32"):
        decode(enc, out=torch.empty(1000, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64 or torch.float32"):
        accumulate(enc, torch.empty(1000, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="float32"):
        add_into(enc, torch.empty(1000, dtype=torch.float64))


def test_torch_ops_alone_give_the_same_results(monkeypatch):
    """Without the kernels (no numba, or STREAMDILOCO_CODECS_NUMBA=0) everything runs on the torch ops."""
    monkeypatch.setattr(kernels, "_KERNELS", False)
    for codec in CODECS:
        for name in ("random", "e3m0 ties", "int8 ties", "denormals", "three"):
            x = EDGES[name]
            payload, scales = ref_encode(x, codec, 128)
            enc = encode(x, codec, 128)
            assert same(enc.payload, payload) and same(enc.scales, scales)
            assert same(decode(enc), ref_decode(codec, x.numel(), payload, scales, 128))
            acc = torch.ones(x.numel(), dtype=torch.float64)
            accumulate(enc, acc, 0.3)
            assert same(acc, torch.ones_like(acc).add_(decode(enc).double(), alpha=0.3))


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("rounding", list(ROUNDINGS))
def test_large_tensors_split_over_threads_give_the_same_bytes_and_values(monkeypatch, codec, rounding):
    """Above PARALLEL_VALUES the kernels run on ranges of whole blocks in several threads: the bytes, the
    stochastic stream and every decoded value are those of one pass over the whole (the torch reference)."""
    monkeypatch.setattr(codecs, "PARALLEL_VALUES", 1000)
    monkeypatch.setenv("STREAMDILOCO_CODEC_THREADS", "3")  # ranges that do not divide evenly
    for n, bs in ((100_003, 128), (5_001, 2), (4_096, 100)):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
        gen = torch.Generator().manual_seed(7)
        enc = encode(x, codec, bs, rounding, gen)
        seed = torch.randint(0, 1 << 32, (1,), generator=torch.Generator().manual_seed(7), dtype=torch.int64)
        ref = codecs._encode_torch(x, get_codec(codec), bs, rounding == "stochastic", int(seed))
        assert same(enc.payload, ref.payload) and same(enc.scales, ref.scales), (n, bs)
        want = codecs._decode_torch(ref)
        assert same(decode(enc), want)
        out = torch.full((n,), 0.5)
        add_into(enc, out)
        assert same(out, torch.full((n,), 0.5).add_(want))
        acc = torch.ones(n, dtype=torch.float64)
        accumulate(enc, acc, 0.3)
        assert same(acc, torch.ones(n, dtype=torch.float64).add_(want.double(), alpha=0.3))
    bad = torch.zeros(100_000)
    bad[77_777] = float("nan")  # in a later range: still refused
    with pytest.raises(ValueError, match="non-finite"):
        encode(bad, codec, 128, rounding)


@pytest.mark.parametrize("codec", list(CODECS))
def test_accumulate_overwrite_is_adding_to_zeros_and_divide_into_is_torch_div(codec):
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(4)) * 1e-3
    x[::7] = -0.0  # signed zeros: overwrite gives 0 + w * x, never -0
    enc = encode(x, codec, 128)
    for weight in (1.0, 0.3, 6144.0):
        got = torch.full((x.numel(),), float("nan"), dtype=torch.float64)  # not read
        accumulate(enc, got, weight, overwrite=True)
        want = torch.zeros(x.numel(), dtype=torch.float64)
        accumulate(enc, want, weight)
        assert same(got, want)
        out = torch.empty(x.numel())
        codecs.divide_into(got, 7.0 * weight, out)
        assert same(out, torch.div(got, 7.0 * weight).to(torch.float32))
    with pytest.raises(ValueError, match="10001 values"):
        codecs.divide_into(got, 2.0, torch.empty(10))


# --- CUDA: the same bytes and values as on the CPU (skipped without a GPU) ----------------------------------
@cuda
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("bs", [2, 128, 100, 7])
def test_cuda_encodes_the_cpu_bytes_where_the_tensor_lives(codec, bs):
    for name, x in EDGES.items():
        enc = encode(x.cuda(), codec, bs)
        assert enc.payload.device.type == "cuda" and enc.scales.device.type == "cuda", name
        cpu = encode(x, codec, bs)
        assert same(enc.payload, cpu.payload) and same(enc.scales, cpu.scales), name
        out = decode(enc)
        assert out.device.type == "cuda"
        assert same(out, decode(cpu)), name


@cuda
@pytest.mark.parametrize("codec", list(CODECS))
def test_cuda_decodes_any_bytes_to_the_cpu_values(codec):
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 128, 4097):
        nbytes, nscales = get_codec(codec).sizes(n, 64)
        payload = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        if codec in ("fp32", "bf16"):  # finite values only: NaN payloads need not keep their bits
            payload = encode(sample(n, seed=n) * 1e3, codec).payload
        scales = torch.randn(nscales, generator=g) * torch.exp(torch.randn(nscales, generator=g) * 20)
        scales[::3] = 1e-44
        bs = 64 if get_codec(codec).scaled else 0
        cpu = Encoded(codec, n, payload, scales if bs else torch.empty(0), bs)
        dev = Encoded(codec, n, payload.cuda(), cpu.scales.cuda(), bs)
        assert same(decode(dev), decode(cpu))
        out = torch.full((n + 2,), 5.0, device="cuda")
        decode(dev, out=out[1 : n + 1])
        assert same(out[1 : n + 1], decode(cpu))
        acc = torch.randn(n, generator=g, dtype=torch.float64)
        want = acc.clone()
        accumulate(cpu, want, 0.3)
        got = acc.cuda()
        accumulate(dev, got, 0.3)
        assert torch.allclose(got.cpu(), want, rtol=0, atol=1e-300) or same(got, want)
        mirror = torch.randn(n, generator=g)
        want32 = mirror.clone()
        add_into(cpu, want32)
        got32 = mirror.cuda()
        add_into(dev, got32)
        assert same(got32, want32)  # a + b in fp32 is one IEEE add everywhere


@cuda
@pytest.mark.parametrize("codec", ["bf16", "int8", "e3m0", "sq2"])
def test_cuda_stochastic_rounding_is_reproducible_and_matches_the_cpu_stream(codec):
    x = sample(5000)
    gpu_gen = torch.Generator(device="cuda")
    a = encode(x.cuda(), codec, 128, "stochastic", gpu_gen.manual_seed(3))
    b = encode(x.cuda(), codec, 128, "stochastic", gpu_gen.manual_seed(3))
    assert same(a.payload, b.payload)
    # a CPU generator draws the same seed for either device, and the stream is the same hash
    c = encode(x.cuda(), codec, 128, "stochastic", torch.Generator().manual_seed(3))
    d = encode(x, codec, 128, "stochastic", torch.Generator().manual_seed(3))
    assert c.payload.device.type == "cuda"
    assert same(c.payload, d.payload) and same(c.scales, d.scales)


@cuda
def test_cuda_refuses_non_finite_values_and_foreign_targets():
    x = sample(300).cuda()
    x[7] = float("nan")
    for codec in CODECS:
        with pytest.raises(ValueError, match="non-finite"):
            encode(x, codec)
    enc = encode(sample(300).cuda(), "e3m0")
    with pytest.raises(ValueError, match="move the bytes"):
        decode(enc, out=torch.empty(300))
