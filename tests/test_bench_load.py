"""The load benchmark (benchmarks/load.py): its figures' arithmetic, the flags it gives a shard, and its
--quick grid end to end (real shard processes, sessions spoken by hand from one asyncio process); and the
flood benchmark (benchmarks/flood.py): its table, and its --quick run end to end."""

from __future__ import annotations

import os

import pytest

from benchmarks.flood import Honest
from benchmarks.flood import table as flood_table
from benchmarks.load import Timings, close_times, proc_stats, shard_flags, table
from streamdiloco.server.trust.bounds import Limits
from tests.support.procs import quick_benchmark


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
    results = quick_benchmark("load", tmp_path)
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


# --- benchmarks/flood.py: stalled calls from 16 addresses against honest Joins (issue 37, item 4) ----------
def test_the_flood_table_says_what_the_honest_joins_got_and_what_the_flood_cost():
    idle = Honest(latencies=[0.2, 0.21, 0.25], codes={"OK": 3}, worker_joins=[0.002])
    during = Honest(latencies=[0.2, 0.3], codes={"OK": 2, "RESOURCE_EXHAUSTED": 1}, worker_failed=["refused"])
    assert during.row()["answered"] == 2 and during.row()["joins"] == 3
    assert idle.row()["p50_ms"] == pytest.approx(210.0) and idle.row()["max_ms"] == pytest.approx(250.0)
    result = {
        "idle": idle.row(),
        "flood": during.row(),
        "flood_calls_per_second": 2765.4,
        "evictions_per_second": 2500.0,
    }
    lines = flood_table(result)
    assert lines[2].startswith("| idle | 3 of 3 | 210 | 250 | 250 | 1 of 1 | 2 | - | - |")
    assert lines[3] == "| flood | 2 of 3 | 200 | 300 | 300 | 0 of 1 | - | 2,765 | 2,500 |"


@pytest.mark.slow  # a shard process and a flood at full rate for about 20 s: in `make test-slow`
def test_flood_quick_run_end_to_end(tmp_path):
    results = quick_benchmark("flood", tmp_path)
    assert results["flood"]["answered"] == results["flood"]["joins"] == 10, results["flood"]
    assert results["flood"]["worker_joined"] == 3 and not results["flood"]["worker_failed"]
    assert results["evictions_per_second"] > 0  # the shard ended calls to make room all along
