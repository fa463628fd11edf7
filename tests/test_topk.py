"""Chunked top-k (common/topk.py, the `topkK_C` codecs): what is kept, the format, the kernels against the
torch reference, sparse adds, bad input on both ends, and pushes and updates through a real shard with the
workers' mirrors equal to the masters bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from streamdiloco.common import topk
from streamdiloco.common.chunks import Assembly, ChunkError
from streamdiloco.common.codecs import (
    Encoded,
    accumulate,
    add_into,
    chunk_values,
    concat,
    decode,
    encode,
    get_codec,
    split,
    sumsq,
)
from streamdiloco.common.codecspec import canonical_codec
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.wire import from_chunk

NAMES = ["topk64_4096", "topk3_10", "topk1_2", "topk5_5", "topk256_4096"]
SIZES = [1, 9, 10, 4096, 4097, 50_001]
kernels = pytest.mark.skipif(topk.cpu_kernels() is None, reason="needs numba (the CPU kernels)")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-2


def _torch_bytes(
    x: torch.Tensor, name: str, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    from streamdiloco.common.codecs import _draw_seed, uniform_at

    s = _draw_seed(torch.Generator().manual_seed(seed), x.device) if stochastic else 0
    done = topk.encode_torch(x, get_codec(name), stochastic, s, uniform_at)
    assert done is not None
    return done


# --- what is kept ------------------------------------------------------------------------------------------
def test_names_parse_and_topk_alone_is_sparselocos_setting():
    spec = get_codec("topk64_4096")
    assert (spec.keep, spec.chunk, spec.index_bits, spec.sparse) == (64, 4096, 12, True)
    assert canonical_codec("topk") == "topk64_4096" and spec.density == 64 / 4096
    # 64 positions of 12 bits, 64 codes of 2 bits, a codebook of 4 fp32 for every 4096 values
    assert spec.encoded_nbytes(4096, 128) == 96 + 16 + 16
    assert spec.encoded_nbytes(4096 + 64, 128) == 128 + (1 * 12 + 7) // 8 + 1 + 16  # a last chunk keeps 1
    for bad in ("topk0_5", "topk6_5", "topk1_1", "topk1_70000", "top64_4096", "topk64_4096x"):
        with pytest.raises(ValueError, match="topk"):
            get_codec(bad)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", SIZES)
def test_each_chunk_keeps_its_largest_magnitudes_as_sq2_codebook_entries_and_zero_elsewhere(name, n):
    spec = get_codec(name)
    x = _x(n, n)
    enc = encode(x, name)
    assert enc.block_size == spec.chunk and enc.nbytes == spec.encoded_nbytes(n, 128)
    d = decode(enc)
    last = (n - 1) // spec.chunk * spec.chunk
    for c in sorted({*range(0, min(n, 40 * spec.chunk), spec.chunk), last}):  # the first 40 and the last
        xs, ds = x[c : c + spec.chunk], d[c : c + spec.chunk]
        k = spec.kept(xs.numel())
        want = set(torch.topk(xs.abs(), k).indices.tolist())  # no ties in random values
        got = set(ds.nonzero().flatten().tolist())
        assert got <= want  # a kept value may decode to 0 only through a zero codebook entry
        books = enc.scales[c // spec.chunk * 4 : c // spec.chunk * 4 + 4]
        assert all(v in books.tolist() for v in ds[sorted(want)].tolist())
        # 2-bit statistical quantization of the kept values: each lands in a bin near it
        kept = xs[sorted(want)]
        assert float((ds[sorted(want)] - kept).abs().max()) <= float(kept.abs().max())
    assert abs(sumsq(enc) - float(d.double().square().sum())) <= 1e-9 * max(1.0, sumsq(enc))


def test_ties_go_to_the_lower_position_and_the_signs_are_kept():
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 1.0, 0.0, 0.0])
    d = decode(encode(x, "topk3_8"))
    assert d.nonzero().flatten().tolist() == [1, 2, 4]
    assert d[1] < 0 < d[2] and d[4] < 0


# --- the kernels against the reference ----------------------------------------------------------------------
@kernels
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_cpu_kernels_write_the_reference_bytes_and_values(name, rounding):
    spec = get_codec(name)
    for n in SIZES:
        x = _x(n, 7 * n)
        enc = encode(x, name, 128, rounding, torch.Generator().manual_seed(3))
        payload, books = _torch_bytes(x, name, rounding == "stochastic", 3)
        assert torch.equal(enc.payload, payload) and torch.equal(enc.scales, books), (name, n)
        ref = torch.full((n,), 9.0)
        topk.apply_torch(enc.payload, enc.scales, spec, n, ref, 0.0, 0)
        assert torch.equal(decode(enc), ref)
        for dtype, w in ((torch.float64, 0.37), (torch.float32, -1.5)):
            acc = torch.randn(n, dtype=dtype)
            want = acc.clone()
            topk.apply_torch(enc.payload, enc.scales, spec, n, want, w, 1)
            accumulate(enc, acc, w)
            assert torch.equal(acc, want)
        mirror = _x(n, 5)
        want = mirror.clone()
        topk.apply_torch(enc.payload, enc.scales, spec, n, want, 1.0, 1)
        add_into(enc, mirror)
        assert torch.equal(mirror.view(torch.int32), want.view(torch.int32))
        assert sumsq(enc) == pytest.approx(topk.sumsq_torch(enc.payload, enc.scales, spec, n), rel=1e-12)


def test_stochastic_rounding_is_unbiased_on_the_kept_values_within_the_codebooks_range():
    """As sq2's: unbiased between the outer codebook entries (a value beyond them goes to the outer one)."""
    x = _x(4096, 11)
    encs = [encode(x, "topk64_4096", 128, "stochastic", torch.Generator().manual_seed(s)) for s in range(400)]
    assert len({bytes(e.payload.numpy()) for e in encs}) > 100  # the rounding differs from seed to seed
    runs = torch.stack([decode(e) for e in encs])
    books = encs[0].scales
    kept = (runs[0] != 0) & (x > books.min()) & (x < books.max())
    assert int(kept.sum()) > 30
    err = (runs.mean(dim=0)[kept] - x[kept]).abs().max()
    assert float(err) < 0.1 * float(books.max() - books.min())


