"""What a worker's link to one shard holds, as pure logic: no networking, no threads, no clocks.

Per fragment of this shard's slice:
- `held`: rounds < held[f] are in the mirror, or handed to the engine, which adds them (taken);
- `covered`: rounds < covered[f] are in a fetched master (taken or not: `masters` holds the ones not taken);
- `arrived`: updates that came whole and are not taken yet;
- `kept`: this worker's pushes, kept (encoded) until their round's update is taken, to be sent again after a
  reconnect or a shard's restart;
- `awaiting`: pushes sent on the current session that have no PushResult yet, with when they were sent
  (the clock is the caller's: `sent(..., at)`), the one record of what is unanswered.

And where the shard is (`view`): its last Welcome moved on by what came since. One writer: the link's own
thread (worker/link.py); everything else asks it. Tested on its own like ShardState. It must not do
networking, threads or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from streamdiloco.common.codecs import Encoded


@dataclass(frozen=True)
class Master:
    """A master slice fetched to resynchronize: the mirror's slice becomes `values`, which hold every round
    of the fragment before `round` (in place of the updates this worker missed)."""

    values: torch.Tensor
    round: int


@dataclass(frozen=True)
class Kept:
    """A push kept until its round's update: sent again after a reconnect if its round is still open."""

    enc: Encoded
    weight: float
    loss: float | None


# An arrived update: the (offset, Encoded) chunks of the slice, as they came (decoded into the mirror by the
# engine's sync thread, chunk by chunk, without joining them).
Parts = list[tuple[int, Encoded]]
# What taking a round gives the engine: the update's parts to add, a Master to replace the slice with, or
# None: nothing to do (the mirror holds that round already, from a fetch).
Update = Parts | Master | None


class RoundsView(NamedTuple):
    """Where a run's rounds are, per fragment, as a shard says (or the shards together: the one behind
    counts): what a joiner's first step is made of (common/schedule.py's joining_step)."""

    open_rounds: list[int]  # the round open now
    started: list[bool]  # whether it is in progress (a push of it came)
    short_of_quorum: list[bool]  # whether it has fewer pushes than --min-workers so far


class MastersFetched(NamedTuple):
    """What a link's latest fetch of masters (in place of updates it missed) left: per fragment the rounds
    the masters hold (rounds < covered[f]), and where the shard said the run was then."""

    covered: list[int]
    view: RoundsView


class ShardBehind(Exception):
    """The shard is at an older round than this worker holds: it restarted from an older checkpoint."""

    def __init__(self, fragment: int, theirs: int, ours: int):
        super().__init__(
            f"is at round {theirs} of fragment {fragment}, but this worker already has round {ours - 1}: the "
            "shard restarted from an older checkpoint than its last round; restart the run from the shards' "
            "checkpoints and the workers' --resume"
        )
        self.fragment, self.theirs, self.ours = fragment, theirs, ours


