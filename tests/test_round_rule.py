"""When a shard's rounds close, under a fake clock (ShardState driven directly; `now` is the test's): a
quorum of the expected weight and a grace from the run's pace, deadlines counted from a round's opening,
dormant members, and the defenses that go with them (each push's own stretch, a norm history a liar cannot
feed). One test per point of issue 27's review of the rule before it, and the rule's own cases."""

from __future__ import annotations

import pytest
import torch

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.rule import GRACE_MIN
from streamdiloco.server.rounds.state import PushRejected, ShardState
from streamdiloco.worker.model import build_gpt

pytestmark = pytest.mark.timeout(60)

torch.manual_seed(0)
_MODEL = build_gpt("nano")
_LAYOUT = build_layout(_MODEL, 3)
_INITIAL = [flatten(fragment_params(_MODEL, f)) for f in _LAYOUT.fragments]
H = 6


def make_state(members, min_workers=1, timeout=120.0, robust=None, **cfg_kw) -> ShardState:
    cfg = SyncConfig(sync_every=H, num_fragments=3, **cfg_kw)
    st = ShardState(0, 1, _LAYOUT, cfg, _INITIAL, 0, min_workers, timeout, robust=robust)
    for m in members:
        st.add_member(m)
    return st


def enc(st: ShardState, seed: int, scale: float = 1.0):
    n = st.ranges[0][1] - st.ranges[0][0]
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-2 * scale
    return encode(x, st.cfg.uplink_codec, st.cfg.codec_block_size)


def push(st: ShardState, who: str, round: int, now: float, weight: float = 100.0, step=None, scale=1.0):
    """A whole push of `who` to fragment 0 at `now` (`step`: the step time its header reports)."""
    e = enc(st, hash((who, round)) % 10_000, scale)
    header = {} if step is None else {"step_seconds": step}  # the rule before it took none
    return st.push_chunk(who, 0, round, 0, 0, e.numel, e, True, weight, None, now, **header)


def a_round_everyone_pushed(st: ShardState, members, round: int, now: float, step=None) -> None:
    """Round `round` of fragment 0: every member pushes at `now`, it closes (all), and the next one opens."""
    for m in members:
        push(st, m, round, now, step=step)
    assert st.due(now) == [(0, "all")]
    st.close_round(0, "all", now=now)  # the next round is open from here


# --- the four points of the review ------------------------------------------------------------------------
def test_the_deadline_counts_from_the_rounds_opening_not_its_first_push():
    st = make_state(("a", "b"), timeout=10.0)
    a_round_everyone_pushed(st, ("a", "b"), 0, now=0.0)  # round 1 opens at 0
    push(st, "a", 1, now=8.0)  # half the weight, 8 s after the round opened
    assert st.due(9.99) == []
    assert st.due(10.0) == [(0, "deadline")]  # not at 8 + 10


def test_a_lone_instant_pusher_never_closes_a_round_the_majority_has_not_reached():
    # H x step time (6 x 30 s) is longer than the timeout: the honest members push 180 s after a round opens
    honest = ("h0", "h1", "h2")
    st = make_state((*honest, "evil"), timeout=120.0)
    a_round_everyone_pushed(st, (*honest, "evil"), 0, now=0.0)
    push(st, "evil", 1, now=0.0, weight=2.0**40)  # the moment the round opens, without training (or a cap)
    assert st.due(120.0) == []  # its share is one member's of four: no quorum, so no deadline
    assert st.due(179.0) == []
    for i, m in enumerate(honest):
        push(st, m, 1, now=180.0 + i)
    assert st.due(182.0) == [(0, "all")]
    closed = st.close_round(0, "all")
    assert closed.contributors == ("evil", *honest) and closed.capped == ("evil",)


def test_nothing_waits_forever_when_the_majority_is_alive_but_stuck():
    honest = ("h0", "h1", "h2")
    st = make_state((*honest, "evil"), timeout=120.0)
    a_round_everyone_pushed(st, (*honest, "evil"), 0, now=0.0, step=30.0)  # a round's length: H x 30 s
    push(st, "evil", 1, now=0.0)
    assert st.due(120.0 + H * 30.0 - 0.01) == []  # the outer bound: the deadline, then a round at the pace
    assert st.due(120.0 + H * 30.0) == [(0, "overdue")]
    st.close_round(0, "overdue", now=300.0)
    assert st.roll.dormant == set(honest)  # until they push again


def test_min_workers_with_a_member_that_joins_and_never_pushes_does_not_halt_the_run():
    st = make_state(("a", "b"), min_workers=2, timeout=10.0)
    for r in range(3):  # round 0 opens with its first push (the shard's first rounds), the others at a close
        t = 10.0 * r
        push(st, "a", r, now=t + (r > 0))
        assert st.due(t + 9.99) == []  # --min-workers 2: the round waits for a second push ...
        assert st.due(t + 10.0) == [(0, "deadline")]  # ... until its deadline: b never pushed, so it cannot
        assert st.close_round(0, "deadline", now=t + 10.0).contributors == ("a",)
    assert st.round_of(0) == 3


