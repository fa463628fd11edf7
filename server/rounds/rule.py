"""When a shard's round closes: the rule, as pure arithmetic on what ShardState knows of the round (who has
pushed, who is still waited for, the shares in hand, the clock and the run's pace). The design's reasons are
in docs/design.md ("Rounds that close on the run's pace"); in short, a round closes
- "all": when every expected member still here (dormant ones aside) has pushed, with at least
  `min_workers` contributions;
- "quorum": when it holds the quorum, with at least `min_workers`, once the grace has passed since the
  later of the quorum and a round's length at the pace after the round opened (H x the pace: honest members
  push about then, whenever a liar's push came). The grace is `round_grace` of a round's length at the
  pace, at least GRACE_MIN seconds, at most `round_timeout`. Not at a run's start (ShardState: the fragment
  has no history yet) while a member it waits for never had an accepted push: the pace, perhaps a lone
  liar's claim, cannot say when that member's first push comes;
- "deadline": when it holds the quorum `round_timeout` after it opened (the previous round closed), with at
  least `min_workers` or, when fewer can push (members that never pushed cannot), all of those;
- "overdue": without a quorum, with the same numbers, a round's length at the pace after its deadline (and
  at least --round-timeout after its first push), so that nothing waits forever, while a member that pushes
  the moment a round opens never closes one that the others have not reached;
- "empty": when every expected member has left.

The quorum counts only what has arrived (issue 37): --quorum of the distinct members (those that pushed
against those pushed and still waited for, each counting) and --quorum of the weight (the pushes' shares,
bounded and never stretched, against those plus each waited-for member's last share, capped at
--weight-cap x the round's reference median). A member that never pushed adds no weight: it stands in for
nobody's, and no typical weight of the pushes (a liar's own) stands in for it.

Split from server/rounds/state.py (ShardState, which gathers the round's numbers and keeps `quorum_at`) by
job. What it must not do: keep state, or read a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamdiloco.common.config import ShardSettings

# The least grace a round gives the rest once it holds a quorum (seconds): what a push's transfer and the
# sites' step times may vary by even when a round's length at the pace is shorter.
GRACE_MIN = 5.0


@dataclass(frozen=True)
class RoundRule:
    """A shard's round policy: the [server] section's --min-workers, --round-timeout, --quorum and
    --round-grace (ShardSettings declares and checks them; `of` builds the rule from it) and H. The pure
    logic and the simulator may also give a round timeout of inf: no deadline."""

    min_workers: int
    round_timeout: float
    quorum: float
    round_grace: float
    sync_every: int

    @classmethod
    def of(cls, settings: ShardSettings, sync_every: int) -> RoundRule:
        """The rule of a shard's [server] section (checked there) and H."""
        s = settings
        return cls(s.min_workers, s.round_timeout, s.quorum, s.round_grace, sync_every)

    def __post_init__(self) -> None:  # the section allows 0 (launch's "all M workers"); a shard needs one
        if self.min_workers < 1:
            raise ValueError(f"--min-workers must be at least 1, got {self.min_workers}")

    def grace(self, pace: float) -> float:
        """How long a round that holds a quorum waits for the rest: `round_grace` of a round's length at the
        pace, at least GRACE_MIN, at most --round-timeout (all of it while no member has reported its step
        time)."""
        if not pace:
            return self.round_timeout
        return min(max(self.round_grace * self.sync_every * pace, GRACE_MIN), self.round_timeout)

    def holds_quorum(self, pushed: float, cap: float | None, n: int, pending: list[float | None]) -> bool:
        """Whether the round's n pushes, of shares summing to `pushed` (bounded, never stretched), are
        --quorum of the distinct members (the n and the `pending` members, every one counting) and of the
        weight (`pushed` and the pending members' last shares, each at most `cap`: a member that never had
        one, None, adds none)."""
        if not pushed > 0 or n < self.quorum * (n + len(pending)):
            return False
        waited = sum(w if cap is None else min(w, cap) for w in pending if w is not None)
        return pushed >= self.quorum * (pushed + waited)

    def why(
        self,
        n: int,
        pending: int,
        can: int,
        unknown: bool,
        opened_at: float,
        started_at: float,
        quorum_at: float | None,
        now: float,
        pace: float,
    ) -> str | None:
        """Why the round closes now (None: it does not), "empty" aside: `n` contributions, `pending` expected
        members that have not pushed, `can`: how many of both ever pushed, `unknown`: one of the pending
        never had an accepted push (the pace cannot say when its first arrives: no quorum close before the
        deadline), the round open since `opened_at`, its first push at `started_at`, the quorum held since
        `quorum_at`."""
        if not pending and n >= self.min_workers:
            return "all"
        # --min-workers waits for members that never pushed only until the deadline
        enough = n >= min(self.min_workers, can)
        length = self.sync_every * pace if pace else self.round_timeout  # a round's, at the pace
        deadline = opened_at + self.round_timeout
        if quorum_at is not None and n >= self.min_workers and not unknown and now < deadline:
            # the grace runs from the quorum, but not from before the honest members' pushes are due
            if max(quorum_at, opened_at + length) + self.grace(pace) <= now:
                return "quorum"
        if quorum_at is not None and enough and now >= deadline:
            return "deadline"
        # (and not sooner than --round-timeout after its first push: the pace is unknown at a run's start)
        if enough and now >= max(deadline + length, started_at + self.round_timeout):
            return "overdue"  # no quorum long after the pace says there should be: nothing waits forever
        return None