# --- sparse adds --------------------------------------------------------------------------------------------
def test_adds_touch_only_the_kept_positions():
    """acc += w * decode: the positions not kept keep their exact bits, -0.0 included (the shard adds M sparse
    pushes into one accumulator without densifying them)."""
    x = _x(8192, 2)
    enc = encode(x, "topk64_4096")
    acc = torch.full((8192,), -0.0, dtype=torch.float64)
    acc[::3] = 1.25
    before = acc.clone()
    accumulate(enc, acc, 0.5)
    kept = decode(enc) != 0
    assert torch.equal(acc[~kept].view(torch.int64), before[~kept].view(torch.int64))
    assert int(kept.sum()) == 128 and not torch.equal(acc[kept], before[kept])
    over = torch.full((8192,), 7.0, dtype=torch.float64)
    accumulate(enc, over, 0.5, overwrite=True)  # as if zeros
    assert torch.equal(over, 0.5 * decode(enc).double())


@pytest.mark.parametrize("name", ["topk64_4096", "topk3_10"])
def test_split_pieces_decode_to_the_whole_and_join_back(name):
    x = _x(3 * 4096 + 100, 4)
    enc = encode(x, name)
    per = chunk_values(name, 128, 200)
    parts = split(enc, per)
    assert len(parts) > 2 and all(p.numel % get_codec(name).chunk == 0 for _, p in parts[:-1])
    whole = decode(enc)
    for at, p in parts:
        assert torch.equal(decode(p), whole[at : at + p.numel])
    joined = concat([p for _, p in parts])
    assert torch.equal(joined.payload, enc.payload) and torch.equal(joined.scales, enc.scales)


