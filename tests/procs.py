"""Real processes for end-to-end tests: a shard started with `python -m streamdiloco server` on loopback,
stopped (SIGTERM, then SIGKILL) however the test ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def streamdiloco(*args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamdiloco", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@contextlib.contextmanager
def shard_process(tmp: Path, *flags: str, name: str = "shard", cwd: Path = ROOT):
    """Yields (target HOST:PORT, http port, Popen) of a running shard; its output goes to tmp/name.log."""
    ready = tmp / f"{name}.ready"
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamdiloco", "server", "--port", "0", "--http-port", "0"]
        + ["--ready-file", str(ready), "--checkpoint-dir", str(tmp / f"{name}-checkpoint"), *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=cwd,
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
        log.close()


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
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
        self.procs: dict[str, subprocess.Popen] = {}
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

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "a")  # noqa: SIM115 (the child holds it; closed below)
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamdiloco", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=self.env,
        )
        log.close()
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

    def worker(self, name: str, servers: list[str], *flags: str) -> subprocess.Popen:
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
