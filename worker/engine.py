"""The worker's sync engine: fragment schedule, global mirror, outer gradients, merges.

Use it around any model and training loop, like torchft's DiLoCo: build it once, then call `step()` right
after every `inner_optimizer.step()`.

What runs where (a GPU step takes tens of milliseconds; the sync work of a 100M-parameter fragment on the
training thread would take longer than the step):
- the training thread, at a fragment's send step, only takes a snapshot of the fragment's parameters (one
  multi-tensor copy into a buffer kept for it; on CUDA a device-side copy), and tau steps later mixes the
  round's update in (one multi-tensor lerp against the mirror, on the parameters' device). With
  merge_policy "fixed" it waits there if the update has not arrived and been added to the mirror yet, and
  counts that wait; with "adaptive" (the default) it goes on training and merges after the first later step
  by which the update is in, waiting only if it is still missing at the fragment's next send;
- the sync thread (one per engine, jobs in order) computes the outer gradient (mirror - snapshot), encodes
  it and hands it to the transport; and when the round's update arrives, decodes it into the mirror (and,
  on CUDA, copies the fragment's mirror to the device for the lerp).
Each (fragment, round) has one future that the merge waits on; `request_stop()` cancels them.

With sync_schedule "adaptive" (sites of unequal speed, common/pace.py) `step_count` counts the schedule's
steps and `step()` completes one only every `per_tick` inner steps, from this worker's measured step time
and the run's pace that the shards answer its pushes with; everything else (schedule, rounds, merges,
checkpoints) is as with one inner step per schedule step.

The transport is what carries pushes and updates: the gRPC client in a worker process, an in-process
connection to the shards' logic in the simulator. The engine does not know which. The simulator runs the
engine with `background=False`: the same jobs, done in order on the calling thread.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import torch
import torch.nn as nn

from streamdiloco.common.codecs import Encoded, add_into, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, fragment_params, slice_ranges
from streamdiloco.common.outer import merge_local_, outer_gradient, rebase_local_
from streamdiloco.common.pace import MAX_STEP_SECONDS, TickClock, steps_per_tick
from streamdiloco.common.schedule import Event, events, merge_deadline, sends_early, sends_through
from streamdiloco.worker.report import Progress

log = logging.getLogger("streamdiloco.worker")

WAIT_LOG_SECONDS = 30.0  # log while a merge waits this long for its update
INTERRUPT_CHECK_SECONDS = 1.0  # how often a wait looks at an `interrupt` Event (request_stop() is at once)
MAX_REPORTED_LOSS = 1e4  # the shards refuse a push that reports a loss beyond (server/robust.py MAX_LOSS)
STEP_TIMES = 16  # inner steps whose durations the reported step time is the median of (adaptive schedule)


class StopRequested(Exception):
    """The worker was asked to stop (SIGTERM, Ctrl+C) while it waited for an update; nothing was taken."""


class Transport(Protocol):
    num_shards: int

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        """Send one fragment's outer gradient (one Encoded per shard slice); must not block on the round."""

    def update(self, fragment: int, round: int) -> Future:
        """A future of the round's update, one entry per shard slice. Each is what to do to the mirror's
        slice: an Encoded update to add (or a list of (offset, Encoded) parts of it), a fetched master (an
        object with `.values` and `.round`, after a resync) to take instead, or None: the mirror has that
        round already. The future fails with an error when the transport cannot deliver it."""


