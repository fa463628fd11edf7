"""The command line: bad configuration stops with one line that says what to change; runs write results."""

import json
import subprocess
import sys

import pytest

QUICK = ["--model", "nano", "--batch-size", "2", "--eval-batches", "1"]


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "streamdiloco", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--sync-every", "32", "--num-fragments", "5"], "use H=30 or H=35"),
        (["--fragment-update-alpha", "1.5"], "fragment_update_alpha must be in [0, 1]"),
        (["--uplink-codec", "fp4"], "unknown uplink_codec 'fp4': choose one of fp32, bf16, int8, e3m0"),
        (["--data", "/nonexistent/file.txt"], "does not exist: give --data a path to a text file"),
        (["--fragment-sync-delay", "30"], "fragment_sync_delay (tau=30) must be in [0, H-1]"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--num-fragments", "9", "--sync-every", "9"], "8 block fragments need at least as many blocks"),
    ],
)
def test_bad_configuration_is_one_line(args, expect):
    r = run("simulate", *QUICK, "--steps", "2", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("streamdiloco: error: ") and expect in lines[0]


def test_empty_data_file(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("")
    r = run("simulate", *QUICK, "--steps", "2", "--data", str(f))
    assert r.returncode == 2 and "is empty" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_simulate_writes_json(tmp_path):
    out = tmp_path / "r.json"
    r = run(
        "simulate",
        *QUICK,
        "--steps",
        "12",
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        "--eval-every",
        "6",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "step    12/12" in r.stdout  # progress lines
    res = json.loads(out.read_text())
    for key in (
        "eval_loss",
        "tokens",
        "bytes_sent_per_worker",
        "bytes_received_per_worker",
        "peak_sync_bytes",
        "wall_seconds",
    ):
        assert key in res
    assert res["tokens"] == 12 * 2 * 2 * 32
    assert res["mirrors_match_masters"] is True


def test_compare_prints_table_and_saves_plot(tmp_path):
    r = run(
        "compare",
        *QUICK,
        "--setups",
        "dp,full",
        "--steps",
        "6",
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        "--eval-every",
        "3",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert "Data-parallel" in r.stdout and "+ E3M0 up and down" in r.stdout
    png = tmp_path / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| Data-parallel | 2 |" in (tmp_path / "results.md").read_text()


def test_help_lists_the_flags():
    r = run("simulate", "--help")
    for flag in (
        "--workers",
        "--steps",
        "--sync-every",
        "--num-fragments",
        "--fragment-sync-delay",
        "--fragment-update-alpha",
        "--uplink-codec",
        "--downlink-codec",
        "--outer-lr",
        "--data",
        "--seed",
        "--json",
        "--method",
    ):
        assert flag in r.stdout
