"""Sites of unequal speed (issue 16, part 2): sync_schedule "adaptive" gives a faster worker more inner
steps per schedule step (common/pace.py), so that it does not wait for a slower one; the shards validate
the step times workers report and, where told to trust them (--trust-speed, `launch`), stretch their weight
caps; the simulator measures the quality."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import ModelSettings, RunSettings, SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.pace import TickClock, pace_seconds, steps_per_tick
from streamdiloco.common.progress import check_progress
from streamdiloco.export import fetch_masters
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.sim.simulator import SimConfig, simulate
from streamdiloco.worker.checkpoint import CHECKPOINT_FORMAT, checkpoint_key, load_checkpoint
from streamdiloco.worker.engine import Pacer
from streamdiloco.worker.model import build_gpt
from streamdiloco.worker.run import WorkerConfig
from tests.support.inthread import InThreadShard, push_messages
from tests.support.procs import Cluster
from tests.support.shards import shard_of

ADAPTIVE = SyncConfig(sync_every=6, num_fragments=3, sync_schedule="adaptive")


# --- the pace: pure --------------------------------------------------------------------------------------


def test_steps_per_tick_is_the_speed_over_the_slowest_within_bounds():
    assert pace_seconds([0.2, None, 0.4, 0.1]) == 0.4
    assert pace_seconds([None, float("nan"), 0.0, -1.0, 1e9]) == 0.0  # nothing a worker can have
    assert steps_per_tick(0.4, 0.2, ADAPTIVE) == 2.0
    assert steps_per_tick(0.4, 0.4, ADAPTIVE) == 1.0  # the slowest sets the pace
    assert steps_per_tick(0.4, 0.39, ADAPTIVE) == 1.0  # within PACE_TOLERANCE: one step, not 1.03
    assert steps_per_tick(0.4, 0.01, ADAPTIVE) == ADAPTIVE.max_steps_per_tick  # a liar's pace is bounded
    for pace, own in ((0.0, 0.2), (0.4, None), (0.4, 0.0), (math.inf, 0.1)):
        assert steps_per_tick(pace, own, ADAPTIVE) == 1.0  # not known yet: as the fixed schedule
    fixed = SyncConfig(sync_every=6, num_fragments=3, sync_schedule="fixed")
    assert steps_per_tick(0.4, 0.1, fixed) == 1.0


def test_the_tick_clock_counts_fractional_steps_per_tick():
    clock = TickClock()
    assert [clock.inner_step(1.0) for _ in range(3)] == [True] * 3
    assert [clock.inner_step(2.0) for _ in range(4)] == [False, True, False, True]
    ticks = sum(clock.inner_step(1.5) for _ in range(300))
    assert ticks == 200 and clock.credit == 0.0  # 1.5 steps a tick: no drift over many steps
    assert clock.inner_step(0.5) and clock.credit == 0.0  # below 1 is 1: at most one tick an inner step


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"sync_schedule": "budget"}, "unknown sync_schedule 'budget': choose fixed or adaptive"),
        ({"max_steps_per_tick": 0.5}, r"max_steps_per_tick must be in \[1, 64\]"),
        ({"max_steps_per_tick": float("nan")}, "max_steps_per_tick must be"),
    ],
)
def test_bad_settings_are_refused_with_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        SyncConfig(sync_every=6, num_fragments=3, **kw)


# --- the shard: what it takes from a worker ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), 3601.0])
def test_a_push_reporting_a_step_time_no_worker_can_have_is_refused(bad):
    assert check_progress(pb.PushHeader(weight=1.0, step_seconds=0.25)) is None
    assert check_progress(pb.PushHeader(weight=1.0)) is None  # 0: not measured yet
    problem = check_progress(pb.PushHeader(weight=1.0, step_seconds=bad))
    assert problem is not None and "step time must be 0 (not measured) or in (0, 3600] seconds" in problem


@pytest.mark.parametrize(
    "schedule, trust_speed, fast_share",
    [("fixed", True, 1 / 2), ("adaptive", True, 2 / 3), ("adaptive", False, 1 / 2)],
)
def test_a_faster_workers_tokens_count_in_full_only_with_the_adaptive_schedule_and_trust(
    schedule, trust_speed, fast_share
):
    # two honest workers, one with twice the tokens: the fixed schedule's cap (1 x the median: of two, the
    # lower) cuts the larger weight, the adaptive one's stretches by the fast push's own k (it reports half
    # the step time) and keeps the token weighting, where the shard trusts reported speeds (--trust-speed,
    # `launch`'s runs); without, a reported speed is a worker's word and stretches nothing
    cfg = SyncConfig(
        sync_every=6, num_fragments=3, sync_schedule=schedule, uplink_codec="fp32", downlink_codec="fp32",
        outer_momentum=0.0,
    )  # fmt: skip
    model = build_gpt("nano")
    layout = build_layout(model, cfg.num_fragments, cfg.fragment_pattern)
    initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
    st = ShardState(
        0, 1, layout, cfg, initial, 0, robust=RobustConfig(clip_norm=0.0, trust_speed=trust_speed)
    )
    n = layout.fragments[0].numel
    zeros, ones = (encode(x, "fp32", cfg.codec_block_size) for x in (torch.zeros(n), torch.ones(n)))
    st.push("slow", 0, 0, zeros, 1000.0, None, step_seconds=0.2)
    st.push("fast", 0, 0, ones, 2000.0, None, step_seconds=0.1)
    closed = st.close_round(0)
    assert closed.capped == (() if fast_share > 1 / 2 else ("fast",))
    # outer lr 1, no momentum: the master moves by minus the weighted mean of 0 and 1, the fast one's share
    moved = initial[0] - st.master(0)
    assert torch.allclose(moved, torch.full_like(moved, fast_share), rtol=1e-6), (moved[:3], fast_share)


def test_each_accepted_push_is_answered_with_the_slowest_members_step_time(tmp_path):
    cfg = SyncConfig(sync_every=6, num_fragments=3, sync_schedule="adaptive")
    model = build_gpt("nano")
    fp = json.dumps(model_fingerprint(build_layout(model, cfg.num_fragments), cfg))
    service = shard_of(cfg, "nano", shard=0, num_shards=1, min_workers=2)
    shard = InThreadShard(service, tmp_path, fp)
    try:
        a, b = shard.worker("a"), shard.worker("b")

        # one push per fragment: no round closes (min_workers 2), so the answers are the only messages
        def enc(f: int):
            lo, hi = service.state.ranges[f]
            return encode(torch.zeros(hi - lo), "e3m0", cfg.codec_block_size)

        a.push(push_messages(enc(0), 0, 0, step_seconds=0.1))
        first = a.session.result()
        assert first.accepted and first.pace_seconds == pytest.approx(0.1)  # only a has said its speed
        b.push(push_messages(enc(1), 1, 0, step_seconds=0.3))
        assert b.session.result().pace_seconds == pytest.approx(0.3)  # b is the slowest: it sets the pace
        a.push(push_messages(enc(2), 2, 0, step_seconds=0.1))
        assert a.session.result().pace_seconds == pytest.approx(0.3)
        status = shard.status()
        assert {m["name"]: m["step_seconds"] for m in status["members"]} == {"a": 0.1, "b": 0.3}
        assert status["pace_seconds"] == pytest.approx(0.3)
    finally:
        shard.shutdown()


# --- the simulator: quality at equal wall time --------------------------------------------------------------


def test_simulated_adaptive_steps_are_no_worse_at_equal_wall_time_and_keep_the_fast_site_busy():
    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: one thread is fastest, and stays fast on a busy machine
    try:
        for schedule in ("fixed", "adaptive"):
            cfg = SimConfig(
                workers=2,
                run=RunSettings(steps=12),
                model=ModelSettings(model="nano"),
                eval_every=12,
                step_seconds=(0.5, 1.0),  # worker 0 twice as fast (emulated)
                sync=SyncConfig(sync_every=6, num_fragments=3, sync_schedule=schedule),
                robust=RobustConfig(trust_speed=True),  # the shards believe the sites' speeds (`launch`)
            )
            results[schedule] = simulate(cfg, log=None)
    finally:
        torch.set_num_threads(threads)
    fixed, adaptive = results["fixed"], results["adaptive"]
    # equal wall time: every schedule step lasts the slow site's step in both
    assert fixed["curve"][-1]["wall_seconds"] == adaptive["curve"][-1]["wall_seconds"] == 12.0
    assert fixed["compute_utilization"] == [0.5, 1.0] and adaptive["compute_utilization"] == [1.0, 1.0]
    assert adaptive["inner_steps"] == [24, 12] and adaptive["tokens"] == 1.5 * fixed["tokens"]
    assert adaptive["eval_loss"] <= fixed["eval_loss"]
    assert adaptive["mirrors_match_masters"] and adaptive["weights_capped"] == 0


def test_with_equal_speeds_the_default_adaptive_schedule_gives_the_fixed_schedules_numbers_bit_for_bit():
    """adaptive is the default because it costs equal sites nothing: each of them sets the pace, does one
    inner step per schedule step, and the run ends on the fixed schedule's parameters to the last bit."""
    assert SyncConfig().sync_schedule == "adaptive"
    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for schedule in ("fixed", "adaptive"):
            cfg = SimConfig(
                workers=3,
                run=RunSettings(steps=18),
                model=ModelSettings(model="nano"),
                eval_every=18,
                step_seconds=(0.5, 0.5, 0.5),
                sync=SyncConfig(sync_every=6, num_fragments=3, sync_schedule=schedule),
            )
            results[schedule] = simulate(cfg, log=None)
    finally:
        torch.set_num_threads(threads)
    fixed, adaptive = results["fixed"], results["adaptive"]
    assert fixed["inner_steps"] == adaptive["inner_steps"] == [18, 18, 18]
    for key in ("tokens", "eval_loss", "compute_utilization", "pushes_clipped", "weights_capped"):
        assert fixed[key] == adaptive[key], key
    for a, b in zip(fixed["global_params"], adaptive["global_params"], strict=True):
        assert torch.equal(a, b)


