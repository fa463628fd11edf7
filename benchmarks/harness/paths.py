"""Where the benchmarks run and write: the repository's root (their working directory, and their child
processes'), the results folder, and the system's files some of them read. Constants only: nothing here
reads or writes a file."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: benchmarks run from here
RESULTS = ROOT / "benchmarks" / "results"  # each benchmark's default --out is a folder of this
# Debian's fortunes: a second corpus (scripts/system-deps.sh real)
FORTUNES = Path("/usr/share/games/fortunes")
