"""The worker's sync engine: fragment schedule, global mirror, outer gradients, merges.

Use it around any model and training loop, like torchft's DiLoCo: build it once, then call `step()` right
after every `inner_optimizer.step()`. At a fragment's send step the engine pushes the quantized outer
gradient (mirror - local) of that fragment through its transport and training goes on; tau steps later it
takes the round's update (waiting only if it has not arrived, and counting that wait), adds it to the
mirror and mixes it into the local parameters with weight alpha.

The transport is what carries pushes and updates: the gRPC client in a worker process, an in-process
connection to the shards' logic in the simulator. The engine does not know which.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn

from streamdiloco.common.codecs import Encoded, decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import (
    FragmentLayout,
    flatten,
    fragment_params,
    slice_ranges,
    unflatten_into,
)
from streamdiloco.common.outer import apply_update, merge_local, outer_gradient
from streamdiloco.common.schedule import Event, events, sends_through


class Transport(Protocol):
    num_shards: int

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        """Send one fragment's outer gradient (one Encoded per shard slice); must not block on the round."""

    def update(self, fragment: int, round: int) -> Sequence[Any]:
        """The round's update, one per shard slice; blocks until it has arrived. Each is an Encoded update
        to add, or (over the network, after a resync) a fetched master with `.values` to take instead, or
        None: the mirror has that round already."""

    def ready(self, fragment: int, round: int) -> bool:
        """Whether update() would return at once."""


