"""The chunk assembler (common/chunks.py) on its own: slices reassemble exactly in every codec and decode
straight into place; every bad chunk is refused with its reason and changes nothing."""

from __future__ import annotations

import pytest
import torch

from streamdiloco.common.chunks import MAX_ABS_VALUE, Assembly, ChunkError, MasterAssembly
from streamdiloco.common.codecs import CODECS, Encoded, chunk_alignment, decode, encode, split
from streamdiloco.common.wire import bytes_to_values, from_chunk, to_chunks, values_to_bytes

BS = 16


def values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


def wire_chunks(enc: Encoded, per: int) -> list[tuple]:
    """(seq, offset, total, part, last) as a receiver gets them: through the wire's messages and back."""
    return [(c.seq, c.offset, c.total, from_chunk(c), c.last) for c in to_chunks(enc, 0, 0, per)]


def assemble(enc: Encoded, per: int, **kw) -> Assembly:
    asm = Assembly(enc.numel, enc.codec, BS, **kw)
    answers = [asm.add(*c) for c in wire_chunks(enc, per)]
    assert answers == [False] * (len(answers) - 1) + [True] and asm.done
    return asm


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_slice_reassembles_exactly_and_decodes_into_place(codec):
    align = chunk_alignment(codec, BS)
    for n in (1, BS - 1, BS + 1, 1001):
        enc = encode(values(n), codec, BS)
        whole = decode(enc)
        for per in (align, 3 * align, 10**6 // align * align):
            asm = assemble(enc, per)
            assert asm.received == n and asm.nbytes == enc.nbytes and asm.next_seq == len(split(enc, per))
            back = asm.encoded()
            assert torch.equal(back.payload, enc.payload) and torch.equal(back.scales, enc.scales)
            out = torch.full((n,), 7.0)
            asm.decode_into(out)
            assert torch.equal(out, whole)
            base = values(n, 1)
            mirror = base.clone()
            asm.add_into(mirror)
            assert torch.equal(mirror, base + whole)
            acc = torch.ones(n, dtype=torch.float64)
            asm.accumulate_into(acc, 3.0)
            assert torch.equal(acc, 1.0 + 3.0 * whole.double())


@pytest.mark.parametrize("codec", ["e3m0", "int8", "fp32"])
def test_pieces_of_any_aligned_range_cross_chunk_boundaries(codec):
    n, align = 1001, chunk_alignment(codec, BS)
    enc = encode(values(n), codec, BS)
    whole = decode(enc)
    asm = assemble(enc, 5 * align)
    for lo, hi in (
        (0, n),
        (align, 7 * align),
        (4 * align, 6 * align),
        (9 * align, n),
        (n // align * align, n),
    ):
        got = torch.zeros(hi - lo)
        asm.decode_into(got, lo)
        assert torch.equal(got, whole[lo:hi]), (lo, hi)
        acc = torch.zeros(hi - lo, dtype=torch.float64)
        asm.accumulate_into(acc, 0.5, lo)
        assert torch.equal(acc, 0.5 * whole[lo:hi].double())
        assert sum(p.numel for _, p in asm.pieces(lo, hi)) == hi - lo
    if align > 1:
        with pytest.raises(ValueError, match="multiples of"):
            list(asm.pieces(1, 2 * align))


def test_a_partial_slice_can_be_used_as_far_as_it_has_arrived():
    enc = encode(values(1001), "e3m0", BS)
    asm = Assembly(enc.numel, "e3m0", BS)
    for c in wire_chunks(enc, 64)[:3]:
        asm.add(*c)
    assert not asm.done and asm.received == 192
    got = torch.zeros(192)
    asm.decode_into(got)
    assert torch.equal(got, decode(enc)[:192])
    with pytest.raises(ValueError, match="incomplete: 192 of 1001"):
        asm.encoded()


# --- refusals --------------------------------------------------------------------------------------------
def _with(c: tuple, **kw) -> tuple:
    seq, offset, total, part, last = c
    d = {"seq": seq, "offset": offset, "total": total, "part": part, "last": last, **kw}
    return d["seq"], d["offset"], d["total"], d["part"], d["last"]


def _part(part: Encoded, **kw) -> Encoded:
    d = {"codec": part.codec, "numel": part.numel, "payload": part.payload, "scales": part.scales}
    d |= {"block_size": part.block_size, **kw}
    return Encoded(**d)


def _scale(part: Encoded, value: float) -> Encoded:
    scales = part.scales.clone()
    scales[len(scales) // 2] = value
    return _part(part, scales=scales)


ENC = encode(values(1001), "e3m0", BS)
CS = wire_chunks(ENC, 128)  # 8 chunks

REFUSALS = {
    # name: (chunks before, the bad chunk, reason, message)
    "no-start": ([], CS[1], "bad_chunk", "a push starts with chunk 0 at offset 0, got chunk 1 at 128"),
    "start-offset": ([], _with(CS[0], offset=32), "bad_chunk", "a push starts with chunk 0 at offset 0"),
    "repeated": (CS[:2], CS[1], "bad_chunk", "chunk 1 repeated (next expected is 2)"),
    "skipped": (CS[:2], CS[3], "bad_chunk", "chunk out of order: expected chunk 2"),
    "offset": (CS[:2], _with(CS[2], offset=288), "bad_offset", "offset 288, expected 256"),
    "total": (
        CS[:1],
        _with(CS[1], total=1002),
        "bad_length",
        "the slice has 1001 values, the push says 1002",
    ),
    "codec": ([], _with(CS[0], part=_part(CS[0][3], codec="int8")), "bad_codec", "uplink codec is e3m0"),
    "unknown-codec": ([], _with(CS[0], part=_part(CS[0][3], codec="fp8")), "bad_codec", "got 'fp8'"),
    "block-size": ([], _with(CS[0], part=_part(CS[0][3], block_size=32)), "bad_codec", "must be 16, got 32"),
    "past-end": (
        CS[:7],
        _with(CS[7], part=_part(CS[7][3], numel=CS[7][3].numel + 32)),
        "bad_length",
        "values [896, 1033) do not fit a 1001-value slice",
    ),
    "early-last": (
        CS[:1],
        _with(CS[1], last=True),
        "bad_length",
        "chunk ends at 256 of 1001 but last is true",
    ),
    "late-last": (
        CS[:7],
        _with(CS[7], last=False),
        "bad_length",
        "chunk ends at 1001 of 1001 but last is false",
    ),
    "misaligned": (
        [],
        _with(CS[0], part=_part(CS[0][3], numel=100)),
        "bad_length",
        "a chunk other than the last must hold a multiple of 16 values, got 100",
    ),
    "payload-short": (
        [],
        _with(CS[0], part=_part(CS[0][3], payload=CS[0][3].payload[:-1])),
        "bad_length",
        "128 e3m0 values need 64 payload bytes and 8 scales, got 63 and 8",
    ),
    "scales-missing": (
        [],
        _with(CS[0], part=_part(CS[0][3], scales=torch.empty(0))),
        "bad_length",
        "got 64 and 0",
    ),
    "scale-nan": ([], _with(CS[0], part=_scale(CS[0][3], float("nan"))), "bad_scale", "non-finite scale"),
    "scale-inf": ([], _with(CS[0], part=_scale(CS[0][3], -float("inf"))), "bad_scale", "non-finite scale"),
    "scale-huge": (
        [],
        _with(CS[0], part=_scale(CS[0][3], 3e38)),
        "bad_scale",
        "the chunk's scales allow values up to 3e+38, above 1e+30",
    ),
    "after-last": (CS, _with(CS[7], seq=8, offset=1001), "bad_chunk", "chunk 8 after the last chunk"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_a_bad_chunk_is_refused_with_its_reason_and_changes_nothing(case):
    before, bad, reason, words = REFUSALS[case]
    asm = Assembly(1001, "e3m0", BS)
    for c in before:
        asm.add(*c)
    state = (list(asm.parts), asm.received, asm.nbytes)
    with pytest.raises(ChunkError) as e:
        asm.add(*bad)
    assert e.value.reason == reason and words in str(e.value), str(e.value)
    assert (list(asm.parts), asm.received, asm.nbytes) == state


SQ2 = encode(values(1001, seed=5), "sq2", BS)
SQ2_CS = wire_chunks(SQ2, 128)  # 8 chunks of 128 values: 32 payload bytes and 32 codebook values each

SQ2_REFUSALS = {
    "codebook-nan": (_scale(SQ2_CS[1][3], float("nan")), "bad_scale", "non-finite codebook value"),
    "codebook-inf": (_scale(SQ2_CS[1][3], float("inf")), "bad_scale", "non-finite codebook value"),
    "codebook-huge": (
        _scale(SQ2_CS[1][3], -2e30),
        "bad_scale",
        "the chunk's codebook values allow values up to 2e+30, above 1e+30",
    ),
    "payload-short": (
        _part(SQ2_CS[1][3], payload=SQ2_CS[1][3].payload[:-1]),
        "bad_length",
        "128 sq2 values need 32 payload bytes and 32 scales, got 31 and 32",
    ),
    "payload-long": (
        _part(SQ2_CS[1][3], payload=torch.cat([SQ2_CS[1][3].payload, SQ2_CS[1][3].payload[:1]])),
        "bad_length",
        "got 33 and 32",
    ),
    "codebook-short": (  # 3 entries for the last block
        _part(SQ2_CS[1][3], scales=SQ2_CS[1][3].scales[:-1]),
        "bad_length",
        "got 32 and 31",
    ),
    "count-mismatch": (  # the chunk says 124 values (aligned to 4, not to the block)
        _part(SQ2_CS[1][3], numel=124),
        "bad_length",
        "a chunk other than the last must hold a multiple of 16 values, got 124",
    ),
}


@pytest.mark.parametrize("role", ["uplink", "downlink"])
@pytest.mark.parametrize("case", list(SQ2_REFUSALS), ids=list(SQ2_REFUSALS))
def test_a_bad_sq2_chunk_is_refused_on_either_end_and_changes_nothing(case, role):
    """A worker's push (the shard's uplink) and a shard's update (the worker's downlink) alike: a codebook
    with NaN, inf or past the value bound, a payload or codebook longer or shorter than the chunk's count
    says, a count that does not match the chunk: refused with the reason, the assembly as it was."""
    bad, reason, words = SQ2_REFUSALS[case]
    asm = Assembly(1001, "sq2", BS, what="push" if role == "uplink" else "update", role=role)
    asm.add(*SQ2_CS[0])
    state = (list(asm.parts), asm.received, asm.nbytes)
    with pytest.raises(ChunkError) as e:
        asm.add(*_with(SQ2_CS[1], part=bad))
    assert e.value.reason == reason and words in str(e.value), str(e.value)
    assert (list(asm.parts), asm.received, asm.nbytes) == state
    for c in SQ2_CS[1:]:  # the good chunk is taken after the bad one
        asm.add(*c)
    out = torch.empty(1001)
    asm.decode_into(out)
    assert torch.equal(out, decode(SQ2))


def test_bent_sq2_chunks_are_refused_or_decode_to_bounded_values():
    """A small fuzzer of the sq2 format: chunk 2 of a push bent at random (payload bytes, codebook values
    and counts, numel, block size, several at once): the assembly either refuses it with a ChunkError and
    is unchanged, or takes it, and then every value it decodes is finite and within the bound."""
    import random

    rng = random.Random(38)
    weird = [float("nan"), float("inf"), -float("inf"), 1e30, 1.01e30, 3.4e38, -0.0, 1e-45, 1.0]
    for _ in range(300):
        good = SQ2_CS[2][3]
        kw: dict = {}
        for what in rng.sample(["payload", "scales", "numel", "block_size", "values"], rng.randint(1, 3)):
            if what == "payload":
                n = max(0, good.payload.numel() + rng.choice([-3, -1, 0, 1, 4]))
                kw["payload"] = torch.randint(0, 256, (n,), dtype=torch.uint8)
            elif what == "scales":
                n = max(0, good.scales.numel() + rng.choice([-4, -1, 0, 1, 4]))
                kw["scales"] = torch.tensor([rng.choice(weird) for _ in range(n)], dtype=torch.float32)
            elif what == "values":
                books = good.scales.clone()
                books[rng.randrange(books.numel())] = rng.choice(weird)
                kw["scales"] = books
            elif what == "numel":
                kw["numel"] = max(0, good.numel + rng.choice([-128, -4, -1, 1, 4, 16, 128]))
            else:
                kw["block_size"] = rng.choice([0, 8, 32, 128])
        asm = Assembly(1001, "sq2", BS, role=rng.choice(["uplink", "downlink"]))
        asm.add(*SQ2_CS[0])
        asm.add(*SQ2_CS[1])
        state = (list(asm.parts), asm.received, asm.nbytes)
        try:
            asm.add(*_with(SQ2_CS[2], part=_part(good, **kw)))
        except ChunkError:
            assert (list(asm.parts), asm.received, asm.nbytes) == state, kw
            continue
        got = torch.empty(asm.received)
        asm.decode_into(got)
        assert torch.isfinite(got).all() and got.abs().max() <= MAX_ABS_VALUE, kw


def test_int8_scales_count_the_largest_level():
    enc = encode(values(64), "int8", BS)
    big = Encoded("int8", 64, enc.payload, torch.full_like(enc.scales, 1e29), BS)
    with pytest.raises(ChunkError, match="allow values up to 1.27e\\+31") as e:
        Assembly(64, "int8", BS).add(0, 0, 64, big, True)
    assert e.value.reason == "bad_scale"


@pytest.mark.parametrize("bad, words", [(float("nan"), "non-finite values"), (3e38, r"values above 1e\+30")])
def test_unscaled_values_must_be_finite_and_bounded(bad, words):
    x = values(100)
    x[50] = bad
    enc = Encoded("fp32", 100, x.view(torch.uint8).clone(), torch.empty(0), 0)
    with pytest.raises(ChunkError, match=words) as e:
        Assembly(100, "fp32", BS).add(0, 0, 100, enc, True)
    assert e.value.reason == "bad_value"
    assert MAX_ABS_VALUE == 1e30


def test_messages_name_what_is_assembled():
    enc = encode(values(64), "e3m0", BS)
    asm = Assembly(64, "e3m0", BS, what="update", role="downlink", where="shard 1's slice of fragment 2")
    with pytest.raises(ChunkError, match="an update starts with chunk 0"):
        asm.add(1, 0, 64, enc, True)
    with pytest.raises(ChunkError, match="shard 1's slice of fragment 2 has 64 values, the update says 65"):
        asm.add(0, 0, 65, enc, True)
    with pytest.raises(ChunkError, match="this run's downlink codec is e3m0, got 'int8'"):
        asm.add(0, 0, 64, encode(values(64), "int8", BS), True)


# --- Fetch: fp32 masters -----------------------------------------------------------------------------------
def master_chunks(x: torch.Tensor, per: int, round: int = 3, start: int = 0) -> list[tuple]:
    n = x.numel()
    out = []
    for lo in range(start, n, per) if n else [0]:
        hi = min(n, lo + per)
        out.append((round, lo, n, bytes_to_values(values_to_bytes(x[lo:hi])), hi == n))
    return out


def test_a_master_is_written_into_place_and_a_broken_stream_resumes():
    x = values(1000)
    out = torch.zeros(1000)
    m = MasterAssembly(1000, out)
    cs = master_chunks(x, 300)
    assert [m.add(*c) for c in cs[:2]] == [False, False] and m.received == 600 and not m.done
    # the stream broke; the resumed one starts at m.received
    assert [m.add(*c) for c in master_chunks(x, 300, start=m.received)] == [False, True]
    assert m.done and m.round == 3 and m.values is out and torch.equal(out, x)


def test_a_master_whose_round_changes_is_started_over():
    x = values(1000)
    m = MasterAssembly(1000)
    m.add(*master_chunks(x, 300)[0])
    with pytest.raises(ChunkError) as e:
        m.add(*master_chunks(x + 1, 300, round=4, start=300)[0])
    assert e.value.reason == "round_changed" and m.received == 300
    m.reset()
    assert [m.add(*c) for c in master_chunks(x + 1, 300, round=4)][-1] is True
    assert torch.equal(m.values, x + 1) and m.round == 4


@pytest.mark.parametrize(
    "chunk, reason, words",
    [
        ((3, 100, 1000, torch.zeros(100), False), "bad_offset", "offset 100, expected 0"),
        ((3, 0, 999, torch.zeros(100), False), "bad_length", "the slice has 1000 values, the shard says 999"),
        ((3, 0, 1000, torch.zeros(1001), True), "bad_length", "do not fit"),
        ((3, 0, 1000, torch.zeros(1000), False), "bad_length", "but last is false"),
        ((3, 0, 1000, torch.zeros(0), False), "bad_length", "do not fit"),
        ((3, 0, 1000, torch.zeros(100, dtype=torch.float64), False), "bad_codec", "fp32"),
    ],
)
def test_bad_master_chunks_are_refused(chunk, reason, words):
    m = MasterAssembly(1000)
    with pytest.raises(ChunkError, match=words) as e:
        m.add(*chunk)
    assert e.value.reason == reason and m.received == 0 and m.round is None


def test_an_empty_slice_is_one_empty_last_chunk():
    m = MasterAssembly(0)
    assert not m.done
    assert m.add(*master_chunks(torch.zeros(0), 300)[0]) is True and m.done