# --- bad input ----------------------------------------------------------------------------------------------
def _positions(enc: Encoded, chunk: int, values: list[int]) -> Encoded:
    """enc with chunk `chunk`'s positions replaced by `values` (packed as the format packs them)."""
    spec = get_codec(enc.codec)
    full = spec.block_payload(spec.chunk)
    m = min(spec.chunk, enc.numel - chunk * spec.chunk)
    nib = (spec.kept(m) * spec.index_bits + 7) // 8
    packed = topk._pack_bits(torch.tensor([values]), spec.index_bits)[0]
    payload = enc.payload.clone()
    payload[chunk * full : chunk * full + nib] = packed
    return Encoded(enc.codec, enc.numel, payload, enc.scales, enc.block_size)


BAD_POSITIONS = {
    "repeated": lambda k: [0, 0] + list(range(2, k)),
    "unsorted": lambda k: [1, 0] + list(range(2, k)),
    "out of range": lambda k: list(range(k - 1)) + [4095],  # chunk 2 holds 100 values
}


@pytest.mark.parametrize("case", list(BAD_POSITIONS))
def test_bad_positions_are_refused_by_decode_and_by_the_assembly_with_nothing_added(case):
    spec = get_codec("topk64_4096")
    x = _x(2 * 4096 + 100, 8)
    enc = encode(x, spec.name)
    bad = _positions(enc, 2, BAD_POSITIONS[case](spec.kept(100)))
    if case != "out of range":
        bad = _positions(enc, 1, BAD_POSITIONS[case](64))
    with pytest.raises(ValueError, match="strictly ascending and below"):
        decode(bad)
    with pytest.raises(ValueError, match="strictly ascending and below"):
        accumulate(bad, torch.zeros(bad.numel, dtype=torch.float64), 1.0)
    asm = Assembly(bad.numel, spec.name, 128)
    good_parts, bad_parts = split(enc, 4096), split(bad, 4096)
    asm.add(0, 0, bad.numel, good_parts[0][1], False)
    seq = 1 if case != "out of range" else 2
    if seq == 2:
        asm.add(1, 4096, bad.numel, good_parts[1][1], False)
    with pytest.raises(ChunkError, match="strictly ascending and below") as e:
        asm.add(seq, seq * 4096, bad.numel, bad_parts[seq][1], seq == 2)
    assert e.value.reason == "bad_value" and asm.received == seq * 4096  # nothing of it taken


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3e30])
def test_a_bad_codebook_is_refused(bad):
    enc = encode(_x(8192, 9), "topk64_4096")
    books = enc.scales.clone()
    books[5] = bad
    asm = Assembly(8192, "topk64_4096", 128)
    with pytest.raises(ChunkError) as e:
        asm.add(0, 0, 8192, Encoded(enc.codec, 8192, enc.payload, books, 4096), True)
    assert e.value.reason == "bad_scale" and "codebook value" in str(e.value) and asm.received == 0


def test_a_payload_longer_or_shorter_than_its_count_or_another_chunk_size_is_refused():
    enc = encode(_x(8192, 10), "topk64_4096")
    for payload in (enc.payload[:-1], torch.cat([enc.payload, enc.payload[:1]])):
        asm = Assembly(8192, "topk64_4096", 128)
        with pytest.raises(ChunkError) as e:
            asm.add(0, 0, 8192, Encoded(enc.codec, 8192, payload, enc.scales, 4096), True)
        assert e.value.reason == "bad_length" and asm.received == 0
    asm = Assembly(8192, "topk64_4096", 128)
    with pytest.raises(ChunkError) as e:  # a count that does not match the bytes
        asm.add(0, 0, 8192, Encoded(enc.codec, 8000, enc.payload, enc.scales, 4096), False)
    assert e.value.reason == "bad_length"
    with pytest.raises(ChunkError) as e:
        asm.add(0, 0, 8192, Encoded(enc.codec, 8192, enc.payload, enc.scales, 128), True)
    assert e.value.reason == "bad_codec" and "block size must be 4096" in str(e.value)
    with pytest.raises(ChunkError) as e:  # another density than the run's
        asm.add(0, 0, 8192, encode(_x(8192, 10), "topk65_4096"), True)
    assert e.value.reason == "bad_codec" and "topk64_4096" in str(e.value)
    with pytest.raises(ValueError, match="not a multiple of 4096"):
        split(enc, 2048)


