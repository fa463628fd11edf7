"""Liveness with real processes on loopback: a peer that stops answering while it keeps its TCP connection
(a frozen process: SIGSTOP, as a sleeping laptop) is noticed within the liveness bound, not at the round
deadline. The shard drops a frozen worker; a worker reconnects to a shard that was frozen and resumed. Every
test bounds its waits, resumes (SIGCONT) what it stopped and kills what it started."""

from __future__ import annotations

import re
import signal
import time

import pytest

from streamdiloco.common.keepalive import LIVENESS_SECONDS, MIN_PING_INTERVAL_MS, RECEIVE_WINDOW, LinkSettings
from streamdiloco.common.wire import CHANNEL_OPTIONS, SERVER_OPTIONS, channel_options
from streamdiloco.server.trust.bounds import Limits, grpc_options
from tests.support.procs import Cluster, http_json, wait_until

NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--merge-policy", "fixed"]
LIVENESS = 2.0  # the shard's --liveness-timeout in these tests
SLACK = 3.0  # a busy machine's delay in noticing and in polling the status
# a round timeout far beyond the tests' waits: only liveness can let a round close without a frozen member
SHARD = [*NANO, "--min-workers", "1", "--round-timeout", "300", "--liveness-timeout", str(LIVENESS)]
WORK = [*NANO, "--log-every", "60", "--checkpoint-every", "0", "--step-delay", "0.02"]


def _members(http: int) -> set[str]:
    return {m["name"] for m in http_json(http)["members"] if m["state"] == "member"}


