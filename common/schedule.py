"""The send/merge schedule: the one function that says what happens after each inner step.

Steps are counted from 1: step t is the t-th call of the inner optimizer (with sync_schedule "adaptive", the
t-th schedule step, for which a faster worker does several inner steps: common/pace.py). With P fragments,
fragment f has offset t_f = f * H / P (H is a multiple of P, or 1: every fragment every step)
and is sent at every step t >= 1 with (t - t_f) mod H == 0; its update is merged tau steps later, at
t + tau. Rounds of a fragment are numbered 0, 1, 2, ... in the order of its sends. With `final_sync`, the
last step (t == total_steps) also merges everything still in flight and then sends and merges every
fragment once more, so the global model holds all the local work.

With merge_policy "adaptive" the merge at t + tau is the earliest: a worker whose update has not arrived by
then merges it after the first later step by which it has, and at `merge_deadline` at the latest.

Within one step the events come in the order they are executed: every send whose fragment has no merge
before it in the step comes first, so that its transfer starts before any wait for an update (at the final
sync, at a deadline, or with the fixed policy); then, in order, merges of earlier sends, the sends that must
follow a merge of their own fragment, and merges of this step's sends (tau = 0 or the final sync). A send
never moves ahead of a merge of its own fragment: its outer gradient is taken against the mirror with that
merge in it. Sends keep their order among themselves, and merges theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from streamdiloco.common.config import SyncConfig


@dataclass(frozen=True)
class Event:
    kind: Literal["send", "merge"]
    fragment: int
    round: int


def fragment_offset(fragment: int, cfg: SyncConfig) -> int:
    return fragment * cfg.sync_every // cfg.num_scheduled_fragments


def _first_send(fragment: int, cfg: SyncConfig) -> int:
    off = fragment_offset(fragment, cfg)
    return off if off > 0 else cfg.sync_every


def sends_through(fragment: int, step: int, cfg: SyncConfig) -> int:
    """How many regular sends of a fragment happen at steps 1..step."""
    first = _first_send(fragment, cfg)
    return 0 if step < first else (step - first) // cfg.sync_every + 1


def send_step(fragment: int, round: int, cfg: SyncConfig) -> int:
    """The step at which a fragment sends the given round (its regular sends; not the final sync)."""
    return _first_send(fragment, cfg) + round * cfg.sync_every


def next_send_after(step: int, cfg: SyncConfig) -> int:
    """The first step after `step` at which some fragment sends."""
    return min(send_step(f, sends_through(f, step, cfg), cfg) for f in range(cfg.num_scheduled_fragments))


def joining_step(views: list[tuple], cfg: SyncConfig) -> int:
    """The step a worker that joins a run in progress starts from (it counts steps from there, so its sends
    line up with the others'), given each shard's view: every fragment's open round, whether that round is
    in progress, and (optionally) whether it is short of its quorum (fewer pushes than --min-workers).

    If some round in progress is short of its quorum, the others wait for more pushes: the joiner starts
    right after the latest send whose round has closed (at 0 if none has: at the start of a run, a worker
    that starts a little late does every step, as if it had been on time), and no later than just before
    the earliest short round, so that it sends every round that waits for it. Otherwise the others are
    somewhere between the latest send and the next send step, and the joiner starts just before the next:
    ahead of them, so that it waits for the others and never the other way round. A run with no send yet
    starts at 0. Without the quorum flags, a round in progress counts as short."""
    latest = 0  # step of the latest send (of a round in progress or closed)
    closed = 0  # step of the latest send whose round has closed
    short_at: int | None = None  # step of the earliest send whose round waits for more pushes
    for view in views:
        rounds, started = view[0], view[1]
        short = view[2] if len(view) > 2 else started
        if not len(rounds) == len(started) == len(short):
            raise ValueError("a shard's view lists rounds, started and short flags of different lengths")
        for f, (r, s, n) in enumerate(zip(rounds, started, short, strict=True)):
            if r > 0:
                closed = max(closed, send_step(f, r - 1, cfg))
            if s:
                latest = max(latest, send_step(f, r, cfg))
                if n:
                    short_at = (
                        send_step(f, r, cfg) if short_at is None else min(short_at, send_step(f, r, cfg))
                    )
    latest = max(latest, closed)
    if short_at is not None:
        return min(closed, short_at - 1)
    return next_send_after(latest, cfg) - 1 if latest else 0


def send_round(fragment: int, step: int, cfg: SyncConfig) -> int | None:
    """The round a fragment sends at this step, or None if it does not send then."""
    first = _first_send(fragment, cfg)
    if step < first or (step - first) % cfg.sync_every:
        return None
    return (step - first) // cfg.sync_every


def merge_deadline(fragment: int, round: int, cfg: SyncConfig, total_steps: int | None = None) -> int:
    """The last step whose events may merge a round (merge_policy "adaptive" merges it there at the latest,
    waiting for its update if need be): the fragment's next send, whose outer gradient is taken against the
    mirror with this round in it; or the run's last step, which syncs everything."""
    deadline = send_step(fragment, round + 1, cfg)
    return deadline if total_steps is None else min(deadline, total_steps)


def sends_early(evs: list[Event]) -> list[Event]:
    """The same events, each send moved ahead of every merge except those of its own fragment."""
    early: list[Event] = []
    rest: list[Event] = []
    merged: set[int] = set()
    for ev in evs:
        if ev.kind == "merge":
            merged.add(ev.fragment)
            rest.append(ev)
        elif ev.fragment in merged:
            rest.append(ev)
        else:
            early.append(ev)
    return early + rest


def events(step: int, cfg: SyncConfig, total_steps: int | None = None) -> list[Event]:
    """What to do after inner step `step`, in order."""
    if step < 1:
        raise ValueError(f"steps are counted from 1, got {step}")
    if total_steps is not None and step > total_steps:
        raise ValueError(f"step {step} is past total_steps={total_steps}")
    tau, nfrag = cfg.fragment_sync_delay, cfg.num_scheduled_fragments
    out: list[Event] = []
    if tau > 0 and step - tau >= 1:
        for f in range(nfrag):
            r = send_round(f, step - tau, cfg)
            if r is not None:
                out.append(Event("merge", f, r))
    sends = [(f, r) for f in range(nfrag) if (r := send_round(f, step, cfg)) is not None]
    out += [Event("send", f, r) for f, r in sends]
    if tau == 0:
        out += [Event("merge", f, r) for f, r in sends]
    if cfg.final_sync and step == total_steps:
        # merge what is still in flight (sent in the last tau steps, this one included)
        for s in range(max(1, step - tau + 1), step + 1):
            for f in range(nfrag):
                r = send_round(f, s, cfg)
                if r is not None and tau > 0:
                    out.append(Event("merge", f, r))
        flush = [(f, sends_through(f, step, cfg)) for f in range(nfrag) if send_round(f, step, cfg) is None]
        out += [Event("send", f, r) for f, r in flush]
        out += [Event("merge", f, r) for f, r in flush]
    return sends_early(out)