def test_non_finite_values_are_refused_at_encode():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = _x(5000, 1)
        x[4500] = bad
        with pytest.raises(ValueError, match="non-finite"):
            encode(x, "topk64_4096")


def test_the_settings_take_topk_names_and_say_what_is_wrong_in_one_line():
    cfg = SyncConfig(uplink_codec="topk", downlink_codec="sq2")
    assert cfg.uplink_codec == "topk64_4096" and cfg.uplink_decay == 0.9
    with pytest.raises(ValueError, match=r"topk9_8: top-k keeps K of every C values with 1 <= K <= C"):
        SyncConfig(uplink_codec="topk9_8")
    with pytest.raises(ValueError, match=r"unknown downlink_codec 'topk_64'"):
        SyncConfig(downlink_codec="topk_64")


def test_a_worker_with_another_density_or_chunk_is_told_at_join_which_setting_differs():
    from streamdiloco.common.fingerprint import fingerprint_diff, model_fingerprint
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.worker.model import build_gpt

    layout = build_layout(build_gpt("nano"), 3)
    shard = model_fingerprint(layout, SyncConfig(sync_every=6, num_fragments=3, uplink_codec="topk"))
    for mine in ("topk256_4096", "topk64_2048", "sq2"):
        worker = model_fingerprint(layout, SyncConfig(sync_every=6, num_fragments=3, uplink_codec=mine))
        said = fingerprint_diff(worker, shard)
        assert said and said.endswith(
            f"uplink_codec is {mine!r} on the worker, 'topk64_4096' on the server"
        ), said
    same = model_fingerprint(layout, SyncConfig(sync_every=6, num_fragments=3, uplink_codec="topk64_4096"))
    assert fingerprint_diff(same, shard) is None  # `topk` is its canonical name


# --- through a real shard -------------------------------------------------------------------------------
def _shard(tmp_path, shards, up: str, down: str):
    import json

    from tests.support.inthread import InThreadShard
    from tests.support.nano_shard import fingerprint
    from tests.support.shards import shard_of

    cfg = SyncConfig(sync_every=6, num_fragments=3, uplink_codec=up, downlink_codec=down)
    service = shard_of(cfg, "nano", shard=0, num_shards=2, min_workers=2, round_timeout=30.0, chunk_bytes=256)
    return shards.add(InThreadShard(service, tmp_path, json.dumps(fingerprint(cfg)))), cfg


