"""The uplink's error feedback on the worker (--uplink-feedback, issue 38): with decay d a push of fragment f
sends enc(delta + d * e_f) and keeps e_f = (delta + d * e_f) - decode(that), one fp32 buffer per fragment.

What a user relies on: what was sent plus the new residual is what went in (conservation, to fp32
rounding), for any codec of the registry; with it off the pushes are byte for byte today's; the residual is
in the worker's checkpoint and a resumed worker pushes as the one that stopped would have (an old
checkpoint without it still loads); the setting is checked at once, in one line, and a Join whose decay
differs from the shard's is refused naming it; unset, it is on for codecs under 4 bits only; the simulator
runs it, its mirrors still bit-identical to the masters.
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from streamdiloco.common import codecspec
from streamdiloco.common.codecs import decode, encode
from streamdiloco.common.codecspec import CODECS, Codec
from streamdiloco.common.config import AUTO_UPLINK_FEEDBACK, ModelSettings, RunSettings, SyncConfig
from streamdiloco.common.fingerprint import fingerprint_diff
from streamdiloco.common.fragments import Fragment, ParamEntry, build_layout, flatten, fragment_params
from streamdiloco.common.outer import outer_gradient
from streamdiloco.sim.config import SimConfig
from streamdiloco.sim.simulator import InProcessCluster, InProcessTransport, simulate
from streamdiloco.worker.checkpoint import save_checkpoint
from streamdiloco.worker.engine import SyncEngine
from streamdiloco.worker.fragment import FragmentSync, Placement
from streamdiloco.worker.model import build_gpt
from tests.support.nano_shard import CFG, fingerprint
from tests.support.procs import Cluster, http_json, wait_until

N = 1000  # values of the test fragment: two parameters of 600 and 400, two shard slices of 500
SPEC = Fragment(
    index=0,
    entries=(ParamEntry("a", (600,), 0, 600, "float32"), ParamEntry("b", (400,), 600, 400, "float32")),
    blocks=(),
)
LOSSY = ("e3m0", "int8", "sq2", "topk16_64")  # the uplink codecs the tests run (any codec would do)
# |sent + e_new - (delta + d * e_old)| per value, in units of the fp32 rounding of the values involved:
# v = delta + d * e_old is rounded once (fma-free: the product, then the sum), and e_new = v - q once more
ULPS = 4.0
EPS32 = 2.0**-24
FLAG_ERROR = "--uplink-feedback must be a decay in [0, 1] (0: off)"


def fragment(codec: str, decay: float | None, seed: int = 0) -> tuple[FragmentSync, list[torch.Tensor]]:
    """A FragmentSync of N values about 1 (the mirror), in 2 shard slices, with the uplink `codec`."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(600, generator=g), torch.randn(400, generator=g)]
    cfg = SyncConfig(sync_every=4, num_fragments=1, uplink_codec=codec, uplink_feedback=decay)
    return FragmentSync(SPEC, params, cfg, 2, Placement(torch.device("cpu"))), params


def train(params: list[torch.Tensor], seed: int) -> None:
    """Some local steps: the parameters move by about 1e-2."""
    g = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def push(f: FragmentSync, params: list[torch.Tensor], round: int, gen: torch.Generator) -> list:
    snapshot, _, _ = f.prepare_send(round, 4 * round + 4)
    return f.encode(snapshot, gen)


def sent(encs: list) -> torch.Tensor:
    return torch.cat([decode(e) for e in encs])


def check_conservation(codec: str, decay: float, rounds: int, lossy: bool) -> None:
    """Push `rounds` times: what was sent plus the new residual is the outer gradient plus the decayed old
    residual, within ULPS fp32 ulps of the magnitudes involved (`lossy`: something is left each time)."""
    f, params = fragment(codec, decay)
    gen = torch.Generator().manual_seed(7)
    old = torch.zeros(N, dtype=torch.float64)
    for r in range(rounds):
        train(params, r)
        delta = (f.mirror - torch.cat([p.flatten() for p in params])).double()
        q = sent(push(f, params, r, gen)).double()
        new = f.feedback.double()
        bound = ULPS * EPS32 * (delta.abs() + decay * old.abs() + q.abs())
        assert ((q + new) - (delta + decay * old)).abs().le(bound).all(), (codec, decay, r)
        if lossy:
            assert new.abs().max() > 0  # the codec is lossy: something is left for the next push
        old = new
        f.merge(r)  # nothing applied: the mirror stays, the parameters too (alpha mixes them with it)
        for p, m in zip(params, f.views(f.mirror), strict=True):
            p.copy_(m)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("decay", [0.9, 1.0, 0.5])
