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
- the sync thread (one per engine, jobs in order) computes the outer gradient (mirror - snapshot), adds the
  decayed residual of the uplink's error feedback (--uplink-feedback) and keeps what the encoding leaves
  out, encodes it and hands it to the transport; and when the round's update arrives, decodes it into the
  mirror (and, on CUDA, copies the fragment's mirror to the device for the lerp).
Each (fragment, round) has one future that the merge waits on; `request_stop()` cancels them.

The transport (`Transport`) is what carries pushes and updates: the gRPC client in a worker process, an
in-process connection to the shards' logic in the simulator.

What it must not do: know which transport it talks to (it calls only what `Transport` declares), or hold
the training thread for sync work beyond a snapshot, a lerp and a merge's wait for its update.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, overload, runtime_checkable

import torch
import torch.nn as nn

from streamdiloco.common.codecs import Encoded
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, fragment_params
from streamdiloco.common.pace import MAX_STEP_SECONDS, PACE_TOLERANCE, TickClock, steps_per_tick
from streamdiloco.common.progress import MAX_REPORTED_LOSS, Progress
from streamdiloco.common.schedule import Event, events, merge_deadline, sends_early, sends_through
from streamdiloco.worker.fragment import FragmentSync, Placement, global_state_dict
from streamdiloco.worker.report import ScalarLogger, TrackedScalars

log = logging.getLogger("streamdiloco.worker")

WAIT_LOG_SECONDS = 30.0  # log while a merge waits this long for its update
INTERRUPT_CHECK_SECONDS = 1.0  # how often a wait looks at an `interrupt` Event (request_stop() is at once)
STEP_TIMES = 16  # inner steps whose durations the reported step time is the median of (adaptive schedule)
# the reports a worker remembers to recognise the pace as its own: the latest, and the one before it (whose
# push's answer may still be the latest pace it heard)
REPORTS_KEPT = 2

T = TypeVar("T")


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
        """A future of the round's update: a list of one `SliceUpdate` (worker/fragment.py) per shard slice,
        what to do to the mirror's slice: an Encoded update to add (or its (offset, Encoded) parts), a
        fetched `Master` (after a resync) to take instead, or None: the mirror has that round already. The
        future fails with an error when the transport cannot deliver it."""

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


@dataclass
class SyncCounters:
    """What the engine counts, for the summary, the metrics and the dashboards. Kept in checkpoints (its
    state_dict is its fields), so that a resumed worker counts on from where it stopped."""

    bytes_sent: int = 0  # encoded bytes of the pushes (payload and scales)
    bytes_received: int = 0  # encoded bytes of the updates added to the mirror
    peak_push_bytes: int = 0  # the largest push's
    pushes: int = 0
    blocked_seconds: float = 0.0  # the training thread's waits for updates, at merges
    merges: int = 0
    waits: int = 0  # merges whose update had not arrived yet
    late_merges: int = 0  # merges done later than tau steps after their send (adaptive)
    merge_delay_steps: int = 0  # steps from send to merge, summed over merges (mean tau = this / merges)
    tokens: int = 0  # tokens trained on, as step() was told
    inner_steps: int = 0  # inner steps this engine was told of (step() calls), in this run
    skips: int = 0  # times it fell whole rounds behind and went on where the run is
    skipped_steps: int = 0  # the schedule steps those skips passed over

    def state_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's counters; one that it lacks (written before that counter was) stays as it is."""
        names = {f.name for f in dataclasses.fields(self)}
        for name, value in state.items():
            if name in names:
                setattr(self, name, value)


class _Counter(Generic[T]):
    """`engine.pushes` reads `engine.counters.pushes`: each counter, read-only, under the engine's own
    name, as the library's users (and the examples) read it before the counters were one object."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, engine: None, owner: type) -> _Counter[T]: ...
    @overload
    def __get__(self, engine: _CountersByName, owner: type) -> T: ...
    def __get__(self, engine: _CountersByName | None, owner: type) -> _Counter[T] | T:
        return self if engine is None else getattr(engine.counters, self.name)

    def __set__(self, engine: _CountersByName, value: T) -> None:
        raise AttributeError(f"{self.name} is counted by the engine (engine.counters.{self.name})")


@dataclass
class MergeHooks:
    """Who hears of each merge: `waited` gets its wait for the update in seconds (the worker's /metrics),
    `merged` the fragment merged (worker/group.py broadcasts its parameters to the other ranks)."""

    waited: Callable[[float], None] = lambda seconds: None
    merged: Callable[[int], None] = lambda fragment: None


class Reports:
    """What a trainer reports through the engine: the eval loss of the global parameters (and the step it
    was measured at) and the compute utilization, which every push carries to the shards' dashboards with
    the engine's counters (`progress`); and the scalars for the experiment trackers (`scalars`)."""

    def __init__(self, loggers: Sequence[ScalarLogger], log_every: int) -> None:
        self.scalars = TrackedScalars(loggers, log_every)  # experiment trackers (worker/report.py)
        self.eval_loss: float | None = None
        self.eval_step = 0
        self.compute_utilization: float | None = None

    def report(self, step: int, eval_loss: float | None, compute_utilization: float | None) -> None:
        """SyncEngine.report, at schedule step `step`."""
        if eval_loss is not None and not 0.0 <= eval_loss <= MAX_REPORTED_LOSS:  # NaN too
            log.warning("eval loss %s is not reported to the shards: not a loss in [0, 1e4]", eval_loss)
        elif eval_loss is not None:
            self.eval_loss, self.eval_step = float(eval_loss), step
            self.scalars.log(step, {"eval/loss": self.eval_loss})
        if compute_utilization is not None:
            self.compute_utilization = min(1.0, max(0.0, float(compute_utilization)))

    def stepped(self, step: int, total_steps: int | None, counters: SyncCounters) -> None:
        """A schedule step ended: the trackers' scalars, at the steps they are logged at."""
        if not self.scalars.loggers:
            return
        sync = {"sync/blocked_seconds": counters.blocked_seconds, "sync/bytes_sent": counters.bytes_sent}
        sync["sync/bytes_received"] = counters.bytes_received
        if self.compute_utilization is not None:
            sync["perf/compute_utilization"] = self.compute_utilization
        self.scalars.stepped(step, total_steps, sync)

    def progress(
        self, step: int, total_steps: int | None, counters: SyncCounters, step_seconds: float | None
    ) -> Progress:
        return Progress(
            step=step,
            blocked_seconds=counters.blocked_seconds,
            total_steps=total_steps or 0,
            tokens=counters.tokens,
            compute_utilization=self.compute_utilization,
            eval_loss=self.eval_loss,
            eval_step=self.eval_step,
            step_seconds=step_seconds,
        )


class UpdateFeed:
    """The rounds' updates into the fragments' mirrors. Each (fragment, round) has one future that says its
    update is in the mirror (FragmentSync.update_future); the first ask for it asks the transport for the
    update, and once that comes the sync thread adds it (FragmentSync.apply) and settles the future.
    `stop()` cancels every such future, now and from then on: a merge waiting on one gets StopRequested."""

    def __init__(self, transport: Transport, jobs: SyncThread, counters: SyncCounters) -> None:
        self.transport, self.jobs, self.counters = transport, jobs, counters
        self.stopping = False

    def applied(self, frag: FragmentSync, round: int) -> Future:
        fut, new = frag.update_future(round)
        if new and self.stopping:
            fut.cancel()
        elif new:
            update = self.transport.update(frag.index, round)
            update.add_done_callback(lambda u: self._run_apply(frag, round, u, fut))
        return fut

    def _run_apply(self, frag: FragmentSync, round: int, update: Future, done: Future) -> None:
        try:
            self.jobs.run(self._apply, frag, round, update, done)
        except BaseException as e:  # inline (no sync thread): _apply has put it into `done`
            if not done.done():
                settle(done, exc=e)

    def _apply(self, frag: FragmentSync, round: int, update: Future, done: Future) -> None:
        """Sync thread: add the round's update to the mirror (or take a fetched master), then tell `done`."""
        try:
            if update.cancelled():
                raise StopRequested()
            self.counters.bytes_received += frag.apply(round, update.result())
            settle(done, result=True)
        except BaseException as e:
            settle(done, exc=e)
            raise

    def stop(self, fragments: Sequence[FragmentSync]) -> None:
        self.stopping = True
        for frag in fragments:
            frag.cancel_waits()


class _CountersByName:
    """The engine's counters read by their own names (`engine.pushes` is `engine.counters.pushes`), as the
    library's users and the examples read them before they were one object."""

    counters: SyncCounters
    bytes_sent = _Counter[int]()
    bytes_received = _Counter[int]()
    peak_push_bytes = _Counter[int]()
    pushes = _Counter[int]()
    blocked_seconds = _Counter[float]()
    merges = _Counter[int]()
    waits = _Counter[int]()
    late_merges = _Counter[int]()
    merge_delay_steps = _Counter[int]()
    tokens = _Counter[int]()
    inner_steps = _Counter[int]()
    skips = _Counter[int]()
    skipped_steps = _Counter[int]()


class SyncEngine(_CountersByName):
    """The fragments of one worker (`fragments`, one FragmentSync each) and the schedule that sends and
    merges them; see the module's docstring for how to drive it. What it counts is `counters` (each also
    read as the engine's own attribute: `engine.pushes`)."""

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
        self.fragments = _fragments(model, layout, cfg, transport.num_shards)
        self.generator = torch.Generator().manual_seed(seed * 7_919 + rank)  # stochastic rounding only
        self.step_count = start_step  # schedule steps taken (by the run, for a worker that joined late)
        self.pacer = Pacer()
        # the schedule: this step's events not done yet (see finish_step), and adaptive merges whose merge
        # step has passed without their update, oldest first (merged once in, or at their deadline)
        self.pending: list[Event] = []
        self.deferred: list[tuple[int, int]] = []
        self.counters = SyncCounters()  # kept in checkpoints
        self.send_seconds = 0.0  # training thread's time in sends (snapshots) and merges (lerps), for
        self.merge_seconds = 0.0  # the benchmarks: what the sync path costs the GPU
        self.reports = Reports(loggers, log_every)  # what the trainer reports, sent with the next pushes
        self.hooks = MergeHooks()
        self._jobs = SyncThread(background)
        self._updates = UpdateFeed(transport, self._jobs, self.counters)

    # --- the fragments, as lists, and who hears of merges ----------------------------------------------
    @property
    def mirrors(self) -> list[torch.Tensor]:
        """Each fragment's mirror: fp32, on the CPU, the global parameters as of the updates merged."""
        return [f.mirror for f in self.fragments]

    @property
    def in_flight(self) -> dict[int, int]:
        """fragment -> the round it sent and has not merged yet."""
        return {f.index: f.in_flight for f in self.fragments if f.in_flight is not None}

    def on_merge(
        self, waited: Callable[[float], None] | None = None, merged: Callable[[int], None] | None = None
    ) -> None:
        """Be told of each merge: `waited` gets its wait for the update in seconds, `merged` its fragment."""
        self.hooks = MergeHooks(waited or self.hooks.waited, merged or self.hooks.merged)

    # --- the hook ------------------------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None, seconds: float | None = None) -> list[Event]:
        """Call after every inner optimizer step: counts it and, when it completes a schedule step, does
        what the schedule says; returns that step's events ([] for an inner step within one). `seconds`:
        the inner step's duration, for a driver that emulates it (the simulator); else it is measured."""
        self.counters.inner_steps += 1
        self.counters.tokens += tokens
        self.reports.scalars.count(tokens, loss)
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
        self.reports.stepped(self.step_count, self.total_steps, self.counters)
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
        frag.sending(self._jobs.run(self._push, frag, round, snapshot, weight, loss))
        self._applied(fragment, round)  # its update is added to the mirror as soon as it comes
        self.send_seconds += time.perf_counter() - t0

    def _push(self, frag: FragmentSync, round: int, snapshot: Any, weight: float, loss: float | None) -> None:
        """Sync thread: outer gradient, encoding, and the push."""
        slices = frag.encode(snapshot, self.generator)
        self.transport.push(frag.index, round, slices, weight, loss)
        nbytes = sum(s.nbytes for s in slices)
        self.counters.bytes_sent += nbytes
        self.counters.peak_push_bytes = max(self.counters.peak_push_bytes, nbytes)
        self.counters.pushes += 1

    # --- merge: the update into the mirror on the sync thread, a lerp here ---------------------------
    def _applied(self, fragment: int, round: int) -> Future:
        """The future that says the round's update is in the mirror (asked for at the send, or at the merge
        of a round this process did not send)."""
        return self._updates.applied(self.fragments[fragment], round)

    def merge(self, fragment: int, round: int) -> None:
        self._jobs.check()
        fut = self._applied(fragment, round)
        waited = not fut.done()
        if waited and self._jobs.inline:  # lock-step (the simulator): nothing else would bring it
            raise RuntimeError(f"round {round} of fragment {fragment} has not closed: lock-step order broken")
        t0 = time.perf_counter()
        _wait(fut, f"fragment {fragment} round {round}", self.interrupt, self.request_stop)  # may raise
        t1 = time.perf_counter()  # (a stop request: the parameters are untouched)
        counts = self.counters
        counts.blocked_seconds += t1 - t0
        self.hooks.waited(t1 - t0)
        counts.merges += 1
        counts.waits += waited
        sent = self.fragments[fragment].merge(round)
        if sent is not None:
            delay = self.step_count - sent
            counts.merge_delay_steps += delay
            counts.late_merges += delay > self.cfg.fragment_sync_delay
        self.merge_seconds += time.perf_counter() - t1
        self.hooks.merged(fragment)

    # --- joining, the end, stopping --------------------------------------------------------------------
    def set_mirror_rounds(self, rounds: list[list[int]]) -> None:
        """What the mirror holds as it is set up (a joiner's fetch): rounds[f][s] per fragment and slice."""
        for frag, held in zip(self.fragments, rounds, strict=True):
            frag.hold_rounds(held)

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
        link down or a restart long enough for rounds to close without it: `Transport.skip_to`), rather
        than push for closed rounds and stay as far behind: merge what is in flight, jump to the step a
        joiner would start at, merge the rounds whose merge step that passes (updates, or the masters
        fetched in their place), and take the mirror, the run's parameters, as a joiner does. What it
        trained since its last send, from parameters the run has left, is dropped (it would be late)."""
        ahead = self.transport.skip_to(self.next_rounds)
        if ahead is None or not _skips_to(ahead[0], self.step_count, self.cfg, self.total_steps):
            return
        start, fetched = ahead
        behind = start - self.step_count
        self.drain()
        self.step_count = start
        self.catch_up([min(frag.mirror_rounds) for frag in self.fragments])
        for frag, upto in zip(self.fragments, fetched, strict=True):
            # rounds in the masters whose merge step is still to come (tau longer than the steps between
            # two sends): into the mirror now, merged at their step
            for r in range(min(frag.mirror_rounds), upto):
                what = f"fragment {frag.index} round {r}"
                _wait(self._applied(frag.index, r), what, self.interrupt, self.request_stop)
        self.quiesce()
        for frag in self.fragments:
            frag.take_mirror()
            self.hooks.merged(frag.index)
        self.counters.skips += 1
        self.counters.skipped_steps += behind
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
        self._updates.stop(self.fragments)

    def close(self) -> None:
        """End the sync thread and the transport's sessions, and close the loggers."""
        self._jobs.close()
        self.transport.close()
        self.reports.scalars.close()

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
        frags = [f.state_dict() for f in self.fragments]  # each after its send job: its push is made
        return {
            "step": self.step_count,
            **_by_fragment(frags),
            "pending": [(e.kind, e.fragment, e.round) for e in self.pending],
            "deferred": [list(x) for x in self.deferred],
            "generator": self.generator.get_state(),
            "tick_credit": self.pacer.clock.credit,
            "counters": self.counters.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """What state_dict wrote (and checkpoints from before deferred merges, send steps, snapshots and the
        adaptive schedule were kept)."""
        if [m.shape for m in state["mirrors"]] != [f.mirror.shape for f in self.fragments]:
            raise ValueError("the checkpoint's mirror does not fit this model's fragments")
        frags = _fragment_states(state, len(self.fragments))
        self.step_count = int(state["step"])
        for frag, frag_state in zip(self.fragments, frags, strict=True):
            frag.load_state_dict(frag_state)
        self.pending = [Event(k, int(f), int(r)) for k, f, r in state["pending"]]
        self.deferred = [(int(f), int(r)) for f, r in state.get("deferred", [])]
        self.generator.set_state(state["generator"])
        self.pacer.clock.credit = float(state.get("tick_credit", 0.0))
        self.counters.load_state_dict(state["counters"])

    # --- what the dashboards show --------------------------------------------------------------------
    def report(self, eval_loss: float | None = None, compute_utilization: float | None = None) -> None:
        """Tell the shards (with the next pushes; their dashboards show it) the eval loss of the global
        parameters measured now (the engine's loggers get it at once, as eval/loss), and the fraction of the
        training time spent computing (0..1). An eval loss the shards would refuse (not a cross-entropy in
        [0, 1e4]: they refuse the push that carries it) is left out, with a warning."""
        self.reports.report(self.step_count, eval_loss, compute_utilization)

    def progress(self) -> Progress:
        """What every push's header reports, as of now."""
        return self.reports.progress(self.step_count, self.total_steps, self.counters, self.pacer.reported())


def _skips_to(start: int, step: int, cfg: SyncConfig, total_steps: int | None) -> bool:
    """Whether a worker at `step` goes on from the run's step `start` (Transport.skip_to's) or stays."""
    if start - step < cfg.sync_every:
        return False  # less than a round behind: within the grace that rounds give (server/rounds/rule.py)
    if total_steps is not None and start >= total_steps:
        log.warning(
            "the run is at step %d, past this worker's last step %d: it goes on where it is",
            start,
            total_steps,
        )
        return False
    return True


def _fragments(
    model: nn.Module, layout: FragmentLayout, cfg: SyncConfig, num_shards: int
) -> list[FragmentSync]:
    """One FragmentSync per fragment of the layout, all on the parameters' device."""
    params = [[p.detach() for p in fragment_params(model, f)] for f in layout.fragments]
    place = Placement(params[0][0].device if params and params[0] else torch.device("cpu"))
    return [
        FragmentSync(spec, ps, cfg, num_shards, place)
        for spec, ps in zip(layout.fragments, params, strict=True)
    ]


def _by_fragment(frags: list[dict]) -> dict:
    """The fragments' states (FragmentSync.state_dict) as a checkpoint holds them: lists by fragment."""
    return {
        "mirrors": [f["mirror"] for f in frags],
        "mirror_rounds": [f["mirror_rounds"] for f in frags],
        "in_flight": {i: f["in_flight"] for i, f in enumerate(frags) if f["in_flight"] is not None},
        "sent_at": [[i, r, t] for i, f in enumerate(frags) for r, t in f["sent_at"].items()],
        # the send snapshots of rounds not merged yet: a resumed worker rebases them as it would have
        "snapshots": {i: f["snapshot"] for i, f in enumerate(frags) if f["snapshot"] is not None},
        "tokens_since_sync": [f["tokens"] for f in frags],
        "loss_since_sync": [f["loss"] for f in frags],
        # the uplink's error-feedback residuals (--uplink-feedback): what the pushes so far left out
        "feedback": {i: f["feedback"] for i, f in enumerate(frags) if f["feedback"] is not None},
    }


def _fragment_states(state: dict, count: int) -> list[dict]:
    """A checkpoint's lists by fragment (what _by_fragment wrote, or a checkpoint from before send steps and
    snapshots were kept) as one FragmentSync state per fragment."""
    lists = (state["mirrors"], state["mirror_rounds"], state["tokens_since_sync"], state["loss_since_sync"])
    frags: list[dict] = [
        {"mirror": m, "mirror_rounds": r, "tokens": t, "loss": loss, "sent_at": {}}
        for m, r, t, loss in zip(*lists, strict=True)
    ]

    def fragment(f: Any, what: str) -> dict:
        if not 0 <= int(f) < count:
            raise ValueError(f"the checkpoint's {what} of fragment {f} does not fit this model")
        return frags[int(f)]

    for f, r in state["in_flight"].items():
        fragment(f, "round in flight")["in_flight"] = r
    for f, r, t in state.get("sent_at", []):
        fragment(f, "send step")["sent_at"][r] = t
    for f, snapshot in state.get("snapshots", {}).items():
        fragment(f, "send snapshot")["snapshot"] = snapshot
    for f, residual in state.get("feedback", {}).items():  # none before the uplink's error feedback
        fragment(f, "uplink error feedback")["feedback"] = residual
    return frags


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
