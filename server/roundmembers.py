"""Who a shard's rounds wait for: its members (each from which round of each fragment on), and, after a
restart, the members its checkpoint names, waited for as if they were here until they are back or their
time is up (without them a round could close without a push it had acknowledged).

Split from server/shard.py (ShardState, which fixes a round's expected members from these when the round
starts) by job. server/roster.py is the only caller that changes them. Pure: the clock is passed in.
"""

from __future__ import annotations


class RoundMembers:
    """The members of one shard's rounds, and those it waits for after a restart."""

    def __init__(self, num_fragments: int):
        self.num_fragments = num_fragments
        self.members: set[str] = set()
        self.member_from: dict[str, list[int]] = {}  # member -> first round of each fragment it pushes
        self.restored: set[str] = set()  # the members the checkpoint names
        self.returning: set[str] = set()  # those of them not back yet, waited for until `returning_until`
        self.returning_until: float | None = None

    def add(self, worker: str, from_rounds: list[int] | None = None) -> None:
        """Rounds that start from now on wait for this worker; with `from_rounds`, only rounds
        >= from_rounds[fragment] (a worker that joins a run in progress skips the rounds before)."""
        if from_rounds is not None and len(from_rounds) != self.num_fragments:
            raise ValueError(f"from_rounds has {len(from_rounds)} entries, this run {self.num_fragments}")
        self.members.add(worker)
        self.returning.discard(worker)
        if from_rounds is not None:
            self.member_from[worker] = list(from_rounds)
        else:
            self.member_from.pop(worker, None)

    def remove(self, worker: str) -> None:
        self.members.discard(worker)
        self.member_from.pop(worker, None)

    def expected(self, fragment: int, number: int) -> frozenset[str]:
        """Who round `number` of the fragment waits for."""
        here = frozenset(
            m for m in self.members if m not in self.member_from or self.member_from[m][fragment] <= number
        )
        return here | self.returning

    def present(self, now: float) -> set[str]:
        """The members, and those still waited for after a restart (who did not come back in time by `now`
        have left)."""
        if self.returning_until is not None and now >= self.returning_until:
            self.returning.clear()
            self.returning_until = None
        return self.members | self.returning

    def saved(self) -> list[str]:
        """The members as a checkpoint names them."""
        return sorted(self.members | self.returning)

    def restore(self, members: list[str]) -> None:
        self.restored.update(members)

    def expect_back(self, until: float) -> None:
        """After a restart: wait for the checkpoint's members as if they were here, until `until`."""
        self.returning = set(self.restored) - self.members
        self.returning_until = until if self.returning else None
