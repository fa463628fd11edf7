"""The bytes benchmark (`python -m benchmarks.bytes`) runs end to end on nano and its numbers mean what its
table says: E3M0's uplink is its 4.25 bits per value plus a little framing, sq2 sends less, top-k's pushes
go through the shard beside a dense downlink, what the proxy saw of a push is what pushframing.py counts,
and the DDP column is the ring all-reduce's formula (about half a minute: in-process shards and worker
links)."""

import json

import pytest

from benchmarks.bytes import main

pytestmark = pytest.mark.timeout(120)


def test_bytes_benchmark_on_nano_measures_the_codecs_and_states_ddp(tmp_path):
    args = ["--model", "nano", "--steps", "1", "--workers", "2", "--block-sizes", "128,1024"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "results.md").read_text()
    rows = {(r["codec"], r["block"]): r for r in res["rows"]}
    assert set(rows) == {
        ("fp32", None),
        ("bf16", None),
        ("int8", 128),
        ("int8", 1024),
        ("e3m0", 128),
        ("e3m0", 1024),
        ("sq2", 128),
        ("sq2", 1024),
        ("topk64_4096/e3m0", 1024),
        ("topk64_4096/sq2", 1024),
        ("topk256_4096/e3m0", 1024),
        ("topk256_4096/sq2", 1024),
    }
    e3m0 = rows["e3m0", 128]
    # 4 bits a value and one fp32 scale per 128, plus the messages' framing: above, and within 3 %
    assert 4.25 / 8 < e3m0["up_b_per_param"] < 4.25 / 8 * 1.03, e3m0
    assert 4.25 / 8 < e3m0["down_b_per_param"] < 4.25 / 8 * 1.03, e3m0
    for block in (128, 1024):
        sq2, ref = rows["sq2", block], rows["e3m0", block]
        assert sq2["up_b_per_param"] < ref["up_b_per_param"], (sq2, ref)
        assert sq2["down_b_per_param"] < ref["down_b_per_param"], (sq2, ref)
        assert sq2["up_vs_e3m0"] == pytest.approx(ref["up_b_per_param"] / sq2["up_b_per_param"])
    # every row carries what the codec itself puts on the wire, and a little more: about 120 B a push, 5 %
    # of nano's smallest sq2 push (2.5 KB); nano's top-k pushes are a few hundred bytes, the framing a large
    # share of them (counted below)
    for r in res["rows"]:
        bound = 1.5 if r["up_codec"].startswith("topk") else 1.05
        assert r["codec_b_per_param"] < r["up_b_per_param"] < r["codec_b_per_param"] * bound, r
        assert r["down_codec_b_per_param"] < r["down_b_per_param"] < r["down_codec_b_per_param"] * 1.03, r
    # top-k up: fewer bytes than sq2's, the denser one more than the sparser; the downlink is its own codec's
    for down in ("e3m0", "sq2"):
        k64, k256 = rows[f"topk64_4096/{down}", 1024], rows[f"topk256_4096/{down}", 1024]
        assert k64["up_b_per_param"] < k256["up_b_per_param"] < rows["sq2", 1024]["up_b_per_param"]
        for k in (k64, k256):
            assert k["down_b_per_param"] == pytest.approx(rows[down, 1024]["down_b_per_param"], rel=1e-3)
    # the proxy's count of a push's framing is what pushframing.py counts without a network (the fragments'
    # ids and rounds differ in their varints' sizes by a byte or two); gRPC + HTTP/2 is 14 B for one frame
    for r in res["rows"]:
        p, model = r["push"], r["push_model"]
        assert abs(p["protobuf_bytes"] - model["protobuf_bytes"]) <= 4, r
        if r["codec"] not in ("fp32", "bf16"):  # one chunk in one DATA frame per push
            assert p["grpc_http2_bytes"] == model["grpc_http2_bytes"] == 14, r
        assert r["wire_up_b_per_param"] > r["up_b_per_param"], r
    # DDP: 2 (M-1)/M x 4 bytes x H per parameter per outer step, each direction
    m, h = res["workers"], res["sync_every"]
    assert res["ddp_b_per_param"] == pytest.approx(2 * (m - 1) / m * 4 * h)
    for r in res["rows"]:
        assert r["up_vs_ddp"] == pytest.approx(res["ddp_b_per_param"] / r["up_b_per_param"])
        assert r["down_vs_ddp"] == pytest.approx(res["ddp_b_per_param"] / r["down_b_per_param"])
    assert "2 (M-1)/M x 4 B x H" in md and "| sq2 | 1024 |" in md and "| topk64_4096/sq2 | 1024 |" in md
