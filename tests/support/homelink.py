"""A volunteer's home link for tests: benchmarks/wan/'s testbed (network namespaces, tbf on both ends of the
worker's veth, its delaying proxy) shaped to RATE Mbit/s each way, QUEUE seconds of modem queue and 2 x
DELAY round trips, under a prefix of the test's own. `home_link` makes it and, whatever happens, stops every
process started on it and removes every namespace; tests/test_slow_link.py (a worker joins and trains) and
tests/test_slow_upload.py (the first worker uploads the starting parameters) run across it. It needs root,
iproute2 and nftables (scripts/system-deps.sh installs them): `needs_namespaces` skips a test, saying why,
where they are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks import wan
from benchmarks.wan import PROXY_PORT, in_ns, proxy_limit, wan_py

ROOT = Path(__file__).resolve().parents[2]
RATE = 1.0  # Mbit/s each way
QUEUE = 1.0  # seconds of that rate the modem holds
DELAY = 0.025  # seconds one way: 50 ms round trips
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "nft")),
    reason="network namespaces need root, iproute2 and nftables (scripts/system-deps.sh)",
)


def stamp(line: str) -> float:
    """The time of a log line (2026-11-28T13:44:08.915+00:00 ...) in seconds."""
    return datetime.fromisoformat(line.split()[0]).timestamp()


@dataclass
class HomeLink:
    """The shaped testbed (`bed`: its `dc` namespace holds the shard's side, `ns[0]` the worker's) and the
    processes started on it."""

    bed: wan.Testbed
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, where: str, argv: list[str], log: Path) -> subprocess.Popen:
        """Run `argv` in namespace `where`, its output into `log`; stopped when the link goes."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                in_ns(where, *argv), cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def start_ready(
        self, where: str, argv: list[str], log: Path, ready: Path, what: str, flag: str = "--ready-file"
    ) -> None:
        """Run `argv` with `FLAG READY` (a shard's --ready-file; the proxy's --ready) and wait until it has
        written READY; the test fails, with the log's end, if it ends or takes two minutes first."""
        proc = self.start(where, [*argv, flag, str(ready)], log)
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{what} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.procs[::-1]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@contextmanager
def home_link(tmp_path: Path, prefix: str) -> Iterator[HomeLink]:
    """The testbed under `prefix`, shaped, with its delaying proxy running in the worker's namespace."""
    wan.Testbed.remove_all(prefix)
    link = HomeLink(wan.Testbed(1, prefix=prefix))
    try:
        link.bed.create()
        link.bed.shape(RATE, QUEUE)
        argv = wan_py("_proxy", "--port", str(PROXY_PORT), "--delay", str(DELAY))
        argv += ["--limit", str(proxy_limit(DELAY, RATE))]
        proxy = (tmp_path / "proxy.log", tmp_path / "proxy.ready", "the delaying proxy", "--ready")
        link.start_ready(link.bed.ns[0], argv, *proxy)
        yield link
    finally:
        link.stop()
        wan.Testbed.remove_all(prefix)
        assert not wan.Testbed.leftovers(prefix)