def test_the_liveness_bound_sets_both_ends_keepalive_and_the_shard_permits_the_workers_pings():
    shard = dict(grpc_options(Limits(), LinkSettings(liveness_timeout=3), 8, 1 << 20))
    # a ping after 1 s in which nothing was read, its ack awaited 2 s (grpc-core's ping timeout would
    # otherwise wait a minute); TCP gives up on unacknowledged data after the whole bound
    assert (shard["grpc.keepalive_time_ms"], shard["grpc.http2.ping_timeout_ms"]) == (1000, 2000)
    assert shard["grpc.keepalive_timeout_ms"] == 3000
    worker, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    assert worker["grpc.keepalive_time_ms"] + worker["grpc.http2.ping_timeout_ms"] == LIVENESS_SECONDS * 1000
    # no pings but keepalive's (on a slow link, a bandwidth probe's ack waits behind the data: tests/
    # test_slow_link.py), and the window that probing would have grown is fixed instead
    for options in (shard, worker, server):
        assert options["grpc.http2.bdp_probe"] == 0
        assert options["grpc.http2.lookahead_bytes"] == RECEIVE_WINDOW
    # a worker sets its own bound and window
    mine = dict(channel_options(LinkSettings(liveness_timeout=4, receive_window=1 << 20)))
    assert (mine["grpc.keepalive_time_ms"], mine["grpc.http2.ping_timeout_ms"]) == (1333, 2667)
    assert mine["grpc.http2.lookahead_bytes"] == 1 << 20
    # the worker's pings are never "too many": no GOAWAY too_many_pings
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_MS
    assert MIN_PING_INTERVAL_MS <= worker["grpc.keepalive_time_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0
    for bad, message in [
        ({"liveness_timeout": 1.5}, "--liveness-timeout must be at least 2 seconds .* got 1.5"),
        ({"liveness_timeout": float("nan")}, "--liveness-timeout must be"),
        ({"receive_window": 1000}, "--receive-window must be 65536 bytes .* got 1000"),
        ({"receive_window": 2 << 30}, "--receive-window must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            LinkSettings(**bad)


def test_a_frozen_worker_stops_holding_rounds_within_the_liveness_bound(tmp_path):
    work = [*WORK, "--steps", "100000"]  # longer than the test: the Cluster kills them
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *SHARD)
        b = c.worker("worker-b", [target], *work, "--rank", "1")
        c.worker("worker-a", [target], *work, "--rank", "0")
        wait_until("both workers to be members", lambda: _members(http) == {"worker-a", "worker-b"}, 120)
        # rounds with both of them: worker-b is a contributor, so its freeze holds a round
        wait_until(
            "a round with both workers",
            lambda: any(len(r["contributors"]) == 2 for r in http_json(http)["recent_rounds"]),
            120,
        )
        try:
            b.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            before: dict[int, int] = {}  # per fragment, the last round closed when worker-b froze
            for r in http_json(http, "/api/status?rounds=500")["recent_rounds"]:
                before[r["fragment"]] = max(before.get(r["fragment"], -1), r["round"])
            wait_until("worker-b to stop being a member", lambda: "worker-b" not in _members(http), 60)
            noticed = time.monotonic() - frozen
            assert noticed < LIVENESS + SLACK, noticed
            assert _members(http) == {"worker-a"}

            # worker-a goes on alone: rounds close with it as their one contributor, never by the deadline.
            # Three of each fragment after the freeze put worker-b more than a round (H steps) behind the
            # run, so that it skips ahead once thawed (old rounds of worker-a alone, or fewer, would let it
            # thaw within the grace, and it would go on where it was)
            def alone() -> list[dict] | None:
                rounds = http_json(http, "/api/status?rounds=500")["recent_rounds"]
                mine = [r for r in rounds if r["round"] > before.get(r["fragment"], -1)]
                per = [
                    sum(r["fragment"] == f and r["contributors"] == ["worker-a"] for r in mine)
                    for f in range(3)
                ]
                return mine if min(per) >= 3 else None

            closed = wait_until("rounds of worker-a alone", alone, 60)
            assert all(r["why"] != "deadline" and (r["seconds"] or 0) < 60 for r in closed), closed
            print(f"worker-b frozen: no longer a member after {noticed:.2f} s")
            last: dict[int, int] = {}  # per fragment, the last round closed without worker-b
            for r in closed:
                last[r["fragment"]] = max(last.get(r["fragment"], 0), r["round"])
        finally:
            b.send_signal(signal.SIGCONT)
        assert "worker-b left" in c.log("shard")
        # thawed whole rounds behind, worker-b goes on from where the run is (as a joiner would) and its
        # pushes count again; trained on from where it was, each would be late, or for a round long closed
        try:
            wait_until(
                "worker-b to go on from the run's step",
                lambda: re.search(r"was \d+ steps behind the run", c.log("worker-b")),
                120,
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- worker-b ---\n{c.log('worker-b')[-3000:]}") from None

        def with_b_again() -> bool:
            rounds = http_json(http, "/api/status?rounds=500")["recent_rounds"]
            return any(
                r["round"] > last.get(r["fragment"], 0) and "worker-b" in r["contributors"] for r in rounds
            )

        wait_until("a round with worker-b's push after its thaw", with_b_again, 120)


# ~40 s (the worker's default bound of LIVENESS_SECONDS, then a reconnect and the rest of the run): in
# `make test-slow`
@pytest.mark.slow
def test_a_worker_notices_a_frozen_shard_and_reconnects_once_it_resumes(tmp_path):
    work = [*WORK, "--steps", "600"]
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *SHARD)
        shard = c.procs["shard"]
        c.worker("worker-a", [target], *work, "--rank", "0")
        wait_until("worker-a to be a member", lambda: _members(http) == {"worker-a"}, 120)
        wait_until("a round to close", lambda: http_json(http)["recent_rounds"], 120)
        try:
            shard.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            wait_until(
                "worker-a to notice the frozen shard",
                lambda: re.search(r"; reconnecting", c.log("worker-a")),
                60,
                every=0.1,
            )
            noticed = time.monotonic() - frozen
            assert noticed < LIVENESS_SECONDS + SLACK, noticed
            print(f"shard frozen: worker-a noticed after {noticed:.2f} s")
        finally:
            shard.send_signal(signal.SIGCONT)
        assert c.wait("worker-a", timeout=180) == 0, c.log("worker-a")[-4000:]
        a = c.summary("worker-a")
        status = http_json(http)
    assert "reconnected to shard 0" in c.log("worker-a")
    masters = [[f["master_hash"]] for f in status["fragments"]]
    assert a["mirror_hashes"] == masters
