"""ShardState without any network: pushes in chunks, when rounds close (the clock is the test's `now`), and
chunked aggregation that equals whole pushes whatever the order in which chunks of several workers arrive."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

from streamdiloco.common.codecs import (
    CODECS,
    Encoded,
    chunk_alignment,
    chunk_values,
    concat,
    decode,
    encode,
    split,
)
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.wire import from_chunk, to_chunks
from streamdiloco.server.rounds.state import PushRejected, ShardState
from streamdiloco.worker.model import build_gpt
from tests.support.nano_shard import slice_delta, slice_push

pytestmark = pytest.mark.timeout(60)

torch.manual_seed(0)
_MODEL = build_gpt("nano")
_LAYOUT = build_layout(_MODEL, 3)
_INITIAL = [flatten(fragment_params(_MODEL, f)) for f in _LAYOUT.fragments]


def make_state(min_workers=1, round_timeout=float("inf"), members=(), **cfg_kw) -> ShardState:
    cfg = SyncConfig(sync_every=6, num_fragments=3, **cfg_kw)
    st = ShardState(0, 2, _LAYOUT, cfg, _INITIAL, 0, min_workers, round_timeout)
    for m in members:
        st.add_member(m)
    return st


def slice_len(st: ShardState, fragment: int) -> int:
    lo, hi = st.ranges[fragment]
    return hi - lo


def chunks(enc: Encoded, fragment: int = 0, round: int = 0, per: int = 512) -> list[tuple]:
    """(seq, offset, total, part, last) of each chunk, as the shard's servicer hands them over: through the
    wire's Chunk messages and back."""
    out = []
    for c in to_chunks(enc, fragment, round, per):
        out.append((c.seq, c.offset, c.total, from_chunk(c), c.last))
    return out


def push_chunks(
    st, worker, fragment, round, enc, weight=1.0, loss=None, per=512, now=0.0, start=0, upto=None
):
    """Push chunks [start, upto) of a push (all of it by default); returns push_chunk's answer for each."""
    out = []
    for seq, offset, total, part, last in chunks(enc, fragment, round, per)[start:upto]:
        first = seq == 0
        out.append(
            st.push_chunk(
                worker,
                fragment,
                round,
                seq,
                offset,
                total,
                part,
                last,
                weight if first else None,
                loss if first else None,
                now,
            )
        )
    return out


def total_of(st: ShardState, fragment: int) -> torch.Tensor:
    return st.sum(fragment)


# === when rounds close ===================================================================================
def test_a_round_nobody_pushed_to_is_never_due():
    st = make_state(members=("a", "b"), round_timeout=1.0)
    assert st.due(0.0) == [] and st.due(1e12) == []


def test_a_round_closes_when_every_expected_member_pushed():
    st = make_state(min_workers=2, members=("a", "b"))
    assert push_chunks(st, "a", 0, 0, slice_push(st, 0, 1))[-1] is True
    assert st.due(0.0) == []  # b is expected
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2))
    assert st.due(0.0) == [(0, "all")]
    closed = st.close_round(0, "all")
    assert (closed.round, closed.contributors, closed.why) == (0, ("a", "b"), "all")
    assert st.round_of(0) == 1 and st.due(0.0) == []


def test_a_single_member_closes_its_own_round_with_min_workers_one():
    st = make_state(min_workers=1, members=("a",))
    push_chunks(st, "a", 1, 0, slice_push(st, 1, 1))
    assert st.due(0.0) == [(1, "all")]


def test_a_round_does_not_close_early_with_fewer_than_min_workers():
    st = make_state(min_workers=3, round_timeout=10.0, members=("a", "b"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1), now=0.0)
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2), now=1.0)
    assert st.due(5.0) == []  # everyone pushed, but only 2 of 3: wait for a third until the deadline
    st.add_member("c")  # a newcomer may still make up the number
    push_chunks(st, "c", 0, 0, slice_push(st, 0, 3), now=2.0)
    assert st.due(2.0) == [(0, "all")]