def test_the_member_that_sets_the_pace_does_one_inner_step_per_schedule_step():
    """A lone worker (or the slowest) hears its own reported step time back as the pace; when its steps get
    quicker than at that report (a slow start), it must not do more inner steps than the schedule's."""
    lone = Pacer()
    assert [lone.completes(0.0, ADAPTIVE, seconds=1.0) for _ in range(4)] == [True] * 4  # pace not known
    assert lone.reported() == 1.0  # what its push told the shards: they answer it as the pace
    ticks = [lone.completes(1.0, ADAPTIVE, seconds=0.2) for _ in range(30)]
    assert lone.step_seconds == 0.2 and all(ticks) and lone.per_tick == 1.0
    assert lone.reported() == 0.2 and lone.completes(0.2, ADAPTIVE, seconds=0.2)  # the next push's answer
    fast = Pacer()  # a member whose own report is not the pace goes as much faster as it is
    fast.completes(0.0, ADAPTIVE, seconds=0.5)
    assert fast.reported() == 0.5
    assert [fast.completes(1.0, ADAPTIVE, seconds=0.5) for _ in range(4)] == [False, True, False, True]
    assert fast.per_tick == 2.0


def test_simulator_refuses_step_times_that_do_not_fit():
    with pytest.raises(ValueError, match="--step-seconds gives 1 step times for 2 workers"):
        SimConfig(workers=2, step_seconds=(1.0,))
    with pytest.raises(ValueError, match=r"--step-seconds must be in \(0, 3600\]"):
        SimConfig(workers=2, step_seconds=(1.0, 0.0))


