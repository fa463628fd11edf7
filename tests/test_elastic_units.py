"""The pieces of elastic runs, one at a time: where a joiner starts counting steps (joining_step), members
that skip rounds (ShardState.add_member with from_rounds), fragment state that a checkpoint keeps and loads
(fragment_state, ShardCheckpoint), passive sessions and Ready on a real gRPC shard, and a worker's link that
keeps its pushes across a shard restarted from its checkpoint.

The gRPC tests start their own shard (nano model, 2 shards, 3 fragments, 256-byte chunks: conftest's
`make_shard`, tests/support/nano_shard.py) on 127.0.0.1 in a background thread with its own event loop, and
talk to it with the blocking gRPC client. Every wait has a timeout.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import time

import pytest
import torch

from streamdiloco.common.codecs import Encoded, concat, decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint, tensor_digest
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.schedule import (
    events,
    joining_step,
    next_send_after,
    send_round,
    send_step,
    sends_through,
)
from streamdiloco.common.wire import from_chunk, to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.worker.link import ShardLink
from streamdiloco.worker.linkstate import Kept, LinkState, Master, ShardBehind
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import WAIT, push_messages
from tests.support.nano_shard import GOOD_FP, delta, slice_push
from tests.support.nowire import NoWire

pytestmark = pytest.mark.timeout(60)

CFG = SyncConfig(sync_every=6, num_fragments=3)  # first sends: fragment 1 at 2, 2 at 4, 0 at 6
CFG30 = SyncConfig(sync_every=30, num_fragments=5, fragment_sync_delay=1)  # 1 at 6, 2 at 12, ... 0 at 30
CFG_TAU3 = SyncConfig(sync_every=6, num_fragments=3, fragment_sync_delay=3)  # two sends in flight

torch.manual_seed(0)
_MODEL = build_gpt("nano")
_LAYOUT = build_layout(_MODEL, 3)
_INITIAL = [flatten(fragment_params(_MODEL, f)) for f in _LAYOUT.fragments]
FP = model_fingerprint(_LAYOUT, CFG)


# === 1. the schedule: send_step, next_send_after, joining_step ===========================================
def view(rounds, started=None):
    """One shard's view: each fragment's open round, and whether it is in progress."""
    return (list(rounds), list(started) if started is not None else [False] * len(rounds))


def first_rounds(t0: int, cfg: SyncConfig) -> list[int]:
    """The first round of each fragment that a worker starting at step t0 pushes."""
    return [sends_through(f, t0, cfg) for f in range(cfg.num_scheduled_fragments)]


def send_steps(cfg: SyncConfig, upto: int) -> list[int]:
    return [t for t in range(1, upto + 1) if any(e.kind == "send" for e in events(t, cfg))]


@pytest.mark.parametrize("cfg", [CFG, CFG30], ids=["H6P3", "H30P5"])
def test_send_step_is_the_step_at_which_a_round_is_sent(cfg):
    for f in range(cfg.num_fragments):
        for r in range(6):
            s = send_step(f, r, cfg)
            assert send_round(f, s, cfg) == r
            assert sends_through(f, s, cfg) == r + 1 and sends_through(f, s - 1, cfg) == r
            assert ("send", f, r) in [(e.kind, e.fragment, e.round) for e in events(s, cfg)]


def test_send_step_pinned_values():
    assert [send_step(f, 0, CFG) for f in range(3)] == [6, 2, 4]
    assert [send_step(f, 2, CFG) for f in range(3)] == [18, 14, 16]
    assert [send_step(f, 0, CFG30) for f in range(5)] == [30, 6, 12, 18, 24]
    assert send_step(4, 2, CFG30) == 84


@pytest.mark.parametrize("cfg", [CFG, CFG30], ids=["H6P3", "H30P5"])
def test_next_send_after_is_the_first_send_step_after_a_step(cfg):
    steps = send_steps(cfg, 400)
    for t in range(0, 300):
        n = next_send_after(t, cfg)
        assert n == min(s for s in steps if s > t), t


def test_next_send_after_pinned_values():
    assert [next_send_after(t, CFG) for t in (0, 1, 2, 3, 5, 6, 7)] == [2, 2, 4, 4, 6, 8, 8]
    assert [next_send_after(t, CFG30) for t in (0, 5, 6, 29, 30)] == [6, 6, 12, 30, 36]


@pytest.mark.parametrize("cfg", [CFG, CFG30], ids=["H6P3", "H30P5"])
def test_a_fresh_run_is_joined_at_step_0(cfg):
    p = cfg.num_fragments
    assert joining_step([view([0] * p)], cfg) == 0
    assert joining_step([view([0] * p), view([0] * p)], cfg) == 0
    assert joining_step([], cfg) == 0


def test_while_a_round_waits_for_pushes_the_joiner_starts_after_the_latest_closed_send_and_sends_it():
    # fragment 1's round 0 (sent at step 2) waits for pushes, nothing closed yet: a late start, every step
    t0 = joining_step([view([0, 0, 0], [False, True, False])], CFG)
    assert t0 == 0 and first_rounds(t0, CFG) == [0, 0, 0]
    # rounds 2 of fragments 1 and 2 closed (the latest at step 16), fragment 0's round 2 (step 18) waits
    t0 = joining_step([view([2, 3, 3], [True, False, False])], CFG)
    assert t0 == 16 and first_rounds(t0, CFG) == [2, 3, 3]
    # H=30, P=5: fragment 1's round 1 (step 36) waits; fragment 0's round 0 (step 30) closed last
    t0 = joining_step([view([1, 1, 1, 1, 1], [False, True, False, False, False])], CFG30)
    assert t0 == 30 and first_rounds(t0, CFG30) == [1, 1, 1, 1, 1]
    # a round in progress that has its quorum does not wait for the joiner: it starts ahead (step 19)
    t0 = joining_step([([2, 3, 3], [True, False, False], [False, False, False])], CFG)
    assert t0 == 19 and first_rounds(t0, CFG) == [3, 3, 3]


def test_when_the_latest_send_closed_the_joiner_starts_just_before_the_next_send():
    t0 = joining_step([view([0, 1, 0])], CFG)  # fragment 1's round 0 (step 2) closed: next send is 4
    assert t0 == 3 and first_rounds(t0, CFG) == [0, 1, 0]
    t0 = joining_step([view([3, 3, 3])], CFG)  # fragment 0's round 2 (step 18) closed: next is step 20
    assert t0 == 19 and first_rounds(t0, CFG) == [3, 3, 3]
    t0 = joining_step([view([1, 2, 1, 1, 1])], CFG30)  # fragment 1's round 1 (step 36) closed: next 42
    assert t0 == 41 and first_rounds(t0, CFG30) == [1, 2, 1, 1, 1]


@pytest.mark.parametrize(
    "a, b, want",
    [
        # shard a: fragment 2's round 0 (step 4) in progress; shard b: still fragment 1's round 0 (step 2):
        # the joiner sends both (shard a drops the one it closed)
        (view([0, 1, 0], [False, False, True]), view([0, 0, 0], [False, True, False]), 1),
        # shard a closed fragment 2's round 1 (step 10); shard b is behind, at fragment 1's round 1 (step 8)
        (view([1, 2, 2]), view([1, 1, 1], [False, True, False]), 7),
        # the same round closed on one shard, open on the other: the joiner sends it (the open shard takes it)
        (view([0, 1, 1]), view([0, 1, 0], [False, False, True]), 3),
    ],
    ids=["both-open", "one-ahead", "closed-here-open-there"],
)
def test_views_of_shards_that_disagree_let_the_joiner_send_what_the_shard_behind_waits_for(a, b, want):
    assert joining_step([a, b], CFG) == want
    assert joining_step([b, a], CFG) == want


def _random_run_views(rng: random.Random, cfg: SyncConfig, num_shards: int):
    """Views of a run whose fastest worker is at step T: every round it sent at a step <= T - tau was
    merged (closed everywhere), each later one is closed or still in progress on each shard on its own."""
    T = rng.randrange(0, 8 * cfg.sync_every)
    sent = first_rounds(T, cfg)  # rounds each fragment has sent by step T
    views = []
    for _ in range(num_shards):
        rounds, started = [], []
        for f, n in enumerate(sent):
            if n == 0:
                rounds.append(0)
                started.append(False)
            elif send_step(f, n - 1, cfg) <= T - cfg.fragment_sync_delay or rng.random() < 0.5:
                rounds.append(n)  # the latest round closed
                started.append(False)
            else:
                rounds.append(n - 1)  # in progress
                started.append(True)
        views.append((rounds, started))
    return T, sent, views


@pytest.mark.parametrize("cfg", [CFG, CFG30, CFG_TAU3], ids=["H6P3", "H30P5", "H6P3-tau3"])
def test_the_joiner_sends_every_round_that_waits_and_never_starts_past_one_nobody_sent(cfg):
    rng = random.Random(1234)
    for _ in range(3000):
        T, sent, views = _random_run_views(rng, cfg, rng.randint(1, 3))
        t0 = joining_step(views, cfg)
        first = first_rounds(t0, cfg)
        where = (T, views, t0)
        assert 0 <= t0 <= next_send_after(T, cfg) - 1, where  # never further ahead than the next send
        for f in range(cfg.num_fragments):
            # nor does it start past a round nobody has sent yet: rounds wait for the others, not for it
            assert first[f] <= sent[f], where
            for rounds, started in views:
                if started[f]:  # a round in progress (short of its quorum, by default): the joiner sends it
                    assert first[f] <= rounds[f], where
        if not any(s for _, started in views for s in started):
            # nothing waits for pushes: it starts just before a send, pushing only rounds nobody has started
            assert next_send_after(t0, cfg) == t0 + 1 or t0 == 0, where
            for f in range(cfg.num_fragments):
                assert first[f] >= max(v[0][f] for v in views), where
        if not any(r for rounds, _ in views for r in rounds):
            assert t0 == 0, where  # no round closed anywhere: a late start does every step


def test_joining_step_refuses_a_view_whose_lists_differ_in_length():
    with pytest.raises(ValueError):
        joining_step([([0, 1, 0], [False, False])], CFG)


# === 2. ShardState: members that skip rounds, started, fragment state ===================================
def make_state(min_workers=1, round_timeout=float("inf"), shard=0, num_shards=2, **cfg_kw) -> ShardState:
    cfg = SyncConfig(sync_every=6, num_fragments=3, **cfg_kw)
    return ShardState(shard, num_shards, _LAYOUT, cfg, _INITIAL, 0, min_workers, round_timeout)


def push_whole(st: ShardState, worker: str, fragment: int, round: int, seed: int, weight=10.0, now=0.0):
    enc = slice_push(st, fragment, seed)
    assert st.push_chunk(worker, fragment, round, 0, 0, enc.numel, enc, True, weight, None, now) is True


def test_a_member_is_not_expected_in_rounds_below_its_from_rounds_but_in_later_ones():
    st = make_state(min_workers=1)
    st.add_member("a")
    st.add_member("j", from_rounds=[1, 0, 0])
    push_whole(st, "a", 0, 0, 1)
    assert st.due(0.0) == [(0, "all")]  # j skips round 0 of fragment 0: a's push closes it
    st.close_round(0)
    push_whole(st, "a", 1, 0, 2)
    assert st.due(0.0) == []  # j is expected from round 0 of fragment 1
    push_whole(st, "j", 1, 0, 3)
    assert st.due(0.0) == [(1, "all")]
    st.close_round(1)
    push_whole(st, "a", 0, 1, 4)
    assert st.due(0.0) == []  # and from round 1 of fragment 0
    push_whole(st, "j", 0, 1, 5)
    assert st.due(0.0) == [(0, "all")]
    assert st.close_round(0).contributors == ("a", "j")


def test_a_member_added_without_from_rounds_is_expected_in_every_round_that_starts_from_now():
    st = make_state(min_workers=1)
    st.add_member("a")
    push_whole(st, "a", 2, 0, 1)  # fragment 2's round started before k came: it does not wait for k
    st.add_member("k")
    assert st.due(0.0) == [(2, "all")]
    st.add_member("j", from_rounds=[5, 5, 5])
    st.add_member("j")  # Ready again without rounds: expected from the open rounds on
    push_whole(st, "a", 0, 0, 2)
    push_whole(st, "k", 0, 0, 3)
    assert st.due(0.0) == [(2, "all")]  # fragment 0 waits for j


@pytest.mark.parametrize("from_rounds", [[], [0, 0], [0, 0, 0, 0]], ids=["empty", "short", "long"])
def test_add_member_refuses_from_rounds_of_the_wrong_length_and_changes_nothing(from_rounds):
    st = make_state()
    st.add_member("j", from_rounds=[2, 2, 2])
    with pytest.raises(ValueError, match=f"from_rounds has {len(from_rounds)} entries, this run 3"):
        st.add_member("w", from_rounds=from_rounds)
    with pytest.raises(ValueError):
        st.add_member("j", from_rounds=from_rounds)
    assert st.members == {"j"} and st.member_from == {"j": [2, 2, 2]}


def test_started_is_true_from_a_rounds_first_whole_push_until_it_closes():
    st = make_state(min_workers=2)
    st.add_member("a")
    st.add_member("b")
    enc = slice_push(st, 0, 1)
    parts = to_chunks(enc, 0, 0, 512)
    assert [st.started(f) for f in range(3)] == [False, False, False]
    for c in parts[:-1]:  # all chunks but the last: the push is staged, the round not started
        st.push_chunk(
            "a", 0, 0, c.seq, c.offset, c.total, from_chunk(c), c.last, 10.0 if c.seq == 0 else None
        )
    assert not st.started(0)
    c = parts[-1]
    assert st.push_chunk("a", 0, 0, c.seq, c.offset, c.total, from_chunk(c), c.last) is True
    assert [st.started(f) for f in range(3)] == [True, False, False]
    push_whole(st, "b", 0, 0, 2)
    st.close_round(0)
    assert not st.started(0) and st.round_of(0) == 1


def _through_bytes(saved: dict) -> dict:
    """As a checkpoint file does: torch.save, then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _run_rounds(st: ShardState, plan: list[tuple[int, int]]) -> list:
    """Close rounds: (fragment, seed) each, two workers per round; returns the ClosedRounds."""
    out = []
    for f, seed in plan:
        r = st.round_of(f)
        push_whole(st, "a", f, r, seed, weight=30.0)
        push_whole(st, "b", f, r, seed + 100, weight=70.0)
        out.append(st.close_round(f))
    return out