def test_what_was_sent_plus_the_new_residual_is_the_gradient_plus_the_decayed_old_one(codec, decay):
    check_conservation(codec, decay, rounds=4, lossy=True)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_conservation_holds_for_every_codec_of_the_registry(codec):
    """The feedback goes through the codecs' public encode and decode only: any codec, present or to come."""
    check_conservation(codec, 0.9, rounds=2, lossy=False)


@pytest.mark.parametrize("codec", LOSSY)
def test_with_full_feedback_the_pushes_add_up_to_the_gradients_but_the_last_residual(codec):
    """d = 1: the sum of what was sent is the sum of the outer gradients minus the one residual left,
    however many pushes; without feedback the codec's errors pile up instead."""
    errors = {}
    for decay in (0.0, 1.0):
        f, params = fragment(codec, decay, seed=3)
        gen = torch.Generator().manual_seed(7)
        total_delta = torch.zeros(N, dtype=torch.float64)
        total_sent = torch.zeros(N, dtype=torch.float64)
        for r in range(12):
            train(params, r)
            total_delta += (f.mirror - torch.cat([p.flatten() for p in params])).double()
            total_sent += sent(push(f, params, r, gen)).double()
            f.merge(r)
            for p, m in zip(params, f.views(f.mirror), strict=True):
                p.copy_(m)
        errors[decay] = (total_sent - total_delta).norm().item()
        if decay:
            assert torch.allclose(total_sent + f.feedback.double(), total_delta, atol=1e-6)
    assert errors[1.0] < errors[0.0] / 2, errors


@pytest.mark.parametrize("codec", ("e3m0", "int8"))  # unset is off at 4 bits and more
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_off_the_pushes_are_todays_byte_for_byte(codec, rounding):
    """--uplink-feedback 0, and unset with a codec of 4 bits or more: the bytes the code sent before it
    (the outer gradient encoded as it is), with no buffer kept."""
    for decay in (0.0, None):
        f, params = fragment(codec, decay)
        f.cfg = SyncConfig(**{**f.cfg.to_dict(), "uplink_rounding": rounding})
        mine, before = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for r in range(3):
            train(params, r)
            local = torch.cat([p.flatten() for p in params])
            delta = outer_gradient(f.mirror, local)
            want = [encode(delta[lo:hi], codec, 128, rounding, before) for lo, hi in f.ranges]
            got = push(f, params, r, mine)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
            f.merge(r)
        assert f.feedback is None
        assert "feedback" not in _engine_state_keys(f)


def _engine_state_keys(f: FragmentSync) -> set[str]:
    return {k for k, v in f.state_dict().items() if v is not None}


# --- the setting ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf")])
def test_a_decay_out_of_range_is_refused_in_one_line(bad):
    with pytest.raises(ValueError) as e:
        SyncConfig(uplink_feedback=bad)
    assert str(e.value) == f"{FLAG_ERROR}, got {bad}"


def test_a_decay_out_of_range_on_the_command_line_is_one_line():
    flags = ["worker", "--servers", "127.0.0.1:1", "--uplink-feedback", "2"]
    r = subprocess.run(
        [sys.executable, "-m", "streamdiloco", *flags], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"{FLAG_ERROR}, got 2.0")


def test_unset_it_is_on_for_codecs_under_four_bits_only(monkeypatch):
    for name, codec in CODECS.items():  # whatever the registry holds (sq2 once it is there)
        want = AUTO_UPLINK_FEEDBACK if codec.bits < 4 else 0.0
        assert SyncConfig(uplink_codec=name).uplink_decay == want, name
    monkeypatch.setitem(codecspec.CODECS, "two-bit", Codec("two-bit", 2, True))
    assert SyncConfig(uplink_codec="two-bit").uplink_decay == AUTO_UPLINK_FEEDBACK
    assert SyncConfig(uplink_codec="two-bit", uplink_feedback=0).uplink_decay == 0.0  # off when said so
    assert SyncConfig(uplink_codec="e3m0", uplink_feedback=0.5).uplink_decay == 0.5