# --- real processes: two sites, one twice as slow -----------------------------------------------------------

NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]


# in `make test-slow`; covered by test_simulated_adaptive_steps_are_no_worse_at_equal_wall_time_and_keep_...
# (the schedule, simulated) and test_each_accepted_push_is_answered_with_the_slowest_members_step_time
@pytest.mark.slow
def test_two_sites_one_twice_as_slow_the_fast_one_keeps_computing(tmp_path):
    steps = 45  # emulated steps of 0.2 s and 0.4 s: long beside a loaded machine's scheduling jitter
    work = [*NANO, "--steps", str(steps), "--log-every", "15", "--checkpoint-every", "0", "--eval-every", "0"]
    with Cluster(tmp_path) as c:
        shard_flags = [*NANO, "--sync-schedule", "adaptive", "--min-workers", "2"]
        targets = [
            c.shard(f"shard{s}", *shard_flags, "--shard", str(s), "--num-shards", "2")[0] for s in range(2)
        ]
        # the schedule comes from the shards at Join: the workers do not say it
        c.worker(
            "fast",
            targets,
            *work,
            "--rank",
            "0",
            "--step-delay",
            "0.2",
            "--save-global",
            str(tmp_path / "f.pt"),
        )
        c.worker(
            "slow",
            targets,
            *work,
            "--rank",
            "1",
            "--step-delay",
            "0.4",
            "--save-global",
            str(tmp_path / "s.pt"),
        )
        for name in ("fast", "slow"):
            assert c.wait(name, timeout=240) == 0, c.log(name)[-3000:]
        fast, slow = c.summary("fast"), c.summary("slow")
        masters = fetch_masters(targets)
    for w in (fast, slow):
        assert w["steps"] == steps and w["late_refusals"] == 0
    # the fast site did about twice the inner steps in the same schedule steps, and barely waited
    assert fast["inner_steps"] >= 1.5 * slow["inner_steps"], (fast["inner_steps"], slow["inner_steps"])
    times = ("train_seconds", "compute_seconds", "blocked_seconds", "final_sync_seconds")
    assert fast["compute_utilization"] >= 0.9, {k: fast[k] for k in ("compute_utilization", *times)}
    assert fast["tokens"] > slow["tokens"]
    for path in ("f.pt", "s.pt"):  # every mirror equals the shards' masters, bit for bit
        mirror = torch.load(tmp_path / path)
        assert all(torch.equal(a, b) for a, b in zip(mirror, masters, strict=True))
    assert os.path.getsize(tmp_path / "f.pt") > 0