def _parts(update: Any) -> list[tuple[int, Encoded]] | None:
    if isinstance(update, Encoded):
        return [(0, update)]
    if isinstance(update, list):
        return update
    return None


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
        background: bool = True,
        interrupt: threading.Event | None = None,
    ):
        if layout.num_fragments != cfg.num_scheduled_fragments:
            raise ValueError(
                f"layout has {layout.num_fragments} fragments, config expects {cfg.num_scheduled_fragments}"
            )
        self.model, self.layout, self.cfg, self.transport = model, layout, cfg, transport
        self.total_steps = total_steps
        self.interrupt = interrupt
        self.params = [[p.detach() for p in fragment_params(model, f)] for f in layout.fragments]
        self.device = self.params[0][0].device if self.params and self.params[0] else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        # fp32 copy of the global parameters as of the last sync, on the CPU (pinned for async copies)
        self.mirrors = [self._flat(f) for f in range(layout.num_fragments)]
        for f in range(layout.num_fragments):
            _copy_into(self._views(self.mirrors[f], f), self.params[f])
        # where the lerp reads the mirror: its views on the CPU; on CUDA, a device copy made per merge
        self._mirror_views = [self._views(m, f) for f, m in enumerate(self.mirrors)]
        self._staged: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # CUDA: on the device
        self._side: Any = None  # CUDA: the sync thread's stream
        self._snapshots: list[torch.Tensor | None] = [None] * layout.num_fragments  # host buffers, reused
        # fragment -> the round whose send the snapshot buffer holds (merge_rule "rebase" mixes against it;
        # a round this process did not send, or one sent before a restart, is mixed as it is at the merge)
        self._snapshot_round: dict[int, int] = {}
        self._deltas: list[torch.Tensor | None] = [None] * layout.num_fragments  # sync thread's, reused
        self.ranges = [slice_ranges(f.numel, transport.num_shards) for f in layout.fragments]
        # rounds < mirror_rounds[f][s] are in slice s of fragment f's mirror (what a checkpoint holds)
        self.mirror_rounds = [[0] * transport.num_shards for _ in layout.fragments]
        self._mirror_lock = threading.Lock()  # apply jobs vs a checkpoint's copy of the mirrors
        self.generator = torch.Generator().manual_seed(seed * 7_919 + rank)  # stochastic rounding only
        self.step_count = start_step  # steps already taken (by the run, for a worker that joined late)
        # sync_schedule "adaptive" (common/pace.py): step_count counts schedule steps, and a faster worker
        # does `per_tick` inner steps for each; `clock` says when they make up the next schedule step
        self.inner_steps = 0  # inner steps this engine was told of (step() calls), in this run
        self.clock = TickClock()
        self.per_tick = 1.0
        self.step_seconds: float | None = None  # median seconds per inner step, waits and syncs left out
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES)
        self._last_step_end: float | None = None
        self.tokens_since_sync = [0] * layout.num_fragments
        self.loss_since_sync = [(0.0, 0)] * layout.num_fragments  # (sum, count) of inner losses
        # counters for the summary and the metrics
        self.bytes_sent = 0
        self.bytes_received = 0
        self.peak_push_bytes = 0
        self.pushes = 0
        self.blocked_seconds = 0.0
        self.merges = 0
        self.tokens = 0  # tokens trained on, as step() was told
        # what the trainer reports for the shards' dashboards (report()): sent with the next pushes
        self.eval_loss: float | None = None
        self.eval_step = 0
        self.compute_utilization: float | None = None
        self.in_flight: dict[int, int] = {}  # fragment -> round sent and not merged yet
        self.waits = 0  # merges whose update had not arrived yet
        # adaptive merges: rounds whose merge step has passed without their update, oldest first; checked
        # again after every step (merged once in, or at their deadline whatever happens)
        self.deferred: list[tuple[int, int]] = []
        self.late_merges = 0  # merges done later than tau steps after their send (adaptive)
        self.merge_delay_steps = 0  # steps from send to merge, summed over merges (mean tau = this / merges)
        self._sent_at: dict[tuple[int, int], int] = {}  # (fragment, round) -> the step that sent it
        self.send_seconds = 0.0  # training thread's time in sends (snapshots) and merges (lerps), for
        self.merge_seconds = 0.0  # the benchmarks: what the sync path costs the GPU
        self.on_merge_wait: Callable[[float], None] | None = None  # gets each merge's wait (/metrics)
        self.on_merged: Callable[[int], None] | None = None  # gets each merged fragment (worker/group.py)
        self.pending: list[Event] = []  # this step's events not done yet (see finish_step)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sync") if background else None
        self._sends: dict[int, Future] = {}  # fragment -> its latest send job
        self._applied: dict[tuple[int, int], Future] = {}  # (fragment, round) -> mirror holds it
        self._stopping = False
        self.error: BaseException | None = None  # the first failure of a background job

    # --- buffers ---------------------------------------------------------------------------------------
    def _flat(self, fragment: int) -> torch.Tensor:
        n = self.layout.fragments[fragment].numel
        return torch.empty(n, dtype=torch.float32, pin_memory=self.cuda and torch.cuda.is_available())

    def _views(self, flat: torch.Tensor, fragment: int) -> list[torch.Tensor]:
        """The parameters' shapes as views of a flat fp32 vector."""
        out, off = [], 0
        for p in self.params[fragment]:
            out.append(flat[off : off + p.numel()].view(p.shape))
            off += p.numel()
        return out

    def _run(self, job: Callable[..., Any], *args: Any) -> Future:
        """Do a job on the sync thread (in order), or here and now without one."""
        if self._executor is not None:
            return self._executor.submit(self._guard, job, *args)
        fut: Future = Future()
        try:
            fut.set_result(job(*args))
        except BaseException as e:
            fut.set_exception(e)
            raise
        return fut

    def _guard(self, job: Callable[..., Any], *args: Any) -> Any:
        try:
            return job(*args)
        except BaseException as e:
            if self.error is None and not isinstance(e, CancelledError | StopRequested):
                self.error = e
                log.error("sync work failed: %s: %s", type(e).__name__, e)
            raise

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

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

    def set_mirror_rounds(self, rounds: list[list[int]]) -> None:
        """What the mirror holds as it is set up (a joiner's fetch): rounds[f][s] per fragment and slice."""
        with self._mirror_lock:
            self.mirror_rounds = [list(r) for r in rounds]

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The global model as this worker knows it (its mirror: the shards' masters as of the latest
        updates it has), as a state_dict of the model: on the CPU, each parameter in its own dtype, buffers
        as the model holds them. The local parameters are α-mixed with local steps, not the global model:
        save or evaluate this instead (`model.load_state_dict(engine.global_state_dict())`)."""
        out = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        # a parameter may appear under several names (tied weights): every name of it gets its global value
        names_of: dict[int, list[str]] = {}
        for key, tensor in self.model.state_dict(keep_vars=True).items():
            names_of.setdefault(id(tensor), []).append(key)
        params = dict(self.model.named_parameters())
        with self._mirror_lock:
            for f, fragment in enumerate(self.layout.fragments):
                mirror = self.mirrors[f]
                for e in fragment.entries:
                    value = mirror[e.offset : e.offset + e.numel].view(e.shape)
                    for key in names_of.get(id(params[e.name]), [e.name]):
                        out[key] = value.to(out[key].dtype, copy=True)
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
        self.deferred = []  # all of them in flight: merged here
        for fragment, round in sorted(self.in_flight.items()):
            self.merge(fragment, round)
        self.quiesce()

    def quiesce(self) -> None:
        """Wait until the sync thread has done every job given to it so far."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()
        self._check()

    def request_stop(self) -> None:
        """Make a merge that waits (or will wait) for its update give up with StopRequested; safe to call
        from a signal handler or another thread."""
        self._stopping = True
        for fut in list(self._applied.values()):
            fut.cancel()

    def close(self) -> None:
        """End the sync thread and the transport's sessions (if it has any)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
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
        "late_merges",
        "merge_delay_steps",
        "tokens",
        "inner_steps",
    )

    def state_dict(self) -> dict:
        """The engine's part of a worker checkpoint (the transport keeps its unanswered pushes; call its
        state_dict after this one, so that it holds the pushes of every send done here). The mirror is
        copied with the rounds it holds, as one: updates may arrive and be added meanwhile."""
        for fut in list(self._sends.values()):  # every send snapshotted has reached the transport
            fut.result()
        with self._mirror_lock:
            mirrors = [m.clone() for m in self.mirrors]
            mirror_rounds = [list(r) for r in self.mirror_rounds]
        return {
            "step": self.step_count,
            "mirrors": mirrors,
            "mirror_rounds": mirror_rounds,
            "in_flight": dict(self.in_flight),
            "pending": [(e.kind, e.fragment, e.round) for e in self.pending],
            "deferred": [list(x) for x in self.deferred],
            "sent_at": [[f, r, t] for (f, r), t in self._sent_at.items()],
            # the send snapshots of rounds not merged yet: a resumed worker rebases them as it would have
            "snapshots": {
                f: (r, self._snapshots[f].clone())  # type: ignore[union-attr]
                for f, r in self._snapshot_round.items()
            },
            "tokens_since_sync": list(self.tokens_since_sync),
            "loss_since_sync": [list(x) for x in self.loss_since_sync],
            "generator": self.generator.get_state(),
            "tick_credit": self.clock.credit,
            "counters": {k: getattr(self, k) for k in self.COUNTERS},
        }

    def load_state_dict(self, state: dict) -> None:
        mirrors = state["mirrors"]
        if [m.shape for m in mirrors] != [m.shape for m in self.mirrors]:
            raise ValueError("the checkpoint's mirror does not fit this model's fragments")
        self.step_count = int(state["step"])
        with self._mirror_lock:
            for mine, saved in zip(self.mirrors, mirrors, strict=True):
                mine.copy_(saved)
            self.mirror_rounds = [[int(x) for x in r] for r in state["mirror_rounds"]]
        self.in_flight = {int(f): int(r) for f, r in state["in_flight"].items()}
        self.pending = [Event(k, int(f), int(r)) for k, f, r in state["pending"]]
        self.deferred = [(int(f), int(r)) for f, r in state.get("deferred", [])]
        self._sent_at = {(int(f), int(r)): int(t) for f, r, t in state.get("sent_at", [])}
        self._snapshot_round = {}
        for f, (r, snap) in state.get("snapshots", {}).items():
            f = int(f)
            if not 0 <= f < self.layout.num_fragments or snap.shape != (self.layout.fragments[f].numel,):
                raise ValueError(f"the checkpoint's send snapshot of fragment {f} does not fit this model")
            if self._snapshots[f] is None:
                self._snapshots[f] = self._flat(f)
            self._snapshots[f].copy_(snap)  # type: ignore[union-attr]
            self._snapshot_round[f] = int(r)
        self.tokens_since_sync = list(state["tokens_since_sync"])
        self.loss_since_sync = [(float(a), int(b)) for a, b in state["loss_since_sync"]]
        self.generator.set_state(state["generator"])
        self.clock.credit = float(state.get("tick_credit", 0.0))
        for k, v in state["counters"].items():
            if k in self.COUNTERS:
                setattr(self, k, v)

    # --- what the dashboards show --------------------------------------------------------------------
    def report(self, eval_loss: float | None = None, compute_utilization: float | None = None) -> None:
        """Tell the shards (with the next pushes; their dashboards show it) the eval loss of the global
        parameters measured now, and the fraction of the training time spent computing (0..1). An eval loss
        the shards would refuse (not a cross-entropy in [0, 1e4]: they refuse the push that carries it) is
        left out, with a warning."""
        if eval_loss is not None and not 0.0 <= eval_loss <= MAX_REPORTED_LOSS:  # NaN too
            log.warning("eval loss %s is not reported to the shards: not a loss in [0, 1e4]", eval_loss)
        elif eval_loss is not None:
            self.eval_loss, self.eval_step = float(eval_loss), self.step_count
        if compute_utilization is not None:
            self.compute_utilization = min(1.0, max(0.0, float(compute_utilization)))

    def progress(self) -> Progress:
        """What every push's header reports, as of now."""
        return Progress(
            step=self.step_count,
            blocked_seconds=self.blocked_seconds,
            total_steps=self.total_steps or 0,
            tokens=self.tokens,
            compute_utilization=self.compute_utilization,
            eval_loss=self.eval_loss,
            eval_step=self.eval_step,
            step_seconds=self.step_seconds,
        )

    # --- the hook ------------------------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None) -> list[Event]:
        """Call after every inner optimizer step: counts the step and does what the schedule says."""
        if self.cfg.sync_schedule == "adaptive":
            return self._paced_step(tokens, loss)
        return self._tick(tokens, loss)

    def _tick(self, tokens: int, loss: float | None) -> list[Event]:
        """Complete a schedule step: count it and do its events."""
        evs = events(self.step_count + 1, self.cfg, self.total_steps)
        # merges put off at earlier steps come first: done now if their update is in, or at their deadline
        self.pending = sends_early([Event("merge", f, r) for f, r in self.deferred] + list(evs))
        self.deferred = []
        self._count(tokens, loss)
        self.finish_step()
        return evs

    def _paced_step(self, tokens: int, loss: float | None) -> list[Event]:
        """step() with sync_schedule "adaptive": the inner step completes a schedule step (and does its
        events) only once this worker's `per_tick` inner steps for it are done (common/pace.py). The time
        from the end of the previous call to this one is the inner step's (the training, and whatever the
        caller does between steps), the sync work and the waits for updates are not."""
        now = time.perf_counter()
        if self._last_step_end is not None:
            self._step_times.append(now - self._last_step_end)
            # the shards refuse a step time beyond MAX_STEP_SECONDS: report at most that (a slower one paces)
            self.step_seconds = min(statistics.median(self._step_times), MAX_STEP_SECONDS)
        self.per_tick = steps_per_tick(
            getattr(self.transport, "pace_seconds", 0.0), self.step_seconds, self.cfg
        )
        try:
            if not self.clock.inner_step(self.per_tick):
                self._count(tokens, loss, tick=False)
                return []
            return self._tick(tokens, loss)
        finally:
            self._last_step_end = time.perf_counter()

    def count(self, tokens: int = 0, loss: float | None = None) -> None:
        """Count an inner step that does not complete a schedule step (for lock-step drivers that pace
        workers themselves, like the simulator: see common/pace.py); the next advance() counts the one that
        does."""
        self._count(tokens, loss, tick=False)

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

    def _count(self, tokens: int, loss: float | None, tick: bool = True) -> None:
        if tick:
            self.step_count += 1
        self.inner_steps += 1
        self.tokens += tokens
        for f in range(self.layout.num_fragments):
            self.tokens_since_sync[f] += tokens
            if loss is not None:
                total, count = self.loss_since_sync[f]
                self.loss_since_sync[f] = (total + loss, count + 1)

    def execute(self, ev: Event) -> None:
        if ev.kind == "send":
            self.send(ev.fragment, ev.round)
        elif self._put_off(ev.fragment, ev.round):
            self.deferred.append((ev.fragment, ev.round))
        else:
            self.merge(ev.fragment, ev.round)

    def _put_off(self, fragment: int, round: int) -> bool:
        """Adaptive merges: whether this merge waits for a later step (its update is not in the mirror yet
        and this step is not its deadline)."""
        if self.cfg.merge_policy != "adaptive" or self.cfg.fragment_sync_delay == 0 or self._executor is None:
            return False  # tau = 0 is blocking by definition (DiLoCo); lock-step drivers have it in time
        if self.step_count >= merge_deadline(fragment, round, self.cfg, self.total_steps):
            return False
        return not self._applied_future(fragment, round).done()

    # --- send: a snapshot here, the rest on the sync thread -------------------------------------------
    def send(self, fragment: int, round: int) -> None:
        self._check()
        t0 = time.perf_counter()
        previous = self._sends.get(fragment)
        if previous is not None:  # its snapshot buffer is ours again (the job is long done, normally)
            previous.result()
        snapshot = self._snapshot(fragment)
        weight = float(max(1, self.tokens_since_sync[fragment]))
        total, count = self.loss_since_sync[fragment]
        loss = total / count if count else None
        self.tokens_since_sync[fragment] = 0
        self.loss_since_sync[fragment] = (0.0, 0)
        self.in_flight[fragment] = round
        self._sent_at[(fragment, round)] = self.step_count
        self._snapshot_round[fragment] = round
        self._sends[fragment] = self._run(self._push, fragment, round, snapshot, weight, loss)
        self._applied_future(fragment, round)  # its update is added to the mirror as soon as it comes
        self.send_seconds += time.perf_counter() - t0

    def _snapshot(self, fragment: int) -> Any:
        """The fragment's parameters as of now. On the CPU, copied into the fragment's buffer; on CUDA, a
        device-side copy (the sync thread brings it to the host) and the event that marks it done."""
        if self.cuda:
            dev = torch.empty(self.layout.fragments[fragment].numel, dtype=torch.float32, device=self.device)
            _copy_into(self._views(dev, fragment), self.params[fragment])
            ev = torch.cuda.Event()
            ev.record()
            return dev, ev
        buf = self._snapshots[fragment]
        if buf is None:
            buf = self._snapshots[fragment] = self._flat(fragment)
        _copy_into(self._views(buf, fragment), self.params[fragment])
        return buf

    def _host_snapshot(self, fragment: int, snapshot: Any) -> torch.Tensor:
        if not self.cuda:
            return snapshot
        dev, ev = snapshot
        buf = self._snapshots[fragment]
        if buf is None:
            buf = self._snapshots[fragment] = self._flat(fragment)
        side = self._side_stream()
        with torch.cuda.stream(side):
            side.wait_event(ev)
            buf.copy_(dev, non_blocking=True)
            dev.record_stream(side)
        side.synchronize()
        return buf

    def _push(self, fragment: int, round: int, snapshot: Any, weight: float, loss: float | None) -> None:
        """Sync thread: outer gradient, encoding, and the push."""
        local = self._host_snapshot(fragment, snapshot)
        delta = self._deltas[fragment]
        if delta is None:
            delta = self._deltas[fragment] = self._flat(fragment)
        outer_gradient(self.mirrors[fragment], local, out=delta)
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
        self.transport.push(fragment, round, slices, weight, loss)
        nbytes = sum(s.nbytes for s in slices)
        self.bytes_sent += nbytes
        self.peak_push_bytes = max(self.peak_push_bytes, nbytes)
        self.pushes += 1

    # --- merge: the update into the mirror on the sync thread, a lerp here ---------------------------
    def _applied_future(self, fragment: int, round: int) -> Future:
        """The future that says the round's update is in the mirror; asks the transport for the update the
        first time (at the send, or at the merge of a round this process did not send)."""
        key = (fragment, round)
        fut = self._applied.get(key)
        if fut is None:
            fut = self._applied[key] = Future()
            if self._stopping:
                fut.cancel()
                return fut
            update = self.transport.update(fragment, round)
            update.add_done_callback(lambda u: self._run_apply(fragment, round, u, fut))
        return fut

    def _run_apply(self, fragment: int, round: int, update: Future, done: Future) -> None:
        try:
            self._run(self._apply, fragment, round, update, done)
        except BaseException as e:  # inline (no sync thread): _apply has put it into `done`
            if not done.done():
                settle(done, exc=e)

    def _apply(self, fragment: int, round: int, update: Future, done: Future) -> None:
        """Sync thread: add the round's update to the mirror (or take a fetched master), then tell `done`."""
        try:
            if update.cancelled():
                raise StopRequested()
            slices: Sequence[Any] = update.result()
            if len(slices) != len(self.ranges[fragment]):
                raise RuntimeError(f"update for fragment {fragment} has {len(slices)} slices")
            mirror = self.mirrors[fragment]
            with self._mirror_lock:
                for s, ((lo, hi), part) in enumerate(zip(self.ranges[fragment], slices, strict=True)):
                    held = self.mirror_rounds[fragment]
                    if part is None:  # the mirror holds this round already (fetched when we joined)
                        held[s] = max(held[s], round + 1)
                        continue
                    parts = _parts(part)
                    if parts is not None:
                        n = sum(p.numel for _, p in parts)
                        if n != hi - lo:
                            raise RuntimeError(
                                f"update for fragment {fragment} has {n} values in a slice of {hi - lo}"
                            )
                        for off, p in parts:
                            add_into(p, mirror[lo + off : lo + off + p.numel])  # the master's fp32 addition
                            self.bytes_received += p.nbytes
                        held[s] = max(held[s], round + 1)
                    else:  # a master fetched after a reconnect: it holds this round's update (and any missed)
                        if part.values.numel() != hi - lo:
                            raise RuntimeError(
                                f"fetched master of fragment {fragment} has {part.values.numel()} values"
                            )
                        mirror[lo:hi] = part.values
                        held[s] = max(held[s], part.round)
            if self.cuda:
                self._stage(fragment, round)
            settle(done, result=True)
        except BaseException as e:
            settle(done, exc=e)
            raise

    def _rebases(self, fragment: int, round: int) -> bool:
        """Whether this merge is a rebase: merge_rule "rebase", and the snapshot of its send is here."""
        return self.cfg.merge_rule == "rebase" and self._snapshot_round.get(fragment) == round

    def _correction(self, fragment: int) -> torch.Tensor:
        """The rebase's correction, mirror minus the parameters at the send (the host snapshot, which _push
        filled), in the fragment's outer-gradient buffer: free until the fragment's next send, which comes
        after this merge, so no fragment-sized allocation per merge."""
        push = self._sends.get(fragment)  # none after a resume from a checkpoint
        if push is not None:
            push.result()  # the push that used the buffer is through (its update is in)
        if self._deltas[fragment] is None:
            self._deltas[fragment] = self._flat(fragment)
        snapshot = self._snapshots[fragment]
        assert snapshot is not None, "a rebase needs the snapshot of its send (_rebases)"
        return torch.sub(self.mirrors[fragment], snapshot, out=self._deltas[fragment])

    def _stage(self, fragment: int, round: int) -> None:
        """CUDA: what the training thread's merge needs, copied to the device: the fragment's mirror (mix),
        or the mirror minus the parameters at the send (rebase)."""
        side = self._side_stream()
        src = self.mirrors[fragment]
        if self._rebases(fragment, round):
            src = self._correction(fragment)
        with torch.cuda.stream(side):
            dev = torch.empty(self.layout.fragments[fragment].numel, dtype=torch.float32, device=self.device)
            dev.copy_(src, non_blocking=True)
        side.synchronize()  # the pinned mirror may change again once this returns
        self._staged[fragment] = (dev, self._views(dev, fragment))

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def merge(self, fragment: int, round: int) -> None:
        self._check()
        fut = self._applied_future(fragment, round)
        waited = not fut.done()
        if waited and self._executor is None:  # lock-step (the simulator): nothing else would bring it
            raise RuntimeError(f"round {round} of fragment {fragment} has not closed: lock-step order broken")
        t0 = time.perf_counter()
        self._wait(fut, fragment, round)  # may raise (a stop request): the parameters are untouched
        t1 = time.perf_counter()
        wait = t1 - t0
        self.blocked_seconds += wait
        if self.on_merge_wait is not None:
            self.on_merge_wait(wait)
        self.merges += 1
        self.waits += waited
        sent = self._sent_at.pop((fragment, round), None)
        if sent is not None:
            delay = self.step_count - sent
            self.merge_delay_steps += delay
            self.late_merges += delay > self.cfg.fragment_sync_delay
        self._applied.pop((fragment, round), None)
        self.in_flight.pop(fragment, None)
        alpha = self.cfg.fragment_update_alpha
        rebase = self._rebases(fragment, round)
        if self.cuda:
            if fragment not in self._staged:  # nothing was applied in this process (came with a fetch)
                self._stage(fragment, round)
            dev, views = self._staged.pop(fragment)
            (rebase_local_ if rebase else merge_local_)(self.params[fragment], views, alpha)
            dev.record_stream(torch.cuda.current_stream(self.device))  # allocated on the side stream
        elif rebase:
            correction = self._correction(fragment)
            rebase_local_(self.params[fragment], self._views(correction, fragment), alpha)
        else:
            merge_local_(self.params[fragment], self._mirror_views[fragment], alpha)
        self._snapshot_round.pop(fragment, None)
        self.merge_seconds += time.perf_counter() - t1
        if self.on_merged is not None:
            self.on_merged(fragment)

    def _wait(self, fut: Future, fragment: int, round: int) -> None:
        waited = 0.0
        while True:
            if self.interrupt is not None and self.interrupt.is_set():
                self.request_stop()
            try:
                fut.result(
                    timeout=INTERRUPT_CHECK_SECONDS if self.interrupt is not None else WAIT_LOG_SECONDS
                )
                return
            except CancelledError:
                raise StopRequested() from None
            except FutureTimeout:
                waited += INTERRUPT_CHECK_SECONDS if self.interrupt is not None else WAIT_LOG_SECONDS
                if waited >= WAIT_LOG_SECONDS:
                    waited = 0.0
                    log.info(
                        "still waiting for fragment %d round %d (a round waits for every member's push or "
                        "its deadline, and for --min-workers members)",
                        fragment,
                        round,
                    )


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        if all(d.dtype == s.dtype and d.device == s.device for d, s in zip(dst, src, strict=True)):
            torch._foreach_copy_(dst, src)
        else:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)


def settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a future unless a stop request cancelled it meanwhile."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except Exception:  # InvalidStateError: cancelled (stop request) or already settled
        pass
