"""A credentialed liar against a shard's rounds (issue 37, holes 1, 2 and 7), under a simulated clock:
ShardState driven directly, `now` the test's, the members' pushes scheduled as a run's would arrive.

The honest members push a round's length at the run's pace (H x 5 s = 30 s) after the round opened (each
0.5 s after the one before), with deltas about the size of six AdamW steps at lr 1e-3 that share a
direction from round to round (a run's outer gradients do: that is what outer momentum is for). The liar
is one admitted identity that trains nothing:
- the early pusher pushes each round the moment it opens, claiming 2^53 tokens and a step time of 1e-6 s
  (a stretch of max_steps_per_tick under the adaptive schedule), values of a large constant;
- the slow pacer makes one push claiming 3600 s per step, then sends one late chunk a round.
What the honest members rely on: their pushes count (>= 95 % accepted), the model moves as without the
liar (max|master| within 1.5x of the honest-only run's: see `test_an_early_pusher_...` for why 1.5x), rounds
close at the honest rate, and the contribution credits rank the liar no higher than an honest member."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from streamdiloco.common.codecs import Encoded, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.state import PushRejected, ShardState
from streamdiloco.server.storage.credits import Credits
from streamdiloco.worker.model import build_gpt

pytestmark = pytest.mark.timeout(120)

torch.manual_seed(0)
_MODEL = build_gpt("nano")
_LAYOUT = build_layout(_MODEL, 3)
_INITIAL = [flatten(fragment_params(_MODEL, f)) for f in _LAYOUT.fragments]
H, STEP = 6, 5.0  # the honest members' schedule: a round's length at their pace is 30 s
ROUND = H * STEP
TIMEOUT = 120.0
TICK = 0.25  # the simulated clock's resolution: the rule is asked at every tick, as a shard's tick does
HONEST_WEIGHT = 4096.0  # tokens of one honest push (batch x context x H of a small run)
LIAR_WEIGHT = 2.0**53
FRAGMENT = 0


def make_state(members, robust: RobustConfig | None = None, **cfg_kw) -> ShardState:
    cfg = SyncConfig(sync_every=H, num_fragments=3, **cfg_kw)  # the adaptive schedule by default
    st = ShardState(0, 1, _LAYOUT, cfg, _INITIAL, 0, 1, TIMEOUT, robust=robust)
    for m in members:
        st.add_member(m)
    return st


def _numel(st: ShardState) -> int:
    lo, hi = st.ranges[FRAGMENT]
    return hi - lo


def honest_delta(st: ShardState, member: int, round: int) -> Encoded:
    """An honest push: a direction the run keeps from round to round, and the member's own noise."""
    n = _numel(st)
    common = torch.randn(n, generator=torch.Generator().manual_seed(7))
    own = torch.randn(n, generator=torch.Generator().manual_seed(1000 * member + round + 1))
    return encode(2e-3 * (common + own), st.cfg.uplink_codec, st.cfg.codec_block_size)


def liar_values(st: ShardState) -> Encoded:
    """The liar's values: a large constant, of the sign that raises the fragment's largest values (the
    outer step moves the master against the mean delta; its largest values are LayerNorm gains of 1)."""
    return encode(torch.full((_numel(st),), -1e3), st.cfg.uplink_codec, st.cfg.codec_block_size)


def push(st, who, round, enc, weight, now, step) -> bool:
    """One whole push; False when the shard refused it (late)."""
    try:
        return bool(st.push_chunk(who, FRAGMENT, round, 0, 0, enc.numel, enc, True, weight, None, now, step))
    except PushRejected as e:
        assert e.reason == "late", e
        return False


