"""The chaos benchmark (benchmarks/chaos.py): its goodput arithmetic (pure, in the default run), and the whole
--quick run with real processes (a frozen worker, a killed and restarted one, a joiner, a restarted shard;
the link drop skipped: tests use loopback only), in `make test-slow`: five to ten minutes of processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.chaos import METRIC, Counts, busy_share, goodput, ledger_goodput, reached_tokens
from tests.support.procs import ROOT


def test_goodput_counts_the_accepted_share_of_each_process_pushed_tokens_over_all_it_computed():
    steady = Counts(tokens=1000, tokens_pushed=1000, accepted=10)
    assert reached_tokens(steady) == 1000 and goodput([steady]) == 1.0
    # thawed after a freeze: 2 of its 10 pushes came late, and the shard refused them
    thawed = Counts(tokens=1000, tokens_pushed=1000, accepted=8, late=2)
    assert reached_tokens(thawed) == 800
    # killed: 300 tokens trained after its last accepted push are lost with it
    killed = Counts(tokens=1300, tokens_pushed=1000, accepted=10)
    assert reached_tokens(killed) == 1000
    assert goodput([steady, thawed, killed]) == pytest.approx(2800 / 3300)
    # a shard restart: 2 pushes sent again, one accepted again (the shard had lost it), one a duplicate (it
    # had kept it): 10 distinct pushes, all in the model
    resent = Counts(tokens=1000, tokens_pushed=1000, accepted=11, duplicate=1, resent=2)
    assert reached_tokens(resent) == 1000
    assert reached_tokens(Counts(tokens=50)) == 0.0  # no push answered: nothing reached the model
    assert goodput([]) == 1.0
    assert busy_share((10.0, 4.0), (70.0, 58.0)) == pytest.approx(0.9)
    assert busy_share((10.0, 4.0), (10.0, 4.0)) is None


def test_the_ledgers_goodput_sums_every_identity_and_the_folded_rows_over_the_tokens_computed():
    credits = {"workers": [{"tokens": 900.0}, {"tokens": 1500.0}], "others": {"tokens": 100.0}}
    assert ledger_goodput(credits, [Counts(tokens=1000), Counts(tokens=2000)]) == pytest.approx(2500 / 3000)
    assert ledger_goodput(credits, []) == 1.0


def test_the_workers_metrics_are_read_by_name_and_label():
    text = (
        "# HELP streamdiloco_worker_tokens_total Tokens trained on\n"
        "streamdiloco_worker_tokens_total 1.2288e+04\n"
        'streamdiloco_worker_pushes_total{outcome="late"} 2.0\n'
        'streamdiloco_worker_phase{phase="training"} 1.0\n'
        'streamdiloco_worker_info{name="w0",version="1"} 1.0\n'
    )
    got = {f"{n}.{label}" if label else n: float(v) for n, label, v in METRIC.findall(text)}
    assert got == {"tokens_total": 12288.0, "pushes_total.late": 2.0, "phase.training": 1.0}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_chaos_quick_runs_every_fault_and_reports_goodput_and_busy_shares(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.chaos",
            "--quick",
            "--no-netns",
            "--max-wait",
            "0",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((out / "results.json").read_text())
    calm, chaos = res["calm"], res["chaos"]
    assert not calm["faults"] and chaos["faults"] and chaos["link"] is None
    assert 0.95 <= calm["goodput"] <= 1.0 and 0.0 < chaos["goodput"] <= 1.0
    # the ledger's count agrees with the estimate where nothing is capped (the undisturbed run)
    assert calm["goodput_ledger"] == pytest.approx(calm["goodput"], abs=0.05)
    assert 0.0 < chaos["goodput_ledger"] <= 1.0
    # the frozen worker was dropped within the liveness bound (5 s, and its pings' interval), and came back
    assert chaos["freeze"]["dropped_after"] < 20 and chaos["freeze"]["back_after"] > 0
    restarted = [p for p in chaos["processes"] if p["restart"]]
    assert [p["name"] for p in restarted] == ["w3"] and restarted[0]["accepted"] > 0
    assert any(p["name"] == "w6" and p["accepted"] > 0 for p in chaos["processes"])  # the joiner
    assert chaos["shard_restart"]["back_after"] > chaos["shard_restart"]["serving_after"] > 0
    for run in (calm, chaos):
        assert set(run["busy_run"]) == {"w0", "w1", "w5"}
        assert all(0.0 < v <= 1.0 for v in run["busy_run"].values())
    md = (out / "results.md").read_text()
    assert "| undisturbed |" in md and "| chaos |" in md and "link: skipped" in md
