"""The roster (server/trust/roster.py), pure: one truth for who is a member, what the rounds wait for, what
status lists and what the pace counts; no network, the clock passed in."""

from __future__ import annotations

import asyncio

import pytest

from streamdiloco.server.trust.auth import Auth, Identity, Refused
from streamdiloco.server.trust.roster import Member, Roster
from tests.support.nano_shard import nano_state

ANY = Identity(None, "nothing")


def _open(roster: Roster, name: str, now: float = 0.0) -> Member:
    member = Member(name, asyncio.Queue(), now)
    roster.hello(member, roster.join(name, ANY, now), ANY, now)
    return member


def _pushed(roster: Roster, name: str, seconds: float) -> None:
    """An accepted push of the member's that reported this step time (ShardState.push_chunk's record)."""
    roster.state.roll.heard(name, seconds)


def test_membership_changes_in_one_place_and_everyone_sees_it_at_once():
    state, _ = nano_state()
    roster = Roster(state, Auth(), max_pending=8)
    a, b, c = (_open(roster, n) for n in "abc")
    assert [m.name for m in roster.sessions()] == ["a", "b", "c"] and roster.passive == 3
    assert roster.members() == [] and roster.pace() == 0.0 and state.members == set()
    for m, seconds in zip((a, b, c), (3.0, 2.0, 0.5), strict=True):
        roster.activate(m)
        _pushed(roster, m.name, seconds)
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
    state, _ = nano_state()
    roster = Roster(state, Auth(), max_pending=8)
    a = _open(roster, "a")
    roster.activate(a)
    roster.leave(a, stopping=True)
    assert roster.open == {} and state.members == {"a"}


def test_the_pace_is_the_rounds_members_and_a_member_that_leaves_leaves_it():
    """What the workers are answered with (the roster's pace) is what the round rule's grace and the
    stretch count from (ShardState's): one record, which a member leaves when it leaves the rounds."""
    state, _ = nano_state()
    roster = Roster(state, Auth(), max_pending=8)
    members = [_open(roster, n) for n in "abc"]
    for m, seconds in zip(members, (1.0, 2.0, 0.5), strict=True):
        roster.activate(m)
        _pushed(roster, m.name, seconds)
    assert roster.pace() == state.pace() == 2.0
    a, b, c = members
    _pushed(roster, "c", 3.0)  # slower than the pace: it is the pace now
    assert roster.pace() == state.pace() == 3.0
    roster.leave(c)
    assert roster.pace() == state.pace() == 2.0
    roster.drop(b)  # stopped reading: gone from the pace at once, while its session ends
    assert roster.pace() == state.pace() == 1.0
