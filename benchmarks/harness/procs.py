"""The processes a benchmark starts: `Procs` starts every child in its own session (its log in
LOGDIR/NAME.log) and stops it with its children (SIGTERM to the group, then SIGKILL), also on an error and on
Ctrl+C (`stop_all`, which session.py's `Session` calls). `sd(...)` is a `python -m streamdiloco ...` command
line and `bench(...)` one of a benchmark module's (its internal subcommands); `start_shards` starts S shard
processes and waits until they serve, `Run` a run's shards and workers by name; `wait_files` waits for ready
files while watching that their processes still run (a port to give a child: `common/ports.py`'s
`free_port`, re-exported by the harness).

tests/support/procs.py is the tests' own harness for the same job; it stays apart: tests kill their
processes at once (SIGKILL, no wait for a clean exit) and fail with AssertionError, where a benchmark stops
its children cleanly and keeps their logs to report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import ROOT


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
    and its children (launch's shards and workers, torchrun's ranks) by the group's id. They run in `cwd`,
    the repository's root by default (where `python -m benchmarks.NAME` finds its package)."""

    def __init__(self, logdir: Path, cwd: Path = ROOT):
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