def test_at_the_deadline_a_round_closes_with_every_member_when_fewer_than_min_workers_are_left():
    st = make_state(min_workers=3, round_timeout=10.0, members=("a", "b", "c"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1), now=0.0)
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2), now=1.0)
    st.remove_member("c")  # died before pushing: the quorum of 3 cannot be met
    assert st.due(9.999) == []
    assert st.due(10.0) == [(0, "deadline")]
    assert st.close_round(0, "deadline").contributors == ("a", "b")
    # with three members present that push, two contributions are not enough even after the deadline (a
    # member that joined and never pushed does not hold the rounds so: tests/test_round_rule.py)
    st.add_member("c")
    for seed, (who, now) in enumerate((("a", 20.0), ("b", 21.0), ("c", 22.0))):
        push_chunks(st, who, 0, 1, slice_push(st, 0, seed), now=now)
    assert st.due(22.0) == [(0, "all")]
    st.close_round(0, "all", now=22.0)
    push_chunks(st, "a", 0, 2, slice_push(st, 0, 1), now=30.0)
    push_chunks(st, "b", 0, 2, slice_push(st, 0, 2), now=31.0)
    assert st.due(1e9) == []


def test_a_round_closes_at_its_deadline_with_at_least_min_workers():
    st = make_state(min_workers=2, round_timeout=10.0, members=("a", "b", "c"))
    enc_a = slice_push(st, 2, 1)
    push_chunks(st, "a", 2, 0, enc_a, now=100.0, upto=1)  # a first chunk does not start the round
    assert push_chunks(st, "a", 2, 0, enc_a, now=103.0, start=1)[-1] is True  # the whole push does
    assert st.due(113.0) == []  # deadline passed, but only one contribution
    push_chunks(st, "b", 2, 0, slice_push(st, 2, 2), now=105.0)
    assert st.due(112.999) == []  # c is still expected, and the deadline is 103 + 10
    assert st.due(113.0) == [(2, "deadline")]
    closed = st.close_round(2, "deadline")
    assert closed.contributors == ("a", "b") and closed.why == "deadline"


def test_a_member_that_leaves_is_no_longer_waited_for():
    st = make_state(min_workers=2, members=("a", "b", "c"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1))
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2))
    assert st.due(0.0) == []
    st.remove_member("c")
    assert st.due(0.0) == [(0, "all")]


def test_a_member_that_leaves_mid_push_takes_its_chunks_with_it():
    st = make_state(min_workers=1, members=("a", "b"))
    before = total_of(st, 0)
    assert push_chunks(st, "a", 0, 0, slice_push(st, 0, 1), upto=5) == [False] * 5
    assert ("a", 0) in st.staged
    st.remove_member("a")
    assert st.staged == {} and torch.equal(total_of(st, 0), before)
    enc_b = slice_push(st, 0, 2)
    push_chunks(st, "b", 0, 0, enc_b, weight=3.0)
    assert st.due(0.0) == [(0, "all")]
    alone = make_state(members=("b",))
    alone.push("b", 0, 0, enc_b, 3.0)
    assert torch.equal(total_of(st, 0), total_of(alone, 0))
    assert torch.equal(st.close_round(0).update.payload, alone.close_round(0).update.payload)


def test_a_push_that_never_finished_does_not_start_the_round():
    st = make_state(min_workers=2, members=("a", "b"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1), upto=3)  # never finishes
    assert st.open[0].started_at is None and st.open[0].expected is None
    st.remove_member("a")
    st.remove_member("b")
    assert st.due(1e9) == []  # nobody has a push in it, so nobody waits for it
    assert st.round_of(0) == 0 and not st.staged


def test_a_round_whose_expected_members_all_left_closes():
    st = make_state(min_workers=2, members=("a", "b"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1))  # starts the round
    assert st.due(0.0) == []  # b is still expected
    st.remove_member("b")
    assert st.due(0.0) == []  # a is still there: the quorum of 2 is not met, the round waits
    st.remove_member("a")
    assert st.due(0.0) == [(0, "empty")]
    closed = st.close_round(0, "empty")
    assert closed.contributors == ("a",) and closed.why == "empty"


