"""The worker's sync engine: the fragment schedule, and the sends and merges it says, around any model.

Driving it, the one way (like torchft's DiLoCo): build it once (`worker.join.connect()` does), then call
`step()` right after every inner optimizer step, and loop on the engine's step count:

    while engine.step_count < total_steps:
        loss = train_on(next_batch)                   # forward, backward, inner_optimizer.step()
        engine.step(tokens=batch_tokens, loss=loss)   # counts it; sends and merges when the schedule says
    engine.close()

`step()` counts one inner step. When that completes a step of the schedule it moves `step_count` on and
does the step's events (common/schedule.py: the sends, then the merges) through `finish_step()`.
`step_count` counts the schedule's steps: with sync_schedule "fixed" every inner step is one; with
"adaptive" (the default; sites of unequal speed, common/pace.py) a worker does `pacer.per_tick` inner steps
for each, from its own measured step time and the run's pace (the transport's `pace_seconds`, which the shards
answer its pushes with). So loop on `step_count`, not on a count of your own: rounds, merges, checkpoints
and the final sync count schedule steps. Without `final_sync`, `drain()` after the loop merges the last
sends' updates.

`finish_step()` does the current step's events that are not done yet: `step()` calls it, and a driver
calls it itself only
- after resuming from a checkpoint: a stop request that interrupts a wait for an update leaves that merge
  and the ones after it in `pending`, which the checkpoint keeps;
- in lock-step (`background=False`, the simulator): nothing brings an update while the engine would wait,
  so a merge whose round has not closed (the other workers have not pushed yet) stays in `pending`; the
  driver steps every worker, then calls `finish_step()` on each until none has events left.

What runs where (a GPU step takes tens of milliseconds; the sync work of a 100M-parameter fragment on the
training thread would take longer than the step). Each fragment's state and mechanics are one
`FragmentSync` (worker/fragment.py); the engine holds the list of them and the schedule.
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

The transport (`Transport`) is what carries pushes and updates: the gRPC client in a worker process, an
in-process connection to the shards' logic in the simulator.

What it must not do: know which transport it talks to (it calls only what `Transport` declares), or hold
the training thread for sync work beyond a snapshot, a lerp and a merge's wait for its update.
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
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from streamdiloco.common.codecs import Encoded
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, fragment_params
from streamdiloco.common.pace import MAX_STEP_SECONDS, PACE_TOLERANCE, TickClock, steps_per_tick
from streamdiloco.common.progress import Progress
from streamdiloco.common.schedule import Event, events, merge_deadline, sends_early, sends_through
from streamdiloco.worker.fragment import FragmentSync, Placement, global_state_dict
from streamdiloco.worker.report import ScalarLogger, TrackedScalars

log = logging.getLogger("streamdiloco.worker")

WAIT_LOG_SECONDS = 30.0  # log while a merge waits this long for its update
INTERRUPT_CHECK_SECONDS = 1.0  # how often a wait looks at an `interrupt` Event (request_stop() is at once)
MAX_REPORTED_LOSS = (
    1e4  # the shards refuse a push that reports a loss beyond (server/rounds/robust.py MAX_LOSS)
)
STEP_TIMES = 16  # inner steps whose durations the reported step time is the median of (adaptive schedule)
# the reports a worker remembers to recognise the pace as its own: the latest, and the one before it (whose
# push's answer may still be the latest pace it heard)
REPORTS_KEPT = 2


class StopRequested(Exception):
    """The worker was asked to stop (SIGTERM, Ctrl+C) while it waited for an update; nothing was taken."""


@runtime_checkable
class Transport(Protocol):
    """What carries a worker's pushes and the rounds' updates: `GrpcTransport` (worker/transport.py) in a
    worker process, the simulator's `InProcessTransport` (sim/simulator.py) in one process. The engine
    calls nothing else on it."""

    @property
    def num_shards(self) -> int:
        """S: each fragment is cut into this many slices, one per shard (common/fragments.slice_ranges)."""

    @property
    def pace_seconds(self) -> float:
        """The run's pace: the slowest member's seconds per inner step as last heard, 0.0 while unknown.
        Read at every inner step with sync_schedule "adaptive" (common/pace.py); never blocks."""

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        """Send one fragment's outer gradient (one Encoded per shard slice); must not block on the round."""

    def update(self, fragment: int, round: int) -> Future:
        """A future of the round's update, one entry per shard slice. Each is what to do to the mirror's
        slice: an Encoded update to add (or a list of (offset, Encoded) parts of it), a fetched master (an
        object with `.values` and `.round`, after a resync) to take instead, or None: the mirror has that
        round already. The future fails with an error when the transport cannot deliver it."""

    def skip_to(self, next_rounds: Callable[[], list[int]]) -> tuple[int, list[int]] | None:
        """When this worker fell whole rounds behind the run (the rounds it would push next, `next_rounds()`,
        have closed already): the step to go on from, and per fragment the first round the masters it
        fetched do not hold; else None. Asked at every schedule step: cheap, and never blocks. A transport
        that never falls behind (the simulator's lock-step) returns None."""

    def close(self) -> None:
        """End the transport's sessions; the engine's close() calls it once, at the end."""


