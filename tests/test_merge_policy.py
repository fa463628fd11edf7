"""The merge policies of the sync engine, with a transport whose updates arrive when the test says.

"fixed" merges a round exactly tau steps after its send and waits there for the update; "adaptive" (the
default) merges it then if the update is in, else after the first later step by which it is, and waits only
at the fragment's next send (the schedule's `merge_deadline`). Either way the mirror gets the same update
(it stays equal to the masters); only the step of the lerp differs. The engine and its transport:
tests/support/held_engine.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from streamdiloco.common.codecs import decode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.schedule import Event, merge_deadline, send_step
from streamdiloco.sim.simulator import InProcessCluster, InProcessTransport
from streamdiloco.worker.engine import StopRequested, SyncEngine, Transport
from tests.support.held_engine import H, HeldTransport, Net, P, make, params, train_step


def timed_step(engine: SyncEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def deliver_later(transport: HeldTransport, fragment: int, round: int, values, delay: float = 1.0):
    timer = threading.Timer(delay, transport.deliver, (fragment, round, values))
    timer.start()
    return timer


def test_adaptive_goes_on_training_and_merges_after_the_first_step_by_which_the_update_is_in():
    engine, transport, net = make("adaptive")
    try:
        f = 1  # sends round 0 at step 2
        for _ in range(2):
            train_step(net)
            engine.step()
        assert send_step(f, 0, engine.cfg) == 2 and engine.in_flight == {f: 0}
        train_step(net)
        engine.step()  # step 3 = t + tau: the update is not in, and it does not wait
        assert engine.deferred == [(f, 0)] and engine.merges == 0 and engine.blocked_seconds == 0
        update = torch.full_like(engine.mirrors[f], 0.5)
        mirror_before = engine.mirrors[f].clone()
        transport.deliver(f, 0, update)
        engine.quiesce()  # the sync thread has added it to the mirror
        assert torch.equal(engine.mirrors[f], mirror_before + update)
        local_before = params(engine, f)
        train_step(net)
        engine.step()  # step 4: merged here, one step late, without waiting
        assert engine.merges == 1 and engine.waits == 0 and engine.late_merges == 1
        assert engine.merge_delay_steps == 2 and engine.deferred == [] and f not in engine.in_flight
        want = 0.5 * (local_before + 0.01) + 0.5 * engine.mirrors[f]
        torch.testing.assert_close(params(engine, f), want)
    finally:
        engine.close()


def test_the_rebase_rule_mixes_against_the_send_and_keeps_the_steps_taken_since():
    engine, transport, net = make("adaptive", rule="rebase")
    try:
        f = 1  # sends round 0 at step 2
        for _ in range(2):
            train_step(net)
            engine.step()
        at_send = params(engine, f)
        for _ in range(2):  # steps 3 and 4: put off, then still not in
            train_step(net)
            engine.step()
        assert engine.deferred == [(f, 0)] and engine.merges == 0
        transport.deliver(f, 0, torch.full_like(engine.mirrors[f], 0.5))
        engine.quiesce()
        train_step(net)
        engine.step()  # step 5: merged three steps after the send
        assert engine.merges == 1 and engine.merge_delay_steps == 3
        # three local steps of +0.01 since the send are kept whole; the mix is taken against the send
        want = at_send + 0.03 + 0.5 * (engine.mirrors[f] - at_send)
        torch.testing.assert_close(params(engine, f), want)
        # the paper's mix would have halved them: the two rules differ by exactly that
        mix = 0.5 * (at_send + 0.03) + 0.5 * engine.mirrors[f]
        torch.testing.assert_close(params(engine, f) - mix, torch.full_like(mix, 0.015))
    finally:
        engine.close()


def test_adaptive_waits_at_the_fragments_next_send_when_the_update_is_still_missing():
    engine, transport, net = make("adaptive")
    try:
        f = 1
        deadline = merge_deadline(f, 0, engine.cfg)
        assert deadline == send_step(f, 1, engine.cfg) == 6
        for _ in range(deadline - 1):  # steps 1..5: sent at 2, put off at 3, 4, 5 (fragment 0's round 0
            train_step(net)  # sent at 4 and put off at 5 too)
            engine.step()
            assert engine.blocked_seconds == 0
        assert (f, 0) in engine.deferred
        transport.deliver(0, 0, torch.zeros_like(engine.mirrors[0]))
        timer = deliver_later(transport, f, 0, torch.full_like(engine.mirrors[f], 0.25))
        train_step(net)
        waited = timed_step(engine)  # step 6: must merge round 0 before sending round 1
        timer.join()
        assert waited > 0 and engine.waits == 1 and engine.blocked_seconds > 0
        assert engine.merges == 2 and engine.in_flight == {f: 1} and engine.deferred == []
        engine.quiesce()
        assert torch.equal(
            engine.mirrors[f], flatten(fragment_params(Net(), engine.layout.fragments[f])) + 0.25
        )
        # round 1's outer gradient is taken against the mirror with round 0 in it, after the merge
        torch.testing.assert_close(decode(transport.pushes[(f, 1)]), engine.mirrors[f] - params(engine, f))
    finally:
        engine.close()


def test_fixed_waits_at_exactly_tau_steps():
    engine, transport, net = make("fixed")
    try:
        for _ in range(2):
            train_step(net)
            engine.step()
        timer = deliver_later(transport, 1, 0, torch.ones_like(engine.mirrors[1]))
        train_step(net)
        waited = timed_step(engine)  # step 3 = t + tau
        timer.join()
        assert waited > 0 and engine.merges == 1 and engine.waits == 1 and engine.late_merges == 0
        assert engine.merge_delay_steps == 1 and engine.deferred == []
    finally:
        engine.close()


def test_tau_zero_always_waits_whatever_the_policy():
    engine, transport, net = make("adaptive", tau=0)
    try:
        train_step(net)
        engine.step()
        timer = deliver_later(transport, 1, 0, torch.ones_like(engine.mirrors[1]))
        train_step(net)
        waited = timed_step(engine)  # step 2: sends and merges in the same step
        timer.join()
        assert waited > 0 and engine.merges == 1 and engine.waits == 1 and engine.deferred == []
    finally:
        engine.close()


def test_the_last_step_merges_everything_put_off_before_the_final_sync():
    engine, transport, net = make("adaptive", total=5)
    try:
        for _ in range(4):  # fragment 1's round 0 (sent at step 2) put off at steps 3 and 4
            train_step(net)
            engine.step()
            assert engine.blocked_seconds == 0
        assert engine.deferred == [(1, 0)] and engine.in_flight == {1: 0, 0: 0}

        def arrive() -> None:  # the two rounds in flight, and those of the final sync
            for f, r in [(1, 0), (0, 0), (0, 1), (1, 1)]:
                transport.deliver(f, r, torch.zeros_like(engine.mirrors[f]))

        timer = threading.Timer(1.0, arrive)
        timer.start()
        train_step(net)
        waited = timed_step(engine)  # step 5, the last: both merged (waiting), then the final sync
        timer.join()
        assert waited > 0 and engine.waits >= 1 and engine.merges == 4
        assert engine.in_flight == {} and engine.deferred == []
        assert sorted(transport.pushes) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    finally:
        engine.close()


def test_the_final_sync_pushes_the_fragments_not_in_flight_before_waiting_for_the_one_that_is():
    """Last step 7: fragment 1's round 1 (sent at 6) is still on its way; fragment 0's final push must not
    wait behind it. Here that update comes only once fragment 0's final push is out (as on a slow link
    where the wait is long, the final pushes go while it lasts); if the engine waited first, it would
    come after 60 s only, and the order check below would fail."""
    engine, transport, net = make("adaptive", total=7)
    order: list[str] = []
    backstop = threading.Timer(60.0, lambda: transport.deliver(1, 1, torch.zeros_like(engine.mirrors[1])))
    held_push = transport.push

    def push(fragment, round, slices, weight, loss) -> None:
        held_push(fragment, round, slices, weight, loss)
        order.append(f"push {fragment}.{round}")
        if (fragment, round) != (1, 1):
            transport.deliver(fragment, round, torch.zeros_like(engine.mirrors[fragment]))
        if (fragment, round) == (0, 1):
            order.append("update 1.1")
            transport.deliver(1, 1, torch.zeros_like(engine.mirrors[1]))

    transport.push = push
    try:
        backstop.start()
        for _ in range(7):
            train_step(net)
            engine.step()
        assert order.index("push 0.1") < order.index("update 1.1") < order.index("push 1.2")
        assert engine.in_flight == {} and engine.deferred == [] and engine.merges == 5
    finally:
        backstop.cancel()
        engine.close()


def test_put_off_merges_survive_a_checkpoint():
    engine, transport, net = make("adaptive")
    try:
        for _ in range(3):
            train_step(net)
            engine.step()
        assert engine.deferred == [(1, 0)]
        state = engine.state_dict()
    finally:
        engine.close()
    again, transport2, net2 = make("adaptive")
    try:
        again.load_state_dict(state)
        assert again.deferred == [(1, 0)] and again.in_flight == {1: 0}
        transport2.deliver(1, 0, torch.zeros_like(again.mirrors[1]))
        # the resumed engine asks its transport for the update at its next step; it is in at once and added to
        # the mirror on the sync thread, so the merge happens at that step or the one after
        for _ in range(2):
            train_step(net2)
            again.step()
            again.quiesce()
            if again.merges:
                break
        assert again.merges == 1 and (1, 0) not in again.deferred and 1 not in again.in_flight
        assert again.merge_delay_steps == again.step_count - 2  # counted from its send, before the checkpoint
    finally:
        again.close()


def test_a_resumed_worker_rebases_a_round_sent_before_its_checkpoint_as_it_would_have():
    engine, transport, net = make("adaptive", rule="rebase")
    try:
        for _ in range(2):
            train_step(net)
            engine.step()
        at_send = params(engine, 1)  # fragment 1 sent round 0 at step 2
        train_step(net)
        engine.step()  # step 3: put off
        state, weights = engine.state_dict(), {k: v.clone() for k, v in net.state_dict().items()}
    finally:
        engine.close()
    again, transport2, net2 = make("adaptive", rule="rebase")
    try:
        net2.load_state_dict(weights)
        again.load_state_dict(state)
        transport2.deliver(1, 0, torch.full_like(again.mirrors[1], 0.5))
        for _ in range(2):  # asked for at the next step, merged there or at the one after
            train_step(net2)
            again.step()
            again.quiesce()
            if again.merges:
                break
        steps_since = again.step_count - 2
        want = at_send + 0.01 * steps_since + 0.5 * (again.mirrors[1] - at_send)
        torch.testing.assert_close(params(again, 1), want)
    finally:
        again.close()


def test_a_stop_request_at_a_deadline_leaves_the_merge_for_the_checkpoint():
    engine, transport, net = make("adaptive")
    try:
        for _ in range(5):
            train_step(net)
            engine.step()
        transport.deliver(0, 0, torch.zeros_like(engine.mirrors[0]))
        threading.Timer(0.2, engine.request_stop).start()
        train_step(net)
        with pytest.raises(StopRequested):
            engine.step()  # step 6: waits for fragment 1's round 0, which never comes
        assert any(e.kind == "merge" and (e.fragment, e.round) == (1, 0) for e in engine.pending)
    finally:
        engine.close()


def test_an_unknown_policy_says_what_to_choose():
    with pytest.raises(ValueError, match="unknown merge_policy 'eager': choose adaptive or fixed"):
        SyncConfig(merge_policy="eager")
    with pytest.raises(ValueError, match="unknown merge_rule 'lerp': choose mix or rebase"):
        SyncConfig(merge_rule="lerp")


def test_every_transport_is_a_whole_transport_and_the_engine_closes_it():
    # the engine reads pace_seconds at every step (adaptive schedule) and calls close() at the end: every
    # transport has them (a transport with only push and update is not one)
    net = Net()
    layout = build_layout(net, P, "strided")
    initial = [flatten(fragment_params(net, f)) for f in layout.fragments]
    cluster = InProcessCluster(layout, SyncConfig(sync_every=H, num_fragments=P), initial, 2, ["a"], 0)
    assert isinstance(HeldTransport(), Transport) and isinstance(InProcessTransport(cluster, "a"), Transport)

    class PushOnly:
        num_shards = 1

        def push(self, fragment, round, slices, weight, loss) -> None: ...

        def update(self, fragment, round) -> Future:
            return Future()

    assert not isinstance(PushOnly(), Transport)
    engine, transport, _ = make("adaptive")
    engine.close()
    assert transport.closed


def test_lock_step_leaves_a_merge_whose_round_has_not_closed_to_finish_step():
    # tau = 0: fragment 1 sends round 0 at step 2 and merges it in the same step. Without a sync thread
    # (the simulator) nothing brings the update while the engine would wait: the first worker's step leaves
    # the merge in `pending`, and its finish_step() does it once the second worker has pushed
    cfg = SyncConfig(
        sync_every=H, num_fragments=P, fragment_sync_delay=0, uplink_codec="fp32", merge_policy="fixed"
    )
    nets = [Net(), Net()]
    layout = build_layout(nets[0], P, "strided")
    initial = [flatten(fragment_params(nets[0], f)) for f in layout.fragments]
    cluster = InProcessCluster(layout, cfg, initial, 1, ["a", "b"], 0)
    engines = [
        SyncEngine(n, layout, cfg, InProcessTransport(cluster, w), background=False)
        for n, w in zip(nets, "ab", strict=True)
    ]
    for _ in range(2):
        for net, engine in zip(nets, engines, strict=True):
            train_step(net)
            engine.step()
    first, second = engines
    assert first.pending == [Event("merge", 1, 0)] and first.merges == 0 and first.in_flight == {1: 0}
    assert second.pending == [] and second.merges == 1
    first.finish_step()
    assert first.pending == [] and first.merges == 1 and first.step_count == 2
    assert all(torch.equal(e.mirrors[1], cluster.master(1)) for e in engines)
    assert torch.equal(params(first, 1), params(second, 1))
