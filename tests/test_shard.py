"""The shard's pure logic: streaming aggregation, order independence, refusals that change nothing."""

import itertools

import pytest
import torch

from streamdiloco.common.codecs import Encoded, decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import fingerprint_diff, model_fingerprint
from streamdiloco.common.fragments import build_layout
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.state import PushRejected
from streamdiloco.worker.model import build_gpt
from tests.support.nano_shard import nano_state, slice_delta


def test_mean_is_weighted_by_tokens_and_independent_of_order():
    masters = []
    for order in itertools.permutations(range(4)):
        # the plain mean (the defenses would cut the weights above the median: tests/test_robust.py)
        state, cfg = nano_state(
            robust=RobustConfig.off(),
            uplink_codec="int8",
            downlink_codec="fp32",
            outer_lr=1.0,
            outer_momentum=0.0,
        )
        for w in order:
            state.push(f"w{w}", 1, 0, encode(slice_delta(state, 1, w), "int8"), weight=100.0 * (w + 1))
        before = state.master(1).clone()
        closed = state.close_round(1)
        assert closed.contributors == ("w0", "w1", "w2", "w3") and closed.weight == 1000.0
        masters.append(state.master(1))
    assert all(torch.equal(m, masters[0]) for m in masters)
    deq = [decode(encode(slice_delta(state, 1, w), "int8")).double() for w in range(4)]
    mean = sum(d * 100.0 * (w + 1) for w, d in enumerate(deq)) / 1000.0
    assert torch.allclose(masters[0], (before.double() - mean).float(), atol=1e-7)


def test_round_numbers_advance_and_late_pushes_are_refused():
    state, _ = nano_state()
    enc = encode(slice_delta(state, 0, 0), "e3m0")
    state.push("a", 0, 0, enc, 10.0)
    assert state.close_round(0).round == 0
    assert state.round_of(0) == 1 and state.round_of(1) == 0
    with pytest.raises(PushRejected, match="round 0 chunk 0: the round is closed") as e:
        state.push("b", 0, 0, enc, 10.0)
    assert e.value.reason == "late"


def test_round_without_contributions_closes_with_zero_update():
    state, _ = nano_state()
    before = state.master(2).clone()
    closed = state.close_round(2)
    assert torch.equal(decode(closed.update), torch.zeros_like(before))
    assert torch.equal(state.master(2), before)


def _snapshot(state, f):
    r = state.open[f]
    return r.number, state.sum(f), r.weight, set(r.contributors), state.bytes_received


@pytest.mark.parametrize(
    "make_push, reason",
    [
        (lambda s, e: ("w", 7, 0, e, 1.0), "bad_fragment"),
        (lambda s, e: ("w", 0, 3, e, 1.0), "bad_round"),
        (lambda s, e: ("w", 0, 0, encode(torch.zeros(5), "e3m0"), 1.0), "bad_length"),
        (lambda s, e: ("w", 0, 0, encode(slice_delta(s, 0, 1), "int8"), 1.0), "bad_codec"),
        (lambda s, e: ("w", 0, 0, e, 0.0), "bad_weight"),
        (lambda s, e: ("w", 0, 0, e, float("nan")), "bad_weight"),
        (
            lambda s, e: (
                "w",
                0,
                0,
                Encoded("e3m0", e.numel, e.payload, torch.full_like(e.scales, float("inf")), e.block_size),
                1.0,
            ),
            "bad_scale",
        ),
        (lambda s, e: ("first", 0, 0, e, 1.0), "duplicate"),
        (lambda s, e: ("w", 0, 0, e, 1.0, float("inf")), "bad_loss"),
    ],
)
def test_bad_pushes_are_refused_and_change_nothing(make_push, reason):
    state, _ = nano_state()
    enc = encode(slice_delta(state, 0, 0), "e3m0")
    state.push("first", 0, 0, enc, 5.0)
    before = _snapshot(state, 0)
    with pytest.raises(PushRejected) as e:
        state.push(*make_push(state, enc))
    assert e.value.reason == reason
    after = _snapshot(state, 0)
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[2:] == after[2:]


def test_shards_own_disjoint_slices():
    a, _ = nano_state(0, 3)
    b, _ = nano_state(1, 3)
    c, _ = nano_state(2, 3)
    for f in range(3):
        assert a.ranges[f][1] == b.ranges[f][0] and b.ranges[f][1] == c.ranges[f][0]
        n = a.layout.fragments[f].numel
        assert c.ranges[f][1] == n


def test_fingerprint_names_the_difference():
    cfg = SyncConfig(sync_every=6, num_fragments=3)
    small = model_fingerprint(build_layout(build_gpt("nano"), 3), cfg)
    assert fingerprint_diff(small, small) is None
    deeper = model_fingerprint(build_layout(build_gpt("nano", n_layer=8), 3), cfg)
    assert (
        fingerprint_diff(deeper, small)
        == "model fingerprint differs from the server's: worker has 8 blocks, server 4"
    )
    wider = model_fingerprint(build_layout(build_gpt("nano", n_embd=64), 3), cfg)
    assert "transformer.h.0.ln_1.weight has shape [64] on the worker, [32] on the server" in fingerprint_diff(
        wider, small
    )
    other = model_fingerprint(build_layout(build_gpt("nano"), 3), SyncConfig(sync_every=9, num_fragments=3))
    assert "sync_every is 9 on the worker, 6 on the server" in fingerprint_diff(other, small)
