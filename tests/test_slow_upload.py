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
import subprocess
import sys

import pytest

from benchmarks.wan import DC_ADDR, SHARD_PORT
from tests.support.homelink import RATE, home_link, needs_namespaces, stamp

PREFIX = "sdlu{}-"  # this test's namespaces: apart from a benchmark's and other runs'

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), needs_namespaces]


def test_the_first_worker_uploads_its_parameters_over_a_slow_link_and_trains(tmp_path):
    with home_link(tmp_path, PREFIX.format(os.getpid() % 100_000)) as link:
        shard_log, ready = tmp_path / "shard.log", tmp_path / "shard.ready"
        argv = [sys.executable, "-m", "streamdiloco", "server", "--host", DC_ADDR, "--port", str(SHARD_PORT)]
        argv += ["--http-port", "0", "--insecure", "--init", "from-worker"]
        argv += ["--checkpoint-dir", str(tmp_path / "shard-checkpoint")]
        link.start_ready(link.bed.dc, argv, shard_log, ready, "the shard")

        log = tmp_path / "worker.log"
        argv = [sys.executable, "-m", "streamdiloco", "worker", "--servers", f"{DC_ADDR}:{SHARD_PORT}"]
        argv += ["--name", "home", "--model", "tiny", "--steps", "6", "--eval-every", "0"]
        argv += ["--checkpoint-every", "0", "--checkpoint", str(tmp_path / "w.pt")]
        worker = link.start(link.bed.ns[0], argv, log)
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
        seconds = stamp(took) - stamp(began)
        # at the link's rate, several times what the shard's floor asks
        assert seconds > size / (RATE * 125_000), seconds  # the shaping held
        assert size / seconds > 4 * 16384, f"{size:,} bytes in {seconds:.1f} s"
        print(f"the upload: {size:,} bytes in {seconds:.1f} s ({8 * size / seconds / 1e6:.2f} Mbit/s)")
