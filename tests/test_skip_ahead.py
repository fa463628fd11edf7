"""A worker that fell whole rounds behind the run (frozen, asleep, its link down, restarted) goes on from
where the run is, as a joiner would, instead of training on silently as far behind as it fell.

The engine's part with a transport whose updates the test delivers (tests/support/held_engine.py); the
transport's decision from what its links published; real processes in tests/test_liveness.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from streamdiloco.common.codecs import decode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.schedule import joining_step, send_step
from streamdiloco.worker.linkstate import MastersFetched, RoundsView
from streamdiloco.worker.transport import GrpcTransport
from tests.support.held_engine import P, make, params, train_step


def test_a_worker_whole_rounds_behind_merges_what_it_missed_and_goes_on_from_the_runs_step():
    engine, transport, net = make("fixed", tau=1)
    try:
        for _ in range(2):  # fragment 1 sends round 0 at step 2
            train_step(net)
            engine.step()
        assert engine.in_flight == {1: 0} and send_step(1, 1, engine.cfg) == 6
        mirrors = [m.clone() for m in engine.mirrors]
        # the run went on without it: a joiner would start at step 9 (fragment 1 sends round 2 at 10). The
        # rounds whose merge step (send + tau) is by then: fragment 0's 0 and 1 (sent at 4 and 8), fragment
        # 1's 0 (in flight) and 1 (sent at 6)
        start = 9
        updates = {(0, 0): 0.25, (0, 1): 0.5, (1, 0): 1.0, (1, 1): 2.0}
        for (f, r), v in updates.items():
            transport.deliver(f, r, torch.full_like(mirrors[f], v))
            mirrors[f] += v
        transport.skip = (start, [2, 2])  # the masters fetched hold rounds 0 and 1 of each fragment
        train_step(net)  # trained from parameters the run has left behind: dropped
        engine.step()
        assert engine.skips == 1 and engine.skipped_steps == start - 2
        assert engine.step_count == start + 1 and engine.merges == len(updates)
        for f in range(P):
            assert torch.equal(engine.mirrors[f], mirrors[f])
        # fragment 0 sends next at step 12: its parameters are the run's, untouched since
        assert torch.equal(params(engine, 0), engine.mirrors[0])
        # fragment 1 sent round 2 at step 10, from the run's parameters: nothing of the dropped steps in it,
        # and the weight of no tokens (it counts only what was trained since the skip)
        engine.quiesce()
        assert engine.in_flight == {1: 2} and set(transport.pushes) == {(1, 0), (1, 2)}
        assert torch.equal(decode(transport.pushes[(1, 2)]), torch.zeros_like(mirrors[1]))
        # and nothing more happens at the next step, which merges round 2 (the transport said so once)
        transport.deliver(1, 2, torch.zeros_like(mirrors[1]))
        train_step(net)
        engine.step()
        assert engine.skips == 1 and engine.step_count == start + 2
    finally:
        engine.close()


def test_less_than_a_round_behind_or_past_its_last_step_it_goes_on_where_it_is():
    engine, transport, net = make("fixed", tau=1, total=12)
    try:
        train_step(net)
        transport.skip = (3, [0, 0])  # less than a round (H = 4) ahead: the rounds' grace takes that in
        engine.step()
        assert engine.skips == 0 and engine.step_count == 1
        transport.skip = (12, [0, 0])  # the run is past this worker's last step: it goes on where it is
        engine.step()
        assert engine.skips == 0 and engine.step_count == 2
    finally:
        engine.close()


CFG = SyncConfig(sync_every=4, num_fragments=2, fragment_sync_delay=1)


def _link(shard: int, covered: list[int] | None, rounds: list[int], fetches: int = 1) -> SimpleNamespace:
    view = RoundsView(rounds, [False] * len(rounds), [False] * len(rounds))
    fetched = None if covered is None else MastersFetched(covered, view)
    return SimpleNamespace(
        shard=shard, num_shards=2, fetches=fetches if fetched else 0, fetched=fetched, config=CFG
    )


def test_the_transport_skips_only_after_a_fetch_that_covers_the_rounds_the_worker_pushes_next():
    a, b = _link(0, [3, 2], [3, 2]), _link(1, None, [3, 2])
    transport = GrpcTransport([b, a])
    # the next rounds it pushes are open still: no skip, and the fetch is not looked at twice
    assert transport.skip_to(lambda: [3, 2]) is None
    a.fetched = MastersFetched([3, 2], RoundsView([3, 2], [False, False], [False, False]))
    assert transport.skip_to(lambda: [0, 0]) is None  # no new fetch since
    # a new fetch covers round 1 of fragment 1, which this worker would push next: go on as a joiner
    a.fetches += 1
    want = joining_step([([3, 2], [False, False], [False, False])], CFG)
    assert want > 0
    assert transport.skip_to(lambda: [3, 1]) == (want, [3, 2])
    # both shards fetched: the one behind counts (a round that one of them still needs is pushed)
    b.fetched, b.fetches = MastersFetched([2, 2], RoundsView([2, 2], [True, False], [False, False])), 1
    a.fetches += 1
    want = joining_step([([2, 2], [True, False], [False, False])], CFG)
    assert transport.skip_to(lambda: [0, 0]) == (want, [2, 2])
    # later only shard 0 fetches again, the run far ahead: shard 1's older fetch does not hold the start back
    a.fetched = MastersFetched([9, 8], RoundsView([9, 8], [False, False], [False, False]))
    a.fetches += 1
    want = joining_step([([9, 8], [False, False], [False, False])], CFG)
    assert transport.skip_to(lambda: [2, 2]) == (want, [9, 8])