def test_fragment_state_round_trip_continues_bit_identically():
    # stochastic downlink rounding: the rounding generator's state matters too
    kw = dict(downlink_rounding="stochastic")
    a, b, fresh = make_state(**kw), make_state(**kw), make_state(**kw)
    _run_rounds(a, [(0, 1), (1, 2), (0, 3), (0, 4), (2, 5)])
    for f in range(3):
        b.load_fragment_state(f, _through_bytes(a.fragment_state(f)))
    assert [b.round_of(f) for f in range(3)] == [a.round_of(f) for f in range(3)] == [3, 1, 1]
    for f in range(3):
        assert torch.equal(b.master(f), a.master(f))
        assert torch.equal(b.fragments[f].outer.residual, a.fragments[f].outer.residual)
    assert not torch.equal(b.master(0), fresh.master(0))
    plan = [(0, 10), (1, 11), (2, 12), (0, 13)]
    ca, cb, cf = _run_rounds(a, plan), _run_rounds(b, plan), _run_rounds(fresh, plan)
    for x, y in zip(ca, cb):
        assert (x.fragment, x.round) == (y.fragment, y.round)
        assert torch.equal(x.update.payload, y.update.payload) and torch.equal(
            x.update.scales, y.update.scales
        )
    for f in range(3):
        assert torch.equal(a.master(f), b.master(f))
    # without the load, the same pushes give other updates (momentum, residual and rounds differ)
    assert not torch.equal(decode(ca[0].update), decode(cf[0].update))


