"""The send/merge schedule, pinned with closed-form cases."""

import pytest

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.schedule import Event, events, fragment_offset, send_round


def sends(cfg, steps, total=None):
    return {
        t: [(e.fragment, e.round) for e in events(t, cfg, total) if e.kind == "send"]
        for t in range(1, steps + 1)
    }


def test_offsets_spread_evenly_over_H():
    cfg = SyncConfig(sync_every=10, num_fragments=5, fragment_sync_delay=0, final_sync=False)
    assert [fragment_offset(f, cfg) for f in range(5)] == [0, 2, 4, 6, 8]
    s = sends(cfg, 30)
    assert s[2] == [(1, 0)] and s[4] == [(2, 0)] and s[6] == [(3, 0)] and s[8] == [(4, 0)]
    assert s[10] == [(0, 0)] and s[12] == [(1, 1)] and s[20] == [(0, 1)] and s[30] == [(0, 2)]
    # exactly one fragment on the wire per send step, each fragment once per H steps
    for f in range(5):
        steps = [t for t, v in s.items() if any(fr == f for fr, _ in v)]
        assert all(b - a == 10 for a, b in zip(steps, steps[1:]))
    assert all(len(v) <= 1 for v in s.values())


def test_merge_comes_tau_steps_after_send():
    cfg = SyncConfig(sync_every=10, num_fragments=5, fragment_sync_delay=3, final_sync=False)
    assert events(2, cfg) == [Event("send", 1, 0)]
    assert events(5, cfg) == [Event("merge", 1, 0)]
    assert events(7, cfg) == [Event("merge", 2, 0)]
    assert events(11, cfg) == [Event("merge", 4, 0)]  # sent at 8
    assert events(13, cfg) == [Event("merge", 0, 0)]  # sent at 10
    assert send_round(1, 12, cfg) == 1 and send_round(1, 13, cfg) is None


def test_tau_zero_merges_in_the_same_step_after_the_send():
    cfg = SyncConfig(sync_every=10, num_fragments=5, fragment_sync_delay=0, final_sync=False)
    assert events(10, cfg) == [Event("send", 0, 0), Event("merge", 0, 0)]


def test_H_equal_1_syncs_every_fragment_every_step():
    cfg = SyncConfig(sync_every=1, num_fragments=2, fragment_sync_delay=0, final_sync=False)
    assert events(1, cfg) == [
        Event("send", 0, 0),
        Event("send", 1, 0),
        Event("merge", 0, 0),
        Event("merge", 1, 0),
    ]
    assert events(5, cfg)[0] == Event("send", 0, 4)


@pytest.mark.parametrize("tau", [0, 1, 4])
def test_final_sync_leaves_nothing_in_flight(tau):
    cfg = SyncConfig(sync_every=10, num_fragments=5, fragment_sync_delay=tau)
    total = 23
    in_flight, last_round = set(), {}
    for t in range(1, total + 1):
        for e in events(t, cfg, total):
            if e.kind == "send":
                assert (e.fragment, e.round) not in in_flight
                assert e.round == last_round.get(e.fragment, -1) + 1, "rounds are numbered in order"
                last_round[e.fragment] = e.round
                in_flight.add((e.fragment, e.round))
            else:
                in_flight.remove((e.fragment, e.round))
    assert not in_flight
    # the last step merges every fragment: the global parameters hold all the local work
    last = events(total, cfg, total)
    assert {e.fragment for e in last if e.kind == "merge"} == set(range(5))


def test_steps_count_from_one():
    with pytest.raises(ValueError):
        events(0, SyncConfig())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"sync_every": 32, "num_fragments": 5},
            r"must be 1 or a multiple of num_fragments \(P=5\).*use H=30 or H=35",
        ),
        ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha must be in \[0, 1\]"),
        ({"fragment_update_alpha": -0.1}, r"fragment_update_alpha must be in \[0, 1\]"),
        ({"uplink_codec": "fp8"}, "unknown uplink_codec 'fp8'"),
        ({"downlink_codec": "int4"}, "unknown downlink_codec 'int4'"),
        ({"fragment_sync_delay": 30}, r"must be in \[0, H-1\]"),
        ({"fragment_pattern": "random"}, "unknown fragment_pattern"),
        ({"num_fragments": 0}, "num_fragments must be at least 1"),
        ({"codec_block_size": 3}, "codec_block_size must be an even number"),
        ({"uplink_rounding": "up"}, "unknown uplink_rounding"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
    ],
)
def test_bad_config_says_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyncConfig(**kwargs)


def test_config_roundtrips_through_a_dict():
    cfg = SyncConfig(sync_every=20, num_fragments=4, fragment_sync_delay=2)
    assert SyncConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown sync config field"):
        SyncConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_sends_go_before_waits_but_never_before_a_merge_of_their_own_fragment():
    # H=10, P=5, tau=1, last step 21: fragment 0 sent round 1 at step 20 and merges it now; the final sync
    # sends every fragment once more
    cfg = SyncConfig(sync_every=10, num_fragments=5, fragment_sync_delay=1)
    last = events(21, cfg, 21)
    kinds = [(e.kind, e.fragment) for e in last]
    # the flushes of 1..4 start first; fragment 0's follows its merge (its outer gradient needs it)
    assert kinds[:4] == [("send", 1), ("send", 2), ("send", 3), ("send", 4)]
    assert kinds[4:6] == [("merge", 0), ("send", 0)]
    assert sorted(kinds[6:]) == [("merge", f) for f in range(5)]
