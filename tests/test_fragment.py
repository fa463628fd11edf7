"""worker/fragment.py in closed form: one fragment of four values (two parameters of two, two shard slices
of two) through prepare_send, encode, apply and merge, for both merge rules, with fp32 codecs (exact) and
dyadic numbers, so that every expected value is written out by hand.

The run: the global parameters are G = [1, 2, 3, 4] (the mirror); the worker trains to L1 = [1.5, 2, 2, 5]
and sends round 0 at step 3 (outer gradient G - L1 = [-0.5, 0, 1, -1]); the round's update is
U = [-0.25, 0.5, 0.25, 1], so the mirror becomes G + U = [0.75, 2.5, 3.25, 5]; meanwhile the worker
trained on to L2 = L1 + [0.5, 0.5, -0.5, 0]. With alpha = 0.5:
- mix: local = alpha * L2 + (1 - alpha) * (G + U);
- rebase: local = L2 + (1 - alpha) * (G + U - L1) (the steps since the send are kept).
"""

from __future__ import annotations

import pytest
import torch

from streamdiloco.common.codecs import decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import Fragment, ParamEntry
from streamdiloco.worker.fragment import FragmentSync, Placement, global_state_dict
from streamdiloco.worker.linkstate import Master

G = [1.0, 2.0, 3.0, 4.0]
L1 = [1.5, 2.0, 2.0, 5.0]
STEPS_SINCE_SEND = [0.5, 0.5, -0.5, 0.0]
L2 = [a + b for a, b in zip(L1, STEPS_SINCE_SEND)]  # [2, 2.5, 1.5, 5]
U = [-0.25, 0.5, 0.25, 1.0]
MIRROR_AFTER = [g + u for g, u in zip(G, U)]  # [0.75, 2.5, 3.25, 5]
ALPHA = 0.5

SPEC = Fragment(
    index=0,
    entries=(ParamEntry("a", (2,), 0, 2, "float32"), ParamEntry("b", (2,), 2, 2, "float32")),
    blocks=(),
)


def config(rule: str) -> SyncConfig:
    return SyncConfig(
        sync_every=4,
        num_fragments=1,
        fragment_update_alpha=ALPHA,
        merge_rule=rule,
        uplink_codec="fp32",
        downlink_codec="fp32",
    )


def fragment(rule: str = "mix", values=G) -> tuple[FragmentSync, list[torch.Tensor]]:
    """A FragmentSync of two 2-value parameters holding `values` (the mirror starts equal to them)."""
    params = [torch.tensor(values[:2]), torch.tensor(values[2:])]
    return FragmentSync(SPEC, params, config(rule), 2, Placement(torch.device("cpu"))), params


def set_params(params: list[torch.Tensor], values: list[float]) -> None:
    params[0].copy_(torch.tensor(values[:2]))
    params[1].copy_(torch.tensor(values[2:]))


def flat(params: list[torch.Tensor]) -> list[float]:
    return torch.cat([p.flatten() for p in params]).tolist()


def fp32(values: list[float]):
    return encode(torch.tensor(values), "fp32", 128)


def sent(rule: str) -> tuple[FragmentSync, list[torch.Tensor], list]:
    """The run up to the send of round 0 at step 3: the fragment, its parameters and the encoded slices."""
    f, params = fragment(rule)
    set_params(params, L1)
    snapshot, _, _ = f.prepare_send(0, 3)
    return f, params, f.encode(snapshot, torch.Generator())


# --- prepare_send: the snapshot, the push's weight and mean loss ---------------------------------------
def test_prepare_send_weighs_by_the_tokens_since_the_last_send_and_reports_their_mean_loss():
    f, params = fragment()
    f.count(10, 2.0)
    f.count(6, 4.0)
    f.count(0, None)  # a step without a loss counts no loss
    set_params(params, L1)
    snapshot, weight, loss = f.prepare_send(0, 3)
    assert (weight, loss) == (16.0, 3.0)
    assert snapshot.tolist() == L1
    assert (f.in_flight, f.sent_at, f.snapshot_round) == (0, {0: 3}, 0)
    assert (f.tokens, f.loss) == (0, (0.0, 0))  # counted afresh for the next send
    set_params(params, L2)
    assert snapshot.tolist() == L1  # a copy: training on does not change what is sent
    _, weight, loss = f.prepare_send(1, 7)
    assert (weight, loss) == (1.0, None)  # no tokens: weight 1, no loss to report