def test_a_round_whose_expected_members_left_keeps_what_they_pushed():
    st = make_state(min_workers=2, members=("a", "b"))
    push_chunks(st, "a", 1, 0, slice_push(st, 1, 1), weight=7.0)
    st.remove_member("a")
    st.remove_member("b")
    assert st.due(0.0) == [(1, "empty")]
    closed = st.close_round(1, "empty")
    assert closed.contributors == ("a",) and closed.weight == 7.0


def test_an_empty_round_waits_for_a_push_still_arriving_from_a_newcomer():
    st = make_state(min_workers=2, members=("a", "b"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1))  # the round starts: a and b are expected
    st.add_member("c")
    enc_c = slice_push(st, 0, 3)
    push_chunks(st, "c", 0, 0, enc_c, upto=2)
    st.remove_member("a")
    st.remove_member("b")
    assert st.due(0.0) == []  # nobody expected is left, but c's push is on its way
    assert push_chunks(st, "c", 0, 0, enc_c, start=2)[-1] is True
    assert st.due(0.0) == [(0, "all")]  # two contributions: the quorum
    assert st.close_round(0).contributors == ("a", "c")


def test_a_member_joining_after_the_first_push_is_not_waited_for():
    st = make_state(min_workers=2, members=("a", "b"))
    enc_a = slice_push(st, 0, 1)
    push_chunks(st, "a", 0, 0, enc_a)  # the round starts: a and b are expected
    st.add_member("c")
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2))
    assert st.due(0.0) == [(0, "all")]  # c is not waited for
    assert st.close_round(0).contributors == ("a", "b")
    # c is expected from the next round on
    push_chunks(st, "a", 0, 1, enc_a)
    push_chunks(st, "b", 0, 1, slice_push(st, 0, 2))
    assert st.due(0.0) == []
    push_chunks(st, "c", 0, 1, slice_push(st, 0, 3))
    assert st.due(0.0) == [(0, "all")]


def test_a_newcomer_may_still_contribute_to_the_open_round():
    st = make_state(min_workers=1, members=("a", "b"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1))
    st.add_member("c")
    push_chunks(st, "c", 0, 0, slice_push(st, 0, 3))
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2))
    assert st.close_round(0).contributors == ("a", "b", "c")