@pytest.mark.parametrize("schedule, trust_speed", [("adaptive", True), ("adaptive", False), ("fixed", True)])
def test_each_push_stretches_its_caps_and_clip_by_its_own_speed(schedule, trust_speed):
    # three slow sites, one four times as fast (4 inner steps per schedule step: 4x the tokens, a larger
    # update), and a liar that reports the slow sites' speed but pushes the fast one's weight and size
    robust = RobustConfig(trust_speed=trust_speed)
    st = make_state(
        ("s0", "s1", "s2", "fast", "liar"), robust=robust, sync_schedule=schedule, max_steps_per_tick=4.0
    )
    for m in ("s0", "s1", "s2"):
        push(st, m, 0, now=0.0, weight=1000.0, step=0.4)
    push(st, "fast", 0, now=0.0, weight=4000.0, step=0.1, scale=3.0)
    push(st, "liar", 0, now=0.0, weight=4000.0, step=0.4, scale=3.0)
    closed = st.close_round(0)
    if schedule == "adaptive" and trust_speed:  # the fast one's stretch is 4: within its bounds; the liar's 1
        assert closed.capped == ("liar",) and closed.clipped == ("liar",)
    else:  # no stretch for anyone (a claimed speed is a worker's word): both held to the slow sites' bounds
        assert closed.capped == ("fast", "liar") and closed.clipped == ("fast", "liar")


def test_the_norm_clip_does_not_ratchet_with_two_pushes_a_round():
    # one honest push and one liar's a round: the liar's norm is clipped to the bound every round; were its
    # clipped norm kept for the next round's median, the bound would grow by an honest norm each round
    st = make_state(("honest", "liar"))
    bounds = []
    for r in range(12):
        push(st, "honest", r, now=float(r))
        push(st, "liar", r, now=float(r), scale=1e4)
        job = st.begin_close(0, "all")
        honest, liar = sorted(job.pushes, key=lambda p: p.worker)
        assert honest.scale == 1.0  # the honest push is never clipped
        bounds.append(liar.norm * liar.scale / honest.norm)
        st.end_close(job.run())
    assert max(bounds[1:]) < 2.5, bounds  # twice the honest norm, round after round


# --- the rule's own cases ---------------------------------------------------------------------------------
def test_a_quorum_closes_a_round_once_the_grace_from_the_pace_has_passed():
    st = make_state(("a", "b", "c"), timeout=120.0)
    step = 2.0  # the slowest member's step time: a round lasts H x 2 = 12 s, and so does its grace
    a_round_everyone_pushed(st, ("a", "b", "c"), 0, now=0.0, step=step)
    grace = max(H * step, GRACE_MIN)
    assert st.grace(st.pace()) == grace
    push(st, "a", 1, now=1.0, step=step)
    assert st.due(1.0) == []  # a third of the weight: no quorum
    push(st, "b", 1, now=2.0, step=step)
    # the quorum at 2 s; c's grace runs from a round's length at the pace after the round opened (at 0):
    # from 12 s, when c's push is due, however early the others' came
    assert st.due(2.0) == [] and st.due(2.0 + grace) == [] and st.due(H * step + grace - 0.01) == []
    assert st.due(H * step + grace) == [(0, "quorum")]
    assert st.close_round(0, "quorum").contributors == ("a", "b")


def test_the_grace_grows_with_the_pace_and_stops_at_the_timeout():
    st = make_state(("a",), timeout=120.0)
    assert st.grace(0.0) == 120.0  # no step time reported yet: wait as long as the timeout allows
    assert st.grace(0.1) == GRACE_MIN
    assert st.grace(10.0) == H * 10.0  # --round-grace 1: a round's length at the pace
    assert st.grace(100.0) == 120.0


def test_a_member_that_missed_a_round_is_not_waited_for_until_it_pushes_again():
    st = make_state(("a", "b", "c"), timeout=120.0)
    a_round_everyone_pushed(st, ("a", "b", "c"), 0, now=0.0, step=1.0)
    push(st, "a", 1, now=1.0)
    push(st, "b", 1, now=1.0)
    st.due(1.0)
    assert st.due(H * 1.0 + st.grace(st.pace())) == [(0, "quorum")]  # a round at the pace, and the grace
    st.close_round(0, "quorum", now=12.0)
    assert st.roll.dormant == {"c"}
    # dormant: the next round closes as soon as a and b are in
    push(st, "a", 2, now=13.0)
    push(st, "b", 2, now=13.0)
    assert st.due(13.0) == [(0, "all")]
    # its push for the round that closed without it is late, and shows it is just behind (it pushed the
    # round before): expected again
    with pytest.raises(PushRejected, match="the round is closed"):
        push(st, "c", 1, now=14.0)
    assert st.roll.dormant == set()
    st.close_round(0, "all", now=14.0)
    push(st, "a", 3, now=15.0)
    push(st, "b", 3, now=15.0)
    assert st.due(15.0) == []  # c is waited for (its grace) again
    push(st, "c", 3, now=16.0)
    assert st.due(16.0) == [(0, "all")]


