"""The machine a benchmark runs on: what it is (`machine()`, `machine_line()`), which code runs on it
(`code_under_test()`), waiting for it to be quiet before a timed run (`wait_quiet()`), and the files of
the system that some benchmarks read (`fortune_files()`).

It reads; it starts no benchmark process (procs.py) and writes no results (output.py).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

from benchmarks.harness.output import say
from benchmarks.harness.paths import FORTUNES, ROOT
from benchmarks.harness.procfs import system_busy_seconds


def machine() -> dict:
    """The machine and the software a benchmark ran on (results.json's "machine")."""
    import grpc
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "grpcio": grpc.__version__,
    }


def machine_line(info: dict) -> str:
    """What `machine()` found, for the head of a benchmark's output and results."""
    return (
        f"{info['cpus']} CPUs ({info['cpu']}), {info['memory_gib']} GiB, {info['platform']}; "
        f"Python {info['python']}, torch {info['torch']}, grpcio {info['grpcio']}"
    )


def code_under_test() -> dict:
    """Where the package was imported from and the repository's commit (and whether tracked files differ
    from it): which code the figures are of."""
    import streamdiloco

    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""

    return {
        "code": str(Path(streamdiloco.__file__).resolve().parent.parent),
        "commit": git("rev-parse", "HEAD") or "unknown",
        "tracked_files_modified": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def wait_quiet(label: str, max_wait: float, threshold: float = 0.15) -> float:
    """Wait (up to max_wait s) until the machine is nearly idle: the figures are timings, and other work on
    a 2-core machine (tests, builds) skews them. Returns the busy fraction of all cores measured last."""
    t_start = time.monotonic()
    said = -1e9
    while True:
        b0, t0 = system_busy_seconds(), time.monotonic()
        time.sleep(1.0)
        busy = (system_busy_seconds() - b0) / (time.monotonic() - t0) / (os.cpu_count() or 1)
        waited = time.monotonic() - t_start
        if busy <= threshold:
            if waited > 2:
                say(f"[{label}] the machine is quiet ({busy:.0%} busy) after {waited:.0f}s")
            return busy
        if waited > max_wait:
            say(f"[{label}] the machine is still {busy:.0%} busy with other processes: timings may suffer")
            return busy
        if waited - said >= 30:
            said = waited
            say(f"[{label}] the machine is {busy:.0%} busy with other processes; waiting for it to calm down")
        time.sleep(2.0)


def fortune_files() -> list[Path]:
    """The fortune files of Debian's `fortunes` (quotations between lines of a single %), sorted; their
    index files (.dat) and links (.u8) left out. ValueError (one line) when the package is missing."""
    files = sorted(p for p in FORTUNES.glob("*") if p.is_file() and not p.is_symlink() and p.suffix != ".dat")
    if not files:
        raise ValueError(
            f"no fortunes under {FORTUNES}: install Debian's fortunes (scripts/system-deps.sh real)"
        )
    return files
