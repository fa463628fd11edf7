"""--outer-variant (issue 38): nesterov, the paper's outer step and the default, or sparseloco, SparseLoCo's
plain averaged step theta -= lr * mean(pushes) with the workers' uplink error feedback as its momentum.

What a user relies on: with sparseloco a shard's close moves the master by exactly minus lr times the
round's mean (fp32, no momentum carried from one round to the next), the fused CPU step and the torch ops
alike; nesterov's step, fingerprint and checkpoints are what they were; the uplink's error feedback is on
at 0.95 unless --uplink-feedback says otherwise, on a worker that takes the variant from its shard too; an
outer momentum set with sparseloco is refused in one line; a Join whose variant differs from the shard's
is refused naming it; the simulator runs it, its mirrors bit-identical to the masters.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import torch

from streamdiloco.common.chunks import Assembly
from streamdiloco.common.codecs import encode
from streamdiloco.common.config import ModelSettings, RunSettings, SyncConfig
from streamdiloco.common.fingerprint import fingerprint_diff
from streamdiloco.common.outer import OuterOptimizer, outer_momentum
from streamdiloco.server.rounds.defenses import Defenses
from streamdiloco.server.rounds.fragment import FragmentSlice
from streamdiloco.server.rounds.jobs import CloseJob, Push
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.storage.checkpoint import FORMAT, read_meta
from streamdiloco.sim.config import SimConfig
from streamdiloco.sim.simulator import simulate
from tests.support.nano_shard import CFG, fingerprint, nano_state, slice_delta

SPARSE = SyncConfig(sync_every=6, num_fragments=3, outer_variant="sparseloco")
REFUSED = "--outer-variant sparseloco takes no outer momentum"


# --- the step ---------------------------------------------------------------------------------------------
def close(fr: FragmentSlice, pushes: list[tuple[list[float], float]], at: float) -> list[float]:
    """Push `pushes` (values, weight) into fr's open round, close it and return the new master."""
    for w, (values, weight) in enumerate(pushes):
        asm = Assembly(len(values), "fp32", 128)
        asm.add(0, 0, len(values), encode(torch.tensor(values), "fp32", 128), True)
        fr.open.add(Push(f"w{w}", weight, asm), 16)
    fr.open.settled = sum(weight for _, weight in pushes)
    fr.take_out()
    rnd = fr.next_round(opened_at=at)
    job = CloseJob(0, fr.outer, {}, rnd.closing("all", ("mean", 0.0, 1), {"weights": [], "norms": []}))
    job.run()
    fr.end_close(job)
    return fr.master.tolist()


@pytest.mark.parametrize("lr", [1.0, 0.5])
def test_a_sparseloco_close_moves_the_master_by_minus_lr_times_the_mean_and_carries_no_momentum(lr):
    """A fragment of eight values, shard 1's slice [4, 8) = [5, 6, 7, 8], fp32 both ways; pushes a (weight
    1) and b (weight 3) average to [2.5, 2, 1.5, 1]; values and means are dyadic, so fp32 is exact."""
    cfg = SyncConfig(
        sync_every=4, num_fragments=1, uplink_codec="fp32", downlink_codec="fp32", outer_lr=lr,
        outer_variant="sparseloco",
    )  # fmt: skip
    fr = FragmentSlice.start(
        0, (1, 2), torch.arange(1.0, 9.0), 8, cfg, 0, Defenses(RobustConfig(), cfg).recent()
    )
    pushes = [([1.0, 2.0, 3.0, 4.0], 1.0), ([3.0, 2.0, 1.0, 0.0], 3.0)]
    mean = [2.5, 2.0, 1.5, 1.0]
    first = close(fr, pushes, 1.0)
    assert first == [m - lr * g for m, g in zip([5.0, 6.0, 7.0, 8.0], mean, strict=True)]
    second = close(fr, pushes, 2.0)  # the same mean again: the same step, no momentum built up
    assert second == [m - lr * g for m, g in zip(first, mean, strict=True)]
    assert "momentum_buffer" not in fr.outer_state()["sgd"]["state"].get(0, {})


def test_sparseloco_on_the_nano_shard_is_plain_sgd_on_the_mean_bit_for_bit():
    """The shard's whole close (int8 pushes, the fused CPU step with e3m0 down) at lr 0.7 is the one of a
    nesterov run with momentum 0, over several rounds; SGD's master is theta - lr * mean exactly in fp32
    (tests/test_outer.py pins momentum 0 to torch.optim.SGD, bit for bit)."""
    runs = []
    for kw in ({"outer_variant": "sparseloco"}, {"outer_momentum": 0.0}):
        state, _ = nano_state(robust=RobustConfig.off(), uplink_codec="int8", outer_lr=0.7, **kw)
        masters = []
        for r in range(3):
            for w in range(2):
                delta = slice_delta(state, 1, w + 2 * r)
                state.push(f"w{w}", 1, r, encode(delta, "int8"), weight=100.0 * (w + 1))
            state.close_round(1)
            masters.append(state.master(1).clone())
        runs.append(masters)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_the_optimizer_steps_theta_minus_lr_times_the_mean_exactly():
    """OuterOptimizer with the sparseloco settings, fp32 down: theta_new = theta - lr * g with torch's fp32
    ops, each step on its own gradient alone."""
    momentum, nesterov = outer_momentum(SyncConfig(outer_variant="sparseloco"))
    assert (momentum, nesterov) == (0.0, False)
    torch.manual_seed(2)
    start = torch.randn(10_007)
    opt = OuterOptimizer(start, lr=0.7, momentum=momentum, nesterov=nesterov, downlink_codec="fp32")
    for _ in range(4):
        g = torch.randn(10_007) * 1e-2
        old = opt.master
        opt.step(g)
        new = torch.add(old, g, alpha=-0.7)
        assert torch.equal(opt.master, old + (new - old))  # theta_old + u, u exact in fp32
    assert "momentum_buffer" not in opt.state_dict()["sgd"]["state"].get(0, {})  # none, ever