# === chunks ==============================================================================================
@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("block_size", [16, 128])
def test_chunk_splits_of_every_codec_reassemble_exactly(codec, block_size):
    align = chunk_alignment(codec, block_size)
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, block_size - 1, block_size, block_size + 1, 1001, 4 * block_size + 3):
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
        enc = encode(x, codec, block_size)
        whole = decode(enc)
        for per in (align, 3 * align, chunk_values(codec, block_size, 256), 10**6 // align * align):
            parts = split(enc, per)
            assert [o for o, _ in parts] == list(range(0, n, per))
            for offset, part in parts:
                assert torch.equal(decode(part), whole[offset : offset + part.numel])
            wire = [from_chunk(c) for c in to_chunks(enc, 0, 0, per)]
            assert [p.numel for p in wire] == [p.numel for _, p in parts]
            back = concat(wire)
            assert (back.codec, back.numel, back.block_size) == (enc.codec, enc.numel, enc.block_size)
            assert torch.equal(back.payload, enc.payload) and torch.equal(back.scales, enc.scales)
            assert torch.equal(decode(back), whole)


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_chunked_push_sums_exactly_like_a_whole_push(codec):
    whole = make_state(uplink_codec=codec, downlink_codec="fp32", members=("a", "b"))
    chunked = make_state(uplink_codec=codec, downlink_codec="fp32", members=("a", "b"))
    per = chunk_values(codec, 128, 1000)
    for name, seed, weight, loss in (("a", 1, 100.0, 2.0), ("b", 2, 300.0, 4.0)):
        enc = slice_push(whole, 0, seed)
        whole.push(name, 0, 0, enc, weight, loss)
        answers = push_chunks(chunked, name, 0, 0, enc, weight, loss, per=per)
        assert len(answers) > 3 and answers == [False] * (len(answers) - 1) + [True]
    assert torch.equal(total_of(whole, 0), total_of(chunked, 0))
    assert whole.bytes_received == chunked.bytes_received
    a, b = whole.close_round(0), chunked.close_round(0)
    # of two weights the reference is the lower one (one of two may be a liar): b's 300 tokens count as a's
    # 100 (server/rounds/robust.py)
    assert a.weight == b.weight == 200.0 and a.mean_loss == b.mean_loss == pytest.approx((200 + 400) / 200)
    assert a.capped == b.capped == ("b",)
    assert torch.equal(decode(a.update), decode(b.update))
    assert torch.equal(whole.master(0), chunked.master(0))


def _interleavings(streams: dict[str, list], rng: random.Random, count: int):
    """Arrival orders of several workers' chunks that keep each worker's own chunks in order."""
    names = list(streams)
    yield [(n, c) for n in names for c in streams[n]]  # one push after the other
    yield [(n, c) for n in reversed(names) for c in streams[n]]
    yield [(n, c) for row in itertools.zip_longest(*streams.values()) for n, c in zip(names, row) if c]
    for _ in range(count):
        tags = [n for n in names for _ in streams[n]]
        rng.shuffle(tags)
        at = {n: iter(streams[n]) for n in names}
        yield [(n, next(at[n])) for n in tags]


def test_aggregation_does_not_depend_on_the_order_chunks_arrive_in():
    ref = make_state(members=("a", "b", "c"))
    encs = {n: slice_push(ref, 0, seed) for n, seed in (("a", 1), ("b", 2), ("c", 3))}
    weights = {"a": 100.0, "b": 250.0, "c": 30.0}
    for n in encs:
        ref.push(n, 0, 0, encs[n], weights[n], 3.0)
    ref_total = total_of(ref, 0)
    ref_closed = ref.close_round(0)
    streams = {n: chunks(encs[n]) for n in encs}
    assert all(len(s) > 10 for s in streams.values())
    for order in _interleavings(streams, random.Random(0), count=5):
        st = make_state(members=("a", "b", "c"))
        for name, (seq, offset, total, part, last) in order:
            first = seq == 0
            st.push_chunk(
                name,
                0,
                0,
                seq,
                offset,
                total,
                part,
                last,
                weights[name] if first else None,
                3.0 if first else None,
            )
        assert st.staged == {} and st.contributors(0) == {"a", "b", "c"}
        assert torch.equal(total_of(st, 0), ref_total)
        closed = st.close_round(0)
        assert torch.equal(closed.update.payload, ref_closed.update.payload)
        assert torch.equal(closed.update.scales, ref_closed.update.scales)
        assert torch.equal(st.master(0), ref.master(0))


# === refusals at chunk level =============================================================================
def _state_of(st: ShardState, f: int = 0):
    r = st.open[f]
    return (r.number, st.sum(f), r.weight, set(r.contributors), r.loss_sum, st.bytes_received)


def _same(a, b) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1]) and a[2:] == b[2:]


def test_a_bad_chunk_drops_its_push_and_the_rest_of_that_push_is_ignored():
    st = make_state(members=("a", "b"))
    enc = slice_push(st, 0, 1)
    cs = chunks(enc)
    before = _state_of(st)
    assert push_chunks(st, "a", 0, 0, enc, upto=3) == [False] * 3
    seq, offset, total, part, last = cs[3]
    with pytest.raises(PushRejected, match="chunk 3: offset 1664, expected 1536") as e:
        st.push_chunk("a", 0, 0, seq, offset + 128, total, part, last)
    assert e.value.reason == "bad_offset"
    assert st.staged == {} and st.discarding == {("a", 0): (0, 0)}
    for seq, offset, total, part, last in cs[4:]:  # the rest of the refused push: silently dropped
        assert st.push_chunk("a", 0, 0, seq, offset, total, part, last) is None
    assert st.discarding == {} and _same(_state_of(st), before)
    assert st.pushes_refused == {"bad_offset": 1} and st.pushes_accepted == 0
    assert push_chunks(st, "a", 0, 0, enc)[-1] is True  # then a whole push is accepted