@dataclass
class Sim:
    """A run of `rounds` rounds of fragment 0 under the simulated clock, with the credits a shard keeps."""

    st: ShardState
    honest: list[str]
    early: list[str] = field(default_factory=list)  # liars that push each round the moment it opens
    slow: list[str] = field(default_factory=list)  # liars that push once (3600 s/step), then a late chunk
    lurk: list[str] = field(default_factory=list)  # liars that never push on time: a late chunk a round
    credits: Credits = field(default_factory=lambda: Credits(3))
    opened: list[float] = field(default_factory=list)  # when each round opened
    closed: list[tuple[float, str, tuple[str, ...]]] = field(default_factory=list)  # when, why, who
    offered: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)

    def schedule(self, r: int, t: float, events: list) -> None:
        """The pushes of round r, which opened at t."""
        for who in self.early:
            heapq.heappush(events, (t, 0, who, r))
        for who in self.slow:
            heapq.heappush(events, (t + (0.0 if r == 0 else 1.0), 0, who, r))
        for who in self.lurk if r > 0 else ():
            heapq.heappush(events, (t + 1.0, 0, who, r))
        for i, who in enumerate(self.honest):
            heapq.heappush(events, (t + ROUND + 0.5 * i, 1, who, r))

    def act(self, when: float, who: str, r: int) -> None:
        st = self.st
        if who in self.early:
            push(st, who, r, liar_values(st), LIAR_WEIGHT, when, 1e-6)
        elif who in self.slow or who in self.lurk:  # a push that counts in round 0 (slow), then late chunks
            push(st, who, r if r == 0 else r - 1, honest_delta(st, 99, r), HONEST_WEIGHT, when, 3600.0)
        else:
            self.offered[who] += 1
            i = self.honest.index(who)
            self.accepted[who] += push(st, who, r, honest_delta(st, i, r), HONEST_WEIGHT, when, STEP)

    def run(self, rounds: int) -> Sim:
        events: list = []
        t = 0.0
        self.opened.append(t)
        self.schedule(0, t, events)
        while len(self.closed) < rounds:
            while events and events[0][0] <= t:
                when, _, who, r = heapq.heappop(events)
                self.act(when, who, r)
            for fragment, why in self.st.due(t):
                job = self.st.begin_close(fragment, why, t)
                job.credit({})  # as server/runner.py credits a round (no fold ahead of the close here)
                self.credits.round_closed(fragment, job.round, job.tokens, job.closing.clipped)
                closed = self.st.end_close(job.run())
                self.closed.append((t, why, closed.contributors))
                self.opened.append(t)
                self.schedule(len(self.closed), t, events)
            t += TICK
            assert t < self.opened[-1] + 10 * TIMEOUT, "a round that never closes"
        return self

    @property
    def honest_accepted(self) -> float:
        offered = sum(self.offered.values())  # none: the rounds went by before any honest push
        return sum(self.accepted.values()) / offered if offered else 0.0

    @property
    def mean_round(self) -> float:
        return self.closed[-1][0] / len(self.closed)

    @property
    def max_master(self) -> float:
        return float(self.st.master(FRAGMENT).abs().max())


def honest_names(m: int) -> list[str]:
    return [f"honest{i}" for i in range(m)]


# --- hole 1: the early pusher -------------------------------------------------------------------------------
@pytest.mark.parametrize("m_honest", [1, 3])
def test_an_early_pusher_with_claimed_speed_and_weight_does_not_take_the_rounds(m_honest):
    """M = 2 and M = 4, 40 rounds. Why 1.5x: the liar's push counts as one member's share (--weight-cap 1)
    at at most twice the honest norm (--clip-norm 2), so per round it moves the mean by at most the honest
    push's own size, in its own direction (here the one that raises the largest values), against the honest
    run's 40 rounds of a common direction under Nesterov momentum. Measured: 0.84x (M = 2) and 0.91x
    (M = 4); with honest deltas of pure noise (no common direction, the worst case tried) 1.49x and 1.36x.
    Before this rule the liar took the rounds (M = 2: it closed all 40 alone within 15 s, max|master| 4.9e5
    against 4.1; M = 4: 42 of 118 honest pushes accepted, max|master| 10.3)."""
    names = honest_names(m_honest)
    honest = Sim(make_state(names), names).run(40)
    liar = Sim(make_state([*names, "liar"]), names, early=["liar"]).run(40)
    assert honest.honest_accepted == 1.0
    assert liar.honest_accepted >= 0.95, (liar.accepted, liar.offered)
    assert all(set(names) <= set(who) for _, _, who in liar.closed), liar.closed[:5]
    assert liar.max_master <= 1.5 * honest.max_master, (liar.max_master, honest.max_master)
    # and it bought nothing with its claims: no round waited less for the honest members than without it
    assert liar.mean_round >= 0.99 * honest.mean_round