class SyncThread:
    """The engine's sync thread: jobs done in order, one at a time. Without one (`background=False`, a
    lock-step driver) each job is done here and now. Keeps the first failure of a background job."""

    def __init__(self, background: bool):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sync") if background else None
        self.error: BaseException | None = None

    @property
    def inline(self) -> bool:
        return self._executor is None

    def run(self, job: Callable[..., Any], *args: Any) -> Future:
        """Do a job on the sync thread (in order), or here and now without one (raising its failure)."""
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

    def check(self) -> None:
        """Raise the first failure of a background job, if there was one."""
        if self.error is not None:
            raise self.error

    def quiesce(self) -> None:
        """Wait until every job given so far is done."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()
        self.check()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


class Pacer:
    """sync_schedule "adaptive": whether an inner step completes a schedule step (common/pace.py), from this
    worker's step time (the median of the last STEP_TIMES) and the run's pace. An inner step's time is the
    caller's `seconds`, or the time from the end of the previous step() to this one (the training, and
    whatever the caller does between steps): the sync work and the waits for updates are left out.

    The member that sets the pace does one inner step per schedule step: when the pace is (within
    PACE_TOLERANCE) a step time this worker itself reported lately, it is the slowest, and its own median,
    which moves from one step to the next, must not make it go faster than itself (a lone worker would
    otherwise do more inner steps than --steps whenever its steps got quicker than at its last report)."""

    def __init__(self) -> None:
        self.clock = TickClock()
        self.per_tick = 1.0  # inner steps per schedule step, as of the latest inner step
        self.step_seconds: float | None = None  # median seconds per inner step, waits and syncs left out
        self._times: deque[float] = deque(maxlen=STEP_TIMES)
        self._last_end: float | None = None
        self._reported: deque[float] = deque(maxlen=REPORTS_KEPT)  # step times the shards were told last

    def reported(self) -> float | None:
        """The step time to report with a push (the shards' pace is the largest of these); kept, so that
        this worker knows the pace for its own."""
        if self.step_seconds is not None and (not self._reported or self._reported[-1] != self.step_seconds):
            self._reported.append(self.step_seconds)
        return self.step_seconds

    def sets_pace(self, pace: float) -> bool:
        """Whether `pace` is one of this worker's own recent reports: it is the run's slowest member."""
        return any(abs(pace - r) <= PACE_TOLERANCE * r for r in self._reported)

    def completes(self, pace: float, cfg: SyncConfig, seconds: float | None = None) -> bool:
        """Count one inner step; True when it completes a schedule step."""
        if seconds is None and self._last_end is not None:
            seconds = time.perf_counter() - self._last_end
        if seconds is not None:
            self._times.append(seconds)
            # the shards refuse a step time beyond MAX_STEP_SECONDS: report at most that (a slower one paces)
            self.step_seconds = min(statistics.median(self._times), MAX_STEP_SECONDS)
        own = self.step_seconds
        self.per_tick = 1.0 if self.sets_pace(pace) else steps_per_tick(pace, own, cfg)
        return self.clock.inner_step(self.per_tick)

    def step_ended(self) -> None:
        self._last_end = time.perf_counter()


class SyncEngine:
    """The fragments of one worker (`fragments`, one FragmentSync each) and the schedule that sends and
    merges them; see the module's docstring for how to drive it."""

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
        "skips",
        "skipped_steps",
    )

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
        loggers: Sequence[ScalarLogger] = (),
        log_every: int = 20,
    ):
        if layout.num_fragments != cfg.num_scheduled_fragments:
            raise ValueError(
                f"layout has {layout.num_fragments} fragments, config expects {cfg.num_scheduled_fragments}"
            )
        self.model, self.layout, self.cfg, self.transport = model, layout, cfg, transport
        self.total_steps = total_steps
        self.interrupt = interrupt
        params = [[p.detach() for p in fragment_params(model, f)] for f in layout.fragments]
        device = params[0][0].device if params and params[0] else torch.device("cpu")
        place = Placement(device)
        self.fragments = [
            FragmentSync(spec, ps, cfg, transport.num_shards, place)
            for spec, ps in zip(layout.fragments, params, strict=True)
        ]
        self.generator = torch.Generator().manual_seed(seed * 7_919 + rank)  # stochastic rounding only
        self.step_count = start_step  # schedule steps taken (by the run, for a worker that joined late)
        self.pacer = Pacer()
        # the schedule: this step's events not done yet (see finish_step), and adaptive merges whose merge
        # step has passed without their update, oldest first (merged once in, or at their deadline)
        self.pending: list[Event] = []
        self.deferred: list[tuple[int, int]] = []
        # counters for the summary and the metrics (COUNTERS are kept in checkpoints)
        self.bytes_sent = self.bytes_received = self.peak_push_bytes = self.pushes = 0
        self.merges = 0
        self.waits = 0  # merges whose update had not arrived yet
        self.late_merges = 0  # merges done later than tau steps after their send (adaptive)
        self.merge_delay_steps = 0  # steps from send to merge, summed over merges (mean tau = this / merges)
        self.tokens = 0  # tokens trained on, as step() was told
        self.inner_steps = 0  # inner steps this engine was told of (step() calls), in this run
        self.skips = self.skipped_steps = 0  # times it fell whole rounds behind and went on where the run is
        self.blocked_seconds = 0.0
        self.send_seconds = 0.0  # training thread's time in sends (snapshots) and merges (lerps), for
        self.merge_seconds = 0.0  # the benchmarks: what the sync path costs the GPU
        # what the trainer reports for the shards' dashboards (report()): sent with the next pushes
        self.eval_loss: float | None = None
        self.eval_step = 0
        self.compute_utilization: float | None = None
        self.on_merge_wait: Callable[[float], None] | None = None  # gets each merge's wait (/metrics)
        self.on_merged: Callable[[int], None] | None = None  # gets each merged fragment (worker/group.py)
        self.scalars = TrackedScalars(loggers, log_every)  # experiment trackers (worker/report.py)
        self._jobs = SyncThread(background)
        self._stopping = False

    # --- the fragments, as lists (what callers and checkpoints read) -----------------------------------
    @property
    def mirrors(self) -> list[torch.Tensor]:
        """Each fragment's mirror: fp32, on the CPU, the global parameters as of the updates merged."""
        return [f.mirror for f in self.fragments]

    @property
    def ranges(self) -> list[list[tuple[int, int]]]:
        """Each fragment's shard slices, (lo, hi) of its flat vector."""
        return [f.ranges for f in self.fragments]

    @property
    def in_flight(self) -> dict[int, int]:
        """fragment -> the round it sent and has not merged yet."""
        return {f.index: f.in_flight for f in self.fragments if f.in_flight is not None}

    @property
    def step_seconds(self) -> float | None:
        return self.pacer.step_seconds

    # --- the hook ------------------------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None, seconds: float | None = None) -> list[Event]:
        """Call after every inner optimizer step: counts it and, when it completes a schedule step, does
        what the schedule says; returns that step's events ([] for an inner step within one). `seconds`:
        the inner step's duration, for a driver that emulates it (the simulator); else it is measured."""
        self.inner_steps += 1
        self.tokens += tokens
        self.scalars.count(tokens, loss)
        for frag in self.fragments:
            frag.count(tokens, loss)
        if self.cfg.sync_schedule != "adaptive":
            return self._tick()
        try:
            if not self.pacer.completes(self.transport.pace_seconds, self.cfg, seconds):
                return []
            return self._tick()
        finally:
            self.pacer.step_ended()

    def _tick(self) -> list[Event]:
        """Complete a schedule step: count it and do its events. Other threads read `pending` and then
        `step_count` (next_rounds): `pending` is set first."""
        if not self._jobs.inline:
            self._skip_ahead()
        evs = events(self.step_count + 1, self.cfg, self.total_steps)
        # merges put off at earlier steps come first: done now if their update is in, or at their deadline
        self.pending = sends_early([Event("merge", f, r) for f, r in self.deferred] + list(evs))
        self.deferred = []
        self.step_count += 1
        self.finish_step()
        if self.scalars.loggers:
            sync = {"sync/blocked_seconds": self.blocked_seconds, "sync/bytes_sent": self.bytes_sent}
            sync["sync/bytes_received"] = self.bytes_received
            if self.compute_utilization is not None:
                sync["perf/compute_utilization"] = self.compute_utilization
            self.scalars.stepped(self.step_count, self.total_steps, sync)
        return evs

    def finish_step(self) -> None:
        """Do the step's events not done yet. Each is done whole or not at all: a stop request that
        interrupts a wait for an update leaves that merge and the ones after it here, in `pending`, which a
        checkpoint keeps and a resumed worker does first. In lock-step a merge whose round has not closed
        stops here too (see the module's docstring)."""
        while self.pending:
            ev = self.pending[0]
            if self._jobs.inline and ev.kind == "merge" and not self._applied(ev.fragment, ev.round).done():
                return  # lock-step: its update comes once the other workers have pushed
            if ev.kind == "send":
                self.send(ev.fragment, ev.round)
            elif self._put_off(ev.fragment, ev.round):
                self.deferred.append((ev.fragment, ev.round))
            else:
                self.merge(ev.fragment, ev.round)
            self.pending.pop(0)

    def _put_off(self, fragment: int, round: int) -> bool:
        """Adaptive merges: whether this merge waits for a later step (its update is not in the mirror yet
        and this step is not its deadline)."""
        if self.cfg.merge_policy != "adaptive" or self.cfg.fragment_sync_delay == 0 or self._jobs.inline:
            return False  # tau = 0 is blocking by definition (DiLoCo); lock-step drivers have it in time
        if self.step_count >= merge_deadline(fragment, round, self.cfg, self.total_steps):
            return False
        return not self._applied(fragment, round).done()

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

    # --- send: a snapshot here, the rest on the sync thread -------------------------------------------
    def send(self, fragment: int, round: int) -> None:
        self._jobs.check()
        t0 = time.perf_counter()
        frag = self.fragments[fragment]
        snapshot, weight, loss = frag.prepare_send(round, self.step_count)
        frag.send_job = self._jobs.run(self._push, frag, round, snapshot, weight, loss)
        self._applied(fragment, round)  # its update is added to the mirror as soon as it comes
        self.send_seconds += time.perf_counter() - t0

    def _push(self, frag: FragmentSync, round: int, snapshot: Any, weight: float, loss: float | None) -> None:
        """Sync thread: outer gradient, encoding, and the push."""
        slices = frag.encode(snapshot, self.generator)
        self.transport.push(frag.index, round, slices, weight, loss)
        nbytes = sum(s.nbytes for s in slices)
        self.bytes_sent += nbytes
        self.peak_push_bytes = max(self.peak_push_bytes, nbytes)
        self.pushes += 1

    # --- merge: the update into the mirror on the sync thread, a lerp here ---------------------------
    def _applied(self, fragment: int, round: int) -> Future:
        """The future that says the round's update is in the mirror; asks the transport for the update the
        first time (at the send, or at the merge of a round this process did not send)."""
        frag = self.fragments[fragment]
        fut = frag.applied.get(round)
        if fut is None:
            fut = frag.applied[round] = Future()
            if self._stopping:
                fut.cancel()
                return fut
            update = self.transport.update(fragment, round)
            update.add_done_callback(lambda u: self._run_apply(frag, round, u, fut))
        return fut

    def _run_apply(self, frag: FragmentSync, round: int, update: Future, done: Future) -> None:
        try:
            self._jobs.run(self._apply, frag, round, update, done)
        except BaseException as e:  # inline (no sync thread): _apply has put it into `done`
            if not done.done():
                settle(done, exc=e)

    def _apply(self, frag: FragmentSync, round: int, update: Future, done: Future) -> None:
        """Sync thread: add the round's update to the mirror (or take a fetched master), then tell `done`."""
        try:
            if update.cancelled():
                raise StopRequested()
            self.bytes_received += frag.apply(round, update.result())
            settle(done, result=True)
        except BaseException as e:
            settle(done, exc=e)
            raise

    def merge(self, fragment: int, round: int) -> None:
        self._jobs.check()
        fut = self._applied(fragment, round)
        waited = not fut.done()
        if waited and self._jobs.inline:  # lock-step (the simulator): nothing else would bring it
            raise RuntimeError(f"round {round} of fragment {fragment} has not closed: lock-step order broken")
        t0 = time.perf_counter()
        _wait(fut, f"fragment {fragment} round {round}", self.interrupt, self.request_stop)  # may raise
        t1 = time.perf_counter()  # (a stop request: the parameters are untouched)
        self.blocked_seconds += t1 - t0
        if self.on_merge_wait is not None:
            self.on_merge_wait(t1 - t0)
        self.merges += 1
        self.waits += waited
        sent = self.fragments[fragment].merge(round)
        if sent is not None:
            delay = self.step_count - sent
            self.merge_delay_steps += delay
            self.late_merges += delay > self.cfg.fragment_sync_delay
        self.merge_seconds += time.perf_counter() - t1
        if self.on_merged is not None:
            self.on_merged(fragment)

    # --- joining, the end, stopping --------------------------------------------------------------------
    def set_mirror_rounds(self, rounds: list[list[int]]) -> None:
        """What the mirror holds as it is set up (a joiner's fetch): rounds[f][s] per fragment and slice."""
        for frag, held in zip(self.fragments, rounds, strict=True):
            with frag.lock:
                frag.mirror_rounds = list(held)

    def catch_up(self, first_rounds: list[int]) -> None:
        """For a worker that starts at step > 0: merge the rounds from `first_rounds` (the first round of
        each fragment not in the fetched masters) whose merge step is already behind us."""
        past = self.step_count - self.cfg.fragment_sync_delay
        for f in range(self.layout.num_fragments):
            upto = sends_through(f, past, self.cfg) if past >= 1 else 0
            for r in range(first_rounds[f], upto):
                self.merge(f, r)

    def _skip_ahead(self) -> None:
        """Go on from where the run is when this worker fell whole rounds behind it (a freeze, a sleep, a
        link down or a restart long enough for rounds to close without it: `Transport.skip_to`). Pushed,
        its next sends would be for rounds closed already, and it would stay as far behind as it fell:
        instead it merges what it has in flight, jumps its step count to where a joiner would start now,
        merges the rounds whose merge step that passes (their updates, or the masters fetched in their
        place), and its parameters become its mirror, the run's global ones, as a joiner's. What it trained
        since its last send, from parameters the run has left behind, is dropped (it would be late)."""
        ahead = self.transport.skip_to(self.next_rounds)
        if ahead is None:
            return  # no fetch since the last look, or none that passed the rounds it pushes next
        start, fetched = ahead
        if start - self.step_count < self.cfg.sync_every:
            return  # less than a round behind: within the grace that rounds give a member (server/roundrule)
        if self.total_steps is not None and start >= self.total_steps:
            log.warning(
                "the run is at step %d, past this worker's last step %d: it goes on where it is",
                start,
                self.total_steps,
            )
            return
        behind = start - self.step_count
        self.drain()
        self.step_count = start
        self.catch_up([min(frag.mirror_rounds) for frag in self.fragments])
        for frag, upto in zip(self.fragments, fetched, strict=True):
            # rounds in the masters whose merge step is still to come (tau longer than the steps between
            # two sends): into the mirror now, merged at their step
            for r in range(min(frag.mirror_rounds), upto):
                _wait(
                    self._applied(frag.index, r),
                    f"fragment {frag.index} round {r}",
                    self.interrupt,
                    self.request_stop,
                )
        self.quiesce()
        for frag in self.fragments:
            frag.take_mirror()
            if self.on_merged is not None:
                self.on_merged(frag.index)
        self.skips += 1
        self.skipped_steps += behind
        log.warning(
            "this worker was %d steps behind the run (rounds closed without it while it was away): it goes "
            "on from step %d with the run's parameters, as a joiner would",
            behind,
            start,
        )

    def drain(self) -> None:
        """Merge every round sent and not merged yet (at the end of training without final_sync, the last
        sends' updates would otherwise never reach the mirror and the local parameters)."""
        self.deferred = []  # all of them in flight: merged here
        for fragment, round in sorted(self.in_flight.items()):
            self.merge(fragment, round)
        self.quiesce()

    def quiesce(self) -> None:
        """Wait until the sync thread has done every job given to it so far."""
        self._jobs.quiesce()

    def request_stop(self) -> None:
        """Make a merge that waits (or will wait) for its update give up with StopRequested; safe to call
        from a signal handler or another thread."""
        self._stopping = True
        for frag in self.fragments:
            for fut in list(frag.applied.values()):
                fut.cancel()

    def close(self) -> None:
        """End the sync thread and the transport's sessions, and close the loggers."""
        self._jobs.close()
        self.transport.close()
        self.scalars.close()

    # --- the global model, checkpoints ---------------------------------------------------------------
    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The global model as this worker knows it (its mirror: the shards' masters as of the latest
        updates it has), as a state_dict of the model: on the CPU, each parameter in its own dtype, buffers
        as the model holds them. The local parameters are α-mixed with local steps, not the global model:
        save or evaluate this instead (`model.load_state_dict(engine.global_state_dict())`)."""
        return global_state_dict(self.model, self.fragments)

    def state_dict(self) -> dict:
        """The engine's part of a worker checkpoint (the transport keeps its unanswered pushes; call its
        state_dict after this one, so that it holds the pushes of every send done here). Each mirror is
        copied with the rounds it holds, as one: updates may arrive and be added meanwhile."""
        return _checkpoint(self)

    def load_state_dict(self, state: dict) -> None:
        _restore(self, state)

    # --- what the dashboards show --------------------------------------------------------------------
    def report(self, eval_loss: float | None = None, compute_utilization: float | None = None) -> None:
        """Tell the shards (with the next pushes; their dashboards show it) the eval loss of the global
        parameters measured now (the engine's loggers get it at once, as eval/loss), and the fraction of the
        training time spent computing (0..1). An eval loss
        the shards would refuse (not a cross-entropy in [0, 1e4]: they refuse the push that carries it) is
        left out, with a warning."""
        if eval_loss is not None and not 0.0 <= eval_loss <= MAX_REPORTED_LOSS:  # NaN too
            log.warning("eval loss %s is not reported to the shards: not a loss in [0, 1e4]", eval_loss)
        elif eval_loss is not None:
            self.eval_loss, self.eval_step = float(eval_loss), self.step_count
            self.scalars.log(self.step_count, {"eval/loss": self.eval_loss})
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
            step_seconds=self.pacer.reported(),
        )


def _checkpoint(engine: SyncEngine) -> dict:
    """SyncEngine.state_dict: the schedule's state and counters, and the fragments' as lists by fragment."""
    frags = engine.fragments
    held = [f.checkpoint() for f in frags]  # after each fragment's send job: its push is in the transport
    return {
        "step": engine.step_count,
        "mirrors": [mirror for mirror, _ in held],
        "mirror_rounds": [rounds for _, rounds in held],
        "in_flight": engine.in_flight,
        "pending": [(e.kind, e.fragment, e.round) for e in engine.pending],
        "deferred": [list(x) for x in engine.deferred],
        "sent_at": [[f.index, r, t] for f in frags for r, t in f.sent_at.items()],
        # the send snapshots of rounds not merged yet: a resumed worker rebases them as it would have
        "snapshots": {
            f.index: (f.snapshot_round, f.snapshot.clone())  # type: ignore[union-attr]
            for f in frags
            if f.snapshot_round is not None
        },
        "tokens_since_sync": [f.tokens for f in frags],
        "loss_since_sync": [list(f.loss) for f in frags],
        "generator": engine.generator.get_state(),
        "tick_credit": engine.pacer.clock.credit,
        "counters": {k: getattr(engine, k) for k in engine.COUNTERS},
    }


def _restore(engine: SyncEngine, state: dict) -> None:
    """SyncEngine.load_state_dict: what _checkpoint wrote (and checkpoints from before deferred merges,
    send steps, snapshots and the adaptive schedule were kept)."""
    mirrors, frags = state["mirrors"], engine.fragments
    if [m.shape for m in mirrors] != [f.mirror.shape for f in frags]:
        raise ValueError("the checkpoint's mirror does not fit this model's fragments")

    def fragment(f: Any, what: str) -> FragmentSync:
        if not 0 <= int(f) < len(frags):
            raise ValueError(f"the checkpoint's {what} of fragment {f} does not fit this model")
        return frags[int(f)]

    engine.step_count = int(state["step"])
    per_fragment = (mirrors, state["mirror_rounds"], state["tokens_since_sync"], state["loss_since_sync"])
    for frag, *parts in zip(frags, *per_fragment, strict=True):
        frag.restore(*parts)
    for f, r in state["in_flight"].items():
        fragment(f, "round in flight").in_flight = int(r)
    engine.pending = [Event(k, int(f), int(r)) for k, f, r in state["pending"]]
    engine.deferred = [(int(f), int(r)) for f, r in state.get("deferred", [])]
    for f, r, t in state.get("sent_at", []):
        fragment(f, "send step").sent_at[int(r)] = int(t)
    for f, (r, snap) in state.get("snapshots", {}).items():
        fragment(f, "send snapshot").restore_snapshot(int(r), snap)
    engine.generator.set_state(state["generator"])
    engine.pacer.clock.credit = float(state.get("tick_credit", 0.0))
    for k, v in state["counters"].items():
        if k in engine.COUNTERS:
            setattr(engine, k, v)


def _wait(fut: Future, what: str, interrupt: threading.Event | None, stop: Callable[[], None]) -> None:
    """Wait for a merge's future, looking at `interrupt` every second (calling `stop` once it is set) and
    logging every WAIT_LOG_SECONDS; StopRequested if the future is cancelled."""
    step = INTERRUPT_CHECK_SECONDS if interrupt is not None else WAIT_LOG_SECONDS
    waited = 0.0
    while True:
        if interrupt is not None and interrupt.is_set():
            stop()
        try:
            fut.result(timeout=step)
            return
        except CancelledError:
            raise StopRequested() from None
        except FutureTimeout:
            waited += step
            if waited >= WAIT_LOG_SECONDS:
                waited = 0.0
                log.info(
                    "still waiting for %s (a round waits for every member's push or its deadline, and for "
                    "--min-workers members)",
                    what,
                )


def settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a future unless a stop request cancelled it meanwhile."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except Exception:  # InvalidStateError: cancelled (stop request) or already settled
        pass