def test_a_worker_checkpoint_from_before_the_schedule_setting_still_resumes(tmp_path):
    cfg = WorkerConfig(
        servers=("127.0.0.1:1",),
        name="w",
        checkpoint=str(tmp_path / "w.pt"),
        resume=True,
        sync=SyncConfig(sync_schedule="fixed"),
    )
    key = checkpoint_key(cfg)
    key["sync"] = {k: v for k, v in key["sync"].items() if k not in ("sync_schedule", "max_steps_per_tick")}
    torch.save({"format": CHECKPOINT_FORMAT, "name": "w", "key": key}, tmp_path / "w.pt")
    # the fields it lacks had their defaults then: max_steps_per_tick's, and the fixed schedule (the default
    # until issue 27), so that it resumes as it was written, not under today's default
    assert load_checkpoint(cfg)["name"] == "w"
    adaptive = dataclasses.replace(cfg, sync=SyncConfig(sync_schedule="adaptive"))
    with pytest.raises(ValueError, match=r"was written with other settings \(sync\)"):
        load_checkpoint(adaptive)
    assert SyncConfig().sync_schedule == "adaptive"  # today's default: refused too
    with pytest.raises(ValueError, match=r"was written with other settings \(sync\)"):
        load_checkpoint(dataclasses.replace(cfg, sync=SyncConfig()))


def test_simulate_takes_step_times_on_the_command_line(capsys):
    from streamdiloco.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = "simulate --model nano --steps 6 --sync-every 6 --num-fragments 3 --eval-every 6".split()
        assert main([*argv, "--step-seconds", "0.5,1", "--sync-schedule", "adaptive"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "emulated wall time 6 s | compute utilization per worker 1.00 / 1.00 | inner steps [12, 6]" in out
    with pytest.raises(SystemExit):
        main([*argv, "--step-seconds", "fast,slow"])
    assert (
        "--step-seconds: give seconds separated by commas, like 0.5,1.0: got 'fast,slow'"
        in capsys.readouterr().err
    )


def test_a_fast_sites_larger_updates_are_not_clipped_as_outliers():
    """Its k inner steps per schedule step make its update about k times larger than the others': with
    --trust-speed the shards' norm clip (median-relative, default 2x) stretches by the push's own k squared
    (at most max_steps_per_tick), as the weight caps stretch by k. Before the stretch a site twice as fast
    had 9 of its pushes clipped here. (At k = 4, the most the default allows, 2 of its 12 pushes still exceed
    8x the median norm: per-token norms would be the full fix.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = SimConfig(
            workers=3,
            run=RunSettings(steps=24),
            model=ModelSettings(model="nano"),
            eval_every=24,
            step_seconds=(0.5, 1.0, 1.0),  # worker 0 twice as fast: 2 inner steps per schedule step
            sync=SyncConfig(sync_every=6, num_fragments=3, sync_schedule="adaptive"),
            robust=RobustConfig(trust_speed=True),  # the stretch is --trust-speed's (`launch`)
        )
        r = simulate(cfg, log=None)
    finally:
        torch.set_num_threads(threads)
    assert r["inner_steps"][0] == 2 * r["inner_steps"][1]
    assert r["pushes_clipped"] == 0 and r["weights_capped"] == 0


def test_worker_and_shard_must_agree_on_the_schedule_and_a_fixed_runs_fingerprint_is_unchanged():
    from streamdiloco.common.fingerprint import fingerprint_diff, model_fingerprint
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.common.modelspec import build_model

    layout = build_layout(build_model("nano", 0), SyncConfig().num_fragments)
    fixed = model_fingerprint(layout, SyncConfig(sync_schedule="fixed"))
    assert "sync_schedule" not in fixed and "max_steps_per_tick" not in fixed  # old checkpoints still resume
    adaptive = model_fingerprint(layout, SyncConfig(sync_schedule="adaptive"))
    assert fingerprint_diff(adaptive, fixed) == (
        "model fingerprint differs from the server's: sync_schedule is 'adaptive' on the worker, 'fixed' on "
        "the server"
    )
    wider = model_fingerprint(layout, SyncConfig(sync_schedule="adaptive", max_steps_per_tick=64))
    assert "max_steps_per_tick is 64.0 on the worker, 4.0 on the server" in fingerprint_diff(wider, adaptive)
    assert fingerprint_diff(adaptive, dict(adaptive)) is None
