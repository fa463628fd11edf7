"""Joining: the settings a worker gives adopted with the shard's (SyncConfig.given and SyncConfig.adopted, no
half-built config), connect()'s options, and what LinkState now owns alone (the pushes not yet answered,
where the shard is), without a network; and a Join that a full edge refuses (RESOURCE_EXHAUSTED: the shard
made room for a flood's calls, or this address holds its limit of waiting calls), tried again with backoff
against the standard in-process shard (issue 37, item 4: before, the worker stopped)."""

from __future__ import annotations

import json
import logging
import threading

import grpc
import pytest

from benchmarks.flood import RawCalls
from streamdiloco.common.config import GivenSync, SyncConfig
from streamdiloco.worker.connection import ShardConnection
from streamdiloco.worker.join import JoinOptions, chosen_sync_fields, connect
from streamdiloco.worker.linkstate import LinkState
from streamdiloco.worker.model import build_gpt
from streamdiloco.worker.session import Retry
from tests.support.inthread import RPC_TIMEOUT
from tests.support.procs import SLACK, wait_until


def test_given_settings_valid_alone_are_a_plain_config_and_a_schedule_waits_for_the_shards():
    assert type(SyncConfig.given({"sync_every": 10})) is SyncConfig
    given = SyncConfig.given({"sync_every": 12})  # not with the default P=5: maybe with the shard's
    assert isinstance(given, GivenSync) and given.sync_every == 12 and given.num_fragments == 5
    shards = SyncConfig(sync_every=6, num_fragments=3)
    adopted = SyncConfig.adopted(given, shards, frozenset({"sync_every"}))
    assert type(adopted) is SyncConfig and (adopted.sync_every, adopted.num_fragments) == (12, 3)
    with pytest.raises(ValueError, match="^the settings given do not go with those of the shard at x: "):
        SyncConfig.adopted(
            SyncConfig(fragment_sync_delay=7), shards, frozenset({"fragment_sync_delay"}), "the shard at x"
        )
    with pytest.raises(ValueError, match="unknown uplink_codec 'fp4'"):  # wrong on its own: said at once
        SyncConfig.given({"sync_every": 12, "uplink_codec": "fp4"})
    with pytest.raises(ValueError, match="unknown uplink_codec"):  # a GivenSync is checked all but H, P, tau
        GivenSync(sync_every=12, uplink_codec="fp4")


def test_the_fields_a_worker_chose():
    assert chosen_sync_fields(None, None) == frozenset()
    assert chosen_sync_fields(SyncConfig(sync_every=10), None) == {"sync_every"}
    assert chosen_sync_fields(SyncConfig(), frozenset({"merge_rule"})) == {"merge_rule"}
    with pytest.raises(ValueError, match="'bogus', which is not a SyncConfig field"):
        chosen_sync_fields(None, frozenset({"bogus"}))


def test_connect_takes_its_options_as_keywords_or_as_one_object():
    with pytest.raises(TypeError, match="bogus"):
        connect(build_gpt("nano"), "127.0.0.1:1", bogus=1)
    with pytest.raises(ValueError, match="'bogus', which is not a SyncConfig field"):  # before any shard
        connect(build_gpt("nano"), "127.0.0.1:1", options=JoinOptions(sync_set=frozenset({"bogus"})))


def test_link_state_is_the_one_record_of_unanswered_pushes():
    state = LinkState(2)
    state.sent(0, 3, at=10.0)
    state.sent(1, 0, at=11.0)
    assert not state.all_answered
    assert state.answered(0, 3) == 10.0 and state.answered(0, 3) is None  # answered once
    state.session_ended()  # the session broke: no answer comes for the rest
    assert state.all_answered and state.answered(1, 0) is None


def test_link_state_view_moves_the_welcome_on_by_what_came_since():
    state = LinkState(3)
    # the Welcome: fragment 0 at round 2 (started, 1 push of 2 needed), fragment 1 at 0, fragment 2 at 5
    rounds, started, pushes = [2, 0, 0], [True, False, True], [1, 0, 2]
    assert state.view(rounds, started, pushes, min_workers=2) == (
        [2, 0, 0],
        [True, False, True],
        [True, False, False],
    )
    state.on_update(0, 2, [])  # round 2 of fragment 0 closed since
    state.on_fetched(1, None, 4)  # type: ignore[arg-type]  # a master of fragment 1 holding rounds < 4
    assert state.view(rounds, started, pushes, min_workers=2) == (
        [3, 4, 0],
        [False, False, True],
        [False, False, False],
    )


def test_a_join_refused_for_a_full_edge_is_tried_again_with_backoff(shard, caplog):
    waiting, refused = shard.service.gates.waiting, shard.service.gates.refused
    full = RawCalls(shard.port, "127.0.0.1", "Join", 8, timeout=RPC_TIMEOUT)  # this address's 8 waiting
    conn = ShardConnection(shard.target, "w", json.loads(shard.fingerprint_json), join_timeout=30)
    try:
        shard.wait_for(lambda: waiting.held == 8, "8 calls from 127.0.0.1 waiting for their request")
        with pytest.raises(Retry, match="Join: RESOURCE_EXHAUSTED: calls waiting for their request from "):
            conn.join(timeout=RPC_TIMEOUT, reconnecting=True)  # a reconnect's: its backoff tries again
        joined: list = []
        thread = threading.Thread(target=lambda: joined.append(conn.join()), daemon=True)
        with caplog.at_level(logging.INFO, logger="streamdiloco.worker"):
            thread.start()
            kind = "calls waiting for their request"
            wait_until("the Join refused twice more", lambda: refused.get(kind, 0) >= 3, timeout=SLACK)
            assert refused[kind] <= 4  # after a backoff each time, not at once
            full.close()  # room again
            thread.join(RPC_TIMEOUT)
        assert joined and joined[0] == conn.config and conn.session_id
        assert "Join: RESOURCE_EXHAUSTED" in caplog.text and "trying again in" in caplog.text
    finally:
        full.close()
        conn.close()
    assert grpc.StatusCode.RESOURCE_EXHAUSTED.name in caplog.text