@pytest.mark.parametrize(
    "up, down", [("topk64_4096", "sq2"), ("topk256_4096", "e3m0"), ("topk64_4096", "topk512_4096")]
)
def test_topk_pushes_through_a_real_shard_keep_mirrors_bit_identical(tmp_path, shards, up, down):
    """Two workers push top-k slices through the shard's gRPC edge (several chunks each); the round closes
    and each gets the update in the downlink codec, which its Assembly adds into its mirror: the mirror equals
    the shard's new master to the bit, and the master equals ShardState's for the same pushes."""
    from streamdiloco.common.fragments import build_layout, flatten, fragment_params
    from streamdiloco.server.rounds.state import ShardState
    from streamdiloco.worker.model import build_gpt
    from tests.support.inthread import push_messages
    from tests.support.nano_shard import delta

    shard, cfg = _shard(tmp_path, shards, up, down)
    st = shard.service.state
    lo, hi = st.ranges[0]
    mirror = shard.on_loop(lambda: st.master(0).clone())
    torch.manual_seed(0)  # the shard's model (tests/support/shards.py)
    model = build_gpt("nano")
    layout = build_layout(model, 3)
    initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
    ref = ShardState(0, 2, layout, cfg, initial, 0, 1)
    for name in ("a", "b"):
        ref.add_member(name)
    assert torch.equal(ref.master(0), mirror)
    a, b = shard.worker("a"), shard.worker("b")
    for w, seed in ((a, 1), (b, 2)):
        enc = encode(delta(seed, hi - lo), up, cfg.codec_block_size)
        w.push(push_messages(enc, weight=100.0, loss=3.0, values_per_chunk=get_codec(up).chunk))
        assert w.session.result().accepted
        ref.push(w.name, 0, 0, enc, 100.0, 3.0)
    ref.close_round(0)
    updates = {w.name: w.session.update() for w in (a, b)}
    master = shard.on_loop(lambda: st.master(0).clone())
    assert torch.equal(master, ref.master(0)) and not torch.equal(master, mirror)
    block = get_codec(down).block(cfg.codec_block_size)
    for w in (a, b):
        chunks_in = updates[w.name]
        assert chunks_in and all(c.codec == down and c.block_size == block for c in chunks_in)
        asm = Assembly(mirror.numel(), down, cfg.codec_block_size, what="update", role="downlink")
        for c in chunks_in:
            asm.add(c.seq, c.offset, c.total, from_chunk(c), c.last)
        mine = mirror.clone()
        asm.add_into(mine)
        assert torch.equal(mine.view(torch.int32), master.view(torch.int32)), w.name


def test_a_topk_push_with_a_repeated_position_is_refused_by_the_shard_and_nothing_is_folded(tmp_path, shards):
    from tests.support.inthread import push_messages
    from tests.support.nano_shard import delta

    shard, cfg = _shard(tmp_path, shards, "topk64_4096", "sq2")
    lo, hi = shard.service.state.ranges[0]
    a, _ = shard.worker("a"), shard.worker("b")
    enc = encode(delta(1, hi - lo), "topk64_4096")
    assert enc.numel > 2 * 4096
    before = shard.snapshot()
    a.push(push_messages(_positions(enc, 1, [5, 5] + list(range(6, 68))), values_per_chunk=4096))
    r = a.session.result()
    assert (r.accepted, r.reason) == (False, "bad_value") and "strictly ascending" in r.message, r.message
    shard.quiesce(a)
    assert shard.snapshot() == before
    a.push(push_messages(enc, values_per_chunk=4096))
    assert a.session.result().accepted


# --- CUDA -------------------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("name", ["topk64_4096", "topk3_10"])
def test_cuda_writes_the_cpu_bytes_and_adds_the_cpu_values(name):
    for n in SIZES:
        x = _x(n, n)
        cpu = encode(x, name)
        dev = encode(x.cuda(), name)
        assert dev.payload.device.type == "cuda"
        assert torch.equal(dev.payload.cpu(), cpu.payload) and torch.equal(dev.scales.cpu(), cpu.scales)
        acc = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        acc_dev = acc.cuda()
        accumulate(cpu, acc, 0.3)
        accumulate(dev, acc_dev, 0.3)
        assert torch.equal(acc_dev.cpu(), acc)


# --- fuzzing the format on both ends --------------------------------------------------------------------
FUZZ_CASES = 400
CHUNK_REASONS = {"bad_chunk", "bad_offset", "bad_length", "bad_codec", "bad_scale", "bad_value"}