# --- encode: mirror minus snapshot, one Encoded per shard slice ----------------------------------------
def test_encode_sends_the_outer_gradient_mirror_minus_snapshot_per_shard_slice():
    f, _, slices = sent("mix")
    assert f.ranges == [(0, 2), (2, 4)]
    assert [s.codec for s in slices] == ["fp32", "fp32"]
    assert [decode(s).tolist() for s in slices] == [[-0.5, 0.0], [1.0, -1.0]]  # G - L1
    assert f.mirror.tolist() == G  # the mirror moves only with the round's update


# --- apply: an update's slices into the mirror, in each form a transport gives -------------------------
def test_apply_adds_each_slice_into_the_mirror_and_counts_its_bytes():
    f, _, _ = sent("mix")
    received = f.apply(0, [fp32(U[:2]), fp32(U[2:])])
    assert f.mirror.tolist() == MIRROR_AFTER
    assert f.mirror_rounds == [1, 1]
    assert received == 16  # four fp32 values


def test_apply_takes_a_slice_in_parts_at_their_offsets_a_fetched_master_or_nothing():
    f, _, _ = sent("mix")
    parts = [(0, fp32(U[:1])), (1, fp32(U[1:2]))]  # slice 0 as it came over the wire, part by part
    received = f.apply(0, [parts, Master(torch.tensor([7.0, 8.0]), 5)])
    assert f.mirror.tolist() == [0.75, 2.5, 7.0, 8.0]
    assert f.mirror_rounds == [1, 5]  # a master holds every round before its own
    assert received == 8  # the fetched master is not an update's bytes
    assert f.apply(1, [None, None]) == 0  # the mirror held these already (fetched at the join)
    assert f.mirror.tolist() == [0.75, 2.5, 7.0, 8.0]
    assert f.mirror_rounds == [2, 5]


def test_apply_refuses_an_update_of_another_shape():
    f, _, _ = sent("mix")
    with pytest.raises(RuntimeError, match="has 1 slices"):
        f.apply(0, [fp32(U)])
    with pytest.raises(RuntimeError, match="has 3 values in a slice of 2"):
        f.apply(0, [fp32(U[:3]), fp32(U[3:])])
    with pytest.raises(RuntimeError, match="has 3 values"):
        f.apply(0, [fp32(U[:2]), Master(torch.zeros(3), 1)])


# --- merge: mix and rebase -------------------------------------------------------------------------------
def test_merge_mix_lerps_the_parameters_toward_the_mirror_as_they_are_at_the_merge():
    f, params, _ = sent("mix")
    set_params(params, L2)
    f.apply(0, [fp32(U[:2]), fp32(U[2:])])
    assert f.merge(0) == 3  # the step that sent the round
    expected = [ALPHA * x + (1 - ALPHA) * m for x, m in zip(L2, MIRROR_AFTER)]
    assert flat(params) == expected == [1.375, 2.5, 2.375, 5.0]
    assert (f.in_flight, f.snapshot_round, f.sent_at) == (None, None, {})


def test_merge_rebase_adds_the_mix_taken_at_the_send_and_keeps_the_steps_since():
    f, params, _ = sent("rebase")
    set_params(params, L2)
    f.apply(0, [fp32(U[:2]), fp32(U[2:])])
    assert f.rebases(0)
    assert f.merge(0) == 3
    expected = [x + (1 - ALPHA) * (m - s) for x, m, s in zip(L2, MIRROR_AFTER, L1)]
    assert flat(params) == expected == [1.625, 2.75, 2.125, 5.0]
    # the same as the mix of the parameters at the send, plus every step taken since
    at_send = [ALPHA * s + (1 - ALPHA) * m for s, m in zip(L1, MIRROR_AFTER)]
    assert expected == [a + d for a, d in zip(at_send, STEPS_SINCE_SEND)]