def test_a_join_whose_decay_differs_from_the_shards_is_refused_naming_it(shard):
    """The standard nano shard runs without uplink feedback: a worker with it is refused at Join."""
    fp = fingerprint(SyncConfig(sync_every=6, num_fragments=3, uplink_feedback=0.9))
    with pytest.raises(grpc.RpcError) as e:
        shard.join("w0", fp=json.dumps(fp))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "uplink_feedback is 0.9 on the worker, 0.0 on the shard" in e.value.details()
    ours = fingerprint(SyncConfig(sync_every=6, num_fragments=3, uplink_feedback=0.95))
    theirs = fingerprint(SyncConfig(sync_every=6, num_fragments=3, uplink_feedback=0.9))
    assert "uplink_feedback is 0.95 on the worker, 0.9 on the server" in str(fingerprint_diff(ours, theirs))
    # off, said or unset, is the fingerprint of a run without it (runs from before keep theirs)
    assert fingerprint(SyncConfig(sync_every=6, num_fragments=3, uplink_feedback=0.0)) == fingerprint(CFG)


# --- the worker's checkpoint ------------------------------------------------------------------------------
def engines(decay: float) -> tuple[SyncEngine, SyncEngine]:
    """Two nano workers' engines of one in-process run (lock-step), uplink e3m0 with feedback `decay`."""
    cfg = SyncConfig(sync_every=6, num_fragments=3, uplink_feedback=decay, sync_schedule="fixed")
    torch.manual_seed(0)
    model = build_gpt("nano")
    layout = build_layout(model, 3)
    initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
    cluster = InProcessCluster(layout, cfg, initial, 1, ["a", "b"], 0)
    out = []
    for m, name in enumerate(("a", "b")):
        replica = copy.deepcopy(model)
        out.append(
            SyncEngine(replica, layout, cfg, InProcessTransport(cluster, name), 60, rank=m, background=False)
        )
    return out[0], out[1]


def run_steps(a: SyncEngine, b: SyncEngine, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for e in (a, b):
            with torch.no_grad():
                for p in e.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 1e-2)
            e.step(tokens=8)
        for _ in range(2):
            for e in (a, b):
                e.finish_step()


def test_a_resumed_worker_keeps_its_residual_and_pushes_as_it_would_have(tmp_path):
    a, b = engines(0.9)
    run_steps(a, b, 7, seed=1)  # every fragment has pushed once
    assert all(f.feedback is not None and f.feedback.abs().max() > 0 for f in a.fragments)
    path = tmp_path / "worker.pt"
    save_checkpoint(path, {"engine": a.state_dict()})  # torch.save, atomically: the worker's own
    loaded = torch.load(path, map_location="cpu", weights_only=True)  # as worker/checkpoint.py reads it
    fresh, _ = engines(0.9)
    fresh.load_state_dict(loaded["engine"])
    for mine, theirs in zip(fresh.fragments, a.fragments, strict=True):
        assert mine.feedback is not None and theirs.feedback is not None
        assert torch.equal(mine.feedback, theirs.feedback)
    # the next push of each fragment from the same parameters: the same bytes as the worker that stopped
    for frag, other in zip(fresh.fragments, a.fragments, strict=True):
        for p, q in zip(frag.params, other.params, strict=True):
            p.copy_(q)
        g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        got = frag.encode(frag.prepare_send(9, 9)[0], g1)
        want = other.encode(other.prepare_send(9, 9)[0], g2)
        assert all(torch.equal(x.payload, y.payload) for x, y in zip(got, want, strict=True))


def test_a_checkpoint_from_before_the_feedback_loads_with_an_empty_residual(tmp_path):
    a, b = engines(0.9)
    run_steps(a, b, 7, seed=1)
    state = a.state_dict()
    assert set(state["feedback"]) == {0, 1, 2}
    del state["feedback"]  # as a checkpoint written before issue 38 has it
    fresh, partner = engines(0.9)
    run_steps(fresh, partner, 7, seed=2)  # a residual of its own, which the load must clear
    fresh.load_state_dict(state)
    assert all(f.feedback is None or not f.feedback.any() for f in fresh.fragments)


