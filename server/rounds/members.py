"""Who a shard's rounds wait for: its members (each from which round of each fragment on), those of them that
are dormant (they missed a round: not expected until a push of theirs arrives again), what each last pushed
(the weight a round counts on from it, and the step time it reported: the run's pace), and, after a restart,
the members its checkpoint names, waited for as if they were here until they are back or their time is up
(without them a round could close without a push it had acknowledged).

Split from server/rounds/state.py (ShardState, which fixes a round's expected members from these when the
round starts, and tells this class who pushed and who missed a round) by job. server/trust/roster.py is the
only caller that adds or removes members. Pure: the clock is passed in; what it must not do: decide when a
round closes.
"""

from __future__ import annotations

from streamdiloco.common.pace import pace_seconds, valid_step_seconds


class RoundMembers:
    """The members of one shard's rounds, and those it waits for after a restart."""

    def __init__(self, num_fragments: int):
        self.num_fragments = num_fragments
        self.members: set[str] = set()
        self.member_from: dict[str, list[int]] = {}  # member -> first round of each fragment it pushes
        self.restored: set[str] = set()  # the members the checkpoint names
        self.returning: set[str] = set()  # those of them not back yet, waited for until `returning_until`
        self.returning_until: float | None = None
        # members that were expected by a round that closed without them: no round that starts from now on
        # waits for them, until a push of theirs arrives (accepted or late: it is there and keeping a pace)
        self.dormant: set[str] = set()
        self.weights: dict[str, float] = {}  # member -> the share its last push had in a closed round
        self.step_seconds: dict[str, float] = {}  # member -> the step time its last accepted push reported
        self._pace: float | None = 0.0  # the largest of step_seconds (None: to be counted again)

    def add(self, worker: str, from_rounds: list[int] | None = None) -> None:
        """Rounds that start from now on wait for this worker; with `from_rounds`, only rounds
        >= from_rounds[fragment] (a worker that joins a run in progress skips the rounds before)."""
        if from_rounds is not None and len(from_rounds) != self.num_fragments:
            raise ValueError(f"from_rounds has {len(from_rounds)} entries, this run {self.num_fragments}")
        self.members.add(worker)
        self.returning.discard(worker)
        self.dormant.discard(worker)  # a new session: it gets its chance again
        if from_rounds is not None:
            self.member_from[worker] = list(from_rounds)
        else:
            self.member_from.pop(worker, None)

    def remove(self, worker: str) -> None:
        self.members.discard(worker)
        self.member_from.pop(worker, None)
        self.dormant.discard(worker)
        self.weights.pop(worker, None)
        self._forget_step(worker)

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

    def heard(self, worker: str, step_seconds: float | None = None) -> None:
        """A push of the worker's arrived (accepted, with the step time it reported, or late): it is not
        dormant from now on."""
        self.dormant.discard(worker)
        if step_seconds is not None:
            self._forget_step(worker)
            self.step_seconds[worker] = step_seconds
            if self._pace is not None and step_seconds > self._pace and valid_step_seconds(step_seconds):
                self._pace = step_seconds

    def _forget_step(self, worker: str) -> None:
        """The worker's step time leaves the pace: counted again (once) only if it was the pace."""
        old = self.step_seconds.pop(worker, None)
        if old is not None and self._pace is not None and old >= self._pace:
            self._pace = None

    def missed(self, workers: set[str]) -> None:
        """A round closed without these expected members' pushes: they are dormant until they push again."""
        self.dormant.update(w for w in workers if w in self.members)

    def pushed(self, shares: dict[str, float]) -> None:
        """These members' pushes were settled at these shares: what later rounds count on from them."""
        self.weights.update(shares)

    def pace(self) -> float:
        """The run's pace: the slowest member's reported seconds per inner step (0.0: none reported). Kept,
        and counted over the members again only when the slowest one's report went down or it left: a
        shard asks at every push, and with a thousand members counting each time made a round O(N^2)."""
        if self._pace is None:
            self._pace = pace_seconds(self.step_seconds.values())
        return self._pace

    def saved(self) -> list[str]:
        """The members as a checkpoint names them."""
        return sorted(self.members | self.returning)

    def restore(self, members: list[str]) -> None:
        self.restored.update(members)

    def expect_back(self, until: float) -> None:
        """After a restart: wait for the checkpoint's members as if they were here, until `until`."""
        self.returning = set(self.restored) - self.members
        self.returning_until = until if self.returning else None
