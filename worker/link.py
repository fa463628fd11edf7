"""A worker's link to one shard: one actor that owns what the link holds, over a ShardConnection.

The link's own thread owns the link's state (worker/linkstate.py: rounds held, kept pushes, arrived updates,
the pushes not yet answered, where the shard is) and is the only one that changes it; everything else posts
work to it (`_post`) or asks it and gets a future (`_ask`). It sends pushes, hands updates over as they
arrive (one future per (fragment, round) that the engine waits on), and reconnects when a session breaks.
The session's reader (worker/session.py) assembles update chunks and tells the link's thread what came, as
typed events (SessionEvent).
Whole updates that nobody has taken yet are bounded: past `max_waiting` (MAX_WAITING_UPDATES) of one
fragment, the fragment's master is fetched in their place; a shard whose master does not hold them fails the
link, in one line naming the shard.
The link's parts, by job: `CatchUp` (masters fetched in place of updates: a resync, or too many waiting),
`Pushes` (sent with the progress header, and the shard's answers: `PushAnswers`), `Membership` (what Ready
names), `Waiters` (the futures the link's thread settles); `Actor` is the thread.
This module must not decide what LinkState decides (what is held, what to resend, where the shard is) nor
talk gRPC itself: the connection does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from streamdiloco.common.codecs import Encoded
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.metrics import PUSH_OUTCOMES, push_outcome
from streamdiloco.common.pace import valid_step_seconds
from streamdiloco.common.progress import Progress, progress_to_proto
from streamdiloco.common.tls import ClientTLS
from streamdiloco.common.wire import to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.worker.connection import ShardConnection
from streamdiloco.worker.engine import settle
from streamdiloco.worker.linkstate import Kept, LinkState, MastersFetched, RoundsView, ShardBehind, Update
from streamdiloco.worker.session import (
    ResultArrived,
    Retry,
    SessionEnded,
    SessionEvent,
    SessionFailed,
    ShardSaid,
    SyncError,
    UpdateArrived,
    WelcomeArrived,
)

log = logging.getLogger("streamdiloco.worker")

_STOP = object()  # ends the link's thread
# Whole updates of one fragment that may wait untaken (a worker far behind, a passive link, or a shard that
# floods it): past this, the fragment's master is fetched in their place, as after a reconnect.
MAX_WAITING_UPDATES = 16
WARN_EVERY = 60.0  # seconds between warnings that updates were replaced by a master (debug lines between)


class Actor:
    """One thread that runs what is posted to it, in order: the one writer of what its subclass holds.
    Other threads `_post` work or `_ask` for a future of its result. An exception in posted work goes to
    `_failed` (the thread never ends silently: whoever waits on it would wait for ever); `_stopped` runs
    when the thread ends."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Have the thread run fn(*args), after what was posted before."""
        self._inbox.put((fn, args, None))

    def _promise(self, fn: Callable[..., Any], *args: Any) -> Future:
        """A future that fn(*args, future), posted to the thread, settles."""
        fut: Future = Future()
        self._post(fn, *args, fut)
        return fut

    def _ask(self, fn: Callable[..., Any], *args: Any) -> Future:
        """A future of fn(*args), run on the thread (here if it has not started: a test driving the state)."""
        fut: Future = Future()
        if self._thread is None:
            fut.set_result(fn(*args))
        else:
            self._inbox.put((fn, args, fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                break
            fn, args, fut = item
            try:
                result = fn(*args)
                if fut is not None:
                    fut.set_result(result)
            except BaseException as e:
                if fut is not None:
                    fut.set_exception(e)
                else:
                    self._failed(e)
        self._stopped()

    def _stop(self, timeout: float) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    def _failed(self, e: BaseException) -> None:
        raise NotImplementedError

    def _stopped(self) -> None:
        pass


class PushAnswers:
    """The shard's answers to this worker's pushes: counted by outcome (/metrics), refusals kept, the run's
    pace as the latest accepting answer said, and each accepted push's seconds from send to answer given to
    `on_answer`."""

    def __init__(self) -> None:
        self.results = dict.fromkeys(PUSH_OUTCOMES, 0)
        self.refusals: list[pb.PushResult] = []
        self.pace_seconds = 0.0  # common/pace.py
        self.on_answer: Callable[[float], None] | None = None

    def listen(self, on_answer: Callable[[float], None]) -> None:
        """`on_answer` gets the seconds from each accepted push's send to its answer from now on."""
        self.on_answer = on_answer

    def take(self, r: pb.PushResult, sent: float | None, shard: int) -> str | None:
        """Count one answer (`sent`: when its push went out, if on this session); the link's failure
        message when the shard refused the push for good."""
        self.results[push_outcome(None if r.accepted else r.reason)] += 1
        if r.accepted:
            # a shard that announces a pace no worker can have is ignored (common/pace.py bounds it)
            self.pace_seconds = r.pace_seconds if valid_step_seconds(r.pace_seconds) else 0.0
            if sent is not None and self.on_answer is not None:
                self.on_answer(time.perf_counter() - sent)
            return None
        self.refusals.append(r)
        if r.reason == "late":  # the round closed without us: its update still comes, and we apply it
            log.warning("shard %d: %s", shard, r.message)
        elif r.reason == "duplicate":  # sent before a reconnect and already in the round: nothing lost
            log.info("shard %d already has this worker's push: %s", shard, r.message)
        else:
            return f"shard {shard} refused a push ({r.reason}): {r.message}"
        return None


class Pushes:
    """This worker's pushes on the wire: sent on the current session in chunks, the first with the header
    (the push's weight and loss, and the worker's progress as of the send: common/progress.py), each then
    awaited in the link's state; and the shard's answers to them (PushAnswers)."""

    def __init__(self, conn: ShardConnection) -> None:
        self.conn = conn
        self.answers = PushAnswers()
        self.progress: Callable[[], Progress] = Progress  # what each header reports (the shards' dashboards)
        self.resent = 0  # pushes sent again after a reconnect or a resume

    def report_progress(self, progress: Callable[[], Progress]) -> None:
        self.progress = progress

    def send(self, state: LinkState, fragment: int, round: int, push: Kept) -> None:
        header = progress_to_proto(self.progress(), push.weight, push.loss)
        for chunk in to_chunks(push.enc, fragment, round, self.conn.chunk_values):
            self.conn.send(
                pb.WorkerMessage(push=pb.Push(chunk=chunk, header=header if chunk.seq == 0 else None))
            )
        state.sent(fragment, round, time.perf_counter())

    def resend(self, state: LinkState, open_rounds: list[int]) -> None:
        """Send again every kept push whose round is still open (after a reconnect or a resume; the shard
        had them only if it says "duplicate")."""
        for f, r, push in state.to_resend(open_rounds):
            self.send(state, f, r, push)
            self.resent += 1


class Waiters:
    """The futures a link's thread settles: the engine's requests for updates (per fragment and round),
    ready() calls waiting to be a member, flush() calls waiting for every push's answer."""

    def __init__(self) -> None:
        self.updates: dict[tuple[int, int], list[Future]] = {}
        self.member: list[Future] = []
        self.flushed: list[Future] = []

    def hand_over(self, state: LinkState) -> None:
        """Give every wanted update that is here to whoever waits for it."""
        for key in sorted(self.updates):
            if state.available(*key):
                update = state.take(*key)
                for fut in self.updates.pop(key):
                    settle(fut, update)

    def welcome(self, w: pb.Welcome) -> None:
        for fut in self.member:
            settle(fut, w)
        self.member.clear()

    def answered(self, all_answered: bool, hopeless: bool) -> None:
        """Settle the flush() calls once every push has its answer, or none will come (`hopeless`)."""
        if self.flushed and (all_answered or hopeless):
            for fut in self.flushed:
                settle(fut, all_answered)
            self.flushed.clear()

    def fail(self, message: str) -> None:
        """The link failed for good: every update and membership waited for fails with SyncError."""
        for fut in [f for futs in self.updates.values() for f in futs] + self.member:
            settle(fut, exc=SyncError(message))
        self.updates.clear()
        self.member.clear()


class Membership:
    """Whether this worker wants to be a member of the shard's rounds, and from which rounds on: what its
    Ready says, at ready() and again after every reconnect."""

    def __init__(self) -> None:
        self.wanted = False  # ready() was called: a reconnect makes us a member again
        self.join_from: list[int] | None = None  # first rounds a joining worker pushes (see join_run)
        self.schedule: Callable[[], list[int]] | None = None  # the engine's next round of each fragment

    def want(self, from_rounds: list[int] | None = None) -> None:
        self.wanted = True
        if from_rounds is not None:
            self.join_from = list(from_rounds)

    def follow(self, schedule: Callable[[], list[int]]) -> None:
        self.schedule = schedule

    def ready_message(self, state: LinkState) -> pb.WorkerMessage:
        """Ready, naming the first round of each fragment this worker will push (none: every round)."""
        if self.schedule is not None:
            first = state.first_rounds(list(self.schedule()))
        else:
            first = list(self.join_from or [])
        return pb.WorkerMessage(ready=pb.Ready(from_rounds=first))


class CatchUp:
    """Masters fetched in place of updates: of the fragments whose rounds closed while this worker was away
    (a reconnect's resync), or of a fragment with more than `max_waiting` whole updates untaken. Each fetch
    is published for the training thread (`fetched`: what the masters hold and where the run was then, then
    `fetches` counted), which may find it is whole rounds behind (GrpcTransport.skip_to)."""

    def __init__(self, conn: ShardConnection, max_waiting: int) -> None:
        self.conn, self.max_waiting = conn, max_waiting
        self._warned = -WARN_EVERY  # when updates were last replaced by a master with a warning
        self.fetches = 0
        self.fetched: MastersFetched | None = None

    def resync(
        self, state: LinkState, rounds: list[int], view: Callable[[], RoundsView], patient: bool
    ) -> bool:
        """Compare the shard's rounds (its Welcome's) with ours; fetch the slices of fragments whose rounds
        we missed (a Fetch that breaks is tried again as ShardConnection.fetch says; Retry when it fails).
        False if there was nothing to fetch."""
        where = f"shard {self.conn.shard} at {self.conn.target}"
        try:
            behind = state.behind(rounds)
        except ShardBehind as e:
            raise SyncError(f"{where} {e}") from None
        if not behind:
            return False
        log.info(
            "shard %d closed rounds of fragment(s) %s while this worker was away: fetching those slices",
            self.conn.shard,
            behind,
        )
        try:
            fetched = self.conn.fetch(behind, patient)
        except SyncError as e:
            raise Retry(str(e)) from None
        for f, (values, rnd) in fetched.items():
            state.on_fetched(f, values, rnd)
        self._publish(state, view)
        return True

    def bound(self, state: LinkState, fragment: int, view: Callable[[], RoundsView]) -> bool:
        """Past `max_waiting` untaken updates of a fragment, fetch its master in their place (the engine
        takes it instead, as after a reconnect); SyncError if the shard's master does not hold them. False
        if they were not too many."""
        waiting = [r for f, r in state.arrived if f == fragment]
        if len(waiting) <= self.max_waiting:
            return False
        now = time.monotonic()
        (log.warning if now - self._warned > WARN_EVERY else log.debug)(
            "shard %d: %d updates of fragment %d wait untaken (at most %d): fetching its master instead",
            self.conn.shard,
            len(waiting),
            fragment,
            self.max_waiting,
        )
        self._warned = now if now - self._warned > WARN_EVERY else self._warned
        values, rnd = self.conn.fetch([fragment])[fragment]
        state.on_fetched(fragment, values, rnd)
        left = [r for f, r in state.arrived if f == fragment]
        if len(left) > self.max_waiting:
            raise SyncError(
                f"shard {self.conn.shard} at {self.conn.target} sent updates of rounds {min(left)} to "
                f"{max(left)} of fragment {fragment}, but its master of round {rnd} does not hold them: more "
                f"than {self.max_waiting} updates waiting is the shard's fault"
            )
        self._publish(state, view)
        return True

    def _publish(self, state: LinkState, view: Callable[[], RoundsView]) -> None:
        """What the masters hold and where the run is: published as one tuple, then counted."""
        self.fetched = MastersFetched(list(state.covered), view())
        self.fetches += 1


class ShardLink(Actor):
    """One shard: Join, a Session that stays open, and its resumption when it breaks.

    Pushes are kept (encoded) until their round's update is taken. When the session breaks, the link's
    thread reconnects with exponential backoff and jitter: Join again, open a passive session, compare the
    shard's rounds with what this worker holds, fetch any slice it missed rounds of (the engine then takes
    that Master in place of the missed updates), become a member again, and send again every kept push
    whose round is still open. A shard restarted from its checkpoint thereby gets back every push it lost.
    """

    def __init__(
        self,
        target: str,
        worker: str,
        fingerprint: dict,
        token: str = "",
        join_timeout: float = 60.0,
        reconnect_timeout: float = 600.0,
        tls: ClientTLS | None = None,
        max_waiting: int = MAX_WAITING_UPDATES,
        link: LinkSettings | None = None,
    ):
        super().__init__()
        self.conn = ShardConnection(
            target,
            worker,
            fingerprint,
            token=token,
            join_timeout=join_timeout,
            tls=tls,
            link=link,
            patience=reconnect_timeout,
        )
        self._catch_up = CatchUp(self.conn, max_waiting)  # masters fetched in place of updates
        self.state: LinkState | None = None  # made at the first Join (its number of fragments)
        # what only the link's thread touches
        self._connected = False  # a session is open and this worker is a member on it
        self._welcome: pb.Welcome | None = None  # the latest Welcome (answer to Hello or Ready)
        self._membership = Membership()
        self._waiters = Waiters()
        # read from any thread
        self.error: str | None = None
        self.reconnects = 0
        self._pushes = Pushes(self.conn)  # sent in chunks, and the shard's answers
        self._closing = False

    # what Join said (the connection's)
    target = property(lambda self: self.conn.target)
    shard = property(lambda self: self.conn.shard)
    num_shards = property(lambda self: self.conn.num_shards)
    slices = property(lambda self: self.conn.slices)
    config = property(lambda self: self.conn.config)
    # pushes sent again; the shard's answers: by outcome, the refusals, the run's pace as it last said
    resent = property(lambda self: self._pushes.resent)
    answers = property(lambda self: self._pushes.answers)
    results = property(lambda self: self._pushes.answers.results)
    refusals = property(lambda self: self._pushes.answers.refusals)
    pace_seconds = property(lambda self: self._pushes.answers.pace_seconds)
    # masters fetched in place of updates, and what this shard said then (GrpcTransport.skip_to)
    fetches = property(lambda self: self._catch_up.fetches)
    fetched = property(lambda self: self._catch_up.fetched)

    def start(self, state: dict | None = None, held: list[int] | None = None) -> None:
        """Join, restore a checkpoint's `state` (and the rounds `held` in the mirror) if given, open a
        passive session and start the link's thread."""
        self.conn.join()
        self.state = self.state or LinkState(len(self.slices))
        if state is not None:
            if state["shard"] != self.shard:
                raise SyncError(
                    f"{self.target} is shard {self.shard}, the checkpoint's link to it was shard "
                    f"{state['shard']}: give --servers in the same order as before"
                )
            assert held is not None
            self.state.load_state_dict(state, held)
        try:
            self._welcome = self.conn.open_session(self._tell)
        except Retry as e:  # the link dropped between Join and the session: join again, with backoff
            log.warning("shard %d at %s: %s; joining again", self.shard, self.target, e)
            self.conn.reconnect(self.conn.patience, self._tell, self._opened)
        self._start(f"shard{self.shard}-link")

    def _opened(self, welcome: pb.Welcome) -> None:
        self._welcome = welcome

    # --- the link's thread -----------------------------------------------------------------------------
    def _failed(self, e: BaseException) -> None:
        if not self._closing:
            what = f"shard {self.shard} at {self.target}: {type(e).__name__}: {e}"
            self._fail(str(e) if isinstance(e, SyncError) else what)

    def _stopped(self) -> None:
        self._fail_waiters(self.error or f"the link to shard {self.shard} is closed")

    def _tell(self, event: SessionEvent) -> None:
        """The session's reader: what came on a session, for the link's thread."""
        self._post(self._on_event, event)

    # --- on the link's thread: what the shard says -----------------------------------------------------
    def _on_event(self, event: SessionEvent) -> None:
        if isinstance(event, ShardSaid):
            self.conn.handled()  # the reader may tell the next one
        if event.session != self.conn.session or (isinstance(event, SessionEnded) and self._closing):
            return  # from a session that is over, or the end of one we are leaving
        if self.error and isinstance(event, UpdateArrived | SessionEnded):
            return  # the link failed for good: nothing more is kept, nobody reconnects
        assert self.state is not None
        match event:
            case UpdateArrived(fragment=fragment, round=round, parts=parts):
                if self.state.on_update(fragment, round, parts):
                    self._hand_over()
                    if self._catch_up.bound(self.state, fragment, self._view):
                        self._hand_over()
            case WelcomeArrived(welcome=welcome):
                self._on_welcome(welcome)
            case ResultArrived(result=result):
                self._on_result(result)
            case SessionFailed(why=why):
                self._fail(why)
            case SessionEnded(why=why):
                self._connected = False
                self.state.session_ended()
                self._check_flushed()
                log.warning("%s; reconnecting", why)
                self._reconnect()

    def _on_welcome(self, w: pb.Welcome) -> None:
        assert self.state is not None
        n = len(self.slices)
        if len(w.rounds) != n or len(w.started) != n or len(w.pushes) != n:
            raise SyncError(f"shard {self.shard} sent a Welcome for {len(w.rounds)} fragments")
        self._welcome = w
        if w.member and not self._connected:  # a member (again): the kept pushes of open rounds go again
            self._pushes.resend(self.state, list(w.rounds))
            self._connected = True
            self._waiters.welcome(w)

    def _on_result(self, r: pb.PushResult) -> None:
        assert self.state is not None
        failure = self._pushes.answers.take(r, self.state.answered(r.fragment, r.round), self.shard)
        self._check_flushed()
        if failure is not None:
            self._fail(failure)

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
            log.error(message)
        self._fail_waiters(message)

    def _fail_waiters(self, message: str) -> None:
        self._waiters.fail(message)
        self._check_flushed()

    def _hand_over(self) -> None:
        assert self.state is not None
        self._waiters.hand_over(self.state)

    # --- reconnecting ----------------------------------------------------------------------------------
    def _reconnect(self) -> None:
        """Join again, resynchronize and become a member (if we were one); fails the link when time runs
        out (the backoff: ShardConnection.reconnect)."""

        def resume(welcome: pb.Welcome) -> None:
            assert self.state is not None
            self._welcome = welcome
            self._resync(welcome, patient=False)  # a Fetch that breaks: the reconnect tries again
            if self._membership.wanted:  # the answer's Welcome sends the kept pushes again
                self.conn.send(self._membership.ready_message(self.state))

        attempts = self.conn.reconnect(self.conn.patience, self._tell, resume)
        if not self._closing:
            self.reconnects += 1
            log.info("reconnected to shard %d at %s (attempt %d)", self.shard, self.target, attempts)

    def _resync(self, welcome: pb.Welcome, patient: bool = True) -> None:
        assert self.state is not None
        if self._catch_up.resync(self.state, list(welcome.rounds), self._view, patient):
            self._hand_over()

    # --- on the link's thread: what the engine and the transport ask -----------------------------------
    def _become_member(self, from_rounds: list[int] | None, fut: Future) -> None:
        assert self.state is not None
        self._membership.want(from_rounds)
        if self.error:
            settle(fut, exc=SyncError(self.error))
            return
        self._waiters.member.append(fut)
        self.conn.send(self._membership.ready_message(self.state))

    def _keep_push(self, fragment: int, round: int, push: Kept) -> None:
        assert self.state is not None
        if self.state.keep(fragment, round, push) and self._connected:
            self._pushes.send(self.state, fragment, round, push)

    def _want(self, fragment: int, round: int, fut: Future) -> None:
        if self.error:
            settle(fut, exc=SyncError(self.error))
            return
        self._waiters.updates.setdefault((fragment, round), []).append(fut)
        self._hand_over()

    def _flush(self, fut: Future) -> None:
        self._waiters.flushed.append(fut)
        self._check_flushed()

    def _check_flushed(self) -> None:
        assert self.state is not None
        self._waiters.answered(self.state.all_answered, not self._connected or bool(self.error))

    def _view(self) -> RoundsView:
        assert self.state is not None and self._welcome is not None
        w = self._welcome
        return self.state.view(list(w.rounds), list(w.started), list(w.pushes), w.min_workers)

    # --- what other threads call -----------------------------------------------------------------------
    def ready(self, timeout: float = 60.0, from_rounds: list[int] | None = None) -> pb.Welcome:
        """Become a member: rounds that start from now on wait for this worker's pushes, from the rounds
        Ready names (`from_rounds`, a joiner's first; else those of the schedule given to `follow`). Pushes
        kept from before are sent again when the shard says so."""
        try:
            return self._promise(self._become_member, from_rounds).result(timeout)
        except FutureTimeout:
            raise SyncError(f"shard {self.shard} at {self.target} did not answer Ready") from None

    def follow(self, schedule: Callable[[], list[int]]) -> None:
        """After a reconnect (or at ready()), become a member from the round `schedule()` (the engine's next
        round of each fragment) says each fragment sends next."""
        self._membership.follow(schedule)

    def report_progress(self, progress: Callable[[], Progress]) -> None:
        """What every push's header reports from now on (steps, blocked time, tokens, eval loss...)."""
        self._pushes.report_progress(progress)

    def push(self, fragment: int, round: int, enc: Encoded, weight: float, loss: float | None) -> None:
        """Send a push (now, or after the reconnect under way) and keep it until its round's update."""
        if self.error:
            raise SyncError(self.error)
        self._post(self._keep_push, fragment, round, Kept(enc, weight, loss))

    def want(self, fragment: int, round: int) -> Future:
        """A future of the round's update (an Update: see LinkState.take), set as soon as it is here; it
        fails with SyncError when the link fails for good."""
        return self._promise(self._want, fragment, round)

    def wait_update(self, fragment: int, round: int, timeout: float | None = None) -> Update:
        """Block until the round's update is here and take it (tools and tests; the engine uses want())."""
        try:
            return self.want(fragment, round).result(timeout)
        except FutureTimeout:
            raise SyncError(
                f"no update for fragment {fragment} round {round} from shard {self.shard}"
            ) from None

    def inspect(self, fn: Callable[[LinkState], Any], timeout: float | None = None) -> Any:
        """fn(state) run on the link's thread, the state's one writer (a consistent look; tools and tests)."""
        if self.state is None:  # set once, by start()
            raise SyncError(f"the link to shard {self.shard} has not joined: no state to inspect")
        return self._ask(fn, self.state).result(timeout)

    def install(self, fetched: dict[int, tuple[torch.Tensor, int]]) -> list[int]:
        """Take fetched master slices as the rounds this link holds; returns their rounds (joining)."""
        assert self.state is not None
        return self._ask(self.state.install, fetched).result()

    def view(self) -> RoundsView:
        """Where the run is, as this shard says: per fragment the open round, whether it has started and
        whether it is short of its quorum (LinkState.view; see GrpcTransport._view)."""
        return self._ask(self._view).result()

    def resync(self, timeout: float | None = None) -> None:
        """Compare what this link holds with the shard's last Welcome and fetch or resend what differs."""
        assert self._welcome is not None, "resync needs a session"
        try:
            self._ask(self._resync, self._welcome).result(timeout)
        except Retry as e:
            raise SyncError(str(e)) from None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every push sent on this session has its PushResult (for a clean stop)."""
        try:
            return bool(self._promise(self._flush).result(timeout))
        except FutureTimeout:
            return False

    def state_dict(self) -> dict:
        """What a worker checkpoint keeps of the link: the pushes not yet answered by an update (the rounds
        its mirror holds are in the engine's part)."""
        assert self.state is not None
        state = self._ask(self.state.state_dict).result()
        return {"target": self.target, "shard": self.shard, **state}

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        self.conn.closed.set()  # wakes a reconnect's backoff
        self._stop(timeout)
        self.conn.close()
