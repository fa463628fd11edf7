"""The roster (server/roster.py), pure: one truth for who is a member, what the rounds wait for, what status
lists and what the pace counts; no network, the clock passed in."""

from __future__ import annotations

import asyncio

import pytest
from test_shard import make_shard

from streamdiloco.server.auth import Auth, Identity, Refused
from streamdiloco.server.dashboard import Report
from streamdiloco.server.roster import Member, Roster

ANY = Identity(None, "nothing")


def _open(roster: Roster, name: str, now: float = 0.0, seconds: float | None = None) -> Member:
    member = Member(name, asyncio.Queue(), now)
    roster.hello(member, roster.join(name, ANY, now), ANY, now)
    if seconds is not None:
        member.report = Report(step=1, step_seconds=seconds)
    return member


def test_membership_changes_in_one_place_and_everyone_sees_it_at_once():
    state, _ = make_shard()
    roster = Roster(state, Auth(), max_pending=8)
    a, b, c = (_open(roster, n, seconds=s) for n, s in (("a", 3.0), ("b", 2.0), ("c", 0.5)))
    assert [m.name for m in roster.sessions()] == ["a", "b", "c"] and roster.passive == 3
    assert roster.members() == [] and roster.pace() == 0.0 and state.members == set()
    for m in (a, b, c):
        roster.activate(m)
    assert roster.pace() == 3.0 and state.members == {"a", "b", "c"} and roster.passive == 0
    assert roster.revoke(["a", "nobody"]) == [a] and a.revoked
    roster.drop(b)  # stopped reading
    assert b.overflowed and roster.reading() == [a, c]
    assert [m.name for m in roster.members()] == ["c"] == [m.name for m in roster.sessions()]
    assert roster.pace() == 0.5 and state.members == {"c"}
    # their sessions are still open until they end: the names stay taken until then
    with pytest.raises(Refused, match="already has a session"):
        roster.join("a", ANY, 1.0)
    roster.leave(a)
    roster.leave(b)
    assert sorted(roster.open) == ["c"] and roster.join("a", ANY, 1.0)


def test_a_shard_on_its_way_down_keeps_its_members_for_the_checkpoint():
    state, _ = make_shard()
    roster = Roster(state, Auth(), max_pending=8)
    a = _open(roster, "a")
    roster.activate(a)
    roster.leave(a, stopping=True)
    assert roster.open == {} and state.members == {"a"}


def test_the_pace_follows_reports_without_counting_the_members_at_every_push(monkeypatch):
    """The pace is answered with every accepted push: kept between the changes that can move it (a report,
    a change of membership), not counted over every member each time (1,000 members: O(N) per push)."""
    state, _ = make_shard()
    roster = Roster(state, Auth(), max_pending=8)
    members = [_open(roster, n, seconds=s) for n, s in (("a", 1.0), ("b", 2.0), ("c", 0.5))]
    for m in members:
        roster.activate(m)
    assert roster.pace() == 2.0
    counted = []
    monkeypatch.setattr(roster, "members", lambda: counted.append(1) or Roster.members(roster))
    a, b, c = members
    for _ in range(100):  # reports that do not move the pace: no count
        a.report = Report(step=2, step_seconds=1.5)
        assert roster.pace() == 2.0
    assert counted == []
    c.report = Report(step=2, step_seconds=3.0)  # slower than the pace: it is the pace now
    assert roster.pace() == 3.0 and counted == []
    c.report = Report(step=3, step_seconds=0.2)  # the slowest became faster: counted again, once
    assert roster.pace() == 2.0 and roster.pace() == 2.0 and len(counted) == 1
    b.report = Report(step=3)  # no step time: it no longer counts
    assert roster.pace() == 1.5
    roster.leave(a)
    assert roster.pace() == 0.2
