"""A volunteer's home link: a worker joins a shard over 1 Mbit/s each way, 50 ms round trips and a modem that
queues a second of data, fetches the run's parameters (about 28 s: several times the liveness bound) and
trains a few rounds without its session ever breaking, ending with its mirror equal to the shard's masters.

Loopback hides this: before common/keepalive.py turned off gRPC's bandwidth probes, their pings' acks waited
behind the Fetch's queued bytes and every session broke within seconds of joining ("ping timeout"), until
the worker gave up. The network is benchmarks/wan/'s testbed (network namespaces, tbf on both ends of the
worker's veth, its delaying proxy), under a prefix of this test's own; everything it makes is removed at the
end. It needs root and iproute2 and nftables (scripts/system-deps.sh installs them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import wan
from benchmarks.wan import DC_ADDR, SHARD_PORT, in_ns
from streamdiloco.common.keepalive import LIVENESS_SECONDS
from tests.support.homelink import home_link, needs_namespaces, stamp

PREFIX = f"sdlt{os.getpid() % 100_000}-"  # this test's namespaces: apart from a benchmark's and other runs'
HTTP_PORT = 8080
STEPS = 40  # H = 30, P = 5 (the defaults): a push every 6 steps, then the final sync of every fragment


@needs_namespaces
def test_a_worker_on_a_slow_link_stays_joined_and_ends_in_sync(tmp_path):
    with home_link(tmp_path, PREFIX) as link:
        shard_log, ready = tmp_path / "shard.log", tmp_path / "shard.ready"
        argv = [sys.executable, "-m", "streamdiloco", "server", "--host", DC_ADDR, "--port", str(SHARD_PORT)]
        argv += ["--http-port", str(HTTP_PORT), "--insecure", "--no-checkpoint", "--model", "tiny"]
        link.start_ready(link.bed.dc, argv, shard_log, ready, "the shard")

        log, summary = tmp_path / "worker.log", tmp_path / "worker.json"
        argv = [sys.executable, "-m", "streamdiloco", "worker", "--servers", f"{DC_ADDR}:{SHARD_PORT}"]
        argv += ["--name", "home", "--model", "tiny", "--steps", str(STEPS), "--log-every", "10"]
        argv += ["--eval-every", "0", "--checkpoint-every", "0", "--checkpoint", str(tmp_path / "w.pt")]
        worker = link.start(link.bed.ns[0], [*argv, "--summary", str(summary)], log)
        try:
            code = worker.wait(timeout=300)
        except subprocess.TimeoutExpired:
            code = None
        text = log.read_text(errors="replace")
        assert code == 0, f"the worker ended with {code}:\n{text[-4000:]}"

        # the session held: no break, no reconnect, on either end
        assert not re.search(r"broke|reconnect|ping timeout", text), text[-4000:]
        assert "ping_timeout" not in shard_log.read_text(errors="replace")
        # the first Fetch (from the shard's config to the parameters in place) took several bounds
        lines = text.splitlines()
        asked = next(stamp(x) for x in lines if "from the shard at" in x)
        fetched = next(stamp(x) for x in lines if " params in " in x)
        assert fetched - asked > 2 * LIVENESS_SECONDS, f"the Fetch took {fetched - asked:.1f} s"
        print(f"the Fetch took {fetched - asked:.1f} s; the liveness bound is {LIVENESS_SECONDS:g} s")

        # a few rounds trained, and the worker's mirror is the shard's masters
        s = json.loads(summary.read_text())
        assert s["pushes"] >= STEPS // 6, s["pushes"]
        read = (
            "import json,sys,urllib.request as u; print(u.urlopen(sys.argv[1], timeout=30).read().decode())"
        )
        out = subprocess.run(
            in_ns(link.bed.dc, sys.executable, "-c", read, f"http://{DC_ADDR}:{HTTP_PORT}/api/status"),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        status = json.loads(out)
        assert s["mirror_hashes"] == [[f["master_hash"]] for f in status["fragments"]]
        assert all(f["round"] >= 1 for f in status["fragments"]), status["fragments"]


def test_the_benchmark_reads_how_long_pings_waited_from_grpcs_trace():
    """`python -m benchmarks.wan pings LOG`: each ping's wait for its ack, by end, from grpc-core's trace
    (how BENCHMARKS.md's figures for pings behind a modem's queue were read)."""
    trace = [
        "I1128 23:59:58.500000 1 writing.cc:144] SERVER[0x7f01]: Ping 11 sent [ipv4:10.0.0.1:5]: ...",
        "I1128 23:59:59.000000 1 writing.cc:144] CLIENT[0x7f02]: Ping 11 sent [ipv4:10.0.0.2:5]: ...",
        "2026-11-28T23:59:59.100+00:00 INFO streamdiloco.shard: a line of the shard's own",
        "I1128 23:59:59.250000 1 frame_ping.cc:96] CLIENT[0x7f02]: received ping ack 11",
        "I1129 00:00:02.000000 1 frame_ping.cc:96] SERVER[0x7f01]: received ping ack 11",  # past midnight
        # a ping never answered, then an ack of a ping that is not in the trace
        "I1129 00:00:03.000000 1 writing.cc:144] SERVER[0x7f01]: Ping 12 sent [ipv4:10.0.0.1:5]: ...",
        "I1129 00:00:04.000000 1 frame_ping.cc:96] SERVER[0x7f01]: received ping ack 99",
    ]
    got = wan.ping_answers(trace)
    assert got == {"SERVER": [pytest.approx(3.5)], "CLIENT": [pytest.approx(0.25)]}
