"""What a benchmark prints and writes: `say` prints a line and keeps it for run.log; `write_results` writes
results.json, results.md and run.log, each atomically.

Only output: nothing here starts a process or reads the machine (session.py puts them together).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path

from streamdiloco.common.atomic import atomic_write_text


class Tee:
    """print() that keeps every line (for run.log); safe from several threads."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str = "") -> None:
        with self._lock:
            print(line, flush=True)
            self.lines.append(line)


say = Tee()


def write_results(
    out: Path, results: dict, md: Sequence[str], log: Tee | None = None, echo: bool = True
) -> None:
    """A benchmark's outputs, each written atomically: results.json, results.md (the lines `md`), run.log
    (what `log`, `say` by default, printed); then, with `echo`, the tables to stdout."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2, default=str))
    atomic_write_text(out / "results.md", "\n".join(md) + "\n")
    atomic_write_text(out / "run.log", "\n".join((log or say).lines) + "\n")
    if echo:
        print("\n".join(md))
