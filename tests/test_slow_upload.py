"""A volunteer's home link at the start of a run: the first worker uploads its starting parameters to a shard
started with `--init from-worker` (its defaults: --init-timeout 30, --init-min-rate 16384) over 1 Mbit/s each
way, 50 ms round trips and a modem that queues a second of data, and the run then trains from them.

Before issue 37 no such upload went through: the call's first message carried a MiB of values (8 s over
1 Mbit/s, past the shard's 5 s for a call's request), and the uploader's keepalive ping waited behind the
4 MiB it had queued and cut the call after about 10 s. The network is benchmarks/wan/'s testbed, as in
tests/test_slow_link.py, under a prefix of this test's own; everything it makes is removed at the end. It
needs root and iproute2 and nftables (scripts/system-deps.sh installs them).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks import wan
from benchmarks.wan import DC_ADDR, PROXY_PORT, SHARD_PORT, in_ns, proxy_limit, wan_py

ROOT = Path(__file__).resolve().parent.parent
PREFIX = f"sdlu{os.getpid() % 100_000}-"  # this test's namespaces: apart from a benchmark's and other runs'
RATE, QUEUE, DELAY = 1.0, 1.0, 0.025  # Mbit/s each way, seconds the modem queues, seconds one way
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "nft")),
        reason="network namespaces need root, iproute2 and nftables (scripts/system-deps.sh)",
    ),
]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_file(path: Path, proc: subprocess.Popen, what: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what} did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)


def _stamp(line: str) -> float:
    return datetime.fromisoformat(line.split()[0]).timestamp()


def test_the_first_worker_uploads_its_parameters_over_a_slow_link_and_trains(tmp_path):
    wan.Testbed.remove_all(PREFIX)
    bed = wan.Testbed(1, prefix=PREFIX)
    procs: list[subprocess.Popen] = []
    try:
        bed.create()
        bed.shape(RATE, QUEUE)
        ready = tmp_path / "proxy.ready"
        argv = wan_py("_proxy", "--port", str(PROXY_PORT), "--delay", str(DELAY))
        argv += ["--limit", str(proxy_limit(DELAY, RATE)), "--ready", str(ready)]
        procs.append(_start(in_ns(bed.ns[0], *argv), tmp_path / "proxy.log"))
        _wait_file(ready, procs[-1], "the delaying proxy", tmp_path / "proxy.log")

        shard_log, ready = tmp_path / "shard.log", tmp_path / "shard.ready"
        argv = [sys.executable, "-m", "streamdiloco", "server", "--host", DC_ADDR, "--port", str(SHARD_PORT)]
        argv += ["--http-port", "0", "--insecure", "--init", "from-worker", "--ready-file", str(ready)]
        argv += ["--checkpoint-dir", str(tmp_path / "shard-checkpoint")]
        procs.append(_start(in_ns(bed.dc, *argv), shard_log))
        _wait_file(ready, procs[-1], "the shard", shard_log)

        log = tmp_path / "worker.log"
        argv = [sys.executable, "-m", "streamdiloco", "worker", "--servers", f"{DC_ADDR}:{SHARD_PORT}"]
        argv += ["--name", "home", "--model", "tiny", "--steps", "6", "--eval-every", "0"]
        argv += ["--checkpoint-every", "0", "--checkpoint", str(tmp_path / "w.pt")]
        worker = _start(in_ns(bed.ns[0], *argv), log)
        procs.append(worker)
        try:
            code = worker.wait(timeout=400)
        except subprocess.TimeoutExpired:
            code = None
        text, shard = log.read_text(errors="replace"), shard_log.read_text(errors="replace")
        assert code == 0, f"the worker ended with {code}:\n{text[-4000:]}\nshard:\n{shard[-2000:]}"
        # one upload, never cut off, never refused
        assert "sending again" not in text and "refused" not in shard, text[-4000:] + shard[-2000:]
        lines = shard.splitlines()
        began = next(x for x in lines if "home is sending the starting parameters" in x)
        took = next(x for x in lines if "starting parameters from home" in x)
        size = int(re.search(r"\(([\d,]+) bytes for this shard\)", began)[1].replace(",", ""))
        seconds = _stamp(took) - _stamp(began)
        # at the link's rate, several times what the shard's floor asks
        assert seconds > size / (RATE * 125_000), seconds  # the shaping held
        assert size / seconds > 4 * 16384, f"{size:,} bytes in {seconds:.1f} s"
        print(f"the upload: {size:,} bytes in {seconds:.1f} s ({8 * size / seconds / 1e6:.2f} Mbit/s)")
    finally:
        for p in procs[::-1]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        wan.Testbed.remove_all(PREFIX)
        assert not wan.Testbed.leftovers(PREFIX)
