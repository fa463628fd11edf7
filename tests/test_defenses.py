"""server/rounds/defenses.py in closed form: the weight a push reports cut to --max-weight, its share cut to
the median's multiple, its clip scale against the median norm, each stretched by a faster site's k, and
what a closing round leaves to the next rounds (the lower halves). The rules themselves (cap_weights,
clip_scales, lower_half) are server/rounds/robust.py's, tested in tests/test_robust.py.

The round: pushes a, b, c with weights 1, 1, 10 and norms 1, 1, 8 under the default defenses (weight cap 1,
clip 2): the median weight is 1, so c's share is cut to 1; the median norm is 1, so the bound is 2 and c is
scaled by 2 / 8.
"""

from __future__ import annotations

import pytest

from streamdiloco.common.config import SyncConfig
from streamdiloco.server.rounds.defenses import Defenses
from streamdiloco.server.rounds.jobs import OpenRound, Push
from streamdiloco.server.rounds.robust import RobustConfig

ADAPTIVE = SyncConfig(sync_schedule="adaptive", max_steps_per_tick=4.0)
FIXED = SyncConfig(sync_schedule="fixed")
TRUSTED = RobustConfig(trust_speed=True)  # `launch`'s: the workers' reported speeds are believed


def push(worker: str, weight: float, norm: float, loss: float | None = None, step_seconds=None) -> Push:
    # the values (asm) are not read by the defenses: only the header's numbers and the measured norm
    return Push(worker, weight, None, norm=norm, loss=loss, step_seconds=step_seconds)  # type: ignore[arg-type]


def round_of(pushes: list[Push]) -> OpenRound:
    rnd = OpenRound(0)
    for p in pushes:
        rnd.add(p, 0)
    return rnd


def test_a_reported_weight_is_cut_to_max_weight_times_its_stretch():
    d = Defenses(RobustConfig(max_weight=100.0), FIXED)
    assert (d.reported(50.0), d.reported(150.0), d.reported(150.0, stretch=2.0)) == (50.0, 100.0, 150.0)
    assert d.reported(250.0, stretch=2.0) == 200.0
    assert d.weights_capped == 2
    unknown = Defenses(RobustConfig(), FIXED)  # max_weight 0: not known, nothing cut
    assert unknown.reported(1e12) == 1e12 and unknown.weights_capped == 0


def test_a_push_stretches_by_its_sites_speed_over_the_pace_only_with_the_adaptive_schedule_and_trust():
    adaptive, fixed = Defenses(TRUSTED, ADAPTIVE), Defenses(TRUSTED, FIXED)
    assert adaptive.stretch(2.0, 1.0) == 2.0  # twice as fast as the slowest member
    assert adaptive.stretch(10.0, 1.0) == 4.0  # at most max_steps_per_tick
    assert adaptive.stretch(1.0, 2.0) == 1.0  # slower than the pace: never below 1
    assert adaptive.stretch(2.0, None) == adaptive.stretch(0.0, 1.0) == 1.0  # either unknown
    assert fixed.stretch(2.0, 1.0) == 1.0
    # the default (a shard facing the internet): a reported speed is a worker's word, and buys nothing
    assert Defenses(RobustConfig(), ADAPTIVE).stretch(10.0, 1e-6) == 1.0


def test_the_options_say_what_the_shard_measures_and_folds():
    default = Defenses(RobustConfig(), FIXED)
    assert default.measures_norms and default.folds_early and default.aggregator == ("mean", 0.25, 3)
    off = Defenses(RobustConfig.off(), FIXED)
    assert not off.measures_norms
    trimmed = Defenses(RobustConfig(aggregator="trimmed", trim=0.1), FIXED)
    assert not trimmed.folds_early and trimmed.aggregator == ("trimmed", 0.1, 3)


def test_settle_cuts_the_outliers_share_and_clips_its_norm_to_twice_the_median():
    d = Defenses(RobustConfig(), FIXED)
    a, b, c = push("a", 1.0, 1.0, loss=2.0), push("b", 1.0, 1.0, loss=4.0), push("c", 10.0, 8.0)
    rnd = round_of([a, b, c])
    d.settle(d.recent(), rnd, [a, b, c])
    assert [(p.share, p.scale, p.mult) for p in (a, b, c)] == [
        (1.0, 1.0, 1.0),
        (1.0, 1.0, 1.0),
        (1.0, 0.25, 0.25),
    ]
    assert rnd.settled == 3.0
    assert (rnd.loss_sum, rnd.loss_weight) == (6.0, 2.0)  # c reported no loss
    assert rnd.used_norms == [1.0, 1.0, 2.0]  # c's at the bound
    assert (rnd.capped, rnd.clipped) == (["c"], ["c"])
    assert (d.weights_capped, d.pushes_clipped) == (1, 1)
    assert d.closing(rnd) == {"weights": [1.0, 1.0], "norms": [1.0, 1.0]}  # the lower halves