def test_an_early_pusher_first_to_push_waits_for_the_honest_member_and_is_capped_and_clipped():
    """The liar's lone round 0: the honest member's first push comes after its start-up (here 50 s: more
    than GRACE_MIN and than a round at the liar's claimed pace), and the round must wait for it."""
    st = make_state(["honest0", "liar"])
    assert push(st, "liar", 0, liar_values(st), LIAR_WEIGHT, 0.0, 1e-6)
    t = 0.0
    while t < 50.0:
        assert st.due(t) == [], t  # not alone, not at GRACE_MIN after its push, not at its claimed pace
        t += TICK
    assert push(st, "honest0", 0, honest_delta(st, 0, 0), HONEST_WEIGHT, 50.0, STEP)
    assert st.due(50.0) == [(FRAGMENT, "all")]
    closed = st.close_round(FRAGMENT, "all", now=50.0)
    assert closed.capped == ("liar",) and closed.clipped == ("liar",)
    assert closed.weight == 2 * HONEST_WEIGHT  # the liar counts as the honest member, not as 2^53
    assert float(st.master(FRAGMENT).abs().max()) < 1.5 * float(_INITIAL[FRAGMENT].abs().max())


def test_a_lone_push_nobody_can_check_seeds_no_history_and_is_credited_as_one_token():
    """A run whose only member is the liar: its rounds are its own (nothing can tell its values from a
    model's), but they leave the weight and norm history empty, so the honest members that come later are
    bounded by their own rounds, and it is credited one token a push, not its claim."""
    st = make_state(["liar"])
    credits = Credits(3)
    for r in range(3):
        assert push(st, "liar", r, liar_values(st), LIAR_WEIGHT, float(r), 1e-6)
        job = st.begin_close(FRAGMENT, "all", float(r))
        job.credit({})
        credits.round_closed(FRAGMENT, r, job.tokens)
        st.end_close(job.run())
    assert list(st.weight_history[FRAGMENT]) == [] and list(st.norm_history[FRAGMENT]) == []
    assert credits.rows["liar"].tokens == pytest.approx(3 / 3)


# --- hole 2: the pace ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("liars", [1, 2])
def test_a_slow_pace_claim_and_a_late_chunk_a_round_cost_the_rounds_nothing_lasting(liars):
    """After one push claiming 3600 s a step, one late chunk a round: rounds stay within 1.5x of the honest
    run's length (before, each waited for the round timeout: 120 s instead of 30); with two such identities
    they keep closing at about the honest rate (before: one round in 4,000 s)."""
    names = honest_names(3)
    honest = Sim(make_state(names), names).run(40)
    slow = [f"slow{i}" for i in range(liars)]
    sim = Sim(make_state([*names, *slow]), names, slow=slow).run(40)
    assert sim.mean_round <= 1.5 * honest.mean_round, (sim.mean_round, honest.mean_round, sim.closed[:6])
    assert sim.honest_accepted >= 0.95
    assert sim.st.pace() == STEP  # the claim left the pace with the round it missed
    assert not set(slow) & set(sim.st.roll.expected(FRAGMENT, sim.st.round_of(FRAGMENT)))


def test_a_member_that_never_pushes_on_time_is_not_kept_expected_by_its_late_chunks():
    """A late chunk a round, and never a push on time: woken once (a worker whose first push came late is
    waited for again, once a session), then never again; before, each of its late chunks made the next
    round wait its grace (twice the honest round)."""
    names = honest_names(3)
    honest = Sim(make_state(names), names).run(40)
    sim = Sim(make_state([*names, "lurker"]), names, lurk=["lurker"]).run(40)
    assert sim.mean_round <= 1.2 * honest.mean_round, (sim.mean_round, honest.mean_round, sim.closed[:6])
    assert sim.honest_accepted == 1.0


def test_one_liar_cannot_move_the_pace_of_honest_members_beyond_a_factor():
    st = make_state(["a", "b", "c", "liar"])
    for who, step in (("a", 1.0), ("b", 1.2), ("c", 0.9)):
        push(st, who, 0, honest_delta(st, 0, 0), HONEST_WEIGHT, 0.0, step)
    push(st, "liar", 0, honest_delta(st, 1, 0), HONEST_WEIGHT, 0.0, 3600.0)
    assert st.pace() == 1.2 * st.cfg.max_steps_per_tick  # its claim is clamped to the factor of the median
    two = make_state(["a", "liar"])
    push(two, "a", 0, honest_delta(two, 0, 0), HONEST_WEIGHT, 0.0, 1.0)
    push(two, "liar", 0, honest_delta(two, 1, 0), HONEST_WEIGHT, 0.0, 1e-6)
    assert two.pace() == 1.0  # of two, the upper median: a fast claim cannot lower it


