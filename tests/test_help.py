"""`streamdiloco --help` and every subcommand's `--help` answer without importing torch (it took seconds).

The parser is built from light modules: the settings sections' dataclasses and the subcommands' flags, with
torch imported only where a command runs. One fresh interpreter asks every subcommand for its help, and
checks after each that torch has not been imported; a real `python -m streamdiloco server --help` is run too.
A bad invocation of each subcommand (a flag, a setting, a file) is refused in one line without torch too.
"""

from __future__ import annotations

import subprocess
import sys
import time

from tests.support.procs import refused_in_one_line

PROBE = r"""
import contextlib, io, sys

from streamdiloco.cli import build_parser, main

subcommands = sorted(build_parser()._subparsers._group_actions[0].choices)
assert len(subcommands) >= 9, subcommands
nested = [["data", "prepare"], ["data", "check"]]  # a subcommand's own subcommands
for argv in [[]] + [[sub] for sub in subcommands] + nested:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
        else:
            raise AssertionError(f"{argv}: --help did not exit")
    assert out.getvalue().startswith("usage: streamdiloco"), (argv, out.getvalue()[:200])
    for heavy in ("torch", "tokenizers"):
        assert heavy not in sys.modules, f"{' '.join(['streamdiloco', *argv, '--help'])} imported {heavy}"
print(" ".join(subcommands))
"""


def test_every_subcommands_help_answers_without_torch():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {"server", "worker", "launch", "simulate", "export", "config", "data"} <= set(r.stdout.split())


def test_python_m_streamdiloco_server_help_is_quick():
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "streamdiloco", "server", "--help"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 0 and "--num-shards" in r.stdout, r.stderr[-2000:]
    # under a second on an idle machine; the bound leaves room for a loaded one (torch alone took seconds)
    assert took < 10, f"`python -m streamdiloco server --help` took {took:.1f}s"


# One bad invocation per subcommand that runs: each is refused with one line (exit 2) by the checks that run
# before torch is imported (cli/checks.py), so a mistyped flag answers at once. export is left out: its
# checks need the export code, which imports torch.
def test_bad_invocations_are_refused_in_one_line_without_torch(tmp_path):
    tmp = str(tmp_path)
    refused_in_one_line(
        [
            (["server", "--model", "nano", "--sync-every", "7"], "use H=5 or H=10"),
            (["server", "--model", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
            (["server", "--round-timeout", "inf"], "--round-timeout must be a finite number"),
            (["server", "--host", "0.0.0.0", "--token", "x"], "refusing to listen on 0.0.0.0 without TLS"),
            (["server", "--shard", "2", "--num-shards", "2"], "shard index 2 is outside [0, 1]"),
            (["worker", "--servers", "localhost"], "--servers: 'localhost' is not HOST:PORT"),
            (["worker", "--servers", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"], "cannot read it"),
            (
                ["worker", "--servers", "127.0.0.1:1", "--resume", "--checkpoint", f"{tmp}/w.pt"],
                "no checkpoint at",
            ),
            (["worker", "--servers", "127.0.0.1:1", "--eval-every", "-1"], "--eval-every must be 0"),
            (["launch", "--uplink-codec", "fp4"], "unknown uplink_codec 'fp4'"),
            (["launch", "--workers", "2", "--min-workers", "3"], "rounds would never close"),
            (["simulate", "--workers", "0"], "--workers must be at least 1"),
            (["simulate", "--data", f"{tmp}/none.txt"], "does not exist: give --data"),
            (["compare", "--setups", "dp,nosuch"], "unknown setup 'nosuch'"),
            (["config", "--fragment-update-alpha", "1.5"], "fragment_update_alpha must be in [0, 1]"),
            (["certs", "--out", f"{tmp}/certs", "--workers", "../x"], "worker name '../x'"),
            (["token", "../x", "--out", f"{tmp}/x.token"], "'../x'"),
            (
                ["data", "prepare", f"{tmp}/none.txt", "--out", f"{tmp}/p", "--train-tokenizer", "300"],
                "no such file",
            ),
            (["data", "prepare", tmp, "--out", f"{tmp}/p", "--train-tokenizer", "100"], "at least 257 ids"),
            (["data", "check", tmp], "no manifest.json"),
        ]
    )


def test_python_m_streamdiloco_bad_worker_flag_is_quick():
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "streamdiloco", "worker", "--servers", "localhost"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.perf_counter() - t0
    assert r.returncode == 2 and "is not HOST:PORT" in r.stderr, r.stderr[-2000:]
    # under a second on an idle machine; the bound leaves room for a loaded one (importing torch took seconds)
    assert took < 10, f"`python -m streamdiloco worker --servers localhost` took {took:.1f}s"
