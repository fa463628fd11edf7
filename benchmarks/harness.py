"""The benchmarks' harness: the processes a benchmark starts, the machine it runs on, what it writes.

- Output: `say` prints a line and keeps it for run.log; `write_results` writes a benchmark's results.json,
  results.md and run.log (each atomically) and prints the tables.
- The machine: `machine()` (CPUs, memory, Python, torch, grpcio), `machine_line()` for the head of the
  output, `code_under_test()` (where the package was imported from, its git commit); `wait_quiet()` waits
  for the CPUs to be nearly idle before a timed run, `system_busy_seconds()` and `loadavg()` say how busy
  they were.
- Data: `fortune_files()`, Debian's fortunes (the second corpus of quality_long.py and real.py).
- Processes: `Procs` starts every child process of a benchmark in its own session (its log in
  LOGDIR/NAME.log) and stops it with its children (SIGTERM to the group, then SIGKILL), also on an error
  and on Ctrl+C (`stop_all` in a `finally`). `sd(...)` is a `python -m streamdiloco ...` command line and
  `bench(...)` one of a benchmark module's (its internal subcommands); `start_shards` starts S shard
  processes and waits until they serve, `Run` a run's shards and workers by name; `wait_files` waits for
  ready files while watching that their processes still run.

The benchmarks are modules of the package `benchmarks` (this folder) and run from the repository's root:
`python -m benchmarks.wire`. They import this module; it imports the installed package (never the other
way: the package knows nothing of the benchmarks) and no other benchmark.

tests/procs.py is the tests' own harness for the same job (a shard or a worker as a process, stopped however
the test ends); it stays apart: tests kill their processes at once (SIGKILL, no wait for a clean exit) and
fail with AssertionError, where a benchmark stops its children cleanly and keeps their logs to report.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamdiloco.common.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent  # the repository: benchmarks run from here
RESULTS = ROOT / "benchmarks" / "results"  # each benchmark's default --out is a folder of this
FORTUNES = Path(
    "/usr/share/games/fortunes"
)  # Debian's fortunes: a second corpus (scripts/system-deps.sh real)


# --- output: print and keep a copy for run.log ------------------------------------------------------------
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


def fortune_files() -> list[Path]:
    """The fortune files of Debian's `fortunes` (quotations between lines of a single %), sorted; their
    index files (.dat) and links (.u8) left out. ValueError (one line) when the package is missing."""
    files = sorted(p for p in FORTUNES.glob("*") if p.is_file() and not p.is_symlink() and p.suffix != ".dat")
    if not files:
        raise ValueError(
            f"no fortunes under {FORTUNES}: install Debian's fortunes (scripts/system-deps.sh real)"
        )
    return files


# --- the machine ------------------------------------------------------------------------------------------
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


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg has them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def system_busy_seconds() -> float:
    """CPU seconds that all processes of the machine have used (all cores, non-idle time), from /proc/stat."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


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


# --- child processes --------------------------------------------------------------------------------------
def sd(*args: str) -> list[str]:
    """The command line of `streamdiloco ARGS` with this interpreter."""
    return [sys.executable, "-m", "streamdiloco", *args]