def test_fragment_state_is_a_snapshot_that_later_rounds_do_not_change():
    st = make_state()
    _run_rounds(st, [(1, 1)])
    saved = st.fragment_state(1)
    copy = _through_bytes(saved)
    _run_rounds(st, [(1, 2), (1, 3)])
    assert saved["round"] == 1 and st.round_of(1) == 3
    assert torch.equal(saved["outer"]["master"], copy["outer"]["master"])
    assert torch.equal(saved["outer"]["residual"], copy["outer"]["residual"])
    buf = saved["outer"]["sgd"]["state"][0]["momentum_buffer"]
    assert torch.equal(buf, copy["outer"]["sgd"]["state"][0]["momentum_buffer"])


def _state_key(st: ShardState) -> list:
    return [
        (st.round_of(f), tensor_digest(st.master(f)), tensor_digest(st.fragments[f].outer.residual))
        for f in range(3)
    ]


def _with_master(saved: dict, master: torch.Tensor) -> dict:
    return {**saved, "outer": {**saved["outer"], "master": master}}


@pytest.mark.parametrize(
    "make_saved, words",
    [
        (lambda: make_state().fragment_state(1), "checkpoint of fragment 1 slice"),
        (lambda: make_state(shard=1).fragment_state(0), "does not fit fragment 0 slice"),
        (lambda: make_state(num_shards=3).fragment_state(0), "does not fit fragment 0 slice"),
        (
            lambda: _with_master(make_state().fragment_state(0), torch.zeros(5)),
            "holds a master of (5,), want (12352,)",
        ),
        (
            lambda: _with_master(make_state().fragment_state(0), make_state().master(0).double()),
            "holds a master of",
        ),
        (lambda: {"round": 3}, "is not a fragment's state"),
    ],
    ids=["other-fragment", "other-shard", "other-num-shards", "short-master", "fp64-master", "no-slice"],
)
def test_load_fragment_state_refuses_another_slice_or_shape_and_changes_nothing(make_saved, words):
    st = make_state()
    _run_rounds(st, [(0, 1)])
    before = _state_key(st)
    with pytest.raises(ValueError) as e:
        st.load_fragment_state(0, make_saved())
    assert words in str(e.value)
    assert _state_key(st) == before