def test_a_member_whole_rounds_behind_is_not_woken_by_its_late_pushes():
    # a worker two rounds behind pushes the rounds it missed, each late: that does not make it expected
    # again (issue 37: a liar's late chunk a round kept it expected for good, each round waiting its grace);
    # the worker goes on from where the run is instead (its skip-ahead: tests/test_skip_ahead.py), and an
    # accepted push of its wakes it
    st = make_state(("a", "b", "c"), timeout=120.0)
    a_round_everyone_pushed(st, ("a", "b", "c"), 0, now=0.0, step=1.0)
    push(st, "a", 1, now=1.0)
    push(st, "b", 1, now=1.0)
    st.close_round(0, "quorum", now=12.0)
    assert st.roll.dormant == {"c"}
    a_round_everyone_pushed(st, ("a", "b"), 2, now=13.0)  # round 3 is open
    with pytest.raises(PushRejected, match="the round is closed"):
        push(st, "c", 1, now=14.0)  # two rounds behind
    assert st.roll.dormant == {"c"}
    push(st, "a", 3, now=15.0)
    push(st, "b", 3, now=15.0)
    assert st.due(15.0) == [(0, "all")]  # not waited for
    st.close_round(0, "all", now=15.0)
    push(st, "c", 4, now=16.0)  # on time again (skipped ahead): accepted, and expected from now on
    assert st.roll.dormant == set()


def test_a_dormant_member_that_contributes_to_an_open_round_is_expected_again():
    st = make_state(("a", "b"), timeout=10.0)
    a_round_everyone_pushed(st, ("a", "b"), 0, now=0.0)
    push(st, "a", 1, now=1.0)
    assert st.due(10.0) == [(0, "deadline")]
    st.close_round(0, "deadline", now=10.0)
    assert st.roll.dormant == {"b"}
    push(st, "a", 2, now=11.0)
    push(st, "b", 2, now=12.0)  # not expected, but welcome: and from now on expected again
    assert st.roll.dormant == set()
    assert st.due(12.0) == [(0, "all")]


def test_a_huge_weight_is_capped_before_it_counts_toward_the_quorum():
    st = make_state(("a", "b", "c"), timeout=120.0, robust=RobustConfig(clip_norm=0.0))
    a_round_everyone_pushed(st, ("a", "b", "c"), 0, now=0.0, step=1.0)
    push(st, "a", 1, now=1.0, weight=1e12)
    assert st.due(1.0 + 120.0) == []  # one member's share of three: no quorum


def test_the_pace_kept_between_reports_is_the_clamped_slowest_at_every_step():
    # the shard asks for the pace at every push, so it is kept, not counted over every member each time:
    # whatever the reports, misses, leaves and joins, it must be what counting would give
    import random

    from streamdiloco.common.pace import pace_seconds
    from streamdiloco.server.rounds.members import RoundMembers

    roll, rng = RoundMembers(3, spread=4.0), random.Random(0)
    names = [f"w{i}" for i in range(30)]
    for m in names:
        roll.add(m)
    for _ in range(5000):
        op, who = rng.random(), rng.choice(names)
        if op < 0.7:
            roll.heard(who, rng.choice([None, rng.uniform(0.01, 2.0), float("nan"), 0.0, 5000.0]))
        elif op < 0.8:
            roll.missed({who})  # a round closed without it: it leaves the pace
        elif op < 0.9:
            roll.remove(who)
        else:
            roll.add(who)
        assert roll.pace() == pace_seconds(roll.step_seconds.values(), 4.0)


def test_after_a_push_only_its_fragments_round_is_looked_at():
    """A push can make only its own fragment's round due (the others move by time: the shard's tick looks at
    every round): at a thousand members, looking at every fragment's round after each push cost P times."""
    st = make_state(("a",))
    e = enc(st, 1)
    for f in (0, 1):
        st.push_chunk("a", f, 0, 0, 0, e.numel, e, True, 100.0, None, 0.0)
    assert st.due(0.0) == [(0, "all"), (1, "all")]
    assert st.due(0.0, 1) == [(1, "all")] and st.due(0.0, 2) == []