class LinkState:
    def __init__(self, num_fragments: int):
        self.held = [0] * num_fragments
        self.covered = [0] * num_fragments
        self.arrived: dict[tuple[int, int], Parts] = {}
        self.masters: dict[int, Master] = {}
        self.kept: dict[tuple[int, int], Kept] = {}
        self.awaiting: dict[tuple[int, int], float] = {}  # (fragment, round) -> when it was sent

    @property
    def num_fragments(self) -> int:
        return len(self.held)

    def have(self, fragment: int) -> int:
        """Rounds of a fragment this worker holds the effect of, without gaps: taken, fetched, or here."""
        m = self.masters.get(fragment)
        h = max(self.covered[fragment], self.held[fragment], m.round if m else 0)
        while (fragment, h) in self.arrived:
            h += 1
        return h

    # --- what comes from the shard ---------------------------------------------------------------------
    def on_update(self, fragment: int, round: int, parts: Parts) -> bool:
        """A whole update arrived; False if it is older than what the mirror holds (then it is dropped)."""
        if round < max(self.covered[fragment], self.held[fragment]):
            return False
        self.arrived[(fragment, round)] = parts
        return True

    def behind(self, theirs: list[int]) -> list[int]:
        """The fragments of which the shard (at rounds `theirs`, from its Welcome and the updates that came
        after it) has closed rounds this worker holds nothing of: their slices must be fetched. Raises
        ShardBehind if the shard is behind this worker."""
        theirs = list(theirs)
        for f, r in self.arrived:
            theirs[f] = max(theirs[f], r + 1)
        out = []
        for f, t in enumerate(theirs):
            ours = self.have(f)
            if t < ours:
                raise ShardBehind(f, t, ours)
            if t > ours:
                out.append(f)
        return out

    def on_fetched(self, fragment: int, values: torch.Tensor, round: int) -> None:
        """A master fetched to resynchronize: the engine takes it in place of the rounds before `round`."""
        if round <= self.covered[fragment]:
            return  # what we hold is as new already
        self.masters[fragment] = Master(values, round)
        self.covered[fragment] = round
        self._forget(fragment, round - 1)

    def installed(self, fragment: int, round: int) -> None:
        """A joiner set its parameters and mirror from a master of `round` fetched by the caller."""
        self.held[fragment] = max(self.held[fragment], round)
        if self.covered[fragment] > round:
            return  # a reconnect meanwhile fetched a newer master: the engine takes it later
        self.covered[fragment] = round
        self.masters.pop(fragment, None)  # older than what was installed, if any
        for key in [k for k in self.arrived if k[0] == fragment and k[1] < round]:
            del self.arrived[key]  # closed before the fetch: in the master already

    def install(self, fetched: dict[int, tuple[torch.Tensor, int]]) -> list[int]:
        """A joiner set its parameters from `fetched` (fragment -> (values, round)); the rounds its mirror
        then holds, per fragment."""
        for f, (_, rnd) in fetched.items():
            self.installed(f, rnd)
        return [fetched[f][1] for f in range(self.num_fragments)]

    # --- what the engine takes -------------------------------------------------------------------------
    def available(self, fragment: int, round: int) -> bool:
        return (
            round < self.covered[fragment] or round < self.held[fragment] or (fragment, round) in self.arrived
        )

    def take(self, fragment: int, round: int) -> Update:
        """The round's update, once available: its parts, a Master (after a resync), or None (the mirror has
        that round already). The round's push is then answered: it is let go."""
        out: Update
        if round < self.covered[fragment]:  # a fetched master holds it: the master, if not taken yet
            out = self.masters.pop(fragment, None)
        elif (fragment, round) in self.arrived:
            out = self.arrived.pop((fragment, round))
        elif round < self.held[fragment]:  # in the mirror already (a resumed worker's pending merge)
            out = None
        else:
            raise KeyError(f"round {round} of fragment {fragment} is not here")
        self.held[fragment] = max(self.held[fragment], round + 1)
        self._forget(fragment, round)
        return out

    def _forget(self, fragment: int, upto: int) -> None:
        """Rounds <= upto of a fragment are in the mirror (or will be): drop their updates and pushes."""
        for key in [k for k in self.arrived if k[0] == fragment and k[1] <= upto]:
            del self.arrived[key]
        for key in [k for k in self.kept if k[0] == fragment and k[1] <= upto]:
            del self.kept[key]

    # --- this worker's pushes --------------------------------------------------------------------------
    def keep(self, fragment: int, round: int, push: Kept) -> bool:
        """Keep a push until its round's update; False if the round is in a fetched master already (then
        there is nothing to send)."""
        if round < self.covered[fragment]:
            return False
        self.kept[(fragment, round)] = push
        return True

    def to_resend(self, open_rounds: list[int]) -> list[tuple[int, int, Kept]]:
        """The kept pushes whose rounds are still open (>= the shard's open round), in order."""
        return [(f, r, p) for (f, r), p in sorted(self.kept.items()) if r >= open_rounds[f]]

    def first_rounds(self, next_rounds: list[int]) -> list[int]:
        """What Ready names: the first round of each fragment this worker pushes, counting kept pushes."""
        out = list(next_rounds)
        for f, r in self.kept:
            out[f] = min(out[f], r)
        return out

    # --- what is unanswered ---------------------------------------------------------------------------
    def sent(self, fragment: int, round: int, at: float) -> None:
        """A push went out on the current session at time `at` (the caller's clock)."""
        self.awaiting[(fragment, round)] = at

    def answered(self, fragment: int, round: int) -> float | None:
        """The shard answered a push: when it was sent (None if not on this session)."""
        return self.awaiting.pop((fragment, round), None)

    def session_ended(self) -> None:
        """The session broke: its pushes will not be answered (the kept ones are sent again)."""
        self.awaiting.clear()

    @property
    def all_answered(self) -> bool:
        return not self.awaiting

    # --- where the shard is ---------------------------------------------------------------------------
    def view(self, rounds: list[int], started: list[bool], pushes: list[int], min_workers: int) -> RoundsView:
        """Where the shard is as of now, from its last Welcome (`rounds`, `started`, `pushes`, `min_workers`)
        moved on by the updates that came and the rounds held since: per fragment the open round, whether it
        has started and whether it is short of its quorum."""
        rounds, started = list(rounds), list(started)
        short = [s and n < min_workers for s, n in zip(started, pushes, strict=True)]
        held = [(f, c - 1) for f, c in enumerate(self.covered) if c > 0]
        for f, r in [*self.arrived, *held]:
            if r + 1 > rounds[f]:
                rounds[f], started[f], short[f] = r + 1, False, False
        return RoundsView(rounds, started, short)

    # --- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "unacked": [
                {"fragment": f, "round": r, "enc": vars(p.enc).copy(), "weight": p.weight, "loss": p.loss}
                for (f, r), p in sorted(self.kept.items())
            ]
        }

    def load_state_dict(self, state: dict, held: list[int]) -> None:
        """A checkpoint's pushes, and `held`: per fragment, the rounds the checkpoint's mirror holds."""
        if len(held) != self.num_fragments:
            raise ValueError(f"held names {len(held)} fragments, the link has {self.num_fragments}")
        self.arrived.clear()
        self.masters.clear()
        self.awaiting.clear()
        self.held, self.covered = list(held), list(held)
        self.kept = {
            (u["fragment"], u["round"]): Kept(Encoded(**u["enc"]), u["weight"], u["loss"])
            for u in state["unacked"]
        }