def test_a_refused_first_chunk_is_forgotten_by_the_next_push():
    st = make_state(members=("a",))
    enc = slice_push(st, 0, 1)
    with pytest.raises(PushRejected) as e:
        push_chunks(st, "a", 0, 0, enc, weight=float("nan"), upto=1)
    assert e.value.reason == "bad_weight" and st.discarding == {("a", 0): (0, 0)}
    assert push_chunks(st, "a", 0, 0, enc, weight=2.0)[-1] is True
    assert st.discarding == {} and st.contributors(0) == {"a"}


def test_refuse_chunk_drops_the_push_like_a_refused_chunk():
    st = make_state(members=("a",))
    enc = slice_push(st, 0, 1)
    cs = chunks(enc)
    push_chunks(st, "a", 0, 0, enc, upto=2)
    assert st.refuse_chunk("a", 0, 0, 2, False, "bad_length") is True  # chunk 2 could not be decoded
    assert st.staged == {} and st.pushes_refused == {"bad_length": 1}
    assert st.refuse_chunk("a", 0, 0, 3, False, "bad_length") is False  # part of the refused push
    for seq, offset, total, part, last in cs[4:]:
        assert st.push_chunk("a", 0, 0, seq, offset, total, part, last) is None
    assert st.discarding == {} and st.pushes_refused == {"bad_length": 1}
    assert push_chunks(st, "a", 0, 0, enc)[-1] is True


def test_closing_a_round_drops_the_pushes_still_arriving_and_their_rest_is_late():
    st = make_state(min_workers=1, members=("a", "b"))
    enc_b = slice_push(st, 0, 2)
    push_chunks(st, "b", 0, 0, enc_b, upto=4)
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1))
    closed = st.close_round(0, "deadline")
    assert closed.contributors == ("a",) and st.staged == {}
    cs = chunks(enc_b)
    seq, offset, total, part, last = cs[4]
    with pytest.raises(PushRejected, match="round 0 chunk 4: the round is closed") as e:
        st.push_chunk("b", 0, 0, seq, offset, total, part, last)
    assert e.value.reason == "late"
    assert all(st.push_chunk("b", 0, 0, *c) is None for c in cs[5:])
    assert push_chunks(st, "b", 0, 1, enc_b)[-1] is True


@pytest.mark.parametrize(
    "mutate, reason, words",
    [
        (lambda cs: [cs[0], cs[1], cs[1]], "bad_chunk", "chunk 1 repeated (next expected is 2)"),
        (lambda cs: [cs[0], cs[2]], "bad_chunk", "chunk out of order: expected chunk 1"),
        (lambda cs: [cs[1]], "bad_chunk", "a push starts with chunk 0 at offset 0, got chunk 1"),
        (lambda cs: [cs[0], (1, cs[1][1], cs[1][2], cs[1][3], True)], "bad_length", "but last is true"),
        (lambda cs: [cs[0], (1, cs[1][1], cs[1][2] - 1, cs[1][3], False)], "bad_length", "the push says"),
    ],
    ids=["repeated", "out-of-order", "no-start", "early-last", "total-changes"],
)
def test_chunk_sequence_errors(mutate, reason, words):
    st = make_state(members=("a",))
    before = _state_of(st)
    cs = mutate(chunks(slice_push(st, 0, 1)))
    with pytest.raises(PushRejected, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        for seq, offset, total, part, last in cs:
            st.push_chunk("a", 0, 0, seq, offset, total, part, last, 1.0 if seq == 0 else None)
    assert e.value.reason == reason
    assert st.staged == {} and _same(_state_of(st), before)


def test_fp32_uplink_refuses_non_finite_values():
    st = make_state(uplink_codec="fp32", members=("a",))
    x = slice_delta(st, 0, 1)
    x[700] = float("nan")
    bad = Encoded("fp32", x.numel(), x.view(torch.uint8).clone(), torch.empty(0), 0)
    with pytest.raises(PushRejected, match="chunk 5: the chunk holds non-finite values") as e:
        push_chunks(st, "a", 0, 0, bad, per=128)
    assert e.value.reason == "bad_value" and st.staged == {}


def test_the_loss_comes_with_the_first_chunk_and_is_token_weighted():
    st = make_state(members=("a", "b", "c"))
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1), weight=50.0, loss=2.0)
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2), weight=100.0, loss=4.0)
    push_chunks(st, "c", 0, 0, slice_push(st, 0, 3), weight=100.0, loss=None)  # no loss reported
    closed = st.close_round(0)
    assert closed.weight == 250.0 and closed.mean_loss == pytest.approx((100 + 400) / 150)


