"""Robust aggregation on the shard (server/rounds/robust.py, and ShardState applying it): the rules in closed
form, ShardState without a network, and one attacker among 3 honest workers over a real gRPC channel, scored
by the eval loss of the nano GPT the shard's master makes."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from streamdiloco.common.codecs import CODECS, Encoded, decode, encode, sumsq
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params, unflatten_into
from streamdiloco.common.wire import from_chunk
from streamdiloco.server.rounds.robust import (
    RobustConfig,
    cap_weights,
    centered_clip,
    clip_scales,
    trim_count,
    trimmed_mean,
)
from streamdiloco.server.rounds.state import PushRejected, ShardState
from streamdiloco.worker.data import BatchStream, ByteDataset, eval_batches
from streamdiloco.worker.model import build_gpt
from streamdiloco.worker.train import (
    InnerConfig,
    evaluate,
    forward_backward,
    make_inner_optimizer,
    optimizer_step,
)
from tests.support.inthread import InThreadShard, push_messages
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(300)  # the nano run the attacks are scored on is slow on a loaded machine


# === the rules, in closed form ==========================================================================
def test_a_weight_is_cut_to_a_multiple_of_the_median():
    honest = [4096.0] * 3
    assert cap_weights(honest + [2.0**53], honest + [2.0**53], 2.0) == honest + [8192.0]
    assert cap_weights(honest + [6000.0], honest + [6000.0], 2.0) == honest + [6000.0]  # within 2x: kept
    assert cap_weights([10.0, 1e9], [], 2.0) == [10.0, 1e9]  # nothing to be relative to
    assert cap_weights([10.0, 1e9], [10.0, 1e9], 0.0) == [10.0, 1e9]  # off
    assert cap_weights([300.0, 400.0], [300.0, 400.0, 100.0, 100.0], 1.0) == [200.0, 200.0]


def test_a_norm_is_clipped_to_a_multiple_of_the_median():
    norms = [1.0, 1.2, 0.9, 100.0]
    scales, bound = clip_scales(norms, norms, 2.0)
    assert bound == pytest.approx(2.2) and scales[:3] == [1.0, 1.0, 1.0]
    assert scales[3] == pytest.approx(2.2 / 100.0)
    # two pushes and no history: of two values the median is the lower (their mean, 500.5, never clipped
    # either: one of two may be a liar's, and the mean is half its own)
    assert clip_scales([1.0, 1000.0], [1.0, 1000.0], 2.0)[0] == [1.0, 2e-3]
    # ... and the recent rounds' norms are what tells them apart
    assert clip_scales([1.0, 1000.0], [1.0, 1000.0, 1.0, 1.1, 0.9, 1.0], 2.0)[0][1] == pytest.approx(2e-3)
    assert clip_scales([5.0], [], 2.0) == ([1.0], math.inf)


def test_trimmed_mean_drops_the_extremes_of_each_coordinate():
    x = torch.tensor([[1.0, 5.0, -3.0], [2.0, 6.0, 100.0], [3.0, -50.0, 0.0], [1000.0, 7.0, 1.0]])

    def read(i, lo, hi, out):
        out.copy_(x[i, lo:hi])

    out = torch.empty(3)
    trimmed_mean(3, 4, read, 0.25, out, step=2)  # blocks of 2 values: the block edge changes nothing
    assert out.tolist() == [2.5, 5.5, 0.5]
    assert [trim_count(k, 0.25) for k in (1, 2, 3, 4, 8, 10)] == [0, 0, 0, 1, 2, 2]
    assert trim_count(3, 0.49) == 1 and trim_count(2, 0.49) == 0  # at least one value is left


def test_centered_clip_pulls_an_outlier_no_harder_than_a_typical_push():
    x = torch.tensor([[1.0], [1.0], [1.0], [101.0]])

    def read(i, lo, hi, out):
        out.copy_(x[i, lo:hi])

    v = torch.tensor([26.0])  # the mean
    dist = centered_clip(1, 4, read, [1.0] * 4, 1, v, step=1)
    # distances 25, 25, 25, 75; tau = 25: the outlier counts a third; v = 26/6 + 3/4 + 101/12
    assert dist == [25.0, 25.0, 25.0, 75.0] and v.item() == 13.5
    before = v.item()
    centered_clip(1, 4, read, [1.0] * 4, 3, v, step=1)
    assert 1.0 < v.item() < before  # on toward the honest pushes


@pytest.mark.parametrize("codec", list(CODECS))
def test_sumsq_is_the_squared_norm_of_the_decoded_values(codec):
    g = torch.Generator().manual_seed(3)
    for n in (1, 127, 128, 1001, 70_000):
        x = torch.randn(n, generator=g) * 1e-2
        enc = encode(x, codec, 128)
        want = float(decode(enc).to(torch.float64).square().sum())
        assert sumsq(enc) == pytest.approx(want, rel=1e-12), (codec, n)
    limit = Encoded("e3m0", 256, torch.full((128,), 0x77, dtype=torch.uint8), torch.full((2,), 9.9e29), 128)
    top = float(limit.scales[0])  # 9.9e29 in fp32
    assert sumsq(limit) == pytest.approx(256 * top**2, rel=1e-12)  # at the codec's limit: finite


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="unknown --aggregator 'median': choose one of mean, trimmed"):
        RobustConfig(aggregator="median")
    with pytest.raises(ValueError, match="--clip-norm must be 0 \\(off\\) or a finite multiple"):
        RobustConfig(clip_norm=0.5)
    with pytest.raises(ValueError, match="--max-weight must be 0 \\(unknown\\) or at least 1 token"):
        RobustConfig(max_weight=0.5)
    with pytest.raises(ValueError, match="--trim must be in \\[0, 0.5\\)"):
        RobustConfig(trim=0.5)


# === ShardState, no network =============================================================================
torch.manual_seed(0)
_MODEL = build_gpt("nano")
_LAYOUT = build_layout(_MODEL, 3)
_INITIAL = [flatten(fragment_params(_MODEL, f)) for f in _LAYOUT.fragments]
HONEST = ("h0", "h1", "h2")


def make_state(
    robust: RobustConfig | None = None, members=HONEST + ("evil",), min_workers=1, timeout=math.inf, **cfg_kw
) -> ShardState:
    # the fixed schedule's caps and clip unless a test says otherwise: under adaptive they stretch
    cfg = SyncConfig(sync_every=6, num_fragments=3, **{"sync_schedule": "fixed", **cfg_kw})
    st = ShardState(0, 1, _LAYOUT, cfg, _INITIAL, 0, min_workers, timeout, robust=robust)
    for m in members:
        st.add_member(m)
    return st


def delta(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-2


def honest_encs(st: ShardState, fragment: int = 0, round: int = 0) -> list[Encoded]:
    n = st.ranges[fragment][1] - st.ranges[fragment][0]
    return [encode(delta(n, 10 * round + i), st.cfg.uplink_codec, 128) for i in range(3)]


@pytest.mark.parametrize(
    "weight, loss, reason, words",
    [
        (5e-324, 3.0, "bad_weight", "at least 1 and at most 2^53, got 5e-324"),
        (0.5, 3.0, "bad_weight", "at least 1 and at most 2^53, got 0.5"),
        (100.0, -1e30, "bad_loss", "a cross-entropy in [0, 10000], got -1e+30"),
        (100.0, -0.5, "bad_loss", "got -0.5"),
        (100.0, 1.5e4, "bad_loss", "got 15000.0"),
        (100.0, math.nan, "bad_loss", "got nan"),
    ],
)
def test_weights_below_a_token_and_absurd_losses_are_refused(weight, loss, reason, words):
    st = make_state(members=("a", "b"), min_workers=2, timeout=10.0)
    enc = honest_encs(st)[0]
    with pytest.raises(PushRejected) as e:
        st.push("a", 0, 0, enc, weight, loss)
    assert e.value.reason == reason and words in str(e.value)
    assert st.contributors(0) == set() and not st.started(0) and st.pushes_accepted == 0
    st.push("b", 0, 0, enc, 1.0, 0.0)  # one token and a zero loss are fine
    # a refused push is no contribution: one of the 2 that --min-workers asks, so the round waits for the
    # other until its deadline; a never had a push accepted, so it cannot hold the round beyond that
    assert st.due(9.9) == []
    assert st.due(10.0) == [(0, "deadline")] and st.close_round(0, "deadline").contributors == ("b",)


def test_a_huge_weight_counts_as_the_median_exactly():
    robust, plain = make_state(RobustConfig(clip_norm=0.0)), make_state(RobustConfig.off())
    for st in (robust, plain):
        for name, enc in zip(HONEST, honest_encs(st)):
            st.push(name, 0, 0, enc, 4096.0, 3.0)
    evil = encode(-20 * _INITIAL[0], "e3m0", 128)  # the finding's push: drags the fragment to -20x
    robust.push("evil", 0, 0, evil, 2.0**53, 3.0)
    plain.push("evil", 0, 0, evil, 4096.0, 3.0)  # what the cap makes of it
    a, b = robust.close_round(0), plain.close_round(0)
    assert a.capped == ("evil",) and a.weight == b.weight == 4 * 4096
    assert robust.weights_capped == 1
    assert torch.equal(robust.master(0), plain.master(0))  # as if it had reported the cap, to the last bit


def test_max_weight_cuts_weights_as_they_arrive():
    st = make_state(RobustConfig(max_weight=5000.0), members=("a",))
    st.push("a", 0, 0, honest_encs(st)[0], 9000.0, 3.0)
    assert st.close_round(0).weight == 5000.0 and st.weights_capped == 1


def test_a_push_far_beyond_the_median_norm_is_scaled_down_to_twice_it():
    # fp32 both ways, lr 1, no momentum: the master moves by exactly minus the mean, to fp32 round-off
    st = make_state(uplink_codec="fp32", downlink_codec="fp32", outer_lr=1.0, outer_momentum=0.0)
    encs = honest_encs(st)
    evil = encode(100 * decode(encs[0]), "fp32")
    for name, enc in zip(HONEST + ("evil",), encs + [evil]):
        st.push(name, 0, 0, enc, 4096.0, 3.0)
    before = st.master(0).clone()
    closed = st.close_round(0)
    assert closed.clipped == ("evil",) and closed.capped == ()
    xs = [decode(e).to(torch.float64) for e in encs + [evil]]
    norms = [float(x.norm()) for x in xs]
    bound = 2 * statistics.median(norms)
    want = sum(x * min(1.0, bound / n) for x, n in zip(xs, norms)) / 4
    torch.testing.assert_close((before - st.master(0)).to(torch.float64), want, rtol=0, atol=1e-7)
    assert float(want.norm()) < 1.2 * float(sum(xs[:3]).norm() / 3) + bound / 4


def test_clipping_uses_the_recent_rounds_when_a_round_has_two_pushes():
    st = make_state(members=("a", "b"))
    n = st.ranges[0][1]
    for r in range(2):  # two ordinary rounds of history
        st.push("a", 0, r, encode(delta(n, r), "e3m0", 128), 100.0, 3.0)
        st.push("b", 0, r, encode(delta(n, r + 50), "e3m0", 128), 100.0, 3.0)
        assert st.close_round(0).clipped == ()
    st.push("a", 0, 2, encode(delta(n, 7), "e3m0", 128), 100.0, 3.0)
    st.push("b", 0, 2, encode(1000 * delta(n, 8), "e3m0", 128), 100.0, 3.0)
    assert st.close_round(0).clipped == ("b",)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_honest_pushes_that_grow_each_round_are_never_clipped_or_capped(workers):
    # a learning-rate warm-up makes each round's outer gradients up to ~3x the last round's; a fragment's
    # first round has fewer tokens than the next (it is sent before H steps)
    names = [f"w{i}" for i in range(workers)]
    st = make_state(members=names)
    n = st.ranges[0][1]
    for r in range(5):
        for i, name in enumerate(names):
            st.push(name, 0, r, encode(3.0**r * delta(n, 10 * r + i), "e3m0", 128), 100.0 * 5**r, 3.0)
        closed = st.close_round(0)
        assert closed.clipped == () and closed.capped == ()
    assert st.pushes_clipped == 0 and st.weights_capped == 0


def test_the_recent_rounds_survive_a_checkpoint_and_a_replay():
    st, twin, replayed = (make_state(members=("a", "b")) for _ in range(3))
    n = st.ranges[0][1]
    for r in range(2):
        st.push("a", 0, r, encode(delta(n, r), "e3m0", 128), 100.0, 3.0)
        st.push("b", 0, r, encode(delta(n, r + 50), "e3m0", 128), 100.0, 3.0)
        job = st.begin_close(0)
        record = job.record()
        st.end_close(job.run())
        replayed.replay_round(0, record)
    twin.load_fragment_state(0, st.fragment_state(0))
    for other in (twin, replayed):
        assert list(other.weight_history[0]) == list(st.weight_history[0]) == [[100.0, 100.0]]
        assert list(other.norm_history[0]) == list(st.norm_history[0]) and len(st.norm_history[0]) == 1
    for s in (st, twin, replayed):  # the last round tells a liar apart in a round of two, after a restart too
        s.push("a", 0, 2, encode(delta(n, 7), "e3m0", 128), 100.0, 3.0)
        s.push("b", 0, 2, encode(1000 * delta(n, 8), "e3m0", 128), 100.0, 3.0)
        assert s.close_round(0).clipped == ("b",)
    assert torch.equal(twin.master(0), st.master(0)) and torch.equal(replayed.master(0), st.master(0))
    bad = st.fragment_state(0) | {"history": {"weights": [[math.nan]], "norms": []}}
    with pytest.raises(ValueError, match="fragment 0 has a malformed history of weights, norms"):
        make_state().load_fragment_state(0, bad)


def test_pushes_folded_ahead_of_the_close_are_clipped_too():
    names = [f"w{i:02d}" for i in range(24)]
    st = make_state(members=names)
    n = st.ranges[0][1]
    st.fragments[0].fold_bytes = 1  # every push forms a group of its own at once (the memory bound, small)
    for i, name in enumerate(names):
        scale = 1000.0 if name == "w05" else 1.0
        st.push(name, 0, 0, encode(scale * delta(n, i), "e3m0", 128), 100.0, 3.0)
        for f in st.fold_due():
            st.end_fold(st.begin_fold(f).run())
    closed = st.close_round(0)
    assert closed.clipped == ("w05",)
    assert float((_INITIAL[0] - st.master(0)).norm()) < 3 * float(delta(n, 0).norm())


@pytest.mark.parametrize("aggregator", ["trimmed", "centered-clip"])
def test_the_robust_aggregators_replay_bit_for_bit_from_the_round_log(aggregator):
    robust = RobustConfig(aggregator=aggregator)
    st, twin = make_state(robust), make_state(robust)
    encs = honest_encs(st) + [encode(-100 * decode(honest_encs(st)[0]), "e3m0", 128)]
    for name, enc in zip(HONEST + ("evil",), encs):
        st.push(name, 0, 0, enc, 4096.0, 3.0)
    job = st.begin_close(0)
    record = job.record()
    closed = st.end_close(job.run())
    assert closed.clipped == ("evil",) and record["aggregator"][0] == aggregator
    twin.replay_round(0, record)
    assert torch.equal(twin.master(0), st.master(0))
    assert torch.isfinite(st.master(0)).all()


def test_a_step_that_comes_out_non_finite_is_undone_and_the_optimizer_restarts():
    st = make_state(outer_lr=1e38, members=HONEST)  # pushes of values near 1 make the step overflow fp32
    before = st.master(0)
    for name, enc in zip(HONEST, honest_encs(st)):
        st.push(name, 0, 0, encode(100 * decode(enc), "e3m0", 128), 4096.0, 3.0)
    closed = st.close_round(0)
    assert closed.why == "nonfinite" and closed.mean_loss is None
    assert torch.equal(decode(closed.update), torch.zeros_like(before))  # workers apply nothing
    assert st.master(0) is before and torch.isfinite(st.master(0)).all()
    outer = st.fragments[0].outer
    assert outer.sgd.state.get(outer._param, {}) == {}  # no momentum left from the failed step
    assert torch.equal(outer.residual, torch.zeros_like(before))
    assert st.round_of(0) == 1  # the run goes on


# === one attacker among 3 honest workers, over a real channel ==========================================
SYNC = SyncConfig(sync_every=10, num_fragments=1, sync_schedule="fixed")  # caps and clip unstretched
BATCH, BLOCK, WEIGHT = 16, 32, 4096.0


def _into(model, vec: torch.Tensor, layout) -> None:
    unflatten_into(vec, fragment_params(model, layout.fragments[0]))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A nano GPT 100 steps into training (the run in progress the shard starts from), the 3 honest workers'
    outer gradients of their next H steps, and the validation batches."""
    torch.manual_seed(0)
    model = build_gpt("nano")
    data = ByteDataset.load(None, BLOCK)
    inner = InnerConfig()
    opt = make_inner_optimizer(model, inner)
    stream = BatchStream(data.train, BATCH, BLOCK, 0, 99)
    for _ in range(100):
        forward_backward(model, *stream.next())
        optimizer_step(model, opt, inner)
    init = tmp_path_factory.mktemp("robust") / "init.pt"
    torch.save(model.state_dict(), init)
    layout = build_layout(model, SYNC.num_fragments)
    start = flatten(fragment_params(model, layout.fragments[0]))
    deltas = []
    for rank in range(3):
        local = build_gpt("nano")
        local.load_state_dict(model.state_dict())
        local_opt = make_inner_optimizer(local, inner)
        s = BatchStream(data.train, BATCH, BLOCK, 0, rank)
        for _ in range(SYNC.sync_every):
            forward_backward(local, *s.next())
            optimizer_step(local, local_opt, inner)
        deltas.append(start - flatten(fragment_params(local, layout.fragments[0])))
    val = eval_batches(data.val, BATCH, BLOCK, 8)
    return {"init": str(init), "start": start, "deltas": deltas, "layout": layout, "val": val, "model": model}


