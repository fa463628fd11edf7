"""The send/merge schedule: the one function that says what happens after each inner step.

Steps are counted from 1: step t is the t-th call of the inner optimizer. With P fragments, fragment f has
offset t_f = f * H / P (H is a multiple of P, or 1: every fragment every step)
and is sent at every step t >= 1 with (t - t_f) mod H == 0; its update is merged tau steps later, at
t + tau. Rounds of a fragment are numbered 0, 1, 2, ... in the order of its sends. With `final_sync`, the
last step (t == total_steps) also merges everything still in flight and then sends and merges every
fragment once more, so the global model holds all the local work.

Within one step the events come in the order they must be executed: merges of earlier sends, then sends,
then merges of this step's sends (tau = 0 or the final sync).
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


def send_round(fragment: int, step: int, cfg: SyncConfig) -> int | None:
    """The round a fragment sends at this step, or None if it does not send then."""
    first = _first_send(fragment, cfg)
    if step < first or (step - first) % cfg.sync_every:
        return None
    return (step - first) // cfg.sync_every


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
    return out