def test_load_fragment_state_refuses_a_residual_of_another_shape():
    saved = make_state().fragment_state(0)
    saved["outer"]["residual"] = torch.zeros(5)
    with pytest.raises(ValueError):
        make_state().load_fragment_state(0, saved)


def test_a_round_that_only_a_skipping_joiner_could_complete_still_closes_at_its_deadline():
    # H=6, P=3, tau=3: the fastest worker a has sent fragment 1 round 0 (step 2) and fragment 2 round 0
    # (step 4), and waits at step 5 to merge fragment 1; worker b has sent nothing, and now dies
    st = make_state(min_workers=2, round_timeout=10.0, fragment_sync_delay=3)
    st.add_member("a")
    st.add_member("b")
    push_whole(st, "a", 1, 0, 1, now=0.0)
    push_whole(st, "a", 2, 0, 2, now=0.0)
    st.remove_member("b")
    first = [0, 1, 0]  # a joiner that will not push fragment 1's round 0 (it started past it)
    st.add_member("j", from_rounds=first)
    push_whole(st, "j", 2, 0, 3, now=1.0)
    assert (2, "all") in st.due(1.0)
    st.close_round(2)
    # nobody present can push fragment 1's round 0 any more: it must close at its deadline, not stall
    assert st.due(100.0) == [(1, "deadline")]


def _restarted(st: ShardState, until: float) -> ShardState:
    """A new state loaded from `st`'s fragment states, as a shard restarted from its checkpoint."""
    again = make_state(min_workers=st.min_workers, round_timeout=st.round_timeout)
    for f in range(st.layout.num_fragments):
        again.load_fragment_state(f, st.fragment_state(f))
    again.expect_back(until)
    return again


def test_a_restarted_shard_waits_for_the_members_its_checkpoint_names_before_closing_a_round():
    # a and b are members; b's push of fragment 0 round 0 was accepted, then the shard died before a pushed
    st = make_state(min_workers=1, round_timeout=30.0)
    st.add_member("a")
    st.add_member("b")
    push_whole(st, "b", 0, 0, 1)
    again = _restarted(st, until=60.0)
    assert again.returning == {"a", "b"} and again.round_of(0) == 0  # the open round's pushes are not saved
    again.add_member("a")  # a comes back first and pushes: the round must wait for b's push again
    push_whole(again, "a", 0, 0, 2, now=1.0)
    assert again.due(1.0) == []
    again.add_member("b")
    push_whole(again, "b", 0, 0, 1, now=2.0)  # b sends again the push it kept
    assert again.due(2.0) == [(0, "all")]
    assert again.close_round(0).contributors == ("a", "b")


def test_a_member_that_does_not_come_back_is_waited_for_only_until_its_time_is_up():
    st = make_state(min_workers=1, round_timeout=30.0)
    st.add_member("a")
    st.add_member("gone")
    again = _restarted(st, until=20.0)
    again.add_member("a")
    push_whole(again, "a", 0, 0, 2, now=1.0)
    assert again.due(19.0) == []
    assert again.due(20.0) == [(0, "all")] and again.returning == set()


def test_the_next_rounds_a_worker_names_count_the_sends_of_its_step_not_done_yet():
    # H=6, P=3, tau=2: fragment 1 sends round 0 at step 2 and round 1 at step 8; a merge of round 0 put off
    # until step 8 (adaptive) is done there before that send, so a worker that is stopped or reconnects
    # while it waits for that merge has not sent fragment 1's round 1 yet
    from streamdiloco.common.schedule import Event, events, sends_early
    from streamdiloco.worker.engine import SyncEngine

    cfg = SyncConfig(sync_every=6, num_fragments=3, fragment_sync_delay=2)
    engine = SyncEngine(build_gpt("nano"), _LAYOUT, cfg, NoWire())
    engine.step_count = 8
    engine.pending = sends_early([Event("merge", 1, 0)] + events(8, cfg))
    assert engine.pending == [Event("merge", 1, 0), Event("send", 1, 1), Event("merge", 0, 0)]
    assert engine.next_rounds() == [1, 1, 1]
    engine.pending = []  # once the step's events are done
    assert engine.next_rounds() == [1, 2, 1]


# === 3. ShardCheckpoint ===================================================================================
def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


@pytest.fixture
def saved_run(tmp_path):
    """A checkpoint directory of a state that closed a few rounds; returns (checkpoint, state)."""
    st = make_state()
    _run_rounds(st, [(0, 1), (0, 2), (2, 3)])
    ck = ShardCheckpoint(tmp_path / "ck", FP)
    assert not ck.exists()
    assert ck.save_all(st) is True
    assert ck.exists() and ck.errors == 0 and ck.writes == 3
    return ck, st


def test_save_all_then_load_restores_rounds_and_state_bit_for_bit(saved_run):
    ck, st = saved_run
    fresh = make_state()
    ShardCheckpoint(ck.dir, FP).load(fresh)
    assert [fresh.round_of(f) for f in range(3)] == [2, 0, 1]
    assert _state_key(fresh) == _state_key(st)
    # and it goes on as the original does
    ca, cb = _run_rounds(st, [(0, 7), (1, 8)]), _run_rounds(fresh, [(0, 7), (1, 8)])
    for x, y in zip(ca, cb):
        assert torch.equal(x.update.payload, y.update.payload) and torch.equal(
            x.update.scales, y.update.scales
        )
    assert _state_key(fresh) == _state_key(st)


def _close_logged(st: ShardState, ck: ShardCheckpoint, f: int) -> None:
    """Close fragment f's round as the service does: its log written before the update would go out, and
    every FULL_EVERY-th round the whole state after it."""
    job = st.begin_close(f)
    record = job.record()
    job.run()
    assert ck.log_round(f, record) is True
    st.end_close(job)
    if ck.full_due(job.round):
        st.hold(f)
        assert ck.save(f, job.fragment_state()) is True
        st.release(f)


