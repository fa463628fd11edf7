"""Real processes for end-to-end tests: a shard started with `python -m streamdiloco server` on loopback,
stopped (SIGTERM, then SIGKILL) however the test ends."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
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
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