def _attack(kind: str, run: dict) -> tuple[Encoded, float]:
    """The attacker's push (e3m0, the run's codec) and the weight it reports."""
    d0 = run["deltas"][0]
    if kind == "weight-2^53":  # the finding: a huge weight with a push that drags the model to -20x
        return encode(21 * run["start"], "e3m0", 128), 2.0**53
    if kind == "scales-at-the-limit":  # every value at +-9.9e29, just under the codec's 1e30
        n = d0.numel()
        codes = torch.randint(0, 256, ((n + 1) // 2,), generator=torch.Generator().manual_seed(1))
        codes = (codes | 0x77).to(torch.uint8)  # both codes at the top level (sign random)
        return Encoded("e3m0", n, codes, torch.full((-(-n // 128),), 9.9e29), 128), WEIGHT
    if kind == "delta-x100":
        return encode(100 * d0, "e3m0", 128), WEIGHT
    assert kind == "sign-flip"
    return encode(-d0, "e3m0", 128), WEIGHT


def _round(tmp_path, run: dict, robust: RobustConfig, attack: str | None) -> tuple[torch.Tensor, float]:
    """One round on an in-process shard over loopback gRPC: the honest workers (and the attacker) push;
    returns the master as an honest worker rebuilds it from the update it received, and its eval loss."""
    members = 3 + (attack is not None)
    service = shard_of(
        SYNC, "nano", 0, 1, min_workers=members, round_timeout=60.0, init=run["init"], robust=robust
    )
    fp = json.dumps(model_fingerprint(run["layout"], SYNC))
    shard = InThreadShard(service, tmp_path, fp)
    try:
        workers = [shard.worker(f"honest-{i}") for i in range(3)]
        pushes = [(w, encode(d, "e3m0", 128), WEIGHT) for w, d in zip(workers, run["deltas"])]
        if attack is not None:
            enc, weight = _attack(attack, run)
            pushes.append((shard.worker("attacker"), enc, weight))
        for w, enc, weight in pushes:
            w.push(push_messages(enc, weight=weight, loss=2.5, values_per_chunk=16384))
        for w, _, _ in pushes:
            assert w.session.result().accepted
        chunks = workers[0].session.update()  # the round closed: its update, as a worker gets it
        update = torch.cat([decode(from_chunk(c)) for c in chunks])
        master = run["start"] + update  # the worker's mirror: bit-identical to the shard's master
        assert torch.equal(master, shard.on_loop(lambda: service.state.master(0)))
    finally:
        shard.shutdown()
    model = build_gpt("nano")
    _into(model, master, run["layout"])
    return master, evaluate(model, run["val"])


@pytest.fixture(scope="module")
def honest_loss(run, tmp_path_factory):
    master, loss = _round(tmp_path_factory.mktemp("honest"), run, RobustConfig(), None)
    model = build_gpt("nano")
    _into(model, run["start"], run["layout"])
    assert loss < evaluate(model, run["val"])  # an honest round helps
    return loss


ATTACKS = ["weight-2^53", "scales-at-the-limit", "delta-x100", "sign-flip"]
CASES = [(a, "mean") for a in ATTACKS] + [
    (a, agg) for agg in ("trimmed", "centered-clip") for a in ("scales-at-the-limit", "sign-flip")
]


@pytest.mark.parametrize("attack, aggregator", CASES)
def test_one_attacker_among_three_honest_workers_is_made_harmless(
    attack, aggregator, run, honest_loss, tmp_path
):
    master, loss = _round(tmp_path, run, RobustConfig(aggregator=aggregator), attack)
    assert torch.isfinite(master).all() and float(master.abs().max()) < 10 * float(run["start"].abs().max())
    assert abs(loss - honest_loss) <= 0.05 * honest_loss, (attack, loss, honest_loss)


@pytest.mark.parametrize("attack", ["weight-2^53", "scales-at-the-limit", "delta-x100"])
def test_without_the_defenses_the_same_attacker_takes_the_model(attack, run, honest_loss, tmp_path):
    _, loss = _round(tmp_path, run, RobustConfig.off(), attack)
    assert not loss <= 1.05 * honest_loss, (attack, loss, honest_loss)  # far off, or NaN
