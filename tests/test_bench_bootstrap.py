"""The bootstrap benchmark (benchmarks/bootstrap.py, issue 37): what its rule column computes, its tables, and
its `trickle` end to end against a real shard process with a 2 s --init-timeout (about 5 s). Its `upload`
(root, minutes over a shaped link) is not run here: tests/test_slow_upload.py runs the same upload as a
slow test."""

from __future__ import annotations

import json

import pytest

from benchmarks.bootstrap import main, mode_doc, parser, rule_hold, trickle_table, upload_table
from streamdiloco.server.edge.initialize import Pace

TRICKLE_COLUMNS = [
    "model",
    "trickle",
    "bytes of values sent",
    "the rule says s",
    "the shard held the slot s",
    "the call ended after s",
    "status (ended by)",
]


def header(md: str) -> list[str]:
    """The columns of the first table in `md`."""
    line = next(x for x in md.splitlines() if x.startswith("| "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_rule_column_is_the_shards_pace_over_the_trickles_messages():
    pace = Pace(grace=30.0, rate=16384.0)
    # one value every 29 s: inside --init-timeout, but far below the floor once the first 30 s have passed
    assert rule_hold(pace, 29.0, 4, 10**6) == pytest.approx(30 + 4 / 16384)
    # a message every 31 s: past --init-timeout before the first one
    assert rule_hold(pace, 31.0, 4, 10**6) == pytest.approx(30.0)
    # above the floor, it holds the slot while its values last, then --init-timeout more
    assert rule_hold(pace, 1.0, 20_000, 100_000) == pytest.approx(5 + 30)


def test_the_tables_say_what_was_measured():
    r = {
        "model": "nano",
        "every": 29.0,
        "values": 1,
        "value_bytes": 4,
        "rule_seconds": 30.0,
        "held_seconds": None,
        "client_seconds": 150.0,
        "client_status": "DEADLINE_EXCEEDED",
        "init_timeout": 30.0,
        "init_min_rate": 16384.0,
        "declared_bytes": 16384,
        "refusal": None,
        "ended_by": "the client's --limit",
    }
    md = "\n".join(trickle_table(r))
    assert header(md) == TRICKLE_COLUMNS
    assert (
        "| 1 value every 29 s | 4 | 30.00 | to the end | 150.0 | DEADLINE_EXCEEDED (the client's --limit) |"
        in md
    )
    assert "holds the slot at most 31 s" in md
    u = {
        "model": "small",
        "rate_mbit": 1.0,
        "round_trip_ms": 50.0,
        "queue_ms": 1000.0,
        "bytes": 1_000_000,
        "upload_seconds": 10.0,
        "bytes_per_second": 100_000.0,
        "rule_bound_seconds": 90.0,
        "margin": 9.0,
        "worker_start_to_upload_seconds": 8.0,
        "init_timeout": 30.0,
        "init_min_rate": 16384.0,
    }
    assert "| 1,000,000 | 10.0 | 100,000 | 0.800 | 90 | 9.0x | 8.0 |" in "\n".join(upload_table(u))


def test_each_mode_has_its_help():
    assert "trickling" in parser().format_help() and "upload" in parser().format_help()
    assert mode_doc("trickle").startswith("A shard process on loopback")
    assert mode_doc("upload").startswith("An honest `streamdiloco worker`")
    assert "honest" not in mode_doc("trickle") and "trickle" not in mode_doc("upload")


def test_a_trickle_loses_the_slot_once_its_first_init_timeout_has_passed(tmp_path, capsys):
    """End to end: a shard process with --init-timeout 2 and one value every 0.2 s (20 bytes a second):
    the shard refuses the upload about 2 s after it took the slot, and the table says so."""
    argv = ["trickle", "--every", "0.2", "--values", "1", "--init-timeout", "2", "--limit", "60"]
    assert main([*argv, "--out", str(tmp_path)]) == 0, capsys.readouterr().out[-4000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["client_status"] == "DEADLINE_EXCEEDED" and "--init-timeout" in r["details"], r
    assert r["held_seconds"] is not None and 1.9 <= r["held_seconds"] <= 10, r
    assert r["client_seconds"] < 20 and r["value_bytes"] == 4 * r["messages"] > 0, r
    assert r["rule_seconds"] == pytest.approx(2.0, abs=0.01)
    md = (tmp_path / "results.md").read_text()
    assert header(md) == TRICKLE_COLUMNS
    row = next(x for x in md.splitlines() if x.startswith("| nano "))
    assert row.endswith("| DEADLINE_EXCEEDED (the shard) |") and "to the end" not in row
