"""The codec speed benchmark (`python -m benchmarks.codecs`) runs end to end on a small tensor and its table
has what BENCHMARKS.md quotes: a row per codec (the top-k ones included) with encode, decode, add_into and
accumulate, each against a copy timed in the same run (a few seconds: the speeds themselves mean nothing at
this size)."""

import json
import os

import pytest
import torch

from benchmarks.codecs import CODECS, OPS, main

pytestmark = pytest.mark.timeout(120)


def test_codec_table_has_every_codec_against_a_copy(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STREAMDILOCO_CODEC_THREADS", os.environ.get("STREAMDILOCO_CODEC_THREADS", "1"))
    threads = torch.get_num_threads()
    try:
        assert main(["--values", "8K", "--repeats", "1", "--json", str(tmp_path / "out.json")]) == 0
    finally:
        torch.set_num_threads(threads)  # the benchmark sets torch's threads for its own timings
    md = capsys.readouterr().out
    raw = json.loads((tmp_path / "out.json").read_text())
    assert {"topk64_4096", "topk256_4096", "sq2", "e3m0"} <= set(CODECS)
    assert [r["codec"] for r in raw["rows"]] == list(CODECS)
    for r in raw["rows"]:
        assert r["memcpy"] > 0, r
        for side in ("compiled", "torch_ops"):
            assert set(r[side]) == set(OPS) and all(v > 0 for v in r[side].values()), r
        assert f"| {r['codec']} | " in md
    assert "| codec | memcpy | encode | decode | add_into | accumulate |" in md