def test_a_late_chunk_wakes_only_a_member_that_just_missed_one_round():
    """A member that pushed round r - 1 and missed round r is woken by its late push (it is just behind, and
    waited for, it catches up); a late chunk of a member whose last accepted push is older does not make it
    expected again (it keeps a liar expected forever)."""
    st = make_state(["a", "b", "c"])
    for r in range(2):
        for who in ("a", "b", "c"):
            push(st, who, r, honest_delta(st, 0, r), HONEST_WEIGHT, 0.0, 1.0)
        st.close_round(FRAGMENT, "all", now=0.0)
    for who in ("a", "b"):
        push(st, who, 2, honest_delta(st, 0, 2), HONEST_WEIGHT, 0.0, 1.0)
    st.close_round(FRAGMENT, "quorum", now=1.0)  # without c
    assert st.roll.dormant == {"c"}
    assert not push(st, "c", 2, honest_delta(st, 2, 2), HONEST_WEIGHT, 2.0, 1.0)  # just missed it: woken
    assert st.roll.dormant == set()
    for who in ("a", "b"):
        push(st, who, 3, honest_delta(st, 0, 3), HONEST_WEIGHT, 3.0, 1.0)
    st.close_round(FRAGMENT, "quorum", now=40.0)  # c missed another round
    assert st.roll.dormant == {"c"}
    for late in (2, 3):  # whatever round its late chunks name: its last accepted push is two rounds back
        assert not push(st, "c", late, honest_delta(st, 2, 3), HONEST_WEIGHT, 41.0, 1.0)
        assert st.roll.dormant == {"c"}


# --- hole 7: the credits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("trust_speed", [False, True])
def test_the_credits_of_an_early_pusher_are_bounded_by_the_median_honest_share(trust_speed):
    """Per round the liar is credited at most the median honest share, also where the shard trusts claimed
    speeds (`launch`): credits never count a stretched share, nor a claim nobody checked."""
    names = honest_names(3)
    robust = RobustConfig(trust_speed=True) if trust_speed else None
    sim = Sim(make_state([*names, "liar"], robust), names, early=["liar"])
    sim.run(20)
    rows = sim.credits.rows
    honest = sorted(rows[n].tokens for n in names)
    assert rows["liar"].tokens <= honest[1], (rows["liar"].tokens, honest)
    assert rows["liar"].tokens <= 20 * HONEST_WEIGHT / 3  # one honest share a round, over P fragments


def test_cycling_names_through_the_credits_does_not_evict_an_honest_contributor():
    """Under the run token a name is the worker's word: 10,000 names, each with a session and an accepted
    push, fold into `others` and leave the honest contributing rows where they are."""
    c = Credits(3)
    c.connected("honest", "run token", now=0.0)
    c.accepted("honest")
    c.round_closed(0, 0, {"honest": HONEST_WEIGHT})
    c.disconnected("honest", now=1.0)
    c.connected("newcomer", "run token", now=1.0)  # contributing, its round not closed yet
    c.accepted("newcomer")
    for i in range(10_000):
        name = f"cycler{i}"
        c.connected(name, "run token", now=2.0 + i)
        c.accepted(name)
        c.refused(name, "late")
        c.disconnected(name, now=2.5 + i)
    assert c.rows["honest"].tokens == pytest.approx(HONEST_WEIGHT / 3) and "newcomer" in c.rows
    assert len(c.rows) <= c.max_rows and c.identities == 10_002


def test_launch_trusts_its_own_workers_speeds_and_a_shard_does_not_unless_told(capsys):
    """`launch` runs one operator's workers on one machine: their reported speeds are believed (the adaptive
    schedule's stretch), unless the operator says otherwise; `server` (a shard facing the internet) believes
    none by default."""
    import tomllib

    from streamdiloco.cli import main

    base = ["launch", "--print-config", "--workers", "2", "--model", "nano"]
    assert main(base) == 0
    assert tomllib.loads(capsys.readouterr().out)["robust"]["trust_speed"] is True
    assert main([*base, "--no-trust-speed"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["robust"]["trust_speed"] is False
    assert RobustConfig().trust_speed is False