def _momentum(st: ShardState, f: int) -> str:
    return tensor_digest(st.fragments[f].outer.state_dict()["sgd"]["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_restart_replays_the_logged_rounds_after_the_whole_state_bit_for_bit(tmp_path, rounding):
    """Between whole states a round is logged as its encoded pushes; a restarted shard loads the last whole
    state and replays the logs: rounds, masters, residuals, momentum and the rounding stream as before."""
    from streamdiloco.server.storage import checkpoint as ckmod

    st = make_state(downlink_rounding=rounding)
    for fr in st.fragments:  # fragment 0's pushes are folded ahead of the close too: logged as a partial sum
        fr.fold_bytes = 1000
    ck = ShardCheckpoint(tmp_path / "ck", FP)
    assert ck.save_all(st)
    for i in range(ckmod.FULL_EVERY + 3):  # past one whole state of each fragment, and 2 logs after it
        for f in range(3):
            r = st.round_of(f)
            for w, name in enumerate(("a", "b", "c")):
                push_whole(st, name, f, r, seed=100 * i + 10 * f + w, weight=10.0 + w)
            for g in st.fold_due():
                st.end_fold(st.begin_fold(g).run())
            _close_logged(st, ck, f)
    logs = {p.name for p in (ck.dir / "rounds").iterdir()}
    assert logs == {f"fragment-{f}-round-{r}.pt" for f in range(3) for r in (8, 9, 10)}  # older ones dropped
    fresh = make_state(downlink_rounding=rounding)
    for fr in fresh.fragments:  # the same shard: its pushes are settled and folded at the same points
        fr.fold_bytes = 1000
    ShardCheckpoint(ck.dir, FP).load(fresh)
    assert _state_key(fresh) == _state_key(st)
    assert [_momentum(fresh, f) for f in range(3)] == [_momentum(st, f) for f in range(3)]
    a, b = _run_rounds(st, [(0, 7), (1, 8)]), _run_rounds(fresh, [(0, 7), (1, 8)])
    for x, y in zip(a, b, strict=True):  # and it goes on as the original does
        assert torch.equal(x.update.payload, y.update.payload) and torch.equal(
            x.update.scales, y.update.scales
        )


def test_a_damaged_round_log_is_refused(tmp_path):
    st = make_state()
    ck = ShardCheckpoint(tmp_path / "ck", FP)
    assert ck.save_all(st)
    for f in range(3):
        push_whole(st, "a", f, 0, seed=f)
        _close_logged(st, ck, f)
    path = ck.dir / "rounds" / "fragment-1-round-0.pt"
    record = torch.load(path, weights_only=True)
    record["pushes"][0]["parts"][0]["scales"][0] = float("inf")  # a chunk its own push would have refused
    torch.save(record, path)
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "rounds/fragment-1-round-0.pt is damaged: its sha256 is" in _one_line(e)
    _relist(ck, "rounds/fragment-1-round-0.pt")  # listed with its new hash: its values are checked too
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "rounds/fragment-1-round-0.pt is damaged" in _one_line(e) and "scales" in str(e.value)
    path.write_bytes(b"not a log")
    _relist(ck, "rounds/fragment-1-round-0.pt")
    with pytest.raises(ValueError, match="fragment-1-round-0.pt is damaged"):
        ck.load(make_state())


def _relist(ck: ShardCheckpoint, name: str) -> None:
    """List a file in meta.json with the hash of what it now holds (a change made with its hash)."""
    meta = json.loads((ck.dir / "meta.json").read_text())
    meta["files"][name] = hashlib.sha256((ck.dir / name).read_bytes()).hexdigest()
    (ck.dir / "meta.json").write_text(json.dumps(meta))


def test_exists_needs_meta_json(tmp_path):
    st = make_state()
    ck = ShardCheckpoint(tmp_path / "ck", FP)
    assert not ck.exists()
    assert ck.save_fragment(st, 0) is True  # a fragment file alone is not a checkpoint
    assert not ck.exists()
    ck.save_all(st)
    assert ck.exists()
    assert sorted(p.name for p in ck.dir.iterdir()) == [
        "fragment-0.pt",
        "fragment-1.pt",
        "fragment-2.pt",
        "meta.json",
    ]


@pytest.mark.parametrize(
    "target, words",
    [
        (lambda: make_state(shard=1), "belongs to shard 0 of 2, not shard 1 of 2"),
        (lambda: make_state(num_shards=3), "belongs to shard 0 of 2, not shard 0 of 3"),
        (lambda: make_state(outer_lr=0.7), "other sync settings (outer_lr)"),
        (
            lambda: make_state(fragment_sync_delay=2, downlink_rounding="stochastic"),
            "other sync settings (downlink_rounding, fragment_sync_delay)",
        ),
    ],
    ids=["shard", "num-shards", "one-setting", "two-settings"],
)
def test_load_refuses_a_checkpoint_of_another_shard_or_other_settings(saved_run, target, words):
    ck, _ = saved_run
    with pytest.raises(ValueError) as e:
        ck.load(target())
    assert words in _one_line(e) and str(ck.dir) in str(e.value)


def test_load_refuses_a_checkpoint_of_another_model(saved_run):
    ck, _ = saved_run
    deeper = model_fingerprint(build_layout(build_gpt("nano", n_layer=8), 3), CFG)
    with pytest.raises(ValueError) as e:
        ShardCheckpoint(ck.dir, deeper).load(make_state())
    assert "was written for another model" in _one_line(e) and "checkpoint has 4 blocks, model 8" in str(
        e.value
    )


def test_load_refuses_a_missing_fragment_file(saved_run):
    ck, _ = saved_run
    (ck.dir / "fragment-1.pt").unlink()
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "is incomplete: fragment-1.pt is missing" in _one_line(e)


def test_load_refuses_an_unreadable_meta_json(saved_run):
    ck, _ = saved_run
    (ck.dir / "meta.json").write_text("{not json")
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "cannot read meta.json" in _one_line(e) and "--fresh" in str(e.value)


def test_load_refuses_a_checkpoint_of_another_format(saved_run):
    ck, _ = saved_run
    meta = json.loads((ck.dir / "meta.json").read_text())
    (ck.dir / "meta.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "has format 99, this shard reads 2 (and 1)" in _one_line(e)


def test_load_refuses_fragment_files_swapped_between_fragments(saved_run):
    ck, _ = saved_run
    one, two = (ck.dir / "fragment-1.pt").read_bytes(), (ck.dir / "fragment-2.pt").read_bytes()
    (ck.dir / "fragment-1.pt").write_bytes(two)
    (ck.dir / "fragment-2.pt").write_bytes(one)
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "fragment-1.pt is damaged: its sha256 is" in _one_line(e)
    for name in ("fragment-1.pt", "fragment-2.pt"):  # swapped with their hashes: the slices do not fit
        _relist(ck, name)
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "checkpoint of fragment 2 slice" in _one_line(e) and "does not fit fragment 1" in str(e.value)


def _damage(kind: str, data: bytes) -> bytes:
    return {
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "garbage": bytes(random.Random(7).randrange(256) for _ in range(4096)),
        "text": b"not a checkpoint\n",
    }[kind]


@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage", "text"])
def test_load_refuses_a_damaged_fragment_file_in_one_line(saved_run, kind):
    ck, _ = saved_run
    path = ck.dir / "fragment-2.pt"
    path.write_bytes(_damage(kind, path.read_bytes()))
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "fragment-2.pt is damaged: its sha256 is" in _one_line(e) and str(ck.dir) in str(e.value)
    _relist(ck, "fragment-2.pt")  # with its hash listed, torch's own refusal
    with pytest.raises(ValueError) as e:
        ck.load(make_state())
    assert "fragment-2.pt is damaged (" in _one_line(e) and str(ck.dir) in str(e.value)


def test_save_fragment_returns_false_and_counts_the_error_when_the_directory_cannot_be_written(tmp_path):
    st = make_state()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the checkpoint directory should be")
    ck = ShardCheckpoint(blocker, FP)
    assert ck.save_fragment(st, 0) is False
    assert (ck.errors, ck.writes) == (1, 0) and ck.last_error and "\n" not in ck.last_error
    assert ck.save_all(st) is False
    assert ck.errors >= 2 and ck.writes == 0
    assert blocker.read_text().startswith("a regular file")


# === 4. the servicer over a real gRPC channel: passive sessions and Ready ================================
SLICE_LEN = [hi - lo for lo, hi in make_state().ranges]
ENC = {(f, s): encode(delta(s + 10 * f, SLICE_LEN[f]), "e3m0", 128) for f in range(3) for s in range(4)}


def reference_round(pushes: list[tuple[str, Encoded, float, float | None]], fragment: int = 0):
    """The closed round that ShardState gives for these whole pushes, from the starting state."""
    st = make_state()
    for name, enc, weight, loss in pushes:
        st.push(name, fragment, 0, enc, weight, loss)
    return st.close_round(fragment)


def same_update(chunks: list[pb.Chunk], closed) -> bool:
    got = concat([from_chunk(c) for c in chunks])
    return (
        all(c.fragment == closed.fragment and c.round == closed.round for c in chunks)
        and torch.equal(got.payload, closed.update.payload)
        and torch.equal(got.scales, closed.update.scales)
    )


def test_a_passive_session_gets_a_welcome_with_the_rounds_and_member_false(make_shard):
    s = make_shard(min_workers=2)
    a = s.worker("a")
    welcome_a = a.welcome
    s.worker("b")
    assert welcome_a.member and list(welcome_a.rounds) == [0, 0, 0]
    a.push(push_messages(ENC[2, 0], fragment=2))
    assert a.session.result().accepted  # fragment 2's round 0 is in progress (waits for b)
    p = s.worker("p", passive=True)
    welcome = p.welcome
    assert welcome.member is False
    assert list(welcome.rounds) == [0, 0, 0] and list(welcome.started) == [False, False, True]
    assert s.member_state("p") == "passive" and s.member_state("a") == "member"
    assert s.on_loop(lambda: sorted(s.service.state.members)) == ["a", "b"]


def test_a_passive_session_is_not_waited_for_but_gets_the_updates(make_shard):
    s = make_shard(min_workers=1)
    p = s.worker("p", passive=True)
    a = s.worker("a")
    a.push(push_messages(ENC[0, 0]))
    assert a.session.result().accepted
    closed = reference_round([("a", ENC[0, 0], 100.0, 3.0)])
    assert same_update(a.session.update(), closed)  # closed by a alone: p is not expected
    assert same_update(p.session.update(), closed)  # and p gets the update as well
    last = s.status()["recent_rounds"][-1]
    assert (last["fragment"], last["round"], last["contributors"], last["why"]) == (0, 0, ["a"], "all")


def test_a_push_before_ready_is_refused_not_ready_and_changes_nothing(make_shard):
    s = make_shard(min_workers=1)
    p = s.worker("p", passive=True)
    s.worker("a")
    before = s.snapshot()
    msgs = push_messages(ENC[0, 1])
    assert len(msgs) > 1
    p.push(msgs)
    r = p.session.result()
    assert (r.accepted, r.reason, r.fragment, r.round) == (False, "not_ready", 0, 0)
    assert "send Ready before pushing" in r.message
    s.quiesce(p)
    assert s.snapshot() == before  # nothing staged, summed, started or closed
    status = s.status()
    me = next(m for m in status["members"] if m["name"] == "p")
    assert (me["state"], me["refused"], me["pushes"], me["receiving"]) == ("passive", 1, 0, [])  # one refusal
    assert status["pushes_refused"] == {"not_ready": 1}
    # once ready, the same push is taken
    p.ready()
    assert p.session.next_message("welcome").welcome.member
    p.push(msgs)
    assert p.session.result().accepted


@pytest.mark.parametrize("from_rounds", [[0, 0], [0, 0, 0, 0], [0, 2**60, 0]], ids=["short", "long", "huge"])
def test_a_bad_ready_is_refused_bad_message_and_the_worker_stays_passive(make_shard, from_rounds):
    s = make_shard(min_workers=1)
    p = s.worker("p", passive=True)
    before = s.snapshot()
    p.ready(from_rounds)
    r = p.session.result()
    assert (r.accepted, r.reason) == (False, "bad_message")
    assert "Ready must name the first round of each of the 3 fragments (or none)" in r.message
    s.quiesce(p)
    assert s.snapshot() == before and s.member_state("p") == "passive"
    assert s.status()["bad_messages"] == 1
    p.push(push_messages(ENC[1, 0], fragment=1))  # still passive: the session goes on, pushes are refused
    assert p.session.result().reason == "not_ready"
    p.ready([0, 0, 0])  # a good Ready afterwards works
    assert p.session.next_message("welcome").welcome.member
    assert s.member_state("p") == "member"


def test_ready_makes_a_passive_session_a_member_that_rounds_wait_for(make_shard):
    s = make_shard(min_workers=1)
    p = s.worker("p", passive=True)
    a = s.worker("a")
    p.ready()
    welcome = p.session.next_message("welcome").welcome
    assert welcome.member and list(welcome.rounds) == [0, 0, 0] and list(welcome.started) == [False] * 3
    assert s.member_state("p") == "member"
    assert s.on_loop(lambda: sorted(s.service.state.members)) == ["a", "p"]
    a.push(push_messages(ENC[0, 0]))
    assert a.session.result().accepted
    s.quiesce(a)
    assert s.on_loop(lambda: s.service.state.round_of(0)) == 0  # p is expected now
    p.push(push_messages(ENC[0, 1], weight=300.0))
    assert p.session.result().accepted
    closed = reference_round([("a", ENC[0, 0], 100.0, 3.0), ("p", ENC[0, 1], 300.0, 3.0)])
    assert same_update(a.session.update(), closed) and same_update(p.session.update(), closed)
    # a second Ready changes nothing but answers with a Welcome
    p.ready([7, 7, 7])
    assert p.session.next_message("welcome").welcome.member
    assert s.on_loop(lambda: s.service.state.member_from) == {}


def test_ready_with_from_rounds_skips_the_rounds_below_them(make_shard):
    s = make_shard(min_workers=1)
    a = s.worker("a")
    p = s.worker("p", passive=True)
    p.ready([1, 0, 0])
    assert p.session.next_message("welcome").welcome.member
    a.push(push_messages(ENC[0, 0]))  # fragment 0 round 0: p skips it, a closes it alone
    assert a.session.result().accepted
    closed = reference_round([("a", ENC[0, 0], 100.0, 3.0)])
    assert same_update(a.session.update(), closed) and same_update(p.session.update(), closed)
    a.push(push_messages(ENC[1, 0], fragment=1))  # fragment 1 round 0: p takes part
    assert a.session.result().accepted
    a.push(push_messages(ENC[0, 1], fragment=0, round=1))  # fragment 0 round 1: p takes part
    assert a.session.result().accepted
    s.quiesce(a)
    assert s.on_loop(lambda: [s.service.state.round_of(f) for f in range(3)]) == [1, 0, 0]
    p.push(push_messages(ENC[1, 1], fragment=1))
    assert p.session.result().accepted
    assert [c.fragment for c in p.session.update()][0] == 1
    p.push(push_messages(ENC[0, 2], fragment=0, round=1))
    assert p.session.result().accepted
    assert [(c.fragment, c.round) for c in p.session.update()][0] == (0, 1)
    s.wait_for(lambda: [s.service.state.round_of(f) for f in range(3)] == [2, 1, 0], "both rounds to close")
    assert {(r["fragment"], r["round"]): r["contributors"] for r in s.status()["recent_rounds"]} == {
        (0, 0): ["a"],
        (1, 0): ["a", "p"],
        (0, 1): ["a", "p"],
    }


def test_status_lists_as_many_recent_rounds_as_asked(make_shard):
    s = make_shard(min_workers=1)
    a = s.worker("a")
    for f in range(3):
        a.push(push_messages(ENC[f, 0], fragment=f))
        assert a.session.result().accepted
        a.session.update()
    assert [(r["fragment"], r["round"]) for r in s.status()["recent_rounds"]] == [(0, 0), (1, 0), (2, 0)]
    assert [(r["fragment"], r["round"]) for r in s.status(rounds=2)["recent_rounds"]] == [(1, 0), (2, 0)]
    assert [r["fragment"] for r in s.status(rounds=1)["recent_rounds"]] == [2]
    assert s.status(rounds=0)["recent_rounds"] == []
    assert len(s.status(rounds=500)["recent_rounds"]) == 3
    assert s.status(rounds=0)["rounds_closed"] == 3


def test_status_shows_a_half_received_push(make_shard):
    s = make_shard(min_workers=1)
    a = s.worker("a")
    s.worker("b")
    msgs = push_messages(ENC[0, 0])
    a.push(msgs[:10])
    s.quiesce(a)
    members = {m["name"]: m for m in s.status()["members"]}
    assert members["a"]["receiving"] == [{"fragment": 0, "round": 0, "values": 10 * 512, "of": SLICE_LEN[0]}]
    assert members["b"]["receiving"] == []
    a.push(msgs[10:])
    assert a.session.result().accepted
    s.quiesce(a)
    assert all(m["receiving"] == [] for m in s.status()["members"])


# === 5. the worker's ShardLink ============================================================================
def test_have_counts_held_rounds_without_gaps():
    state = LinkState(3)  # the link's bookkeeping alone
    dummy = [(0, ENC[0, 0])]
    state.arrived = {(0, 0): dummy, (0, 2): dummy, (1, 3): dummy}
    assert [state.have(f) for f in range(3)] == [1, 0, 0]  # round 1 of fragment 0 is missing
    state.arrived[(0, 1)] = dummy
    assert state.have(0) == 3
    state.held = [0, 3, 0]  # rounds 0..2 of fragment 1 taken, round 3 here
    assert state.have(1) == 4
    state.covered = [0, 0, 5]  # a fetched master holds rounds 0..4 of fragment 2
    state.arrived[(2, 6)] = dummy
    assert state.have(2) == 5
    state.masters[2] = Master(torch.zeros(1), 6)
    state.arrived[(2, 7)] = dummy
    assert state.have(2) == 8


def test_link_state_takes_updates_masters_and_lets_kept_pushes_go():
    state = LinkState(2)
    push = Kept(ENC[0, 0], 10.0, None)
    assert state.keep(0, 0, push) and state.keep(0, 1, push)
    assert state.first_rounds([2, 0]) == [0, 0]
    assert state.on_update(0, 0, [(0, ENC[0, 0])])
    assert state.available(0, 0) and not state.available(0, 1)
    assert state.take(0, 0) == [(0, ENC[0, 0])]
    assert list(state.kept) == [(0, 1)] and state.held == [1, 0]  # round 0's push is answered
    assert not state.on_update(0, 0, [(0, ENC[0, 0])])  # older than what the mirror holds: dropped
    assert [(f, r) for f, r, _ in state.to_resend([1, 0])] == [(0, 1)]
    assert state.to_resend([2, 0]) == []  # the round closed meanwhile: nothing to send again
    # a resync: the shard has closed rounds 1..3 of fragment 0 meanwhile
    assert state.behind([4, 0]) == [0]
    state.on_fetched(0, torch.ones(3), 4)
    assert state.kept == {} and state.available(0, 1) and state.available(0, 3)
    assert isinstance(state.take(0, 1), Master)
    assert state.take(0, 2) is None and state.take(0, 3) is None  # the master held them
    assert state.behind([4, 0]) == []
    with pytest.raises(ShardBehind):
        state.behind([3, 0])  # a shard restarted from an older checkpoint than what we hold
    assert not state.keep(0, 3, push)  # in the fetched master already: nothing to send
    # a checkpoint keeps the pushes; the rounds held come from the engine's checkpoint
    state.keep(1, 5, push)
    other = LinkState(2)
    other.load_state_dict(state.state_dict(), held=[4, 5])
    assert list(other.kept) == [(1, 5)] and other.held == [4, 5] and other.available(1, 4)
    assert other.take(1, 4) is None


def _link_state(link: ShardLink, fn):
    """Ask the link's own thread to run fn(state) and return its result."""
    return link.inspect(fn, timeout=WAIT)


def _wait_link(link: ShardLink, cond, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not _link_state(link, cond):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_link_missing_an_update_between_two_it_holds_fetches_the_master(make_shard):
    s = make_shard(min_workers=1)
    link = ShardLink(s.target, "L", json.loads(GOOD_FP), join_timeout=10, reconnect_timeout=10)
    try:
        link.start()  # passive: it gets the updates, no round waits for it
        a = s.worker("a")
        for r in range(3):
            a.push(push_messages(ENC[0, r], round=r))
            assert a.session.result().accepted
            a.session.update()
        _wait_link(link, lambda st: (0, 2) in st.arrived, "the link to have round 2's update")
        _link_state(link, lambda st: st.arrived.pop((0, 1)))  # as if round 1's update were lost
        assert _link_state(link, lambda st: st.have(0)) == 1
        link.resync(timeout=WAIT)
        master = s.on_loop(lambda: s.service.state.master(0).clone())
        assert _link_state(link, lambda st: (st.covered[0], st.masters[0].round)) == (3, 3)
        assert torch.equal(_link_state(link, lambda st: st.masters[0].values), master)
        fetched = link.wait_update(0, 1, timeout=WAIT)
        assert isinstance(fetched, Master) and torch.equal(fetched.values, master)
        assert link.wait_update(0, 2, timeout=WAIT) is None  # the fetched master holds round 2 already
    finally:
        link.close()


def test_a_kept_push_is_sent_again_to_a_shard_restarted_from_its_checkpoint(make_shard, tmp_path):
    ckdir = tmp_path / "shard-ck"
    s1 = make_shard(min_workers=2, checkpoint_dir=ckdir)
    link = ShardLink(s1.target, "L", json.loads(GOOD_FP), join_timeout=10, reconnect_timeout=20)
    try:
        link.start()
        assert link.ready(timeout=WAIT).member
        b = s1.worker("b")
        # fragment 1's round 0 closes with both (it is checkpointed); fragment 0's waits for b
        link.push(1, 0, ENC[1, 0], 100.0, 2.0)
        b.push(push_messages(ENC[1, 1], fragment=1))
        assert b.session.result().accepted
        link.wait_update(1, 0, timeout=WAIT)
        link.push(0, 0, ENC[0, 0], 50.0, 1.5)
        s1.wait_for(lambda: s1.service.state.contributors(0) == {"L"}, "L's push of fragment 0")
        hash1 = s1.status()["fragments"][1]["master_hash"]
        assert s1.status()["checkpoint"]["writes"] >= 4 and s1.status()["checkpoint"]["errors"] == 0

        s1.shutdown(stop_first=True)  # the shard stops; the push in its open round is lost with it
        s2 = make_shard(min_workers=1, round_timeout=2.0, checkpoint_dir=ckdir, port=s1.port)
        assert s2.on_loop(lambda: [s2.service.state.round_of(f) for f in range(3)]) == [0, 1, 0]
        assert s2.status()["fragments"][1]["master_hash"] == hash1
        # the checkpoint names the members of the time (b too, unless the shard saw b's session end before
        # it stopped): rounds wait for them until they are back, or for a round timeout (2 s here)
        returning = s2.status()["returning"]
        assert "L" in returning and set(returning) <= {"L", "b"}

        # the link reconnects, becomes a member again and sends the kept push; the round closes with it
        parts = link.wait_update(0, 0, timeout=15)
        closed = reference_round([("L", ENC[0, 0], 50.0, 1.5)])
        assert isinstance(parts, list)
        update = concat([p for _, p in parts])
        assert torch.equal(update.payload, closed.update.payload) and torch.equal(
            update.scales, closed.update.scales
        )
        assert link.reconnects == 1 and link.resent == 1  # fragment 1's push was answered: not sent again
        last = s2.status()["recent_rounds"][-1]
        assert (last["fragment"], last["round"], last["contributors"]) == (0, 0, ["L"])
        assert link.error is None
    finally:
        link.close()
