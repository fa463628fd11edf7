"""The benchmarks' harness: what every benchmark shares, one of each.

- session.py: `Session`, one run of a benchmark from its main() (the command and the machine said, the
  results folder, a scratch folder for logs, every process stopped and clean-ups run however it ends,
  Ctrl+C and SIGTERM, results.json / results.md / run.log written by `finish()`); `bench_parser`, the flags
  most share (--parts, --quick, --out, --max-wait).
- output.py: `say` prints a line and keeps it for run.log; `write_results` writes the three files.
- machine.py: `machine()`, `machine_line()`, `code_under_test()`, `wait_quiet()` (a quiet machine before a
  timed run), `fortune_files()` (Debian's fortunes, a second corpus).
- procfs.py: the one /proc reader: a process's, a group's, a session's, a thread's CPU and memory, the
  machine's busy seconds and load; `CpuSampler` for CPU over a window.
- procs.py: `Procs` (every child in its own session, stopped with its children), `sd(...)`/`bench(...)`
  command lines, `start_shards`, `Run`, `wait_files`, `http_json`, `free_port`(s).
- netns.py: network namespaces, veth pairs and links (root, iproute2), for the WAN testbed and the chaos
  benchmark's dropped link.
- inthread.py: `ThreadShard`, a shard serving in a thread of this process (the bytes benchmark; the tests'
  InThreadShard builds on it). Imported from its module, not from here: it loads the shard's code.

The benchmarks are modules (or packages) of the package `benchmarks` and run from the repository's root:
`python -m benchmarks.wire`. They import this package; it imports the installed package (never the other
way: the package knows nothing of the benchmarks) and no benchmark.
"""

from benchmarks.harness import netns
from benchmarks.harness.machine import code_under_test, fortune_files, machine, machine_line, wait_quiet
from benchmarks.harness.output import Tee, say, write_results
from benchmarks.harness.paths import FORTUNES, RESULTS, ROOT
from benchmarks.harness.procfs import (
    CpuSampler,
    cpu_seconds,
    group_cpu_seconds,
    group_peak_rss,
    loadavg,
    proc_stats,
    session_cpu,
    system_busy_seconds,
    thread_cpu,
)
from benchmarks.harness.procs import (
    Procs,
    Run,
    bench,
    http_json,
    sd,
    shard_argv,
    start_shards,
    wait_files,
)
from benchmarks.harness.session import INTERRUPTED, Session, bench_parser
from streamdiloco.common.ports import free_port, free_ports  # the package's one free-port

__all__ = [
    "FORTUNES",
    "INTERRUPTED",
    "RESULTS",
    "ROOT",
    "CpuSampler",
    "Procs",
    "Run",
    "Session",
    "Tee",
    "bench",
    "bench_parser",
    "code_under_test",
    "cpu_seconds",
    "fortune_files",
    "free_port",
    "free_ports",
    "group_cpu_seconds",
    "group_peak_rss",
    "http_json",
    "loadavg",
    "machine",
    "machine_line",
    "netns",
    "proc_stats",
    "say",
    "sd",
    "session_cpu",
    "shard_argv",
    "start_shards",
    "system_busy_seconds",
    "thread_cpu",
    "wait_files",
    "wait_quiet",
    "write_results",
]