def _mutate(rng, c, spec) -> str:
    """One random change to a wire Chunk of a top-k slice; its name."""
    import struct

    what = rng.choice(
        ["flip", "random", "cut", "grow", "book", "numel", "block", "codec", "positions", "none"]
    )
    p = bytearray(c.payload)
    if what == "flip" and p:
        for _ in range(rng.randint(1, 8)):
            p[rng.randrange(len(p))] ^= 1 << rng.randrange(8)
    elif what == "random":
        p = bytearray(rng.randbytes(len(p)))
    elif what == "cut" and p:
        del p[rng.randrange(len(p)) :]
    elif what == "grow":
        p += rng.randbytes(rng.randint(1, 300))
    elif what == "book":
        books = bytearray(c.scales)
        at = 4 * rng.randrange(max(1, len(books) // 4))
        books[at : at + 4] = struct.pack(
            "<f", rng.choice([math.nan, math.inf, -math.inf, 3e30, -1e31, 0.0, 1e-3])
        )
        c.scales = bytes(books)
    elif what == "numel":
        c.numel = max(0, c.numel + rng.choice([-4096, -1, 1, 4096, 2**40]))
    elif what == "block":
        c.block_size = rng.choice([0, 1, 128, 4095, 4097, 2**32 - 1])
    elif what == "codec":
        c.codec = rng.choice(["topk", "topk65_4096", "topk64_4097", "sq2", "e3m0", "", "topk64_4096\x00"])
    elif what == "positions" and c.numel:  # valid-looking positions, random but ascending
        m = min(spec.chunk, c.numel)
        pos = sorted(rng.sample(range(m), spec.kept(m)))
        nib = (spec.kept(m) * spec.index_bits + 7) // 8
        p[:nib] = bytes(topk._pack_bits(torch.tensor([pos]), spec.index_bits)[0].tolist())
    c.payload = bytes(p)
    return what


@pytest.mark.parametrize("role", ["uplink", "downlink"])
def test_fuzzed_topk_chunks_are_refused_cleanly_or_decode_to_bounded_values(role):
    """Seeded mutations of a top-k slice's wire chunks, taken the way the shard takes a push and the worker
    an update (wire Chunk -> from_chunk -> Assembly): each is refused with a chunk reason and a one-line
    message, changing nothing of what was assembled, or taken, and then whatever was taken decodes, adds
    and accumulates to finite values within the bound, never writing outside its slice."""
    import random

    from streamdiloco.common.chunks import MAX_ABS_VALUE
    from streamdiloco.common.wire import to_chunks

    spec = get_codec("topk64_4096")
    n = 3 * 4096 + 777
    enc = encode(_x(n, 21), spec.name)
    rng = random.Random(1125 + (role == "downlink"))
    refused = taken = 0
    for case in range(FUZZ_CASES):
        chunks_out = to_chunks(enc, 0, 0, 4096)
        asm = Assembly(n, spec.name, 128, role=role, what="push" if role == "uplink" else "update")
        target = rng.randrange(len(chunks_out))
        what = _mutate(rng, chunks_out[target], spec)
        for c in chunks_out:
            before = asm.received
            try:
                asm.add(c.seq, c.offset, c.total, from_chunk(c), c.last)
            except ChunkError as e:
                assert e.reason in CHUNK_REASONS and "\n" not in str(e) and len(str(e)) < 400, (case, what, e)
                assert asm.received == before, (case, what)
                refused += 1
                break
            except ValueError as e:  # from_chunk: scales that are not whole fp32 numbers
                assert "whole fp32" in str(e), (case, what, e)
                refused += 1
                break
        else:
            taken += 1
            guard = torch.full((n + 8,), 5.0, dtype=torch.float64)
            acc = guard[4 : 4 + n]
            asm.accumulate_into(acc, 0.5)
            assert torch.equal(guard[:4], torch.full((4,), 5.0, dtype=torch.float64)), (case, what)
            assert torch.equal(guard[-4:], torch.full((4,), 5.0, dtype=torch.float64)), (case, what)
            out = torch.empty(n)
            asm.decode_into(out)
            assert bool(torch.isfinite(out).all()) and float(out.abs().max()) <= MAX_ABS_VALUE, (case, what)
            assert int((out != 0).sum()) <= sum(
                spec.kept(min(spec.chunk, n - c)) for c in range(0, n, spec.chunk)
            )
    assert refused > FUZZ_CASES // 3 and taken > 20, (
        refused,
        taken,
    )  # both sides of the check were exercised