def test_rebase_falls_back_to_the_mix_for_a_round_this_process_did_not_send():
    f, params = fragment("rebase")
    set_params(params, L2)
    f.apply(0, [fp32(U[:2]), fp32(U[2:])])  # round 0, sent before a restart: no snapshot of it here
    assert not f.rebases(0)
    assert f.merge(0) is None  # not sent by this process
    assert flat(params) == [ALPHA * x + (1 - ALPHA) * m for x, m in zip(L2, MIRROR_AFTER)]


def test_take_mirror_makes_the_parameters_the_global_ones_and_drops_the_counts():
    f, params = fragment()
    f.count(5, 1.0)
    f.apply(0, [fp32(U[:2]), fp32(U[2:])])
    f.take_mirror()
    assert flat(params) == MIRROR_AFTER
    assert (f.tokens, f.loss) == (0, (0.0, 0))


# --- the futures that say a round's update is in ----------------------------------------------------------
def test_update_future_is_made_once_per_round_and_a_stop_cancels_the_waits():
    f, _ = fragment()
    fut, new = f.update_future(0)
    again, new_again = f.update_future(0)
    assert (new, new_again) == (True, False) and again is fut
    f.cancel_waits()
    assert fut.cancelled()


# --- checkpoints -----------------------------------------------------------------------------------------
def test_state_dict_round_trips_into_a_fresh_fragment():
    f, params, _ = sent("rebase")
    f.count(4, 2.5)
    f.apply(0, [fp32(U[:2]), None])
    state = f.state_dict()
    assert state["mirror_rounds"] == [1, 1] and state["in_flight"] == 0 and state["sent_at"] == {0: 3}
    assert state["snapshot"][0] == 0 and state["snapshot"][1].tolist() == L1
    assert (state["tokens"], state["loss"]) == (4, [2.5, 1])

    g, g_params = fragment("rebase", values=[0.0] * 4)
    g.load_state_dict(state)
    assert g.mirror.tolist() == f.mirror.tolist() == [0.75, 2.5, 3.0, 4.0]
    assert (g.mirror_rounds, g.in_flight, g.sent_at, g.snapshot_round) == ([1, 1], 0, {0: 3}, 0)
    assert (g.tokens, g.loss) == (4, (2.5, 1))
    set_params(params, L2)
    set_params(g_params, L2)
    assert f.merge(0) == g.merge(0) == 3  # the restored fragment merges its round as the first would
    assert flat(g_params) == flat(params)


def test_a_checkpoint_without_sends_loads_and_a_snapshot_of_another_size_is_refused():
    f, _ = fragment()
    old = {"mirror": torch.tensor(U), "mirror_rounds": [2, 3], "tokens": 0, "loss": [0.0, 0]}
    f.load_state_dict(old)  # written before send steps and snapshots were kept
    assert (f.mirror.tolist(), f.mirror_rounds, f.in_flight, f.sent_at) == (U, [2, 3], None, {})
    with pytest.raises(ValueError, match="send snapshot of fragment 0 does not fit"):
        f.load_state_dict({**old, "snapshot": (0, torch.zeros(5))})


def test_global_state_dict_takes_every_parameter_from_its_fragments_mirror():
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.tensor(G[:2]))
    model.b = torch.nn.Parameter(torch.tensor(G[2:]))
    f = FragmentSync(SPEC, [model.a, model.b], config("mix"), 2, Placement(torch.device("cpu")))
    f.apply(0, [fp32(U[:2]), fp32(U[2:])])
    state = global_state_dict(model, [f])
    assert state["a"].tolist() == MIRROR_AFTER[:2] and state["b"].tolist() == MIRROR_AFTER[2:]
    assert model.a.tolist() == G[:2]  # the model itself is left as it is
