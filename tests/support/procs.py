"""Real processes for end-to-end tests: shards, workers and other `python -m streamdiloco` commands on
loopback, stopped (SIGTERM, then SIGKILL) however the test ends.

They start through tests/support/forkserver.py: one interpreter per test process imports torch and the
rest once, and forks each command from there (a real process that skips the ~4 s of imports).
STREAMDILOCO_TEST_FORK=0 starts every one as a fresh interpreter instead."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# settings that the imports read: a command whose environment differs here gets a fresh interpreter
IMPORT_ENV = ("PYTHONPATH", "STREAMDILOCO_CODECS_NUMBA", "PYTHONHASHSEED")
TEST_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ForkServer:
    """The client of one forkserver.py process (beside this file)."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("forkserver.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        self.cond = threading.Condition()
        self.started: dict[int, int] = {}  # request id -> pid
        self.exited: dict[int, int] = {}  # pid -> return code
        self.alive = True
        self.next_id = 0
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line or "ready" not in json.loads(line):
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            event = json.loads(line)
            with self.cond:
                if "started" in event:
                    self.started[event["started"]] = event["pid"]
                else:
                    self.exited[event["exited"]] = event["code"]
                self.cond.notify_all()
        with self.cond:
            self.alive = False
            self.cond.notify_all()

    def spawn(
        self, args: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path | None
    ) -> Forked:
        with self.cond:
            rid, self.next_id = self.next_id, self.next_id + 1
            request = {"id": rid, "args": args, "env": env, "cwd": str(cwd)}
            request |= {"stdout": str(stdout), "stderr": stderr and str(stderr)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            if not self.cond.wait_for(lambda: rid in self.started or not self.alive, timeout=60):
                raise RuntimeError("the fork server did not answer in 60 s")
            if not self.alive:
                raise RuntimeError("the fork server is gone")
            return Forked(self, self.started.pop(rid), args)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]  # it kills what is left of its children
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


class Forked:
    """A child of the fork server, as much of subprocess.Popen as the tests use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def _done(self) -> bool:
        return self.pid in self.server.exited or not self.server.alive

    def poll(self) -> int | None:
        with self.server.cond:
            if self.returncode is None and self._done():
                self.returncode = self.server.exited.get(self.pid, -signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.cond:
            if not self.server.cond.wait_for(self._done, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.poll()  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_server: list[ForkServer] = []  # this test process's, started at its first command
_IMPORTED = {k: os.environ.get(k) for k in IMPORT_ENV}  # as the test process started: its fork server's


def start_process(
    args: list[str], *, stdout: Path, stderr: Path | None = None, env: dict | None = None, cwd: Path = ROOT
) -> Forked | subprocess.Popen:
    """`python -m streamdiloco ARGS` with its output appended to `stdout` (and `stderr`, else with it): a
    child of the fork server, or a fresh interpreter where the environment changes what an import reads."""
    env = {**os.environ, **TEST_ENV} if env is None else env
    fresh = os.environ.get("STREAMDILOCO_TEST_FORK", "1") == "0"
    if fresh or any(env.get(k) != _IMPORTED.get(k) for k in IMPORT_ENV):
        with open(stdout, "a") as out, open(stderr or stdout, "a") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "streamdiloco", *args], stdout=out, stderr=err, cwd=cwd, env=env
            )
    if not _server:
        base = {k: v for k, v in {**os.environ, **TEST_ENV}.items() if k not in IMPORT_ENV}
        _server.append(ForkServer({**base, **{k: v for k, v in _IMPORTED.items() if v is not None}}))
        atexit.register(_server[0].close)
    return _server[0].spawn(args, env, cwd, stdout, stderr)


def streamdiloco(*args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `python -m streamdiloco ARGS` to its end: its exit code, stdout and stderr (as subprocess.run
    with capture_output and text); killed, and TimeoutExpired, after `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="streamdiloco-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = start_process(list(args), stdout=out, stderr=err, env={**os.environ}, cwd=cwd)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "streamdiloco", *args], code, out.read_text(), err.read_text()
        )


# a fresh interpreter: each argv through the command line's main(), refused in one line without torch
_REFUSALS = r"""
import contextlib, io, json, sys

from streamdiloco.cli import main

cases, heavy = json.loads(sys.argv[1])
for argv, expect in cases:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    lines = err.getvalue().strip().splitlines()
    assert rc == 2 and len(lines) == 1, (argv, rc, err.getvalue()[-2000:])
    assert lines[0].startswith("streamdiloco: error: ") and expect in lines[0], (argv, lines[0])
    for module in heavy:
        assert module not in sys.modules, f"{' '.join(['streamdiloco', *argv])} imported {module}"
