"""server/observe/status.py: the status JSON and the dashboard's series as read from a shard's parts
(`Observed`), no network. What the parts hold is what status says: the round of each fragment, the
members and their pushes being received, the bounds held and refused, the counters; the masters' hashes
are taken once per round."""

from __future__ import annotations

import asyncio

from streamdiloco.common.fingerprint import tensor_digest
from streamdiloco.server.shard import Shard
from tests.support.nano_shard import CFG, build, slice_push


def _shard() -> Shard:
    shard = build()
    assert isinstance(shard, Shard)
    return shard


def test_status_says_what_the_parts_hold():
    shard = _shard()
    st, view = shard.state, shard.view
    status = view.status(rounds=5, hashes=False, credits=3)
    assert (status["shard"], status["num_shards"], status["ready"]) == (0, 2, False)  # not serving yet
    assert status["config"] == CFG.to_dict() and status["members"] == [] and status["checkpoint"] is None
    assert [f["round"] for f in status["fragments"]] == [0, 0, 0]
    assert [f["slice"] for f in status["fragments"]] == [list(r) for r in st.ranges]
    assert all(f["master_hash"] is None for f in status["fragments"])  # hashes=False: none taken

    shard.gates.count("no_hello")
    shard.counters.msg_in += 123
    bounds = view.status(hashes=False)["bounds"]
    assert bounds["refused"] == {"no_hello": 1} and bounds["sessions"] == 0 and bounds["waiting_calls"] == 0
    assert bounds["unread_limit"] == shard.outbox.unread.limit and bounds["staged_limit"] == st.staging.limit
    assert view.status(hashes=False)["bytes"]["message_bytes_in"] == 123


def test_a_round_closed_shows_in_status_and_its_master_hash_changes_once():
    shard = _shard()
    st, view = shard.state, shard.view
    before = view.status()["fragments"][1]["master_hash"]
    assert before == tensor_digest(st.master(1))
    assert view.digest(1) is view.digest(1)  # cached: the master has not changed
    st.add_member("a")
    st.push("a", 1, 0, slice_push(st, 1, 1), weight=6.0)
    st.close_round(1)
    status = view.status()
    assert status["fragments"][1]["round"] == 1 and status["rounds_closed"] == 1
    assert status["fragments"][1]["master_hash"] == tensor_digest(st.master(1)) != before
    asyncio.run(view.hash_masters())  # on the pool: the cache already holds every master's hash
    assert {f: d for f, (_, d) in view.digests.items()} == {f: tensor_digest(st.master(f)) for f in range(3)}
    shard.runner.pool.shutdown()


def test_the_series_holds_the_samples_and_the_values_of_this_moment():
    shard = _shard()
    shard.counters.msg_in += 1000
    shard.view.sample()  # the tick's, once a second
    shard.counters.msg_in += 500
    samples = shard.view.series(0.0)["samples"]
    assert [p["bytes_in"] for p in samples] == [0, 1000, 1500]  # built, sampled, and now
    assert all(p["members"] == 0 and p["passive"] == 0 for p in samples)
    assert shard.view.series(samples[-1]["t"] + 3600)["samples"] == []  # nothing after a time to come
