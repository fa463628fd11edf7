"""server/runner.py's RoundRunner over a real ShardState and no network: a due round is closed on the pool
and its update's messages go out once; the round's credited tokens, its record on the dashboard and its
metrics follow; a stopping shard closes nothing; a job that fails stops the shard (`fatal`, `failed`)
instead of going on without the fragment."""

from __future__ import annotations

import asyncio

import pytest

from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.observe.dashboard import DashboardData
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.runner import RoundRunner
from streamdiloco.server.storage.credits import Credits
from tests.support.nano_shard import nano_state, slice_push


class Delivered:
    """The runner's `deliver`: what went out, as the sessions would get it."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.nbytes: list[int] = []

    def __call__(self, messages: list[bytes], nbytes: int) -> None:
        self.messages.extend(messages)
        self.nbytes.append(nbytes)


class Metrics:
    """What the runner tells the shard's metrics (server/observe/metrics.py is tested with a real shard)."""

    def __init__(self) -> None:
        self.closed: list[tuple[str, float | None, int]] = []
        self.checkpoint_write = self  # a histogram: observe()

    def round_closed(self, why: str, seconds: float | None, update_bytes: int) -> None:
        self.closed.append((why, seconds, update_bytes))

    def observe(self, seconds: float) -> None:
        raise AssertionError("no checkpoint here: nothing is written")


def _runner(state, deliver, closing: list[int], credits: Credits) -> RoundRunner:
    clock = lambda: 0.0  # noqa: E731 - the rounds' clock: every push and close at 0
    metrics = Metrics()
    return RoundRunner(
        state,
        None,
        metrics,
        DashboardData(),
        1 << 20,
        deliver,
        closing.append,
        clock,
        credits,  # type: ignore[arg-type]
    )


def test_a_round_due_is_closed_once_and_its_update_goes_out_with_its_credit():
    state, _ = nano_state(num_shards=1, robust=RobustConfig(weight_cap=0.0))  # a push's share: its weight
    state.add_member("a")
    state.add_member("b")
    delivered, closing, credits = Delivered(), [], Credits(3)
    runner = _runner(state, delivered, closing, credits)

    async def run() -> None:
        state.push("a", 1, 0, slice_push(state, 1, 1), weight=30.0)
        runner.close_due(1)  # b has not pushed: not due
        assert closing == [] and not runner.closing
        state.push("b", 1, 0, slice_push(state, 1, 2), weight=10.0)
        runner.close_due(1)
        runner.close_due(1)  # a second call while the job is out starts nothing
        assert closing == [1] and set(runner.closing) == {1}
        await runner.drain()

    asyncio.run(run())
    assert state.round_of(1) == 1 and state.round_of(0) == 0  # only fragment 1's round closed
    updates = [pb.ShardMessage.FromString(m).update for m in delivered.messages]
    assert {(u.fragment, u.round) for u in updates} == {(1, 0)} and updates[-1].last
    assert sum(len(u.payload) + len(u.scales) for u in updates) == delivered.nbytes[0]
    (record,) = runner.dashboard.recent_rounds(10)
    assert (record["fragment"], record["round"], record["why"]) == (1, 0, "all")
    assert sorted(record["contributors"]) == ["a", "b"]
    assert [(why, size) for why, _, size in runner.metrics.closed] == [("all", delivered.nbytes[0])]
    tokens = {name: row.tokens for name, row in credits.rows.items()}
    # each push's share (its weight, no cap) over the 3 fragments: a push stands for the tokens since its
    # worker's last sync of that fragment, one P-th of what it trained
    assert tokens == pytest.approx({"a": 30.0 / 3, "b": 10.0 / 3})
    assert {name: row.rounds for name, row in credits.rows.items()} == {"a": 1, "b": 1}
    runner.pool.shutdown()


def test_a_stopping_shard_closes_no_round():
    state, _ = nano_state(num_shards=1)
    state.add_member("a")
    runner = _runner(state, Delivered(), closing := [], Credits(3))

    async def run() -> None:
        state.push("a", 1, 0, slice_push(state, 1, 1), weight=1.0)
        runner.stop()
        runner.close_due(1)
        await runner.drain()

    asyncio.run(run())
    assert runner.down and closing == [] and state.round_of(1) == 0
    runner.pool.shutdown()


def test_a_failing_close_stops_the_shard():
    state, _ = nano_state(num_shards=1)
    state.add_member("a")
    runner = _runner(state, Delivered(), [], Credits(3))

    def broken(job):
        raise RuntimeError("a bug")

    runner._compute_close = broken  # type: ignore[method-assign]

    async def run() -> None:
        state.push("a", 1, 0, slice_push(state, 1, 1), weight=1.0)
        runner.close_due(1)
        await runner.drain()
        assert runner.failed.is_set()

    asyncio.run(run())
    assert runner.down and "closing fragment 1 round 0 failed (RuntimeError: a bug)" in (runner.fatal or "")
    runner.pool.shutdown()
