"""Who a shard's rounds wait for: its members (each from which round of each fragment on), those of them that
are dormant (they missed a round: not expected until an accepted push of theirs), what each last pushed
(the share a round counts on from it, the round of its last accepted push of each fragment, and the step
time it reported: the run's pace), and, after a restart, the members its checkpoint names, waited for as if
they were here until they are back or their time is up (without them a round could close without a push it
had acknowledged).

The pace is robust to one liar (issue 37): only members with a recent accepted push count (one that missed
a round leaves it until an accepted push of its own), and each one's report is clamped to within
`spread` (--max-steps-per-tick) of their upper median (common/pace.py's `robust_pace`). A late push wakes a
dormant member only when it just missed one round (its last accepted push of that fragment is the round
before the one that closed without it), or, once a session, a member whose first push came late: waited
for again, it catches up; a member further behind goes on from where the run is (the worker's
skip-ahead), and a liar cannot keep itself expected with late chunks.

Split from server/rounds/state.py (ShardState, which fixes a round's expected members from these when the
round starts, and tells this class who pushed and who missed a round) by job. server/trust/roster.py is the
only caller that adds or removes members. Pure: the clock is passed in; what it must not do: decide when a
round closes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from streamdiloco.common.pace import robust_pace, valid_step_seconds

# Names whose last share and accepted rounds are kept after they leave (a member that reconnects is not
# one that never pushed): at most this many beyond the members, the oldest forgotten first.
MAX_REMEMBERED = 4096


@dataclass
class Known:
    """What a member's accepted pushes told: the share its last settled push counted with (None: none
    settled yet), and per fragment the round of its last accepted push (-1: none)."""

    rounds: list[int]
    share: float | None = None


@dataclass
class RoundMembers:
    """The members of one shard's rounds, and those it waits for after a restart. `spread`: how far one
    member's reported step time may be from the others' upper median (--max-steps-per-tick)."""

    num_fragments: int
    spread: float = math.inf
    members: set[str] = field(default_factory=set)
    member_from: dict[str, list[int]] = field(default_factory=dict)  # member -> first round of each fragment
    restored: set[str] = field(default_factory=set)  # the members the checkpoint names
    returning: set[str] = field(default_factory=set)  # those not back yet, waited for until returning_until
    returning_until: float | None = None
    # members that were expected by a round that closed without them: no round that starts from now on
    # waits for them, until an accepted push of theirs (or a late one, just behind: `late`)
    dormant: set[str] = field(default_factory=set)
    known: dict[str, Known] = field(default_factory=dict)  # oldest first (kept after a member leaves)
    woken: set[str] = field(default_factory=set)  # members without an accepted push, woken once this session
    # members with a recent accepted push -> the step time it reported; its values, ascending (the pace)
    step_seconds: dict[str, float] = field(default_factory=dict)
    _steps: list[float] = field(default_factory=list)

    def add(self, worker: str, from_rounds: list[int] | None = None) -> None:
        """Rounds that start from now on wait for this worker; with `from_rounds`, only rounds
        >= from_rounds[fragment] (a worker that joins a run in progress skips the rounds before)."""
        if from_rounds is not None and len(from_rounds) != self.num_fragments:
            raise ValueError(f"from_rounds has {len(from_rounds)} entries, this run {self.num_fragments}")
        self.members.add(worker)
        self.returning.discard(worker)
        self.dormant.discard(worker)  # a new session: it gets its chance again
        self.woken.discard(worker)
        if from_rounds is not None:
            self.member_from[worker] = list(from_rounds)
        else:
            self.member_from.pop(worker, None)

    def remove(self, worker: str) -> None:
        self.members.discard(worker)
        self.member_from.pop(worker, None)
        self.dormant.discard(worker)
        self.woken.discard(worker)
        self._forget_step(worker)
        if len(self.known) > MAX_REMEMBERED + len(self.members) + MAX_REMEMBERED // 4:
            # forget the oldest names that left (in batches: O(1) a departure, amortized)
            for name in [n for n in self.known if n not in self.members][: len(self.known) - MAX_REMEMBERED]:
                del self.known[name]

    def expected(self, fragment: int, number: int) -> frozenset[str]:
        """Who round `number` of the fragment waits for (dormant members aside)."""
        here = frozenset(
            m
            for m in self.members
            if m not in self.dormant
            and (m not in self.member_from or self.member_from[m][fragment] <= number)
        )
        return here | self.returning

    def present(self, now: float) -> set[str]:
        """The members, and those still waited for after a restart (who did not come back in time by `now`
        have left)."""
        if self.returning_until is not None and now >= self.returning_until:
            self.returning.clear()
            self.returning_until = None
        return self.members | self.returning

    def heard(
        self, worker: str, step_seconds: float | None = None, fragment: int | None = None, round: int = -1
    ) -> None:
        """An accepted push of the worker's (of `round` of `fragment`, reporting `step_seconds`): it is not
        dormant from now on, and its step time is in the pace."""
        self.dormant.discard(worker)
        if fragment is not None:
            self._known(worker).rounds[fragment] = round
        if step_seconds is not None and valid_step_seconds(step_seconds):
            self._forget_step(worker)
            self.step_seconds[worker] = step_seconds
            bisect.insort(self._steps, step_seconds)

    def late(self, worker: str, fragment: int, open_round: int) -> bool:
        """A push of the worker's for a closed round of `fragment` (whose open round is `open_round`)
        arrived: it wakes the worker only if its last accepted push of the fragment was to the round before
        the one that closed last (it just missed one), or, for a worker that never had an accepted push (its
        first came late: a slow start), once a session. True if it was dormant and is woken."""
        if worker not in self.dormant:
            return False
        known = self.known.get(worker)
        if known is not None and known.rounds[fragment] != open_round - 2:
            return False
        if known is None:
            if worker in self.woken:
                return False
            self.woken.add(worker)
        self.dormant.discard(worker)
        return True

    def _known(self, worker: str) -> Known:
        known = self.known.pop(worker, None)  # moved to the end: the most recent
        if known is None:
            known = Known([-1] * self.num_fragments)
        self.known[worker] = known
        return known

    def _forget_step(self, worker: str) -> None:
        """The worker's step time leaves the pace."""
        old = self.step_seconds.pop(worker, None)
        if old is not None:
            del self._steps[bisect.bisect_left(self._steps, old)]

    def missed(self, workers: set[str]) -> None:
        """A round closed without these expected members' pushes: they are dormant until they push again,
        and their step times leave the pace."""
        for w in workers:
            if w in self.members:
                self.dormant.add(w)
                self._forget_step(w)

    def pushed(self, shares: dict[str, float]) -> None:
        """These members' pushes were settled at these shares (bounded, never stretched): what later rounds
        count on from them."""
        for worker, share in shares.items():
            self._known(worker).share = share

    def share(self, worker: str) -> float | None:
        """The share the worker's last settled push counted with (None: it never had one)."""
        known = self.known.get(worker)
        return None if known is None else known.share

    def pace(self) -> float:
        """The run's pace: the slowest reported seconds per inner step of the members with a recent accepted
        push, each clamped to within `spread` of their upper median (0.0: none reported). O(1): the reports
        are kept sorted (O(log N) a report), as a shard asks at every push and a thousand members must not
        make a round O(N^2)."""
        return robust_pace(self._steps, self.spread)

    def saved(self) -> list[str]:
        """The members as a checkpoint names them."""
        return sorted(self.members | self.returning)

    def restore(self, members: list[str]) -> None:
        self.restored.update(members)

    def expect_back(self, until: float) -> None:
        """After a restart: wait for the checkpoint's members as if they were here, until `until`."""
        self.returning = set(self.restored) - self.members
        self.returning_until = until if self.returning else None