def test_nesterov_is_the_default_and_unchanged():
    assert SyncConfig().outer_variant == "nesterov"
    assert outer_momentum(SyncConfig()) == (0.95, True)
    assert outer_momentum(SyncConfig(outer_momentum=0.9, outer_nesterov=False)) == (0.9, False)
    assert "outer_variant" not in fingerprint(CFG)  # runs from before keep their fingerprint
    state, _ = nano_state()
    outer = state.fragments[1].outer
    assert (outer.momentum, outer.nesterov) == (0.95, True)


# --- the setting ------------------------------------------------------------------------------------------
def test_sparseloco_turns_the_uplink_feedback_on_at_095_unless_said_otherwise():
    assert SPARSE.uplink_decay == 0.95
    assert SyncConfig(outer_variant="sparseloco", uplink_codec="fp32").uplink_decay == 0.95
    assert SyncConfig(outer_variant="sparseloco", uplink_feedback=0.9).uplink_decay == 0.9
    assert SyncConfig(outer_variant="sparseloco", uplink_feedback=0).uplink_decay == 0.0
    # a worker that did not set the variant takes the shard's, and its feedback with it
    worker = SyncConfig.adopted(SyncConfig(), SPARSE, frozenset())
    assert (worker.outer_variant, worker.uplink_decay) == ("sparseloco", 0.95)


@pytest.mark.parametrize("kw", [{"outer_momentum": 0.9}, {"outer_momentum": 0.0}, {"outer_nesterov": False}])
def test_an_outer_momentum_set_with_sparseloco_is_refused_in_one_line(kw):
    with pytest.raises(ValueError, match=REFUSED) as e:
        SyncConfig(outer_variant="sparseloco", **kw)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown outer_variant 'adam': choose nesterov or sparseloco"):
        SyncConfig(outer_variant="adam")


def test_on_the_command_line_too():
    flags = ["worker", "--servers", "127.0.0.1:1", "--outer-variant", "sparseloco", "--outer-momentum", "0.9"]
    r = subprocess.run(
        [sys.executable, "-m", "streamdiloco", *flags], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and REFUSED in lines[0], r.stderr[-2000:]


def test_a_join_whose_variant_differs_from_the_shards_is_refused_naming_it(shard):
    """The standard nano shard runs nesterov: a sparseloco worker is refused at Join, and the sentence names
    the variant (not the uplink feedback that comes with it)."""
    with pytest.raises(grpc.RpcError) as e:
        shard.join("w0", fp=json.dumps(fingerprint(SPARSE)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "outer_variant is 'sparseloco' on the worker, 'nesterov' on the shard" in e.value.details()
    said = fingerprint_diff(fingerprint(CFG), fingerprint(SPARSE))
    assert "outer_variant is 'nesterov' on the worker, 'sparseloco' on the server" in str(said)


def test_a_shard_checkpoint_from_before_the_setting_resumes_as_nesterov(tmp_path):
    config = SyncConfig().to_dict()
    del config["outer_variant"]
    meta = {"format": FORMAT, "shard": 0, "num_shards": 1, "config": config, "files": {}, "incoming": {}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert read_meta(tmp_path, 0, 1, SyncConfig())["config"] == config
    with pytest.raises(ValueError, match=r"other sync settings \(outer_variant\)"):
        read_meta(tmp_path, 0, 1, SyncConfig(outer_variant="sparseloco", uplink_feedback=None))


# --- the simulator ----------------------------------------------------------------------------------------
def test_the_simulator_runs_sparseloco_with_mirrors_bit_identical_to_the_masters():
    """One run (the step itself is pinned above): it trains through the shards' sparseloco step and the
    workers' feedback at 0.95, and the mirrors are the masters, bit for bit."""
    cfg = SimConfig(
        model=ModelSettings(model="nano"),
        run=RunSettings(steps=12, batch_size=2, eval_batches=1),
        workers=2,
        eval_every=10_000,
        sync=SyncConfig(sync_every=6, num_fragments=3, outer_variant="sparseloco", sync_schedule="fixed"),
    )
    out = simulate(cfg, log=None)
    assert out["mirrors_match_masters"]
    assert all(torch.isfinite(p).all() for p in out["global_params"])