@pytest.mark.parametrize(
    "codec, scale, words",
    [("int8", 1e37, "allow values up to 1.27e+39"), ("e3m0", 3e38, "allow values up to 3e+38")],
)
def test_scales_that_could_overflow_the_sum_are_refused(codec, scale, words):
    st = make_state(members=("a",), uplink_codec=codec)
    enc = slice_push(st, 0, 1)
    big = Encoded(enc.codec, enc.numel, enc.payload, torch.full_like(enc.scales, scale), enc.block_size)
    with pytest.raises(PushRejected, match=re.escape(words)) as e:
        st.push("a", 0, 0, big, 1.0)
    assert e.value.reason == "bad_scale" and st.pushes_accepted == 0


def test_fp32_values_that_could_overflow_the_sum_are_refused():
    st = make_state(members=("a",), uplink_codec="fp32")
    n = slice_len(st, 0)
    with pytest.raises(PushRejected, match="values above 1e\\+30") as e:
        st.push("a", 0, 0, encode(torch.full((n,), 3e38), "fp32"), 1.0)
    assert e.value.reason == "bad_value"


def test_a_round_whose_mean_is_not_finite_closes_with_a_zero_update_and_keeps_the_optimizer_clean():
    st = make_state(members=("a",))
    st.push("a", 0, 0, slice_push(st, 0, 1), 1.0)
    st.open[0].partial = torch.zeros(slice_len(st, 0), dtype=torch.float64)
    st.open[0].partial[0] = float("inf")  # cannot happen through push (bounded values and weights)
    master = st.master(0).clone()
    closed = st.close_round(0)
    assert closed.why == "nonfinite" and torch.equal(decode(closed.update), torch.zeros(slice_len(st, 0)))
    assert torch.equal(st.master(0), master) and st.round_of(0) == 1
    st.push("a", 0, 1, slice_push(st, 0, 2), 1.0)  # the next round works as usual
    assert torch.isfinite(decode(st.close_round(0).update)).all()


def test_pushes_to_made_up_fragments_keep_the_refusal_table_small():
    st = make_state(members=("a",))
    enc = slice_push(st, 0, 1)
    for fragment in range(3, 1003):
        with pytest.raises(PushRejected):
            push_chunks(st, "a", fragment, 0, enc, upto=1)
    assert len(st.discarding) == 1  # one shared entry for every fragment id that does not exist


# === the arithmetic as jobs: folds ahead of the close, closes while pushes go on ==========================
def _closed_bits(closed) -> tuple:
    return closed.update.payload.numpy().tobytes(), closed.update.scales.numpy().tobytes(), closed.weight