def test_a_faster_sites_share_and_clip_stretch_by_k_and_k_squared_but_not_its_credit():
    d = Defenses(TRUSTED, ADAPTIVE)
    a, b, fast = push("a", 1.0, 1.0), push("b", 1.0, 1.0), push("fast", 10.0, 8.0, step_seconds=0.5)
    rnd = round_of([a, b, fast])
    d.settle(d.recent(), rnd, [a, b, fast], pace=1.0)  # k = 2: its share up to 2, its norm up to 2 * 4
    assert (fast.share, fast.scale) == (2.0, 1.0)
    assert rnd.used_norms == [1.0, 1.0, 8.0] and rnd.clipped == [] and rnd.capped == ["fast"]
    # credits and quorums never count a stretched share: what it is credited with is the median's multiple
    assert fast.credited == 1.0 and rnd.settled == 4.0 and rnd.counted == 3.0


def test_a_lone_push_nothing_can_check_keeps_its_weight_in_the_mean_and_is_credited_one_token():
    d = Defenses(RobustConfig(), FIXED)
    liar = push("liar", 2.0**53, 1e6)
    rnd = round_of([liar])
    d.settle(d.recent(), rnd, [liar])
    assert (liar.share, liar.scale, liar.credited) == (2.0**53, 1.0, 1.0)  # a mean of one: that push
    assert d.closing(rnd) == {"weights": [], "norms": []}  # and it leaves no history to be relative to
    bounded = Defenses(RobustConfig(max_weight=4096.0), FIXED)
    liar = push("liar", 4096.0, 1e6)
    bounded.settle(bounded.recent(), round_of([liar]), [liar])
    assert liar.credited == 4096.0  # the operator's bound, where it set one


def test_with_fewer_than_three_pushes_the_recent_rounds_join_the_median():
    d = Defenses(RobustConfig(), FIXED)
    recent = d.recent({"weights": [[4.0, 4.0, 4.0]], "norms": [[1.0]]})
    liar = push("liar", 40.0, 1.0)
    rnd = round_of([liar])
    assert (
        d.shares(recent, rnd, [liar], pace=0.0) == d.counted(recent, rnd, [liar]) == [4.0]
    )  # of 40, 4, 4, 4
    honest = push("h", 3.0, 1.0)
    alone = round_of([honest])
    assert d.shares(recent, alone, [honest], pace=0.0) == [3.0]  # below the median of 3, 4, 4, 4
    one = d.recent({"weights": [[4.0]], "norms": [[1.0]]})
    assert d.shares(one, rnd, [liar], pace=0.0) == [4.0]  # a pool of two: the lower, not their mean (22)


def test_a_round_of_two_is_capped_and_clipped_relative_to_the_lower_of_the_two():
    # one of two may be a liar: their mean would be half its own weight and norm, and never cap or clip it
    d = Defenses(RobustConfig(), FIXED)
    honest, liar = push("h", 100.0, 1.0), push("liar", 2.0**53, 1e6)
    rnd = round_of([honest, liar])
    d.settle(d.recent(), rnd, [honest, liar])
    assert (honest.share, honest.scale) == (100.0, 1.0)
    assert liar.share == liar.credited == 100.0 and liar.scale == pytest.approx(2.0 / 1e6)
    assert d.closing(rnd) == {"weights": [100.0], "norms": [1.0]}


def test_recent_rounds_keep_the_last_history_rounds_that_brought_something():
    d = Defenses(RobustConfig(history_rounds=2), FIXED)
    recent = d.recent()
    recent.remember({"weights": [1.0], "norms": []})
    recent.remember({"weights": [2.0], "norms": [5.0]})
    recent.remember({"weights": [3.0], "norms": []})
    assert recent.saved() == {"weights": [[2.0], [3.0]], "norms": [[5.0]]}
    again = d.recent(recent.saved())  # as a checkpoint gives it back
    assert again.saved() == recent.saved() and again.weights.maxlen == 2


def test_settle_of_no_pushes_changes_nothing():
    d = Defenses(RobustConfig(), FIXED)
    rnd = OpenRound(0)
    d.settle(d.recent(), rnd, [])
    assert rnd.settled == 0.0 and rnd.used_norms == []


@pytest.mark.parametrize("clip", [0.0, 2.0])
def test_a_closing_round_leaves_norms_only_when_clipping_is_on(clip):
    d = Defenses(RobustConfig(clip_norm=clip), FIXED)
    pushes = [push("a", 1.0, 1.0), push("b", 2.0, 3.0)]
    rnd = round_of(pushes)
    d.settle(d.recent(), rnd, pushes)
    assert d.closing(rnd) == {"weights": [1.0], "norms": [1.0] if clip else []}
