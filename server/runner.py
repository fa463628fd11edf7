"""The shard's round runner: it starts a close job for every round that is due and a fold job where pushes
wait to be folded, runs their arithmetic (the fold, the outer step, encoding the update, writing the
checkpoint, serializing the update's messages) on a small thread pool beside the event loop, and takes the
results back on the loop: the round's update goes to every session (`deliver`), its record to the dashboard
and the metrics. A failed job or checkpoint stops the shard (`fatal`).

It owns the jobs and the shard's way down (`stopping`, `fatal`); ShardState owns the rounds themselves (pure)
and the servicer the sessions. What it must not do: read or answer calls, or change membership.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor

from streamdiloco.common.wire import to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.observe.dashboard import DashboardData
from streamdiloco.server.observe.metrics import ShardMetrics
from streamdiloco.server.rounds.jobs import Push
from streamdiloco.server.rounds.state import CloseJob, FoldJob, ShardState
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.server.storage.credits import Credits

log = logging.getLogger("streamdiloco.shard")

SAMPLE_SECONDS = 1.0  # how often tick calls each_second
COMPUTE_THREADS = 2  # jobs of different fragments may run at once; one fragment has one job at a time


class RoundRunner:
    """Close and fold jobs of one shard's rounds (see the module's docstring). `deliver(messages, nbytes)`
    queues an update's serialized messages to every session (`nbytes`: its codec bytes, counted once per
    session); `closing(fragment)` is told when a round of that fragment starts closing (pushes still
    arriving for it are late now)."""

    def __init__(
        self,
        state: ShardState,
        checkpoint: ShardCheckpoint | None,
        metrics: ShardMetrics,
        dashboard: DashboardData,
        down_chunk: int,
        deliver: Callable[[list[bytes], int], None],
        closing: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        credits: Credits | None = None,
        pool: Executor | None = None,
    ) -> None:
        self.state, self.checkpoint, self.metrics, self.dashboard = state, checkpoint, metrics, dashboard
        self.down_chunk, self.deliver, self.on_closing, self.clock = down_chunk, deliver, closing, clock
        # the contribution credits: each closed round's tokens per worker; and the credits of the pushes that
        # fold jobs took out of a round still open ((fragment, round) -> worker -> summed credits)
        self.credits = credits if credits is not None else Credits(state.layout.num_fragments)
        self.folded: dict[tuple[int, int], dict[str, float]] = {}
        self.stopping = False  # shutting down: sessions end, but no round closes because of that
        self.fatal: str | None = None  # why the shard must stop (a checkpoint it could not write)
        self.failed = asyncio.Event()  # set with `fatal`: the shard stops serving
        self.pool = pool or ThreadPoolExecutor(COMPUTE_THREADS, thread_name_prefix="shard-compute")
        self._jobs: set[asyncio.Task] = set()  # fold and close jobs out (awaited before a final checkpoint)
        self.closing: dict[int, asyncio.Task] = {}  # fragment -> its close job, while it runs

    def stop(self) -> None:
        """The shard is on its way down: sessions end now, and that must not close rounds with partial
        pushes."""
        self.stopping = True

    @property
    def down(self) -> bool:
        """Stopping, or stopped by a failure: no round closes, no master goes out."""
        return self.stopping or self.fatal is not None

    def close_due(self, pushed: int | None = None) -> None:
        """Start a close job for every round that is due, and a fold job where pushes wait to be folded.
        `pushed`: called for a push of this fragment, whose round is the only one it can make due (the rule
        costs O(members) per round looked at; the tick looks at every round five times a second)."""
        if self.down:
            return
        now = self.clock()
        for fragment, why in self.state.due(now, pushed):
            started = self.state.open[fragment].started_at
            job = self.state.begin_close(fragment, why, now)
            # every push of the round is settled now (its credit: the weight after the caps, never stretched)
            job.credit(self.folded.pop((fragment, job.round), {}))
            self.on_closing(fragment)  # pushes still arriving for the closed round are late now
            self.closing[fragment] = self._start(self._close(job, started))
        for fragment in self.state.fold_due():
            fold = self.state.begin_fold(fragment)
            shares = self.folded.setdefault((fragment, fold.round), {})
            add_shares(shares, (p for group in fold.groups for p in group))
            self._start(self._fold(fold))

    def _start(self, work: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    async def drain(self) -> None:
        """Wait for the jobs that are out (before a final checkpoint: the state is whole again)."""
        while self._jobs:
            await asyncio.wait(set(self._jobs))

    def _job_failed(self, what: str, error: BaseException) -> None:
        # a bug, not bad input: the fragment cannot go on, so the shard stops; workers keep their pushes and
        # send them again to the shard restarted from its checkpoint
        log.error("%s failed", what, exc_info=error)
        if not self.fatal:
            self.fatal = f"{what} failed ({type(error).__name__}: {error}): stopping the shard"
            self.failed.set()

    async def _fold(self, job: FoldJob) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, job.run)
        except Exception as e:
            self._job_failed(f"folding pushes of fragment {job.fragment} round {job.round}", e)
            return
        self.state.end_fold(job)
        self.close_due()

    def _compute_close(self, job: CloseJob) -> tuple[bool, list[bytes], float | None]:
        """On a pool thread: the round's arithmetic, its checkpoint, and its update's messages."""
        ckpt = self.checkpoint
        record = job.record() if ckpt is not None else None  # before run(), which lets the pushes go
        job.run()
        saved, seconds = True, None
        if ckpt is not None and record is not None:  # the round is durable before its update goes out
            t0 = time.perf_counter()
            saved = ckpt.log_round(job.fragment, record)
            seconds = time.perf_counter() - t0
        assert job.update is not None
        messages = (
            [
                pb.ShardMessage(update=c).SerializeToString()
                for c in to_chunks(job.update, job.fragment, job.round, self.down_chunk)
            ]
            if saved
            else []
        )
        return saved, messages, seconds

    async def _close(self, job: CloseJob, started: float | None) -> None:
        try:
            saved, messages, seconds = await asyncio.get_running_loop().run_in_executor(
                self.pool, self._compute_close, job
            )
        except Exception as e:
            self._job_failed(f"closing fragment {job.fragment} round {job.round}", e)
            return
        finally:
            del self.closing[job.fragment]
        c = self.state.end_close(job)
        if seconds is not None:
            self.metrics.checkpoint_write.observe(seconds)
        if not saved:
            assert self.checkpoint is not None
            # no worker may apply an update that a restart would not have: stop instead; workers keep
            # their pushes and send them again to the shard restarted from its last good checkpoint
            self.fatal = f"cannot write the checkpoint ({self.checkpoint.last_error}): stopping the shard"
            log.critical(self.fatal)
            self.failed.set()
            return
        self.deliver(messages, c.update.nbytes)  # the same bytes for every member
        void = c.why == "nonfinite"  # a zero update: nothing reached the model
        self.credits.round_closed(c.fragment, c.round, job.tokens, c.clipped, c.capped, void)
        seconds = self.clock() - started if started is not None else None
        self.metrics.round_closed(c.why, seconds, c.update.nbytes)
        self.dashboard.record_round(
            {
                "fragment": c.fragment,
                "round": c.round,
                "contributors": list(c.contributors),
                "why": c.why,
                "clipped": list(c.clipped),
                "capped": list(c.capped),
                "seconds": round(seconds, 3) if seconds is not None else None,
                "mean_loss": c.mean_loss,
                "closed_at": time.time(),
            }
        )
        (log.error if c.why == "nonfinite" else log.info)(
            "fragment %d round %d closed (%s): %d contributors%s%s",
            c.fragment,
            c.round,
            c.why,
            len(c.contributors),
            f", mean loss {c.mean_loss:.4f}" if c.mean_loss is not None else "",
            "; THE OUTER STEP CAME OUT NON-FINITE: the round's update was not applied (a zero update went "
            "out) and the outer optimizer restarted from the master before it"
            if c.why == "nonfinite"
            else "",
        )
        if c.clipped or c.capped:  # names are bounded (check_name): at most a member list's length
            log.warning(
                "fragment %d round %d: %s",
                c.fragment,
                c.round,
                "; ".join(
                    f"{what} of {', '.join(names)}"
                    for what, names in (("norm clipped", c.clipped), ("weight capped", c.capped))
                    if names
                ),
            )
        if self.checkpoint is not None and self.checkpoint.full_due(c.round):
            # the fragment's whole state, after the update has gone out (the round's log made it durable);
            # the fragment holds still meanwhile: no close until it is written
            self.state.hold(c.fragment)
            self._start(self._save_whole(job))
        self.close_due()  # a round may have become due while this one was out

    async def _save_whole(self, job: CloseJob) -> None:
        ckpt = self.checkpoint
        assert ckpt is not None
        credits = self.credits.to_state(self.clock())  # this round credited: written before its log goes
        try:
            t0 = time.perf_counter()
            # a failure is logged and counted, not fatal: the round logs stay until a whole state is written
            # (and no state drops the logs of rounds that the credits written have not)
            await asyncio.get_running_loop().run_in_executor(
                self.pool,
                lambda: ckpt.save_part("credits", credits) and ckpt.save(job.fragment, job.fragment_state()),
            )
            self.metrics.checkpoint_write.observe(time.perf_counter() - t0)
        finally:
            self.state.release(job.fragment)
            self.close_due()

    async def tick(self, each_second: Callable[[], None], period: float = 0.2) -> None:
        """Close rounds whose deadline has passed; call `each_second` about once a second (the dashboard's
        sample, re-reading the workers file)."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            if time.monotonic() - last >= SAMPLE_SECONDS:  # not time.time(): clocks step
                last = time.monotonic()
                each_second()
            try:
                self.close_due()
            except Exception:  # keep closing rounds at their deadlines whatever one close did
                log.exception("closing rounds failed")


def add_shares(into: dict[str, float], pushes: Iterable[Push]) -> None:
    """Add settled pushes' credits (their weights after the caps, never stretched) into `into`, by worker."""
    for p in pushes:
        into[p.worker] = into.get(p.worker, 0.0) + p.credited