def test_pushes_beyond_an_fp64_sum_fold_early_to_the_same_result_whenever_the_fold_runs():
    names = [f"w{i}" for i in range(7)]
    encs = {n: slice_push(make_state(), 0, i + 1) for i, n in enumerate(names)}

    def run(fold_after: set[int]) -> tuple:
        st = make_state(members=names)
        st.fragments[0].fold_bytes = 2 * encs["w0"].nbytes  # every two pushes make a group
        for i, n in enumerate(names):
            push_chunks(st, "w" + str(i), 0, 0, encs[n], weight=10.0 + i)
            if i in fold_after:
                for f in st.fold_due():
                    st.end_fold(st.begin_fold(f).run())
        kept = sum(len(g) for g in st.open[0].groups) + len(st.open[0].kept)
        return _closed_bits(st.close_round(0)), kept, st.master(0).clone()

    never, kept, master = run(set())
    assert kept == 7  # nothing folded: three groups of two wait, and one push
    for when in ({1}, {3}, {1, 3, 5}, set(range(7))):
        again, kept, m = run(when)
        assert again == never and torch.equal(m, master), when
        assert kept < 7


def test_a_fold_job_out_keeps_the_round_open_and_pushes_coming():
    st = make_state(members=("a", "b", "c"))
    st.fragments[0].fold_bytes = 1  # every push is a group of its own
    push_chunks(st, "a", 0, 0, slice_push(st, 0, 1))
    assert st.fold_due() == [0]
    job = st.begin_fold(0)
    assert st.fold_due() == [] and st.fragments[0].busy
    push_chunks(st, "b", 0, 0, slice_push(st, 0, 2))
    push_chunks(st, "c", 0, 0, slice_push(st, 0, 3))
    assert st.due(0.0) == []  # complete, but the fold is out
    st.end_fold(job.run())
    assert st.due(0.0) == [(0, "all")] and st.fold_due() == [0]
    ref = make_state(members=("a", "b", "c"))
    for n, seed in (("a", 1), ("b", 2), ("c", 3)):
        push_chunks(ref, n, 0, 0, slice_push(ref, 0, seed))
    assert torch.equal(total_of(st, 0), total_of(ref, 0))
    assert _closed_bits(st.close_round(0)) == _closed_bits(ref.close_round(0))


def test_a_close_job_out_takes_pushes_for_the_next_round_and_publishes_the_master_when_it_is_back():
    st = make_state(members=("a",))
    enc = slice_push(st, 0, 1)
    push_chunks(st, "a", 0, 0, enc)
    before = st.master(0)
    job = st.begin_close(0)
    assert st.round_of(0) == 1 and st.fragments[0].busy
    with pytest.raises(PushRejected) as e:  # the closed round's pushes are late at once
        push_chunks(st, "a", 0, 0, enc)
    assert e.value.reason == "late"
    assert push_chunks(st, "a", 0, 1, enc)[-1] is True  # the next round's are taken
    assert st.due(0.0) == []  # complete, but round 0's job is out
    with pytest.raises(RuntimeError, match="being closed"):
        st.fragment_state(0)
    with pytest.raises(RuntimeError, match="already has a job out"):
        st.begin_close(0)
    job.run()
    assert st.master(0) is before  # readers see the old master until the job is taken back
    closed = st.end_close(job)
    assert closed.round == 0 and closed.contributors == ("a",) and not any(fr.busy for fr in st.fragments)
    assert not torch.equal(st.master(0), before) and job.fragment_state()["round"] == 1
    assert st.due(0.0) == [(0, "all")]
    ref = make_state(members=("a",))
    ref.push("a", 0, 0, enc, 1.0)
    assert _closed_bits(ref.close_round(0)) == _closed_bits(closed)
    assert torch.equal(st.master(0), ref.master(0))


# === sq2 through a real shard ============================================================================
def _sq2_shard(tmp_path, shards):
    """Shard 0 of 2 of the nano run with sq2 both ways, serving in a thread (chunks of 256 bytes)."""
    import json

    from tests.support.inthread import InThreadShard
    from tests.support.nano_shard import fingerprint
    from tests.support.shards import shard_of

    cfg = SyncConfig(sync_every=6, num_fragments=3, uplink_codec="sq2", downlink_codec="sq2")
    service = shard_of(cfg, "nano", shard=0, num_shards=2, min_workers=2, round_timeout=30.0, chunk_bytes=256)
    return shards.add(InThreadShard(service, tmp_path, json.dumps(fingerprint(cfg))))


