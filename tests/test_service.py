"""The shard's edge over a real gRPC channel: Join, Session and Fetch refuse what is wrong, with the right
status code or PushResult reason and a message that names the problem, and a refused push changes nothing.

Each test starts its own shard (nano model, 2 shards, 3 fragments, chunks of 256 bytes so that a slice
spans many chunks: tests/support/nano_shard.py, conftest's `shard`) on 127.0.0.1, port 0, in a background
thread with its own event loop, and talks to it with the blocking gRPC client, as a worker does.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import urllib.request

import grpc
import pytest
import torch

from streamdiloco.common.codecs import Encoded, concat, decode, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import tensor_digest
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.wire import PROTOCOL, bytes_to_values, from_chunk
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import END, RPC_TIMEOUT, InThreadShard, push_messages
from tests.support.nano_shard import CFG, ENC_A, ENC_B, GOOD_FP, SLICE_LEN, build, delta, fingerprint

pytestmark = pytest.mark.timeout(60)


# --- what a round should give ---------------------------------------------------------------------------
def reference_round(pushes: list[tuple[str, Encoded, float, float | None]], fragment: int = 0):
    """The closed round and master that ShardState gives for these whole pushes, without any wire."""
    st = build().state
    for name, enc, weight, loss in pushes:
        st.add_member(name)
        st.push(name, fragment, 0, enc, weight, loss)
    closed = st.close_round(fragment)
    return closed, st.master(fragment)


def assert_update_matches(chunks: list[pb.Chunk], closed, fragment: int = 0, round: int = 0) -> None:
    n = closed.update.numel
    assert len(chunks) > 1, "the update should span several chunks"
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c.fragment == fragment and c.round == round and c.total == n for c in chunks)
    assert all(c.codec == CFG.downlink_codec and c.block_size == CFG.codec_block_size for c in chunks)
    at = 0
    for c in chunks:
        assert c.offset == at
        at += c.numel
    assert at == n
    got = concat([from_chunk(c) for c in chunks])
    assert torch.equal(got.payload, closed.update.payload)
    assert torch.equal(got.scales, closed.update.scales)
    assert torch.equal(decode(got), decode(closed.update))


# === Join ===============================================================================================
def test_join_reply_describes_the_run(shard):
    reply = shard.join("w0")
    assert json.loads(reply.config_json) == CFG.to_dict()
    assert (reply.shard, reply.num_shards) == (0, 2)
    st = shard.service.state
    assert [(s.offset, s.length) for s in reply.slices] == [(lo, hi - lo) for lo, hi in st.ranges]
    assert list(reply.rounds) == [0, 0, 0]
    assert reply.chunk_values == 512 and reply.session


@pytest.mark.parametrize(
    "fp, words",
    [
        (fingerprint(n_layer=8), "worker has 8 blocks, shard 4"),
        (
            fingerprint(SyncConfig(sync_every=9, num_fragments=3)),
            "sync_every is 9 on the worker, 6 on the shard",
        ),
        (
            fingerprint(SyncConfig(sync_every=6, num_fragments=3, uplink_codec="int8")),
            "uplink_codec is 'int8'",
        ),
        (fingerprint(n_embd=64), "has shape [64] on the worker, [32] on the shard"),
    ],
    ids=["blocks", "sync_every", "codec", "shape"],
)
def test_join_refuses_a_different_model(shard, fp, words):
    with pytest.raises(grpc.RpcError) as e:
        shard.join("w0", fp=json.dumps(fp))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "model fingerprint differs" in e.value.details() and words in e.value.details()


@pytest.mark.parametrize("name", ["", "x" * 129, " padded", "tab\there", "new\nline"])
def test_join_refuses_a_bad_worker_name(shard, name):
    with pytest.raises(grpc.RpcError) as e:
        shard.join(name)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "worker name must be 1..128 printable characters" in e.value.details()


def test_join_accepts_the_longest_name(shard):
    assert shard.join("x" * 128).session


def test_join_refuses_another_protocol(shard):
    for protocol in (0, PROTOCOL + 1):
        with pytest.raises(grpc.RpcError) as e:
            shard.join("w0", protocol=protocol)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"protocol {protocol}, this shard {PROTOCOL}" in e.value.details()


@pytest.mark.parametrize(
    "fp", ["not json", "", "[1, 2]", "null", '"a string"', "{", "[" * 100_000], ids=lambda fp: fp[:10]
)
def test_join_refuses_a_fingerprint_that_is_not_a_json_object(shard, fp):
    with pytest.raises(grpc.RpcError) as e:
        shard.join("w0", fp=fp)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model fingerprint is not valid JSON" in e.value.details()


@pytest.mark.parametrize(
    "mangle",
    [
        lambda fp: {**fp, "params": 5},
        lambda fp: {**fp, "params": [[]]},
        lambda fp: {**fp, "fragments": [[1]]},
        lambda fp: {**fp, "params": [[p[0], p[1]] for p in fp["params"]]},
    ],
    ids=["params-not-a-list", "empty-param", "bad-fragments", "param-without-dtype"],
)
def test_join_refuses_a_malformed_fingerprint_cleanly(shard, mangle):
    with pytest.raises(grpc.RpcError) as e:
        shard.join("w0", fp=json.dumps(mangle(fingerprint())))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model fingerprint is malformed" in e.value.details()


def test_join_and_fetch_check_the_token(make_shard):
    s = make_shard(token="s3cret")
    for token in ("", "wrong", "s3cret "):
        with pytest.raises(grpc.RpcError) as e:
            s.join("w0", token=token)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "wrong or missing run token" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            s.fetch(token=token)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert s.join("w0", token="s3cret").session
    assert len(s.fetch([2], token="s3cret")) > 1


def test_a_name_with_a_session_cannot_join_or_open_another(shard):
    first, second = shard.join("w0"), shard.join("w0")  # no session yet: both Joins succeed
    s1 = shard.open_session(pb.WorkerMessage(hello=pb.Hello(worker="w0", session=first.session)))
    s1.next_message("welcome")
    with pytest.raises(grpc.RpcError) as e:
        shard.join("w0")
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "'w0' already has a session" in e.value.details()
    s2 = shard.open_session(pb.WorkerMessage(hello=pb.Hello(worker="w0", session=second.session)))
    err = s2.error()
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "'w0' already has a session" in err.details()
    assert shard.on_loop(lambda: sorted(shard.service.roster.open)) == ["w0"]
    # the first session is unharmed; once it ends, the name is free again
    s1.close()
    shard.wait_for(lambda: not shard.service.roster.open, "w0 to leave")
    assert shard.worker("w0").session


def test_session_needs_a_hello_with_a_session_from_join(shard):
    reply = shard.join("w0")
    cases = [
        (pb.WorkerMessage(hello=pb.Hello(worker="w0", session="made-up")), grpc.StatusCode.UNAUTHENTICATED),
        (
            pb.WorkerMessage(hello=pb.Hello(worker="w1", session=reply.session)),
            grpc.StatusCode.UNAUTHENTICATED,
        ),
        (pb.WorkerMessage(hello=pb.Hello(worker="w0", session="")), grpc.StatusCode.UNAUTHENTICATED),
        (pb.WorkerMessage(push=push_messages(ENC_A)[0].push), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.WorkerMessage(), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for hello, code in cases:
        err = shard.open_session(hello).error()
        assert err.code() == code, (hello, err)
        assert ("call Join first" if code == grpc.StatusCode.UNAUTHENTICATED else "starts with Hello") in (
            err.details()
        )
    assert shard.on_loop(lambda: dict(shard.service.roster.open)) == {}
    # the session id from Join is still good (none of the above used it up) and is good only once
    hello = pb.WorkerMessage(hello=pb.Hello(worker="w0", session=reply.session))
    s = shard.open_session(hello)
    s.next_message("welcome")
    s.close()
    shard.wait_for(lambda: not shard.service.roster.open, "w0 to leave")
    err = shard.open_session(hello).error()
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_session_that_sends_nothing_ends_quietly(shard):
    s = shard.open_session(None)
    s.close()
    assert s.next() is END
    assert shard.on_loop(lambda: dict(shard.service.roster.open)) == {}


def test_a_session_is_the_membership_lease(shard):
    a = shard.worker("a")
    assert shard.on_loop(lambda: sorted(shard.service.state.members)) == ["a"]
    a.session.cancel()
    shard.wait_for(lambda: not shard.service.state.members and not shard.service.roster.open, "a to leave")


def test_a_broken_session_leaves_no_task_behind(shard):
    def tasks() -> int:
        return len(asyncio.all_tasks())

    base = shard.on_loop(tasks)
    for name in ("a", "b"):
        w = shard.worker(name)
        w.push(push_messages(ENC_A)[:2])
        shard.quiesce(w)
        assert shard.on_loop(tasks) > base
        w.session.cancel()  # the worker dies
        shard.wait_for(lambda: not shard.service.roster.open, f"{name} to leave")
    shard.wait_for(lambda: tasks() <= base, "the sessions' tasks to end")


# === pushes =============================================================================================
def _with(msgs: list[pb.WorkerMessage], i: int, **chunk_fields) -> list[pb.WorkerMessage]:
    """A copy of the push with some fields of chunk i changed (i may be negative)."""
    out = [pb.WorkerMessage.FromString(m.SerializeToString()) for m in msgs]
    for k, v in chunk_fields.items():
        setattr(out[i].push.chunk, k, v)
    return out


def _all(msgs, **chunk_fields):
    out = msgs
    for i in range(len(msgs)):
        out = _with(out, i, **chunk_fields)
    return out


def _scales(i: int, value: float):
    def make(msgs):
        enc = from_chunk(msgs[i].push.chunk)
        scales = enc.scales.clone()
        scales[len(scales) // 2] = value
        return _with(msgs, i, scales=scales.numpy().tobytes())

    return make


_GOOD = push_messages(ENC_A)
_N = SLICE_LEN[0]

REFUSALS = {
    # name: (the push as sent, reason, words the message must hold)
    "fragment": (
        _all(_GOOD, fragment=7),
        "bad_fragment",
        "fragment 7 does not exist: this run has fragments 0..2",
    ),
    "round-ahead": (_all(_GOOD, round=1), "bad_round", "ahead of the open round 0"),
    "offset": (_with(_GOOD, 2, offset=1024 + 128), "bad_offset", "chunk 2: offset 1152, expected 1024"),
    "first-offset": (_with(_GOOD, 0, offset=512), "bad_chunk", "a push starts with chunk 0 at offset 0"),
    "first-seq": (_GOOD[1:], "bad_chunk", "a push starts with chunk 0 at offset 0, got chunk 1"),
    "total": (
        _all(_GOOD, total=_N + 128),
        "bad_length",
        f"slice 0 has {_N} values, the push says {_N + 128}",
    ),
    "payload-short": (
        _with(_GOOD, 1, payload=_GOOD[1].push.chunk.payload[:-1]),
        "bad_length",
        "512 e3m0 values need 256 payload bytes and 4 scales, got 255 and 4",
    ),
    "payload-long": (
        _with(_GOOD, -1, payload=_GOOD[-1].push.chunk.payload + b"\0"),
        "bad_length",
        "payload bytes",
    ),
    "scales-missing": (
        _with(_GOOD, 0, scales=b""),
        "bad_length",
        "need 256 payload bytes and 4 scales, got 256 and 0",
    ),
    "scales-ragged": (_with(_GOOD, 3, scales=b"\0\0\0"), "bad_length", "scales must be whole fp32 values"),
    "numel": (_with(_GOOD, 1, numel=500), "bad_length", "multiple of 128 values, got 500"),
    "past-the-end": (_with(_GOOD, -1, numel=_GOOD[-1].push.chunk.numel + 128), "bad_length", "do not fit"),
    "last-missing": (_with(_GOOD, -1, last=False), "bad_length", "but last is false"),
    "codec-int8": (
        push_messages(encode(delta(1, _N), "int8", 128)),
        "bad_codec",
        "uplink codec is e3m0, got 'int8'",
    ),
    "codec-unknown": (_all(_GOOD, codec="fp8"), "bad_codec", "uplink codec is e3m0, got 'fp8'"),
    "block-size": (
        push_messages(encode(delta(1, _N), "e3m0", 64)),
        "bad_codec",
        "block size must be 128, got 64",
    ),
    "scale-nan": (_scales(2, math.nan)(_GOOD), "bad_scale", "chunk 2: the chunk has a non-finite scale"),
    "scale-inf": (_scales(0, math.inf)(_GOOD), "bad_scale", "chunk 0: the chunk has a non-finite scale"),
    "scale-neg-inf": (_scales(-1, -math.inf)(_GOOD), "bad_scale", "non-finite scale"),
    "scale-huge": (_scales(1, 3e38)(_GOOD), "bad_scale", "allow values up to 3e+38, above 1e+30"),
    "weight-zero": (
        push_messages(ENC_A, weight=0.0),
        "bad_weight",
        "at least 1 and at most 2^53, got 0.0",
    ),
    "weight-negative": (push_messages(ENC_A, weight=-5.0), "bad_weight", "got -5.0"),
    "weight-nan": (push_messages(ENC_A, weight=math.nan), "bad_weight", "got nan"),
    "weight-inf": (push_messages(ENC_A, weight=math.inf), "bad_weight", "got inf"),
    "weight-huge": (push_messages(ENC_A, weight=1e308), "bad_weight", "at most 2^53, got 1e+308"),
    "header-missing": (
        [pb.WorkerMessage(push=pb.Push(chunk=m.push.chunk)) for m in _GOOD],
        "bad_weight",
        "got 0.0",
    ),
    "loss-nan": (push_messages(ENC_A, loss=math.nan), "bad_loss", "in [0, 10000], got nan"),
    "loss-inf": (
        push_messages(ENC_A, loss=math.inf),
        "bad_loss",
        "a cross-entropy in [0, 10000], got inf",
    ),
    "loss-huge": (push_messages(ENC_A, loss=-1e308), "bad_loss", "in [0, 10000], got -1e+308"),
    "step-huge": (push_messages(ENC_A, step=2**53 + 1), "bad_header", "step must be at most 2^53"),
    "blocked-nan": (push_messages(ENC_A, blocked=math.nan), "bad_header", "blocked time must be 0..1e+09"),
    "blocked-negative": (push_messages(ENC_A, blocked=-1.0), "bad_header", "seconds, got -1.0"),
    "blocked-inf": (push_messages(ENC_A, blocked=math.inf), "bad_header", "seconds, got inf"),
    # what the run dashboard shows (step of total, tokens, utilization, eval loss): numbers in range only
    "total-steps-huge": (
        push_messages(ENC_A, total_steps=2**63),
        "bad_header",
        "total steps must be at most 2^53, got 9223372036854775808",
    ),
    "tokens-huge": (push_messages(ENC_A, tokens=2**64 - 1), "bad_header", "token count must be at most 2^53"),
    "eval-step-huge": (push_messages(ENC_A, eval_step=2**60), "bad_header", "eval step must be at most 2^53"),
    "utilization-5": (
        push_messages(ENC_A, has_utilization=True, compute_utilization=5.0),
        "bad_header",
        "compute utilization must be a fraction in [0, 1], got 5.0",
    ),
    "utilization-nan": (
        push_messages(ENC_A, has_utilization=True, compute_utilization=math.nan),
        "bad_header",
        "in [0, 1], got nan",
    ),
    "eval-loss-nan": (
        push_messages(ENC_A, has_eval_loss=True, eval_loss=math.nan),
        "bad_header",
        "eval loss must be a cross-entropy in [0, 10000], got nan",
    ),
    "eval-loss-negative": (
        push_messages(ENC_A, has_eval_loss=True, eval_loss=-1.0),
        "bad_header",
        "got -1.0",
    ),
    "eval-loss-inf": (push_messages(ENC_A, has_eval_loss=True, eval_loss=math.inf), "bad_header", "got inf"),
    # a worker's speed (sync_schedule adaptive sets the others' steps by it): a step time it can have
    "step-seconds-nan": (
        push_messages(ENC_A, step_seconds=math.nan),
        "bad_header",
        "step time must be 0 (not measured) or in (0, 3600] seconds, got nan",
    ),
    "step-seconds-huge": (push_messages(ENC_A, step_seconds=1e9), "bad_header", "seconds, got 1000000000.0"),
    "step-seconds-negative": (push_messages(ENC_A, step_seconds=-0.5), "bad_header", "seconds, got -0.5"),
    "chunk-repeated": (_GOOD[:2] + _GOOD[1:], "bad_chunk", "chunk 1 repeated (next expected is 2)"),
    "chunk-restarted": (_GOOD[:3] + _GOOD, "bad_chunk", "chunk 0 repeated (next expected is 3)"),
    "chunk-out-of-order": (
        [_GOOD[0], _GOOD[2], _GOOD[1]] + _GOOD[3:],
        "bad_chunk",
        "chunk 2: chunk out of order: expected chunk 1",
    ),
    "chunk-skipped": (_GOOD[:4] + _GOOD[5:], "bad_chunk", "expected chunk 4"),
    "round-changes": (
        _GOOD[:2] + _all(_GOOD[2:], round=1),
        "bad_round",
        "ahead of the open round 0",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_a_bad_push_is_refused_changes_nothing_and_the_session_goes_on(shard, case):
    msgs, reason, words = REFUSALS[case]
    assert len(msgs) > 1, "every bad push spans several chunks"
    a, b = shard.worker("a"), shard.worker("b")
    before = shard.snapshot()
    a.push(msgs)
    r = a.session.result()
    assert (r.accepted, r.reason) == (False, reason), r
    assert words in r.message, r.message
    expected_fragment = 7 if case == "fragment" else 0
    assert r.fragment == expected_fragment
    shard.quiesce(a)
    assert shard.snapshot() == before  # nothing staged, summed, counted or closed

    # the same session goes on: a correct push is accepted (and no second refusal came before it)
    a.push(push_messages(ENC_A, weight=100.0, loss=2.5))
    r = a.session.result()
    assert r.accepted and (r.fragment, r.round) == (0, 0), r
    b.push(push_messages(ENC_B, weight=300.0, loss=3.5))
    assert b.session.result().accepted
    closed, master = reference_round([("a", ENC_A, 100.0, 2.5), ("b", ENC_B, 300.0, 3.5)])
    for w in (a, b):
        assert_update_matches(w.session.update(), closed)
    status = shard.on_loop(shard.service.view.status)
    assert status["fragments"][0]["round"] == 1
    assert status["fragments"][0]["master_hash"] == tensor_digest(master)
    assert status["pushes_refused"] == {reason: 1}
    assert status["recent_rounds"][-1]["mean_loss"] == pytest.approx(closed.mean_loss)
    # b's 300 tokens count as the median of the two, the lower, 100 (the weight cap: tests/test_defenses.py)
    assert closed.mean_loss == pytest.approx((2.5 * 100 + 3.5 * 100) / 200)


def test_a_message_other_than_a_push_is_refused(shard):
    a = shard.worker("a")
    before = shard.snapshot()
    a.session.send(pb.WorkerMessage(hello=pb.Hello(worker="a", session=a.join.session)))
    a.session.send(pb.WorkerMessage())
    for _ in range(2):
        r = a.session.result()
        assert (r.accepted, r.reason) == (False, "bad_message")
        assert "only pushes and Ready may follow Hello" in r.message
    shard.quiesce(a)
    assert shard.snapshot() == before


def test_a_round_closes_when_both_members_pushed_and_everyone_gets_the_update(shard):
    a, b, c = shard.worker("a"), shard.worker("b"), shard.worker("c")
    frag2 = [encode(delta(s, SLICE_LEN[2]), "e3m0", 128) for s in (5, 6, 7)]
    a.push(push_messages(frag2[0], fragment=2, weight=10.0, loss=None))
    assert a.session.result().accepted
    b.push(push_messages(frag2[1], fragment=2, weight=20.0, loss=4.0))
    assert b.session.result().accepted
    shard.quiesce(b)
    assert shard.on_loop(lambda: shard.service.state.round_of(2)) == 0  # c was there: it is waited for
    c.push(push_messages(frag2[2], fragment=2, weight=30.0, loss=5.0))
    assert c.session.result().accepted
    closed, master = reference_round(
        [("a", frag2[0], 10.0, None), ("b", frag2[1], 20.0, 4.0), ("c", frag2[2], 30.0, 5.0)], fragment=2
    )
    for w in (a, b, c):
        assert_update_matches(w.session.update(), closed, fragment=2)
    status = shard.on_loop(shard.service.view.status)
    assert [f["round"] for f in status["fragments"]] == [0, 0, 1]
    assert status["fragments"][2]["master_hash"] == tensor_digest(master)
    last = status["recent_rounds"][-1]
    assert (last["fragment"], last["round"], last["why"], last["contributors"]) == (
        2,
        0,
        "all",
        ["a", "b", "c"],
    )
    assert last["mean_loss"] == pytest.approx((4.0 * 20 + 5.0 * 20) / 40)  # c's 30 tokens count as 20


def test_a_push_after_the_round_closed_is_late_and_a_second_push_is_a_duplicate(shard):
    a, b = shard.worker("a"), shard.worker("b")
    a.push(push_messages(ENC_A))
    assert a.session.result().accepted
    before = shard.snapshot()
    a.push(push_messages(ENC_A))
    r = a.session.result()
    assert (r.accepted, r.reason) == (False, "duplicate") and "a already pushed this round" in r.message
    shard.quiesce(a)
    assert shard.snapshot() == before
    b.push(push_messages(ENC_B))
    assert b.session.result().accepted
    update = a.session.update()
    assert update[0].round == 0 and b.session.update()[0].round == 0
    before = shard.snapshot()
    b.push(push_messages(ENC_B))  # round 0 again: it closed
    r = b.session.result()
    assert (r.accepted, r.reason, r.round) == (False, "late", 0)
    assert "round 0 chunk 0: the round is closed (open round is 1)" in r.message
    shard.quiesce(b)
    assert shard.snapshot() == before
    b.push(push_messages(ENC_B, round=1))  # the open round
    assert b.session.result().accepted


def test_a_member_that_dies_mid_push_is_no_longer_waited_for(make_shard):
    s = make_shard(min_workers=1)
    a, b = s.worker("a"), s.worker("b")
    msgs_b = push_messages(ENC_B)
    b.push(msgs_b[:3])  # b starts, so the round expects a and b
    s.quiesce(b)
    a.push(push_messages(ENC_A))
    assert a.session.result().accepted
    b.session.cancel()  # b dies: it is no longer waited for, the round closes with a alone
    closed, master = reference_round([("a", ENC_A, 100.0, 3.0)])
    assert_update_matches(a.session.update(), closed)
    assert s.on_loop(lambda: tensor_digest(s.service.state.master(0))) == tensor_digest(master)


def test_a_push_still_arriving_when_its_round_closes_at_the_deadline_is_late(make_shard):
    s = make_shard(min_workers=1, round_timeout=0.5)
    a, b = s.worker("a"), s.worker("b")
    msgs_b = push_messages(ENC_B, weight=300.0)
    b.push(msgs_b[:3])  # b starts the round (it expects a and b), then stalls
    s.quiesce(b)
    a.push(push_messages(ENC_A))
    assert a.session.result().accepted
    closed, master = reference_round([("a", ENC_A, 100.0, 3.0)])
    assert_update_matches(a.session.update(), closed)  # the deadline passed: closed without b
    assert_update_matches(b.session.update(), closed)  # b is still a member: it gets the update
    status = s.on_loop(s.service.view.status)
    assert status["recent_rounds"][-1]["why"] == "deadline"
    assert status["fragments"][0]["master_hash"] == tensor_digest(master)
    # the round closed without b: it is dormant (status says so), not waited for until it pushes again
    assert status["dormant"] == ["b"] and status["quorum"] == 0.5
    assert {m["name"]: m["dormant"] for m in status["members"]} == {"a": False, "b": True}
    before = s.snapshot()
    b.push(msgs_b[3:])  # the rest of b's push: one refusal, the other chunks are dropped
    r = b.session.result()
    assert (r.accepted, r.reason, r.round) == (False, "late", 0), r
    assert "round 0 chunk 3: the round is closed (open round is 1)" in r.message
    s.quiesce(b)
    assert s.snapshot() == before
    assert s.on_loop(s.service.view.status)["dormant"] == []  # late by one round: it is close to the pace
    b.push(push_messages(ENC_B, round=1))  # and b goes on with the open round
    assert b.session.result().accepted


def test_a_push_that_breaks_off_leaves_nothing_half_applied(make_shard):
    s = make_shard(min_workers=1)
    a, b = s.worker("a"), s.worker("b")
    before = s.snapshot()
    a.push(push_messages(ENC_A)[:10])  # 10 of 25 chunks, then a dies
    s.quiesce(a)
    assert s.on_loop(lambda: sorted(s.service.state.staged)) == [("a", 0)]
    a.session.cancel()
    s.wait_for(lambda: "a" not in s.service.roster.open, "a to leave")
    after = s.snapshot()
    assert after == {**before, "members": ["b"]}  # nothing of a's push stayed
    b.push(push_messages(ENC_B, weight=300.0, loss=3.5))
    assert b.session.result().accepted
    closed, master = reference_round([("b", ENC_B, 300.0, 3.5)])
    assert_update_matches(b.session.update(), closed)
    status = s.on_loop(s.service.view.status)
    assert status["fragments"][0]["master_hash"] == tensor_digest(master)
    assert status["recent_rounds"][-1]["contributors"] == ["b"]


def test_pushes_of_two_workers_may_interleave_chunk_by_chunk(shard):
    a, b = shard.worker("a"), shard.worker("b")
    ma, mb = push_messages(ENC_A, weight=100.0, loss=2.5), push_messages(ENC_B, weight=300.0, loss=3.5)
    for x, y in zip(ma, mb):
        a.session.send(x)
        b.session.send(y)
    assert a.session.result().accepted and b.session.result().accepted
    closed, _ = reference_round([("a", ENC_A, 100.0, 2.5), ("b", ENC_B, 300.0, 3.5)])
    assert_update_matches(a.session.update(), closed)
    assert_update_matches(b.session.update(), closed)


# === Fetch ==============================================================================================
def _initial_slices() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = build_gpt("nano")
    layout = build_layout(model, CFG.num_fragments)
    st = build().state
    return [flatten(fragment_params(model, f))[lo:hi] for f, (lo, hi) in zip(layout.fragments, st.ranges)]


def _values(chunks: list[pb.MasterChunk], fragment: int) -> torch.Tensor:
    return torch.cat([bytes_to_values(c.values) for c in chunks if c.fragment == fragment])


def test_fetch_returns_the_master_slices_in_chunks(shard):
    initial = _initial_slices()
    chunks = shard.fetch()
    assert [c.fragment for c in chunks] == sorted(c.fragment for c in chunks)
    for f in range(3):
        mine = [c for c in chunks if c.fragment == f]
        assert len(mine) == -(-SLICE_LEN[f] // 64)  # 256-byte chunks: 64 fp32 values
        assert [c.last for c in mine] == [False] * (len(mine) - 1) + [True]
        assert [c.offset for c in mine] == list(range(0, SLICE_LEN[f], 64))
        assert all(c.total == SLICE_LEN[f] and c.round == 0 for c in mine)
        assert torch.equal(_values(chunks, f), initial[f])


def test_fetch_resumes_from_an_offset_and_follows_the_rounds(shard):
    a, b = shard.worker("a"), shard.worker("b")
    a.push(push_messages(ENC_A))
    b.push(push_messages(ENC_B))
    assert a.session.result().accepted
    a.session.update()
    master = shard.on_loop(lambda: shard.service.state.master(0).clone())
    initial = _initial_slices()
    chunks = shard.fetch([0, 2], offset=100)
    first = [c for c in chunks if c.fragment == 0]
    assert first[0].offset == 100 and all(c.round == 1 for c in first)
    assert torch.equal(_values(chunks, 0), master[100:])
    assert not torch.equal(master, initial[0])
    assert [c.offset for c in chunks if c.fragment == 2][0] == 0 and torch.equal(
        _values(chunks, 2), initial[2]
    )
    # resuming at the very end gives one empty last chunk
    end = shard.fetch([2], offset=SLICE_LEN[2])
    assert len(end) == 1 and end[0].last and end[0].values == b"" and end[0].offset == SLICE_LEN[2]


def test_fetch_refuses_bad_fragments_and_offsets(shard):
    for fragments in ([3], [0, 9]):
        with pytest.raises(grpc.RpcError) as e:
            shard.fetch(fragments)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not exist: this run has fragments 0..2" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        shard.fetch([1], offset=SLICE_LEN[1] + 1)
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert f"offset {SLICE_LEN[1] + 1} is past the end of fragment 1's {SLICE_LEN[1]}-value slice" in (
        e.value.details()
    )
    with pytest.raises(grpc.RpcError) as e:
        shard.fetch(offset=2**63)
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_a_member_whose_unread_messages_pass_the_bound_is_dropped_and_its_session_ended(shard):
    a, b = shard.worker("a"), shard.worker("b")
    # the real budget (over all sessions) is 256 MiB or four rounds of updates; here no update chunk (~300 B)
    # fits in it, as if neither worker read its updates
    shard.service.outbox.unread.limit = 100
    a.push(push_messages(ENC_A))
    b.push(push_messages(ENC_B))
    for w in (a, b):
        item = w.session.next()
        while not isinstance(item, grpc.RpcError):  # a PushResult may come first, no update can
            assert item.WhichOneof("kind") == "result", item
            item = w.session.next()
        assert (
            item.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes of messages unread" in item.details()
        )
    shard.wait_for(lambda: not shard.service.roster.open, "both sessions to end")
    assert shard.on_loop(lambda: (shard.service.state.members, shard.service.state.round_of(0))) == (set(), 1)


# === the event loop stays free while a round's arithmetic runs ============================================
def _http_json(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=RPC_TIMEOUT) as r:
        return json.loads(r.read())


def test_health_status_and_pushes_are_answered_while_a_round_closes(tmp_path):
    """A close job held on its thread (as a big model's fold and outer step would take long): the loop
    still answers /healthz and /api/status and takes the next round's pushes; Fetch waits for the new
    master; once the job goes on, everyone gets the update."""
    s = InThreadShard(build(), tmp_path, GOOD_FP, http=True)
    try:
        entered, release = threading.Event(), threading.Event()
        compute = s.service.runner._compute_close

        def held(job):
            entered.set()
            assert release.wait(RPC_TIMEOUT), "the test never let the close job go on"
            return compute(job)

        s.service.runner._compute_close = held
        a, b = s.worker("a"), s.worker("b")
        a.push(push_messages(ENC_A, weight=100.0, loss=2.5))
        b.push(push_messages(ENC_B, weight=300.0, loss=3.5))
        assert a.session.result().accepted and b.session.result().accepted
        assert entered.wait(RPC_TIMEOUT), "the round did not start closing"

        assert _http_json(s.http_port, "/healthz")["ok"] is True
        status = _http_json(s.http_port, "/api/status")
        assert status["fragments"][0]["round"] == 1 and status["rounds_closed"] == 0
        a.push(push_messages(ENC_B, round=1))  # the next round's push is taken meanwhile
        assert (r := a.session.result()).accepted and r.round == 1
        fetched: list = []
        fetcher = threading.Thread(target=lambda: fetched.append(s.fetch([0])))
        fetcher.start()
        s.wait_for(lambda: s.service.counters.fetch_waits == 1, "Fetch to wait for the new master")
        assert not fetched
        release.set()

        closed, master = reference_round([("a", ENC_A, 100.0, 2.5), ("b", ENC_B, 300.0, 3.5)])
        for w in (a, b):
            assert_update_matches(w.session.update(), closed)
        fetcher.join(RPC_TIMEOUT)
        assert all(c.round == 1 for c in fetched[0]) and torch.equal(_values(fetched[0], 0), master)
        status = _http_json(s.http_port, "/api/status")
        assert status["rounds_closed"] == 1 and status["fragments"][0]["master_hash"] == tensor_digest(master)
    finally:
        s.shutdown()


# === one truth for who is a member ========================================================================
def test_a_revoked_or_overflowed_member_leaves_status_and_pace_at_once(shard):
    """Status and pace read the roster, as the rounds do: a member whose credential was revoked, or that
    stopped reading, is gone from them the moment it is dropped, not when its session has ended."""
    for name in ("a", "b", "c"):
        shard.worker(name)

    def drop():
        svc = shard.service
        for name, seconds in (("a", 3.0), ("b", 2.0), ("c", 0.5)):  # accepted pushes' step times
            svc.state.roll.heard(name, seconds)

        def seen() -> tuple[list[str], float, list[str]]:
            names = [m["name"] for m in svc.view.status(0, hashes=False)["members"]]
            return names, svc.roster.pace(), sorted(svc.state.members)

        before = seen()
        svc.revoke(["a"])
        revoked = seen()
        svc.outbox.unread.limit = 100  # b has the most unread: it is dropped when the budget runs out
        svc.outbox.send(svc.roster.open["b"], b"x" * 80)
        svc.outbox.send(svc.roster.open["c"], b"x" * 40)
        return before, revoked, seen()

    before, revoked, overflowed = shard.on_loop(drop)
    assert before == (["a", "b", "c"], 3.0, ["a", "b", "c"])
    assert revoked == (["b", "c"], 2.0, ["b", "c"])
    assert overflowed == (["c"], 0.5, ["c"])
    shard.wait_for(lambda: sorted(shard.service.roster.open) == ["c"], "a's and b's sessions to end")