def test_a_checkpoint_whose_residual_does_not_fit_is_refused():
    a, b = engines(0.9)
    run_steps(a, b, 7, seed=1)
    state = a.state_dict()
    state["feedback"][1] = state["feedback"][1][:-1]
    fresh, _ = engines(0.9)
    with pytest.raises(ValueError, match="uplink error feedback of fragment 1 does not fit this model"):
        fresh.load_state_dict(state)


# --- the simulator -----------------------------------------------------------------------------------
def test_the_simulator_runs_the_feedback_with_mirrors_bit_identical_to_the_masters():
    def sim(decay: float) -> dict:
        cfg = SimConfig(
            model=ModelSettings(model="nano"),
            run=RunSettings(steps=12, batch_size=2, eval_batches=1),
            workers=2,
            eval_every=10_000,
            sync=SyncConfig(sync_every=6, num_fragments=3, uplink_feedback=decay, sync_schedule="fixed"),
        )
        return simulate(cfg, log=None)

    on, off = sim(0.9), sim(0.0)
    assert on["mirrors_match_masters"] and off["mirrors_match_masters"]
    assert on["bytes_sent_per_worker"] == off["bytes_sent_per_worker"]  # the same codec: the same bytes
    assert any(not torch.equal(x, y) for x, y in zip(on["global_params"], off["global_params"], strict=True))


# --- a real worker process, stopped and resumed ------------------------------------------------------
NANO = [
    *("--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--uplink-feedback", "0.9"),
    *("--merge-policy", "fixed", "--sync-schedule", "fixed"),
]


def _one_worker_run(tmp: Path, stop: bool) -> tuple[list[torch.Tensor], dict]:
    """A shard and one worker with the uplink's feedback; with `stop`, the worker is stopped (SIGTERM) after
    its first checkpoint and started again with --resume. Returns its global parameters and what the stop
    left (its checkpoint's residuals, its summary)."""
    work = [*NANO, "--steps", "24", "--log-every", "6", "--checkpoint-every", "6", "--step-delay", "0.2"]
    work += ["--save-global", str(tmp / "global.pt")]
    info: dict = {}
    with Cluster(tmp) as c:
        target, http = c.shard("shard", *NANO, "--min-workers", "1", "--round-timeout", "300")
        c.worker("w", [target], *work)
        if stop:
            wait_until("the worker's first checkpoint", (tmp / "w.pt").exists, timeout=120)
            c.procs["w"].send_signal(signal.SIGTERM)
            assert c.procs["w"].wait(60) == 0, c.log("w")[-3000:]
            ck = torch.load(tmp / "w.pt", map_location="cpu", weights_only=True)
            info["feedback"], info["stopped_at"] = ck["engine"]["feedback"], ck["engine"]["step"]
            c.worker("w", [target], *work, "--resume")
        assert c.wait("w", timeout=240) == 0, c.log("w")[-4000:]
        info["summary"] = c.summary("w")
        masters = [[f["master_hash"]] for f in http_json(http)["fragments"]]
        assert info["summary"]["mirror_hashes"] == masters  # the mirrors are the masters, bit for bit
    return list(torch.load(tmp / "global.pt")), info


@pytest.mark.slow  # two runs of a shard and a worker process (about 30 s); the in-process save and load above
def test_a_worker_process_stopped_and_resumed_ends_as_if_uninterrupted(tmp_path):
    """Its residuals go into the checkpoint and come back: the run ends with the global parameters, bit for
    bit, of the run in which it never stopped (a residual lost at the resume would change every push after
    it)."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "stop").mkdir()
    want, _ = _one_worker_run(tmp_path / "ref", stop=False)
    got, info = _one_worker_run(tmp_path / "stop", stop=True)
    assert 6 <= info["stopped_at"] < 24 and info["summary"]["resumed"]
    assert info["feedback"] and all(e.abs().max() > 0 for e in info["feedback"].values())
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
