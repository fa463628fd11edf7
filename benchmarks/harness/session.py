"""One run of a benchmark, from its main(): the skeleton every benchmark that starts processes shares.

    md: list[str] = []
    with Session("elastic", argv, Path(a.out)) as s:
        s.results["a"] = part_a(s.procs, s.tmp)
        md += ["## (a) ...", "", table_a(s.results["a"]), ""]
    return s.finish(md)

`Session(...)` says the command and the machine, makes the results folder and a scratch folder for the
processes' logs (`tmp`), and holds `procs` (every child, procs.py) and `results` (results.json: the command,
the machine, the code, the start; the benchmark adds its figures). Leaving the
`with` block stops every process, runs the clean-ups the benchmark registered (`cleanup`: a network
namespace), with Ctrl+C ignored so that a second one cannot cut them short, and removes the scratch folder
unless asked to keep it or the run failed (then it says where the logs are). Ctrl+C and SIGTERM (and SIGHUP
with `hangup`) end the block as an interruption: status 130. An error ends it with status 1 and the error
said (`report_errors`), or goes on up to the caller. `finish(md)` then writes results.json, results.md (the
lines `md`) and run.log, and returns the exit status.

The benchmark's own figures, tables and parts stay in its module; this is only what is the same in each.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType

from benchmarks.harness.machine import code_under_test, machine, machine_line
from benchmarks.harness.output import say, write_results
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.procs import Procs

INTERRUPTED = 130  # the exit status after Ctrl+C or SIGTERM, as a shell gives it


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def bench_parser(
    doc: str | None,
    name: str,
    *,
    parts: str | None = None,
    parts_help: str = "",
    quick_help: str | None = None,
    max_wait: float = 120.0,
) -> argparse.ArgumentParser:
    """A benchmark's parser with the flags most share: --parts (when it has parts: `parts` by default),
    --quick, --out (benchmarks/results/NAME) and --max-wait (seconds to wait for a quiet machine before a
    timed run); the benchmark adds its own."""
    ap = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if parts is not None:
        ap.add_argument("--parts", default=parts, help=parts_help)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", default=str(RESULTS / name))
    ap.add_argument("--max-wait", type=float, default=max_wait, help="seconds to wait for a quiet machine")
    return ap


class Session:
    """One run of benchmark `module` (e.g. "wire") with the command line `argv`, writing under `out` (None:
    the benchmark writes nothing there); see the module's docstring."""

    def __init__(
        self,
        module: str,
        argv: Sequence[str],
        out: Path | None,
        *,
        keep: bool = False,
        report_errors: bool = False,
        hangup: bool = False,
        scratch_in_out: bool = False,
    ):
        self.command = shlex.join(["python", "-m", f"benchmarks.{module}", *argv])
        self.out, self.keep, self.report_errors = out, keep, report_errors
        self.signals = (signal.SIGTERM, signal.SIGHUP) if hangup else (signal.SIGTERM,)
        self.info = machine()
        self.code = code_under_test()
        self.started = time.strftime("%Y-%m-%d %H:%M:%S")
        self.results: dict = {
            "command": self.command,
            "argv": list(argv),
            "machine": self.info,
            "code": self.code,
            "started": self.started,
        }
        self.status = 0
        self.failed = False
        self.seconds = 0.0
        say(f"$ {self.command}")
        say(f"machine: {machine_line(self.info)}")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        # scratch_in_out: on the results' disk (real fsyncs, not a tmpfs)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{module}-bench-", dir=out if scratch_in_out else None))
        self.procs = Procs(self.tmp)
        self._cleanups: list[Callable[[], object]] = []
        self._previous: dict[int, object] = {}
        self._t0 = time.monotonic()

    def cleanup(self, fn: Callable[[], object]) -> None:
        """Call `fn` when the session ends, after every process is stopped (in the order registered)."""
        self._cleanups.append(fn)

    def __enter__(self) -> Session:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, _interrupt)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> bool:
        handled = False
        if isinstance(error, KeyboardInterrupt):
            say("\ninterrupted: stopping every process")
            self.status, handled = INTERRUPTED, True
        elif isinstance(error, Exception):
            self.failed = True
            self.status = 1
            if self.report_errors:
                say(f"\nerror: {type(error).__name__}: {error}")
                handled = True
        self._close()
        return handled

    def _close(self) -> None:
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not stop this
        try:
            self.procs.stop_all()
            for fn in self._cleanups:
                fn()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]  # what signal.signal returned
        if self.keep or self.failed:
            say(f"kept the processes' logs in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.seconds = time.monotonic() - self._t0
        self.results["seconds"] = self.seconds

    def head(self, title: str | None) -> list[str]:
        """The first lines of results.md: with a title, the title, the command, when and how long, the
        machine; without, the machine alone."""
        machine_md = f"Machine: {machine_line(self.info)}"
        if title is None:
            return [machine_md, ""]
        return [
            f"# {title}",
            "",
            f"Command: `{self.command}`  ",
            f"Run: {self.started}, {self.seconds:.0f} s  ",
            machine_md,
            "",
        ]

    def finish(
        self,
        md: Sequence[str],
        *,
        title: str | None = None,
        echo: bool = True,
        partial: bool = False,
        extra: str = "",
        status: int = 0,
    ) -> int:
        """Write results.json, results.md (`head(title)`, then `md`) and run.log under `out`, print the
        tables with `echo`, and return the exit status: the session's (130 interrupted, 1 failed), else
        `status`, the benchmark's own verdict on a run that went through (1: a point timed out). A run that
        was interrupted or failed writes nothing unless `partial` (its results so far). `extra`: more files
        written, for the closing line."""
        if self.out is not None and (partial or not self.status):
            say(f"\n{self.seconds:.0f}s in all; wrote {self.out}/results.md, results.json, run.log{extra}")
            write_results(self.out, self.results, self.head(title) + list(md), echo=echo)
        return self.status or status