class SyncEngine:
    def __init__(
        self,
        model: nn.Module,
        layout: FragmentLayout,
        cfg: SyncConfig,
        transport: Transport,
        total_steps: int | None = None,
        seed: int = 0,
        rank: int = 0,
        start_step: int = 0,
    ):
        if layout.num_fragments != cfg.num_scheduled_fragments:
            raise ValueError(
                f"layout has {layout.num_fragments} fragments, config expects {cfg.num_scheduled_fragments}"
            )
        self.model, self.layout, self.cfg, self.transport = model, layout, cfg, transport
        self.total_steps = total_steps
        self.params = [fragment_params(model, f) for f in layout.fragments]
        # fp32 copy of the global parameters as of the last sync, on the CPU
        self.mirrors = [flatten(p) for p in self.params]
        self.ranges = [slice_ranges(f.numel, transport.num_shards) for f in layout.fragments]
        self.generator = torch.Generator().manual_seed(seed * 7_919 + rank)  # stochastic rounding only
        self.step_count = start_step  # steps already taken (by the run, for a worker that joined late)
        self.tokens_since_sync = [0] * layout.num_fragments
        self.loss_since_sync = [(0.0, 0)] * layout.num_fragments  # (sum, count) of inner losses
        # counters for the summary and the metrics
        self.bytes_sent = 0
        self.bytes_received = 0
        self.peak_push_bytes = 0
        self.pushes = 0
        self.blocked_seconds = 0.0
        self.merges = 0
        self.in_flight: dict[int, int] = {}  # fragment -> round sent and not merged yet
        self.waits = 0  # merges whose update had not arrived yet
        self.on_merge_wait: Callable[[float], None] | None = None  # gets each merge's wait (/metrics)
        self.pending: list[Event] = []  # this step's events not done yet (see finish_step)

    def next_rounds(self) -> list[int]:
        """The next round each fragment sends (the rounds a shard may expect this worker in from now on),
        counting the sends of the current step that are not done yet. Read from other threads: step()
        sets `pending` before it moves `step_count` on, and this reads them in the other order."""
        step = self.step_count
        pending = list(self.pending)
        out = [sends_through(f, step, self.cfg) for f in range(self.layout.num_fragments)]
        for ev in pending:
            if ev.kind == "send":
                out[ev.fragment] = min(out[ev.fragment], ev.round)
        return out

    def catch_up(self, first_rounds: list[int]) -> None:
        """For a worker that starts at step > 0: merge the rounds from `first_rounds` (the first round of
        each fragment not in the fetched masters) whose merge step is already behind us."""
        past = self.step_count - self.cfg.fragment_sync_delay
        for f in range(self.layout.num_fragments):
            upto = sends_through(f, past, self.cfg) if past >= 1 else 0
            for r in range(first_rounds[f], upto):
                self.merge(f, r)

    def drain(self) -> None:
        """Merge every round sent and not merged yet (at the end of training without final_sync, the last
        sends' updates would otherwise never reach the mirror and the local parameters)."""
        for fragment, round in sorted(self.in_flight.items()):
            self.merge(fragment, round)

    def close(self) -> None:
        """End the transport's sessions (if it has any)."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    # --- checkpoints ------------------------------------------------------------------------------------
    COUNTERS = (
        "bytes_sent",
        "bytes_received",
        "peak_push_bytes",
        "pushes",
        "blocked_seconds",
        "merges",
        "waits",
    )

    def state_dict(self) -> dict:
        """The engine's part of a worker checkpoint (the transport keeps its unanswered pushes)."""
        return {
            "step": self.step_count,
            "mirrors": [m.clone() for m in self.mirrors],
            "in_flight": dict(self.in_flight),
            "pending": [(e.kind, e.fragment, e.round) for e in self.pending],
            "tokens_since_sync": list(self.tokens_since_sync),
            "loss_since_sync": [list(x) for x in self.loss_since_sync],
            "generator": self.generator.get_state(),
            "counters": {k: getattr(self, k) for k in self.COUNTERS},
        }

    def load_state_dict(self, state: dict) -> None:
        mirrors = state["mirrors"]
        if [m.shape for m in mirrors] != [m.shape for m in self.mirrors]:
            raise ValueError("the checkpoint's mirror does not fit this model's fragments")
        self.step_count = int(state["step"])
        self.mirrors = [m.clone() for m in mirrors]
        self.in_flight = {int(f): int(r) for f, r in state["in_flight"].items()}
        self.pending = [Event(k, int(f), int(r)) for k, f, r in state["pending"]]
        self.tokens_since_sync = list(state["tokens_since_sync"])
        self.loss_since_sync = [(float(a), int(b)) for a, b in state["loss_since_sync"]]
        self.generator.set_state(state["generator"])
        for k, v in state["counters"].items():
            if k in self.COUNTERS:
                setattr(self, k, v)

    # --- the hook ------------------------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None) -> list[Event]:
        """Call after every inner optimizer step: counts the step and does what the schedule says."""
        evs = events(self.step_count + 1, self.cfg, self.total_steps)
        self.pending = list(evs)
        self._count(tokens, loss)
        self.finish_step()
        return evs

    def finish_step(self) -> None:
        """Do the step's events not done yet. Each is done whole or not at all: a stop request that
        interrupts a wait for an update leaves that merge and the ones after it here, in `pending`, which a
        checkpoint keeps and a resumed worker does first."""
        while self.pending:
            self.execute(self.pending[0])
            self.pending.pop(0)

    def advance(self, tokens: int = 0, loss: float | None = None) -> list[Event]:
        """Count one inner step; returns the events due now without doing them (for lock-step drivers)."""
        evs = events(self.step_count + 1, self.cfg, self.total_steps)
        self._count(tokens, loss)
        return evs

    def _count(self, tokens: int, loss: float | None) -> None:
        self.step_count += 1
        for f in range(self.layout.num_fragments):
            self.tokens_since_sync[f] += tokens
            if loss is not None:
                total, count = self.loss_since_sync[f]
                self.loss_since_sync[f] = (total + loss, count + 1)

    def execute(self, ev: Event) -> None:
        if ev.kind == "send":
            self.send(ev.fragment, ev.round)
        else:
            self.merge(ev.fragment, ev.round)

    # --- send and merge ------------------------------------------------------------------------------
    def send(self, fragment: int, round: int) -> None:
        local = flatten(self.params[fragment])
        delta = outer_gradient(self.mirrors[fragment], local)
        slices = [
            encode(
                delta[lo:hi],
                self.cfg.uplink_codec,
                self.cfg.codec_block_size,
                self.cfg.uplink_rounding,
                self.generator,
            )
            for lo, hi in self.ranges[fragment]
        ]
        weight = float(max(1, self.tokens_since_sync[fragment]))
        total, count = self.loss_since_sync[fragment]
        loss = total / count if count else None
        self.transport.push(fragment, round, slices, weight, loss)
        self.in_flight[fragment] = round
        nbytes = sum(s.nbytes for s in slices)
        self.bytes_sent += nbytes
        self.peak_push_bytes = max(self.peak_push_bytes, nbytes)
        self.pushes += 1
        self.tokens_since_sync[fragment] = 0
        self.loss_since_sync[fragment] = (0.0, 0)

    def merge(self, fragment: int, round: int) -> None:
        waited = not self.transport.ready(fragment, round)
        t0 = time.perf_counter()
        slices = self.transport.update(fragment, round)  # may raise (a stop request): nothing changed yet
        wait = time.perf_counter() - t0
        self.blocked_seconds += wait
        if self.on_merge_wait is not None:
            self.on_merge_wait(wait)
        self.merges += 1
        self.waits += waited
        self.in_flight.pop(fragment, None)
        mirror = self.mirrors[fragment]
        if len(slices) != len(self.ranges[fragment]):
            raise RuntimeError(f"update for fragment {fragment} has {len(slices)} slices")
        changed = False
        for (lo, hi), part in zip(self.ranges[fragment], slices, strict=True):
            if part is None:  # the mirror holds this round already (fetched when this worker joined)
                continue
            changed = True
            if isinstance(part, Encoded):
                if part.numel != hi - lo:
                    raise RuntimeError(
                        f"update for fragment {fragment} has {part.numel} values in a slice of {hi - lo}"
                    )
                self.bytes_received += part.nbytes
                apply_update(mirror[lo:hi], decode(part))
            else:  # a master fetched after a reconnect: it holds this round's update (and any missed)
                if part.values.numel() != hi - lo:
                    raise RuntimeError(
                        f"fetched master of fragment {fragment} has {part.values.numel()} values"
                    )
                mirror[lo:hi] = part.values
        if not changed:
            return
        local = flatten(self.params[fragment])
        unflatten_into(
            merge_local(local, self.mirrors[fragment], self.cfg.fragment_update_alpha), self.params[fragment]
        )
