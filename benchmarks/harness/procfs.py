"""The benchmarks' one reader of Linux's /proc: how much CPU and memory a process (its threads, its process
group, its session) has used, how busy and loaded the whole machine is; and `CpuSampler`, which reads some
of these every few milliseconds in a thread so that the CPU used over any window can be read afterwards.

Readers only: nothing here starts, signals or waits for a process (procs.py does). A process that ends
between being listed and being read is skipped, never an error.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK")  # clock ticks per second: the unit of stat's utime and stime
# fields of /proc/PID/stat after the command's name (`stat_fields`): 0 is the state
PPID, PGRP, SESSION, UTIME, STIME = 1, 2, 3, 11, 12


def stat_fields(stat: Path) -> list[str]:
    """The fields of a /proc/.../stat file after the command's name (which may hold spaces and brackets:
    cut at the last ")"); OSError if the process is gone."""
    return stat.read_text().rsplit(")", 1)[1].split()


def _cpu(fields: list[str]) -> float:
    return (int(fields[UTIME]) + int(fields[STIME])) / TICK


def cpu_seconds(pid: int) -> float:
    """The process's CPU seconds so far (utime + stime, all its threads)."""
    return _cpu(stat_fields(PROC / str(pid) / "stat"))


def status_kib(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status in KiB: VmRSS (resident now), VmHWM (its peak), ..."""
    out = {}
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.startswith("Vm") and value.strip().endswith("kB"):
            out[key] = int(value.split()[0])
    return out


def proc_stats(pid: int) -> dict[str, float]:
    """A process's memory (MiB: VmRSS now, VmHWM its peak) and CPU seconds (utime + stime, all threads)."""
    mem = status_kib(pid)
    return {"vmrss": mem["VmRSS"] / 1024, "vmhwm": mem["VmHWM"] / 1024, "cpu": cpu_seconds(pid)}


def pids_where(field: int, value: int) -> list[int]:
    """The processes whose stat field `field` (PGRP, SESSION, PPID) is `value`."""
    out = []
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int(stat_fields(d / "stat")[field]) == value:
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _each(pids: list[int], read: Callable[[int], float]) -> dict[int, float]:
    """`read(pid)` of each process still there, by pid."""
    out = {}
    for pid in pids:
        try:
            out[pid] = read(pid)
        except OSError:
            continue
    return out


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of every process of a process group (a child started in its own session, its children)."""
    return sum(_each(pids_where(PGRP, pgid), cpu_seconds).values())


def group_peak_rss(pgid: int) -> int:
    """The sum of the peak RSS (VmHWM) of a process group's processes, bytes."""
    peaks = _each(pids_where(PGRP, pgid), lambda pid: status_kib(pid).get("VmHWM", 0) * 1024)
    return int(sum(peaks.values()))


def session_cpu(sid: int) -> dict[int, float]:
    """CPU seconds of every process in a session (a process we started and its children), by pid."""
    return _each(pids_where(SESSION, sid), cpu_seconds)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process: the main thread as "main thread", the others by their name
    ("<name> threads", those of one name summed)."""
    out: dict[str, float] = {}
    for task in (PROC / str(pid) / "task").glob("*"):
        try:
            comm = (task / "comm").read_text().strip()
            cpu = _cpu(stat_fields(task / "stat"))
        except OSError:
            continue
        name = "main thread" if task.name == str(pid) else f"{comm} threads"
        out[name] = out.get(name, 0.0) + cpu
    return out


def system_busy_seconds() -> float:
    """CPU seconds that all processes of the machine have used (all cores, non-idle time), from /proc/stat."""
    vals = [int(v) for v in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / TICK


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg has them."""
    try:
        return " ".join((PROC / "loadavg").read_text().split()[:3])
    except OSError:
        return "?"


class CpuSampler:
    """Samples processes' CPU seconds per thread, and the whole machine's ("ALL"), every `period` s, so that
    CPU over a window can be read. With more than one process the threads are named "p<i> ..." (the i-th
    pid given)."""

    def __init__(self, pids: list[int], period: float = 0.02):
        self.pids, self.period = pids, period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = {"ALL": system_busy_seconds()}
            for i, pid in enumerate(self.pids):
                for k, v in thread_cpu(pid).items():
                    sample[k if len(self.pids) == 1 else f"p{i} {k}"] = v
            self.samples.append((time.monotonic(), sample))
            self._stop.wait(self.period)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)

    def between(self, t0: float, t1: float) -> tuple[dict[str, float], float]:
        """CPU seconds per thread from the last sample at or before t0 to the first at or after t1, and the
        seconds between those two samples."""
        before = [(t, s) for t, s in self.samples if t <= t0] or self.samples[:1]
        after = [(t, s) for t, s in self.samples if t >= t1] or self.samples[-1:]
        (ta, a), (tb, b) = before[-1], after[0]
        return {k: b[k] - a.get(k, 0.0) for k in b if b[k] - a.get(k, 0.0) >= 0.005}, tb - ta