"""


def quick_benchmark(module: str, out: Path, timeout: float = 600) -> dict:
    """`python -m benchmarks.MODULE --quick --out OUT` run to its end (exit 0, or the test fails with its
    output's end); its results.json."""
    r = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def refused_in_one_line(cases: list[tuple[list[str], str]], heavy: tuple[str, ...] = ("torch",)) -> None:
    """Run every `streamdiloco ARGV` of `cases` ((argv, expected text) pairs) in one fresh interpreter, one
    after the other: each must exit 2 with one line, `streamdiloco: error: ...` holding its expected text,
    and none may have imported a module of `heavy` (torch: a mistyped flag answers at once)."""
    probe = [sys.executable, "-c", _REFUSALS, json.dumps([cases, list(heavy)])]
    r = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


@contextlib.contextmanager
def shard_process(tmp: Path, *flags: str, name: str = "shard", cwd: Path = ROOT):
    """Yields (target HOST:PORT, http port, Popen) of a running shard; its output goes to tmp/name.log."""
    ready = tmp / f"{name}.ready"
    log = tmp / f"{name}.log"
    log.write_text("")
    proc = start_process(
        ["server", "--port", "0", "--http-port", "0"]
        + ["--ready-file", str(ready), "--checkpoint-dir", str(tmp / f"{name}-checkpoint"), *flags],
        stdout=log,
        cwd=cwd,
        env={**os.environ},
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"shard exited with {proc.returncode}: {(tmp / f'{name}.log').read_text()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("shard not ready after 60 s")
            time.sleep(0.05)
        ports = json.loads(ready.read_text())
        yield f"127.0.0.1:{ports['grpc_port']}", ports["http_port"], proc
    finally:
        stop(proc)


def stop(proc: Forked | subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def http_json(port: int, path: str = "/api/status") -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


def masters_hashes(http: list[int]) -> list[list[str]]:
    """[fragment][shard] master hashes of the shards at these HTTP ports, as a worker's summary lists its
    mirror's."""
    per_shard = [[f["master_hash"] for f in http_json(p)["fragments"]] for p in http]
    return [list(x) for x in zip(*per_shard, strict=True)]


SLACK = 10.0  # seconds a loaded machine may add to a deadline


def wait_until(what: str, pred, timeout: float = 60.0, every: float = 0.05):
    """Poll `pred()` until it returns something truthy (returned); AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
        except (OSError, ValueError):  # a process not serving yet
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


class Cluster:
    """Shard and worker processes of one test, each logging to tmp/NAME.log; every one of them is stopped
    (SIGKILL) when the `with` block ends, however it ends."""

    def __init__(self, tmp: Path, env: dict | None = None):
        self.tmp = tmp
        self.procs: dict[str, Forked | subprocess.Popen] = {}
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if getattr(proc, "own_session", False):  # a launcher (torchrun): its children go with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def start(self, name: str, *args: str) -> Forked | subprocess.Popen:
        proc = start_process(list(args), stdout=self.tmp / f"{name}.log", env=self.env)
        self.procs[name] = proc
        return proc

    def shard(self, name: str, *flags: str, port: int = 0) -> tuple[str, int]:
        """Start (or restart, on the same port) a shard; returns (target, http port) once it serves."""
        ready = self.tmp / f"{name}.ready"
        ready.unlink(missing_ok=True)
        proc = self.start(
            name,
            "server",
            *("--host", "127.0.0.1", "--port", str(port), "--http-port", "0", "--ready-file", str(ready)),
            *("--checkpoint-dir", str(self.tmp / f"{name}-checkpoint")),
            *flags,
        )

        def up():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}: {self.log(name)[-3000:]}")
            return ready.exists() and json.loads(ready.read_text())

        ports = wait_until(f"{name} to serve", up, timeout=60)
        return f"127.0.0.1:{ports['grpc_port']}", ports["http_port"]

    def worker(self, name: str, servers: list[str], *flags: str) -> Forked | subprocess.Popen:
        return self.start(
            name,
            "worker",
            *("--servers", ",".join(servers), "--name", name),
            *("--summary", str(self.tmp / f"{name}.json"), "--checkpoint", str(self.tmp / f"{name}.pt")),
            *flags,
        )

    def summary(self, name: str) -> dict:
        return json.loads((self.tmp / f"{name}.json").read_text())

    def wait(self, name: str, timeout: float = 300) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {timeout:g} s: {self.log(name)[-3000:]}"
            ) from None