def bench(module: str, *args: str) -> list[str]:
    """The command line of benchmark `module` (e.g. "wire") with ARGS, run as `python -m benchmarks.wire`:
    a child started by `Procs` runs in the benchmark's own directory (the repository's root), so it
    imports `benchmarks` as its parent did."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


class Procs:
    """Every process the benchmark starts, each in its own session (process group), so that stop() ends it
    and its children (launch's shards and workers, torchrun's ranks) by the group's id."""

    def __init__(self, logdir: Path, cwd: Path | None = None):
        self.logdir, self.cwd = logdir, cwd
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(
        self,
        name: str,
        argv: list[str],
        stdin: bool = False,
        env_extra: dict | None = None,
        pipe: bool = False,
    ) -> subprocess.Popen:
        """Start `argv` as NAME, its output to LOGDIR/NAME.log (with `pipe`, to the Popen's stdout instead,
        for the caller to read); `stdin`: a pipe to write to, else /dev/null."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        with open(self.logdir / f"{name}.log", "w") as log:  # the child holds its own copy
            p = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE if pipe else log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                text=True,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )
        self.procs.append((name, p))
        return p

    def tail(self, name: str, n: int = 15) -> str:
        """The last lines of NAME's log, indented and marked with its name (for an error message)."""
        path = self.logdir / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(f"    [{name}] {line}" for line in lines[-n:])

    def stop(self, p: subprocess.Popen, timeout: float = 10.0) -> None:
        """SIGTERM to the process's group, up to `timeout` s for it to exit, then SIGKILL to what is left."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of the group (a child that ignored SIGTERM)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.poll() is None:
            p.wait()
        for f in (p.stdin, p.stdout):
            if f:
                try:
                    f.close()
                except OSError:
                    pass
        self.procs = [(n, q) for n, q in self.procs if q is not p]  # stopped once, never signalled again

    def stop_all(self) -> None:
        """Every process still running: all are asked at once, then each is waited for (5 s) and killed."""
        for _, p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for _, p in list(self.procs):
            self.stop(p, timeout=5.0)


def wait_files(
    procs: Procs, files: list[Path], watch: list[tuple[str, subprocess.Popen]], timeout: float
) -> None:
    """Wait until every file exists; RuntimeError (with the log's tail) if a watched process exits first,
    or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        for name, p in watch:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with status {p.returncode}:\n{procs.tail(name)}")
        if time.monotonic() > deadline:
            tails = "\n".join(procs.tail(name) for name, _ in watch)
            waited = [str(f) for f in files]
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {waited}:\n{tails}")
        time.sleep(0.05)


def http_json(port: int, path: str = "/api/status") -> Any:
    """GET a JSON page of a process on loopback."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())


def shard_argv(s: int, num: int, ready: Path, flags: list[str], port: int = 0) -> list[str]:
    """`server` arguments of shard s of num on loopback: gRPC on `port` (0: any), HTTP on any port, its
    ports written to `ready` once it serves."""
    argv = ["server", "--shard", str(s), "--num-shards", str(num), "--host", "127.0.0.1"]
    return argv + ["--port", str(port), "--http-port", "0", "--ready-file", str(ready), *flags]


def start_shards(
    procs: Procs,
    tmp: Path,
    tag: str,
    num: int,
    flags: list[str],
    wrap: list[str] | None = None,
    checkpoint: bool = True,
    env_extra: dict | None = None,
    timeout: float = 180.0,
) -> list[tuple[str, subprocess.Popen, dict]]:
    """S shard processes named TAG-shard<s> (checkpointing every round into a fresh directory, or with
    --no-checkpoint; `wrap`: an interpreter command line to run them under, e.g. cProfile's); waits until
    all serve. Returns their (name, Popen, {grpc_port, http_port, shard})."""
    out = []
    for s in range(num):
        ready = tmp / f"{tag}-shard{s}.ready"
        argv = shard_argv(s, num, ready, flags)
        if checkpoint:
            argv += ["--checkpoint-dir", str(tmp / f"{tag}-shard{s}-checkpoint"), "--fresh"]
        else:
            argv += ["--no-checkpoint"]
        cmd = (wrap + ["-m", "streamdiloco", *argv]) if wrap else sd(*argv)
        name = f"{tag}-shard{s}"
        out.append((name, procs.start(name, cmd, env_extra=env_extra), ready))
    wait_files(procs, [r for _, _, r in out], [(n, p) for n, p, _ in out], timeout=timeout)
    return [(n, p, json.loads(r.read_text())) for n, p, r in out]


class Run:
    """Shard and worker processes of one measured run, by name (TAG-shard<s>, TAG-w<m>); their files
    (ready files, summaries, checkpoints) in `tmp`."""

    def __init__(self, procs: Procs, tmp: Path, tag: str):
        self.procs, self.tmp, self.tag = procs, tmp, tag
        self.p: dict[str, subprocess.Popen] = {}

    def shard(self, s: int, num: int, flags: list[str], port: int = 0) -> dict:
        """Start (or restart, on the same gRPC port) shard s; its ports once it serves."""
        ready = self.tmp / f"{self.tag}-shard{s}.ready"
        ready.unlink(missing_ok=True)
        name = f"{self.tag}-shard{s}"
        argv = sd(*shard_argv(s, num, ready, flags, port))
        p = self.procs.start(name + (f"-{port}" if port else ""), argv, env_extra={"OMP_NUM_THREADS": "1"})
        self.p[name] = p
        wait_files(self.procs, [ready], [(name, p)], timeout=180)
        return json.loads(ready.read_text())

    def worker(self, m: int, servers: str, flags: list[str], threads: int) -> None:
        """Start worker m (named w<m>, rank m) with `threads` torch threads; evaluated at its start and end
        only, as when measured."""
        name = f"{self.tag}-w{m}"
        argv = ["worker", "--servers", servers, "--name", f"w{m}", "--rank", str(m), "--eval-every", "0"]
        argv += ["--summary", str(self.tmp / f"{name}.json"), "--checkpoint", str(self.tmp / f"{name}.pt")]
        self.p[name] = self.procs.start(name, sd(*argv, *flags), env_extra={"OMP_NUM_THREADS": str(threads)})

    def wait_workers(self, names: list[str], timeout: float = 900) -> list[dict]:
        """Wait for the workers (w0, ...) to end; their summaries. RuntimeError if one fails."""
        deadline = time.monotonic() + timeout
        for n in names:
            name = f"{self.tag}-{n}"
            code = self.p[name].wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{name} exited with {code}:\n{self.procs.tail(name)}")
        return [json.loads((self.tmp / f"{self.tag}-{n}.json").read_text()) for n in names]

    def stop_shards(self) -> None:
        """Stop the run's shards (the workers have ended)."""
        for name, p in list(self.p.items()):
            if "shard" in name:
                self.procs.stop(p)
