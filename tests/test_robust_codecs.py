"""The robust rules with each kind of uplink codec (issue 38): the weight cap and the norm clip hold with
sparse top-k pushes (a push's norm is that of the values it sent), and the trimmed mean, which means nothing
over pushes that are mostly zeros, is refused with a sparse codec in one line at the shard's start."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch

from streamdiloco.common.codecs import decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.rounds.robust import AGGREGATORS, RobustConfig
from tests.support.nano_shard import nano_state, slice_delta

REFUSED = "--aggregator trimmed does not go with the sparse uplink codec topk64_4096"


@pytest.mark.parametrize("codec", ["e3m0", "int8", "sq2", "topk", "topk32_1024"])
@pytest.mark.parametrize("aggregator", AGGREGATORS)
def test_the_trimmed_mean_of_sparse_pushes_is_refused_at_the_shards_start(codec, aggregator):
    robust, sync = RobustConfig(aggregator=aggregator), SyncConfig(uplink_codec=codec)
    if aggregator == "trimmed" and codec.startswith("topk"):
        with pytest.raises(ValueError, match="--aggregator trimmed does not go with the sparse uplink") as e:
            ShardConfig(robust=robust, sync=sync)
        assert "\n" not in str(e.value) and sync.uplink_codec in str(e.value)
    else:
        ShardConfig(robust=robust, sync=sync)  # dense codecs take every rule; top-k the mean and the clip


def test_on_the_command_line_it_is_one_line():
    flags = ["server", "--model", "nano", "--aggregator", "trimmed", "--uplink-codec", "topk", "--port", "0"]
    r = subprocess.run(
        [sys.executable, "-m", "streamdiloco", *flags], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and REFUSED in lines[0], r.stderr[-2000:]


def test_a_top_k_push_far_beyond_the_median_norm_is_clipped_and_its_weight_capped():
    """Three honest top-k pushes and one 100 times as large with a huge weight, fp32 down, SparseLoCo's step
    at lr 1 (the master moves by exactly minus the round's mean, to fp32 round-off): the large push is
    counted at the median weight and scaled to twice the median norm of the values the pushes sent."""
    st, cfg = nano_state(num_shards=1, uplink_codec="topk", downlink_codec="fp32", outer_variant="sparseloco")
    encs = [encode(slice_delta(st, 0, i), cfg.uplink_codec) for i in range(3)]
    encs.append(encode(100 * slice_delta(st, 0, 0), cfg.uplink_codec))
    for i, enc in enumerate(encs):
        st.push(f"w{i}", 0, 0, enc, 4096.0 if i < 3 else 2.0**40, 3.0)
    before = st.master(0).clone()
    closed = st.close_round(0)
    assert closed.clipped == ("w3",) and closed.capped == ("w3",) and closed.weight == 4 * 4096
    xs = [decode(e).to(torch.float64) for e in encs]
    assert all(int((x != 0).sum()) <= x.numel() * 64 // 4096 + 64 for x in xs)  # sparse: 64 of 4096
    norms = [float(x.norm()) for x in xs]
    bound = 2 * statistics.median(norms)
    want = sum(x * min(1.0, bound / n) for x, n in zip(xs, norms, strict=True)) / 4
    torch.testing.assert_close((before - st.master(0)).to(torch.float64), want, rtol=0, atol=1e-7)


def test_the_simulator_refuses_it_as_a_shard_does():
    from streamdiloco.compare import SETUPS, sim_config

    with pytest.raises(ValueError, match=REFUSED):
        sim_config({"method": "streaming"}, **{**SETUPS["full-topk"], "aggregator": "trimmed"})
    assert sim_config({"method": "streaming"}, **{**SETUPS["full-topk"], "aggregator": "centered-clip"})