def _sq2_delta(shard, seed: int) -> Encoded:
    from tests.support.nano_shard import delta

    lo, hi = shard.service.state.ranges[0]
    return encode(delta(seed, hi - lo), "sq2", 128)


def test_sq2_pushes_and_updates_through_a_real_shard_keep_mirrors_bit_identical(tmp_path, shards):
    """Two workers push sq2 slices through the shard's gRPC edge (many chunks each); the round closes and
    each gets the sq2 update, whose bytes a worker's Assembly adds into its mirror: the mirror equals the
    shard's new master to the bit, and the update equals ShardState's for the same pushes."""
    from streamdiloco.common.chunks import Assembly
    from tests.support.inthread import push_messages

    shard = _sq2_shard(tmp_path, shards)
    mirror = shard.on_loop(lambda: shard.service.state.master(0).clone())
    a, b = shard.worker("a"), shard.worker("b")
    encs = {"a": _sq2_delta(shard, 1), "b": _sq2_delta(shard, 2)}
    ref = make_state(uplink_codec="sq2", downlink_codec="sq2", members=("a", "b"))
    for w, weight in ((a, 100.0), (b, 100.0)):
        w.push(push_messages(encs[w.name], weight=weight, loss=3.0, values_per_chunk=512))
        assert w.session.result().accepted
        ref.push(w.name, 0, 0, encs[w.name], weight, 3.0)
    closed = ref.close_round(0)
    updates = {w.name: w.session.update() for w in (a, b)}  # the round has closed once they arrive
    master = shard.on_loop(lambda: shard.service.state.master(0).clone())
    assert torch.equal(master, ref.master(0))
    for w in (a, b):
        chunks_in = updates[w.name]
        assert len(chunks_in) > 3 and all(c.codec == "sq2" and c.block_size == 128 for c in chunks_in)
        got = concat([from_chunk(c) for c in chunks_in])
        assert torch.equal(got.payload, closed.update.payload)
        assert torch.equal(got.scales, closed.update.scales)
        asm = Assembly(mirror.numel(), "sq2", 128, what="update", role="downlink")
        for c in chunks_in:
            asm.add(c.seq, c.offset, c.total, from_chunk(c), c.last)
        mine = mirror.clone()
        asm.add_into(mine)
        assert torch.equal(mine.view(torch.int32), master.view(torch.int32)), w.name
    assert not torch.equal(master, mirror)  # the round moved the master


@pytest.mark.parametrize(
    "bad, words",
    [
        (float("nan"), "non-finite codebook value"),
        (float("inf"), "non-finite codebook value"),
        (-float("inf"), "non-finite codebook value"),
        (3e30, "codebook values allow values up to 3e+30, above 1e+30"),
    ],
)
def test_an_sq2_push_with_a_bad_codebook_is_refused_and_nothing_is_folded(tmp_path, shards, bad, words):
    """A codebook entry that is NaN, inf or past the value bound (in a later chunk, after good ones):
    the push is refused with bad_scale and a message naming the codebook, the round keeps nothing of it,
    and the worker's next, good push of the same round is accepted."""
    from tests.support.inthread import push_messages

    shard = _sq2_shard(tmp_path, shards)
    a, _ = shard.worker("a"), shard.worker("b")
    enc = _sq2_delta(shard, 1)
    before = shard.snapshot()
    msgs = push_messages(enc, values_per_chunk=512)
    books = enc.scales.clone()
    books[16 + 2] = bad  # in chunk 1 (512 values: 4 blocks, 16 codebook values a chunk)
    bent = Encoded("sq2", enc.numel, enc.payload, books, 128)
    bad_msgs = push_messages(bent, values_per_chunk=512)
    assert bad_msgs[1].push.chunk.scales != msgs[1].push.chunk.scales
    a.push(bad_msgs)
    r = a.session.result()
    assert (r.accepted, r.reason) == (False, "bad_scale") and words in r.message, r.message
    shard.quiesce(a)
    assert shard.snapshot() == before
    a.push(msgs)
    assert a.session.result().accepted
