"""`make bench-real` (benchmarks/real.py) end to end at toy sizes: the corpus of Debian's fortunes and the
plays prepared with a trained BPE, one shard and two worker processes through the CLI, two DDP ranks over
gloo on the same pieces, both models loaded with from_pretrained and sampled. Its results add up: every
piece the workers reported done was reported once and the ledger counts the same, the mirrors agree, and
DDP's computed traffic is far above what the workers sent. About two minutes of processes: test-slow; the
default run covers the same path through the README's quick start (tests/test_quickstart.py), and the DDP
baseline's dealing of pieces here."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks.real import fortunes
from benchmarks.wan_ddp import DealtPieces
from tests.support.procs import ROOT

TINY = {"model_type": "gpt2", "vocab_size": 512, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2}


@pytest.mark.slow
def test_bench_real_trains_both_systems_on_the_same_pieces_and_its_results_add_up(tmp_path):
    assert fortunes(), "Debian's fortunes are missing: bash scripts/system-deps.sh real"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY, "bos_token_id": 0, "eos_token_id": 0}))
    out = tmp_path / "out"
    argv = ["--model-dir", str(model), "--vocab", "512", "--steps", "16", "--batch-size", "4"]
    argv += ["--block-size", "32", "--sync-every", "4", "--fragments", "2", "--piece-tokens", "512"]
    argv += ["--warmup-steps", "2", "--eval-batches", "2", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.real", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    s, d = res["streaming"], res["ddp"]
    assert s["pieces_reported_done"] > 0 and s["pieces_done_exactly_once"] == s["pieces_reported_done"]
    assert s["ledger_agrees"] and s["mirrors_equal"]
    assert s["tokens"] == d["tokens"] == 2 * 16 * 4 * 32
    assert all(math.isfinite(x["eval_loss"]) and x["eval_loss"] < math.log(512) for x in (s, d))
    assert d["bytes_sent_per_worker"] > 10 * s["bytes_sent_per_worker"] > 0
    assert s["sample"].startswith("The") and d["sample"].startswith("The")
    md = (out / "results.md").read_text()
    assert "| Streaming DiLoCo" in md and "| data-parallel (DDP, 2 ranks)" in md


def test_the_ddp_baseline_deals_every_piece_once_per_epoch_round_robin():
    ranks = [DealtPieces(r, 2, train_tokens=10_000, piece_tokens=1_000) for r in range(2)]
    seen: list[int] = []
    for source in ranks:
        held: list[int] = []
        for _ in range(5):
            reply = source.ask(held[:1], held, want=2)
            held = [p.id for p in reply.held]
            seen.append(held[0])
            assert all(p.end - p.start == 1_000 for p in reply.held)
    assert sorted(seen) == list(range(10))
    assert ranks[0].ask([], [], 12).epoch >= 1  # dealt past the end: the next epoch, from piece 0 again
