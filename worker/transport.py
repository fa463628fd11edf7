"""The engine's Transport over gRPC: the links to all S shards of a run, ordered by shard index.

SyncEngine (worker/engine.py) calls it to push a fragment's slices, to wait for a round's update from every
shard, to flush and to read the run's pace; a joiner uses `join_run` to take the run's parameters and start
where the run is. It must not hold per-shard state of its own: each ShardLink (worker/link.py) does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from streamdiloco.common.codecs import Encoded
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.metrics import PUSH_OUTCOMES
from streamdiloco.common.progress import Progress
from streamdiloco.common.schedule import joining_step, sends_through
from streamdiloco.common.tls import ClientTLS
from streamdiloco.worker.engine import settle
from streamdiloco.worker.link import ShardLink
from streamdiloco.worker.linkstate import MastersFetched, RoundsView
from streamdiloco.worker.session import SyncError


class GrpcTransport:
    """The engine's Transport over gRPC: one ShardLink per shard, ordered by shard index."""

    def __init__(self, links: list[ShardLink]):
        by_index = sorted(links, key=lambda link: link.shard)
        num = by_index[0].num_shards
        if [link.shard for link in by_index] != list(range(num)) or any(
            link.num_shards != num for link in by_index
        ):
            got = ", ".join(f"{link.target} is shard {link.shard}/{link.num_shards}" for link in links)
            raise SyncError(f"--servers must list each of the run's shards once: {got}")
        self.links, self.num_shards = by_index, num
        self.installed: list[list[int]] = []  # a joiner's fetched rounds, per fragment and shard
        self._fetches_seen = [0] * num  # per link, the fetches that skip_to has looked at

    @classmethod
    def open(
        cls,
        targets: list[str],
        worker: str,
        fingerprint: dict,
        token: str = "",
        join_timeout: float = 60.0,
        reconnect_timeout: float = 600.0,
        states: list[dict] | None = None,
        held: list[list[int]] | None = None,
        tls: ClientTLS | None = None,
        link: LinkSettings | None = None,
    ) -> GrpcTransport:
        """Join every shard and open a passive session with each (nobody waits for us yet); with `states`
        (a worker checkpoint's links, in shard order) and `held` (its engine's mirror rounds, per fragment
        and shard), each link first takes back what it held. `link`: the liveness bound and receive window
        of every connection (common/keepalive.py)."""
        if states is not None and len(states) != len(targets):
            raise SyncError(
                f"the checkpoint has links to {len(states)} shards, --servers names {len(targets)}"
            )
        links: list[ShardLink] = []
        try:
            for i, t in enumerate(targets):
                links.append(
                    ShardLink(t, worker, fingerprint, token, join_timeout, reconnect_timeout, tls, link=link)
                )
                links[-1].start(
                    None if states is None else states[i],
                    None if held is None else [h[i] for h in held],
                )
            return cls(links)
        except BaseException:
            for opened in links:
                opened.close()
            raise

    def join_run(
        self,
        fragment_vectors: Callable[[list[torch.Tensor]], None],
        prepare: Callable[[], None] | None = None,
    ) -> int:
        """A new worker: fetch every master slice (after the sessions opened, so no update is missed), hand
        the full fragments to `fragment_vectors(list of tensors)`, pick the step to start counting from (0
        for a run that has not synced yet) and become a member of every shard from the first round it will
        push. Returns that step; `installed` then holds the rounds of the fetched slices."""
        cfg = self.links[0].config
        assert cfg is not None
        parts = [link.conn.fetch() for link in self.links]
        per_link = [link.install(part) for link, part in zip(self.links, parts, strict=True)]
        self.installed = [list(r) for r in zip(*per_link, strict=True)]
        fragment_vectors([torch.cat([p[f][0] for p in parts]) for f in range(len(parts[0]))])
        if prepare is not None:  # what the caller does before its first step, done before anyone waits for us
            prepare()
        start = joining_step([self._view()], cfg)
        first = [sends_through(f, start, cfg) for f in range(cfg.num_scheduled_fragments)]
        for link in self.links:
            link.ready(from_rounds=first)  # rounds before these: no shard waits for us; we take their updates
        return start

    def _view(self) -> RoundsView:
        """Where the run is, as of now: per fragment the open round, whether it is in progress and whether it
        is short of its quorum, from each shard's Welcome moved on by the updates that came since. Shards
        can disagree (a push that reached one shard and not another, from a worker that died between):
        then the shard that is behind counts, so that a joiner pushes the round it still needs."""
        return _one_view([link.view() for link in self.links])

    def skip_to(self, next_rounds: Callable[[], list[int]]) -> tuple[int, list[int]] | None:
        """The step this worker should go on from if it fell whole rounds behind the run, and per fragment
        the first round that the masters fetched do not hold (on every shard); else None.

        After a link fetched masters in place of updates it missed (a reconnect after a freeze, a sleep or
        a dropped link; a restart from a checkpoint; too many updates waiting), the rounds it would push next
        (`next_rounds()`) may have closed already: each push would be for nothing until it caught up, and it
        would never catch up while the others go on. Then it goes on from where a joiner would start now
        (common/schedule.joining_step over what the shards said with the masters). Cheap when no fetch
        happened since the last call: the engine asks at every schedule step."""
        counts = [link.fetches for link in self.links]  # read before `fetched`, which is set first
        said: list[MastersFetched] = [
            link.fetched
            for link, n, seen in zip(self.links, counts, self._fetches_seen, strict=True)
            if n != seen and link.fetched is not None
        ]  # what the fetches since the last call said (an older fetch's view would hold the start back)
        self._fetches_seen = counts
        if not said:
            return None
        nxt = next_rounds()
        if not any(r < s.covered[f] for s in said for f, r in enumerate(nxt)):
            return None
        cfg = self.links[0].config
        assert cfg is not None
        start = joining_step([_one_view([s.view for s in said])], cfg)
        return start, [min(s.covered[f] for s in said) for f in range(len(nxt))]

    def resume(self, schedule: Callable[[], list[int]]) -> None:
        """A worker restarted from its checkpoint (its links loaded in open()): fetch the slices of rounds
        that closed meanwhile, become a member from the next round it pushes (`schedule()`: the engine's
        next round of each fragment), and send again the kept pushes whose rounds are still open."""
        for link in self.links:
            link.follow(schedule)
            link.resync()
        for link in self.links:
            link.ready()

    def follow(self, schedule: Callable[[], list[int]]) -> None:
        """After a reconnect, become a member from the next round `schedule()` says each fragment sends."""
        for link in self.links:
            link.follow(schedule)

    def first_rounds(self, num_fragments: int) -> list[int]:
        """Per fragment, the first round not yet in the mirror on every shard."""
        covered = [link.inspect(lambda st: list(st.covered)) for link in self.links]
        return [min(c[f] for c in covered) for f in range(num_fragments)]

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        for link, enc in zip(self.links, slices, strict=True):
            link.push(fragment, round, enc, weight, loss)

    def update(self, fragment: int, round: int) -> Future:
        """A future of the round's update: one Update per shard slice, once every slice is here."""
        return gather([link.want(fragment, round) for link in self.links])

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (up to `timeout` in all) until every push sent has been answered."""
        deadline = time.monotonic() + timeout
        return all([link.flush(max(0.0, deadline - time.monotonic())) for link in self.links])

    def state_dict(self) -> list[dict]:
        return [link.state_dict() for link in self.links]

    @property
    def pace_seconds(self) -> float:
        """The run's pace (the slowest member's seconds per inner step) as the shards last said: the largest
        of their answers (each sees the same members, a moment apart); 0.0 before any said one."""
        return max(link.pace_seconds for link in self.links)

    @property
    def reconnects(self) -> int:
        return sum(link.reconnects for link in self.links)

    @property
    def resent(self) -> int:
        return sum(link.resent for link in self.links)

    def report_progress(self, progress: Callable[[], Progress]) -> None:
        """What every push's header reports (steps, blocked time, tokens, eval loss...), for the dashboard."""
        for link in self.links:
            link.report_progress(progress)

    def on_push_answered(self, on_answer: Callable[[float], None]) -> None:
        """`on_answer` gets the seconds from each push's send to the shard's acceptance (for /metrics)."""
        for link in self.links:
            link.answers.listen(on_answer)

    @property
    def results(self) -> dict[str, int]:
        """Answers to this worker's pushes, by outcome, over all shards."""
        return {k: sum(link.results[k] for link in self.links) for k in PUSH_OUTCOMES}

    @property
    def message_bytes(self) -> tuple[int, int]:
        """Serialized protobuf bytes sent and received (gRPC and HTTP/2 framing not included)."""
        return sum(link.conn.msg_out for link in self.links), sum(link.conn.msg_in for link in self.links)

    def close(self) -> None:
        for link in self.links:
            link.close()


def _one_view(per_shard: list[RoundsView]) -> RoundsView:
    """Shards' views (per fragment the open round, whether it is in progress, whether it is short of its
    quorum) as one: per fragment, the shard that is behind counts."""
    out = RoundsView([], [], [])
    for f in range(len(per_shard[0].open_rounds)):
        low = min(v.open_rounds[f] for v in per_shard)
        behind = [v for v in per_shard if v.open_rounds[f] == low]
        out.open_rounds.append(low)
        out.started.append(all(v.started[f] for v in behind))
        out.short_of_quorum.append(any(v.short_of_quorum[f] for v in behind))
    return out


def gather(futures: list[Future]) -> Future:
    """One future of the results of all `futures` (in order); it fails as soon as one of them fails."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def on_done(f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if f.cancelled():
            settle(out, exc=SyncError("cancelled"))
        elif f.exception() is not None:
            settle(out, exc=f.exception())
        elif last:
            settle(out, [x.result() for x in futures])

    for f in futures:
        f.add_done_callback(on_done)
    return out
