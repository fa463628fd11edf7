"""The load benchmark (benchmarks/load.py): its figures' arithmetic, the flags it gives a shard, and its
--quick grid end to end (real shard processes, sessions spoken by hand from one asyncio process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.load import Timings, close_times, proc_stats, shard_flags, table
from streamdiloco.server.trust.bounds import Limits
from tests.support.procs import ROOT


def test_the_flags_hold_n_sessions_from_one_address():
    """N sessions from 127.0.0.1 need the run token for N names and room for N Session streams in all and
    per address; what the flags ask is what the shard's Limits accept."""
    for n in (1, 10, 1000):
        flags = shard_flags(n, "nano", [])
        value = {flags[i]: flags[i + 1] for i in range(0, len(flags), 2)}
        assert int(value["--names-per-token"]) == n
        limits = Limits(
            max_sessions=int(value["--max-sessions"]),
            max_sessions_per_peer=int(value["--max-sessions-per-peer"]),
        )
        assert limits.max_sessions_per_peer >= n and limits.max_sessions >= n


def test_round_close_times_count_from_the_last_and_the_first_push():
    t = Timings()
    for t0, t1 in [(0.0, 1.0), (0.5, 2.0)]:  # two sessions' pushes of round 1
        t.pushed((0, 0, 1), t0, t1)
    t.pushed((0, 0, 0), 0.0, 0.1)
    t.updates[(0, 0, 1)] = [2.5, 3.0, 2.25]
    t.updates[(0, 0, 0)] = [100.0]  # the warm-up round: left out
    got = close_times(t, skip_first=True)
    assert got == {"last_to_update_ms": 500.0, "last_to_update_max_ms": 1000.0, "first_to_update_ms": 2500.0}
    assert close_times(Timings(), skip_first=True) == {}


def test_proc_stats_reads_memory_and_cpu():
    st = proc_stats(os.getpid())
    assert 0 < st["vmrss"] <= st["vmhwm"] and st["cpu"] > 0


@pytest.mark.slow  # starts a shard per point (about a minute on a busy 2-core machine): in `make test-slow`
def test_quick_run_end_to_end(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.load", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["rows"]
    assert [(x["shards"], x["sessions"]) for x in rows] == [(1, 1), (1, 10), (2, 1), (2, 10)]
    fragments = 5  # the shards' default P
    for x in rows:
        assert not x["timed_out"] and not x["errors"], x
        # every round of every fragment closed on every shard, with every session's push accepted
        assert x["rounds_closed"] == [results["rounds"] * fragments] * x["shards"]
        assert x["results"] == {"accepted": results["rounds"] * fragments * x["sessions"] * x["shards"]}
        assert x["last_to_update_ms"] >= 0 and x["first_to_update_ms"] >= x["last_to_update_ms"]
        assert all(0 < a <= b for a, b in zip(x["rss_end_mib"], x["hwm_mib"]))
        assert all(c >= 0 for c in x["cpu_ms_per_push"])
    md = (tmp_path / "results.md").read_text()
    assert md.count("\n| ") == len(table(rows)) - 1  # the header and one line per point
