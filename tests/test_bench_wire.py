"""The wire benchmark (`python -m benchmarks.wire`) still runs and its numbers add up (slow: ~7 minutes on a
quiet 2-core machine, longer beside other tests; `make test-slow`)."""

import pytest

from tests.support.procs import quick_benchmark

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1500)  # the default 600 s was too short beside the chaos bench in `make test-slow`
def test_wire_benchmark_quick_run_agrees_with_the_codec(tmp_path):
    results = quick_benchmark("wire", tmp_path, timeout=1400)
    assert (tmp_path / "results.md").read_text().strip()
    for run in results["a"]:  # (a): four independent counts of the codec bytes agree, framing is small
        for direction, d in run["directions"].items():
            counts = {d[k] for k in ("predicted_codec_bytes", "summary_codec_bytes", "shard_codec_bytes")}
            assert counts == {d["proxy_codec_bytes"]}, (run["model"], direction, d)
            assert d["sync_bytes"] > d["predicted_codec_bytes"] and 0 < d["overhead_sync_pct"] < 5
            assert not d["parse_errors"]
    b = results["b"]  # (b): one and two shards, checkpointing or not; every push accepted by every shard
    grpc = [r for r in b["rows"] if r["transport"] != "plain TCP"]
    assert sorted((r["shards"], r["checkpoint"]) for r in grpc if r["pipeline"] == 1) == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    rounds = b["warmup_rounds"] + b["repeats"] * grpc[0]["rounds_per_repeat"]
    for r in grpc:
        assert r["refused"] == 0 and r["shard_pushes_accepted"] == b["clients"] * rounds * r["shards"], r
        assert r["shard_codec_in"] == r["shard_codec_in_expected"], r  # the rate counts what the shards took
        assert r["median_mb_s"] > 0
    # the summary: 1 and 2 shards beside plain TCP reading and discarding, with the ratios
    for s in b["shards_summary"]:
        assert set(s["mb_s"]) == {"1", "2"} and s["tcp_discard_mb_s"] > 0, s
        assert s["one_shard_over_tcp_discard"] > 0 and s["over_one_shard"]["2"] > 0, s
    assert "2 shards / 1 shard" in (tmp_path / "results.md").read_text()
    assert results["c"]
