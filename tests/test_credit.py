"""The contribution ledger (server/storage/credits.py): its rules under a fake clock, the checks of what it
reads back, `streamdiloco ledger` merging shards' ledgers from checkpoint directories and from live shards,
and a real shard with two workers whose ledger holds across a crash (SIGKILL: the rounds replayed from the
logs are credited exactly once) and a stop."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest

from streamdiloco.credit_cmd import from_checkpoint, merge, to_csv
from streamdiloco.server.shard import Shard
from streamdiloco.server.storage.credits import Credits
from tests.support.inthread import InThreadShard, push_messages
from tests.support.nano_shard import CFG, ENC_A, ENC_B, GOOD_FP
from tests.support.procs import Cluster, http_json, refused_in_one_line, stop, streamdiloco
from tests.support.shards import shard_of


# --- the rules -------------------------------------------------------------------------------------------
def test_pushes_rounds_and_tokens_are_credited_per_identity():
    c = Credits(num_fragments=2)
    c.connected("alice", "worker token", now=10.0)
    c.connected("bob", "run token", now=12.0)
    for _ in range(3):
        c.accepted("alice")
    c.accepted("bob")
    c.refused("bob", "late")
    c.refused("bob", "bad_weight")
    c.refused("bob", "bad_weight")
    c.refused("bob", "something new")  # an unknown reason: "other", the set stays bounded
    # fragment 0 round 0: alice's share 100, bob's capped to 200 from 300; alice clipped
    assert c.round_closed(0, 0, {"alice": 100.0, "bob": 200.0}, clipped=["alice"], capped=["bob"])
    assert c.round_closed(1, 0, {"alice": 100.0})
    assert not c.round_closed(1, 0, {"alice": 100.0})  # credited already (a replay): nothing changes
    assert c.round_closed(1, 1, {"alice": 50.0}, void=True)  # non-finite: nothing reached the model
    assert c.through == [1, 2]
    with pytest.raises(ValueError, match="fragment 2 is outside"):
        c.round_closed(2, 0, {})
    c.disconnected("bob", now=20.0)
    s = c.status(now=30.0)
    alice, bob = s["workers"]
    assert alice == {
        "worker": "alice", "via": "worker token", "tokens": 100.0, "pushes": 3, "clipped": 1, "capped": 0,
        "late": 0, "rounds": 2, "sessions": 1, "refused": {}, "connected_seconds": 20.0, "connected": True,
    }  # fmt: skip
    assert bob["tokens"] == 100.0 and bob["capped"] == 1 and bob["late"] == 1 and bob["rounds"] == 1
    assert bob["refused"] == {"bad_weight": 2, "other": 1}
    assert bob["connected_seconds"] == 8.0 and not bob["connected"]
    assert s["identities"] == 2 and s["others"]["identities"] == 0
    # one row shown: the other sums into others (the most tokens, then pushes, first)
    one = c.status(now=30.0, limit=1)
    assert [w["worker"] for w in one["workers"]] == ["alice"]
    assert one["others"]["tokens"] == 100.0 and one["others"]["identities"] == 1


def test_time_connected_counts_the_open_session_without_counting_it_twice():
    c = Credits(1)
    c.connected("a", "nothing", now=0.0)
    first = c.to_state(now=5.0)
    assert first["workers"][0]["connected_seconds"] == 5.0 and not c.changed
    assert c.to_state(now=7.0)["workers"][0]["connected_seconds"] == 7.0  # not 5 + 7
    c.disconnected("a", now=9.0)
    c.connected("a", "nothing", now=100.0)
    assert c.status(now=101.0)["workers"][0]["connected_seconds"] == 10.0
    assert c.status(now=101.0)["workers"][0]["sessions"] == 2
    restored = Credits.from_state(c.to_state(now=101.0), 1)  # a restart ends the session: 10 s so far
    assert restored.status(now=500.0)["workers"][0]["connected_seconds"] == 10.0


def test_identities_beyond_the_bound_fold_into_others_least_contributing_idle_first():
    c = Credits(1, max_rows=3)
    c.connected("busy", "nothing", now=0.0)  # connected, and nothing credited yet
    c.round_closed(0, 0, {"big": 500.0, "small": 5.0})
    c.accepted("small")
    c.row("new")  # a fourth: "small" folds (idle, fewest tokens); "busy" has fewer but is connected
    assert set(c.rows) == {"busy", "big", "new"} and c.folded == 1
    assert c.others.tokens == 5.0 and c.others.pushes == 1 and c.others.rounds == 1
    c.row("newer")  # now every idle row but "big" has nothing: "new" (fewest, then by name) goes
    assert set(c.rows) == {"busy", "big", "newer"} and c.folded == 2
    s = c.status(now=1.0)
    assert s["identities"] == 5 and s["others"]["identities"] == 2 and len(s["workers"]) == 3
    c.round_closed(0, 1, {"small": 7.0})  # a folded name that comes back starts a new row
    assert c.rows["small"].tokens == 7.0 and "busy" in c.rows  # the one connected is never folded first
    # a ledger read back into a smaller bound folds its rows the same way
    small = Credits.from_state(c.to_state(now=2.0), 1, max_rows=2)
    assert len(small.rows) == 2 and small.folded == c.folded + 1


def test_the_state_round_trips():
    c = Credits(3)
    c.connected("a", "certificate", now=1.0)
    c.accepted("a")
    c.refused("a", "duplicate")
    c.round_closed(2, 4, {"a": 30.0, "b": 60.0}, capped=["b"])
    state = c.to_state(now=3.0)
    back = Credits.from_state(json.loads(json.dumps(state)), 3)
    assert back.to_state(now=99.0) == state  # nothing open after a restart: the same numbers
    assert back.through == [0, 0, 5]
    assert not back.round_closed(2, 4, {"a": 30.0})


def _state() -> dict:
    c = Credits(2)
    c.connected("a", "worker token", now=0.0)
    c.refused("a", "late")
    c.round_closed(0, 0, {"a": 10.0})
    c.row("b")
    c.row("c")
    return c.to_state(now=1.0)


def _set(path: str, value):
    def change(state: dict) -> None:
        *keys, last = path.split(".")
        d = state
        for k in keys:
            d = d[int(k)] if isinstance(d, list) else d[k]
        if value is DELETE:
            del d[last]
        else:
            d[int(last) if isinstance(d, list) else last] = value

    return change


DELETE = object()


@pytest.mark.parametrize(
    "change, message",
    [
        (_set("version", 2), "version 2"),
        (_set("fragments", 3), "3 fragments, the run has 2"),
        (_set("through", [0]), "through must be 2 round numbers"),
        (_set("through", [0, -1]), "through must be 2 round numbers"),
        (_set("extra", 1), "not a contribution ledger"),
        (_set("workers.0.pushes", -1), "pushes must be a count"),
        (_set("workers.0.pushes", True), "pushes must be a count"),
        (_set("workers.0.rounds", 1.5), "rounds must be a count"),
        (_set("workers.0.tokens", math.nan), "tokens must be a finite number"),
        (_set("workers.0.tokens", -1.0), "tokens must be a finite number"),
        (_set("workers.0.connected_seconds", math.inf), "connected_seconds must be a finite number"),
        (_set("workers.0.refused", {"made_up": 1}), "refused must map the reasons"),
        (_set("workers.0.refused", {"bad_weight": -2}), "refused must map the reasons"),
        (_set("workers.0.via", "a friend"), "via must be one of"),
        (_set("workers.0.worker", "evil\nname"), "names no worker: 'evil\\nname'"),
        (_set("workers.0.worker", ""), "names no worker"),
        (_set("workers.1.worker", "a"), "'a' has two rows"),
        (_set("workers.0.late", DELETE), "must have the keys"),
        (_set("others.identities", -1), "others must be a row with its count"),
        (_set("others.tokens", "many"), "others row: tokens must be a finite number"),
        (_set("workers", {}), "workers must be a list"),
    ],
)
def test_from_state_refuses_what_is_not_a_ledger_in_one_line(change, message):
    state = copy.deepcopy(_state())
    Credits.from_state(copy.deepcopy(state), 2)  # as written, it loads
    change(state)
    with pytest.raises(ValueError, match=None) as e:
        Credits.from_state(state, 2)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_replayed_round_credits_what_its_log_says_once():
    c = Credits(1)
    credit = {"tokens": {"a": 8.0}, "clipped": ["a"], "capped": []}
    assert not c.replayed(0, 0, None, "all")  # logged before the ledger existed: nothing
    assert c.replayed(0, 0, credit, "all") and c.rows["a"].tokens == 8.0 and c.rows["a"].clipped == 1
    assert not c.replayed(0, 0, credit, "all")
    assert c.replayed(0, 1, credit, "nonfinite") and c.rows["a"].tokens == 8.0
    for bad in ({"tokens": {"a": -1.0}, "clipped": [], "capped": []}, {"tokens": {}}, [1]):
        with pytest.raises(ValueError, match="credit of fragment 0 round 2 is malformed"):
            c.replayed(0, 2, bad, "all")


# --- streamdiloco ledger: merging shards' ledgers -------------------------------------------------------
def write_checkpoint(directory: Path, shard: int, num_shards: int, credits: Credits) -> None:
    """A shard's checkpoint as far as the ledger command reads it: meta.json listing credits.json."""
    directory.mkdir(parents=True)
    data = json.dumps(credits.to_state(now=100.0)).encode()
    (directory / "credits.json").write_bytes(data)
    files = {"credits.json": hashlib.sha256(data).hexdigest()}
    meta = {"format": 2, "shard": shard, "num_shards": num_shards, "files": files, "incoming": {}}
    (directory / "meta.json").write_text(json.dumps(meta))


def two_shards(tmp_path: Path) -> tuple[Path, Path]:
    s0, s1 = Credits(2), Credits(2)
    for s in (s0, s1):  # shard 1's round closed before alice's second push came: late there
        s.connected("alice", "worker token", now=0.0)
        s.accepted("alice")
        s.round_closed(0, 0, {"alice": 100.0, "bob": 100.0}, capped=["bob"])
        s.disconnected("alice", now=40.0 if s is s0 else 30.0)
    s0.accepted("alice")
    s0.round_closed(1, 0, {"alice": 100.0})
    s1.refused("alice", "late")
    s1.refused("bob", "bad_value")
    d0, d1 = tmp_path / "ck0", tmp_path / "ck1"
    write_checkpoint(d0, 0, 2, s0)
    write_checkpoint(d1, 1, 2, s1)
    return d0, d1


def test_ledger_merges_the_shards_checkpoints_into_json_and_csv(tmp_path):
    d0, d1 = two_shards(tmp_path)
    merged = merge([from_checkpoint(str(d1)), from_checkpoint(str(d0))])  # any order
    assert merged["num_shards"] == 2 and [s["shard"] for s in merged["sources"]] == [0, 1]
    alice, bob = merged["workers"]
    # shard 0 credited alice 200/2 fragments = 100 tokens, shard 1 50: the mean over the shards
    assert alice["worker"] == "alice" and alice["tokens"] == 75 and alice["tokens_by_shard"] == [100, 50]
    assert alice["pushes"] == 1.5 and alice["late"] == 0.5 and alice["rounds"] == 1.5
    assert alice["sessions"] == 1 and alice["connected_seconds"] == 40  # the largest
    assert alice["via"] == "worker token"
    assert bob["tokens"] == 50 and bob["capped"] == 1 and bob["refused"] == {"bad_value": 0.5}
    assert merged["others"]["identities"] == 0

    out = tmp_path / "ledger.csv"
    r = streamdiloco("ledger", "--checkpoint-dir", str(d0), "--checkpoint-dir", str(d1), "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == (
        "row,worker,via,tokens,tokens_shard_0,tokens_shard_1,pushes,clipped,capped,late,refused,"
        "refused_bad_value,rounds,sessions,connected_seconds"
    )
    assert lines[1] == "worker,alice,worker token,75,100,50,1.5,0,0,0.5,0,0,1.5,1,40"
    assert lines[2] == "worker,bob,,50,50,50,0,0,1,0,0.5,0.5,1,0,0"
    assert lines[3].startswith("others,,,0,0,0,")
    assert out.read_text() == to_csv(merged)
    r = streamdiloco("ledger", "--checkpoint-dir", str(d0), "--checkpoint-dir", str(d1), "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout) == json.loads(json.dumps(merged))


def test_ledger_refuses_bad_input_in_one_line_without_torch(tmp_path):
    d0, d1 = two_shards(tmp_path)
    damaged = tmp_path / "damaged"
    write_checkpoint(damaged, 1, 2, Credits(2))
    (damaged / "credits.json").write_text((damaged / "credits.json").read_text().replace("[]", "[ ]", 1))
    other = tmp_path / "other"
    write_checkpoint(other, 1, 3, Credits(2))
    (tmp_path / "bare").mkdir()
    cd = "--checkpoint-dir"
    refused_in_one_line(
        [
            (["ledger"], "give every shard's --status-url or --checkpoint-dir"),
            (["ledger", cd, str(d0)], "shard(s) [1] missing"),
            (["ledger", cd, str(d0), cd, str(d0)], "are both shard 0"),
            (["ledger", cd, str(d0), cd, str(other)], "different numbers of shards"),
            (["ledger", cd, str(d0), cd, str(damaged)], "does not hash to what meta.json lists"),
            (["ledger", cd, str(tmp_path / "bare")], "cannot read meta.json"),
            (["ledger", "--status-url", "127.0.0.1:1"], "give each shard's HTTP address as http(s)://"),
            (["ledger", "--status-url", "http://127.0.0.1:1"], "cannot read its status"),
            (
                ["ledger", "--status-url", "http://192.0.2.1:80", "--read-token", "x"],
                "plain http, and the shard would send it the read token in clear",
            ),
        ]
    )


# --- a shard in a thread: the hooks, status, metrics, and a stop and a start from its checkpoint ---------
def in_thread_shard(tmp_path: Path) -> InThreadShard:
    service = shard_of(
        CFG, "nano", shard=0, num_shards=2, min_workers=2, round_timeout=30.0,
        checkpoint_dir=str(tmp_path / "ck"),
    )  # fmt: skip
    return InThreadShard(service, tmp_path, GOOD_FP, http=True)


def test_a_shard_counts_pushes_rounds_and_tokens_and_keeps_them_across_a_restart(tmp_path):
    shard = in_thread_shard(tmp_path)
    try:
        a, b = shard.worker("a"), shard.worker("b")
        a.push(push_messages(ENC_A, weight=100.0))
        assert a.session.result().accepted
        b.push(push_messages(ENC_B, weight=300.0))
        assert b.session.result().accepted
        a.session.update(), b.session.update()  # round 0 of fragment 0 closed
        a.push(push_messages(ENC_A, weight=100.0))  # round 0 has closed: late
        assert a.session.result().reason == "late"
        a.push(push_messages(ENC_A, round=1, weight=-1.0))
        assert a.session.result().reason == "bad_weight"
        shard.quiesce(a)
        credits = shard.status()["credits"]
        rows = {w["worker"]: w for w in credits["workers"]}
        p = CFG.num_fragments
        # b's 300 tokens count as the median of the two, the lower one (the weight cap; their mean, 200, was
        # half a liar's claim): over the run's 3 fragments
        assert rows["b"]["tokens"] == pytest.approx(100 / p) and rows["b"]["capped"] == 1
        assert rows["a"]["tokens"] == pytest.approx(100 / p) and rows["a"]["capped"] == 0
        assert (rows["a"]["pushes"], rows["a"]["late"], rows["a"]["refused"]) == (1, 1, {"bad_weight": 1})
        assert all(r["rounds"] == 1 and r["sessions"] == 1 and r["connected"] for r in rows.values())
        assert all(r["via"] == "nothing" for r in rows.values())  # a shard without credentials
        assert credits["identities"] == 2 and credits["others"]["identities"] == 0
        metrics = _get(shard.http_port, "/metrics")
        assert f'streamdiloco_shard_credit_tokens{{worker="b"}} {100 / p!r}' in metrics
        assert 'streamdiloco_shard_credit_pushes{outcome="late",worker="a"} 1.0' in metrics
        assert 'streamdiloco_shard_credit_tokens{worker=""} 0.0' in metrics  # the rest: nobody
        # the checkpoint as a crash would leave it now: the ledger written at the start (empty), and the
        # round's log, which a restart replays and credits
        shutil.copytree(tmp_path / "ck", tmp_path / "crashed")
    finally:
        shard.shutdown()  # the sessions end, then the shard stops: its checkpoint has the ledger
    crashed = shard_of(CFG, "nano", shard=0, num_shards=2, checkpoint_dir=str(tmp_path / "crashed"))
    assert isinstance(crashed, Shard)
    replayed = {w["worker"]: w for w in crashed.credits.status(now=0.0)["workers"]}
    for name, row in rows.items():  # what the round's log says: tokens, rounds, caps (not pushes: no log)
        assert replayed[name]["tokens"] == pytest.approx(row["tokens"])
        assert (replayed[name]["rounds"], replayed[name]["capped"]) == (1, row["capped"])
    again = in_thread_shard(tmp_path)
    try:
        back = {w["worker"]: w for w in again.status()["credits"]["workers"]}
        for name, row in rows.items():
            assert back[name]["connected_seconds"] >= row["connected_seconds"]
            assert back[name] == {
                **row,
                "connected": False,
                "connected_seconds": back[name]["connected_seconds"],
            }
    finally:
        again.shutdown()


# --- a real shard process, two workers, a crash ---------------------------------------------------------
NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--merge-policy", "fixed"]
SHARD = [*NANO, "--min-workers", "2", "--round-timeout", "300"]
WORK = [*NANO, "--steps", "54", "--log-every", "60", "--checkpoint-every", "0"]


def ledger_of(http: int) -> dict:
    return {w["worker"]: w for w in http_json(http, "/api/status?rounds=0&hashes=0")["credits"]["workers"]}


@pytest.mark.slow  # about 30 s on an idle machine (two shard starts, two workers)
def test_a_shard_process_credits_two_workers_and_keeps_its_ledger_across_a_crash(tmp_path):
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *SHARD)
        for rank, name in enumerate(("worker-a", "worker-b")):
            c.worker(name, [target], *WORK, "--rank", str(rank))
        for name in ("worker-a", "worker-b"):
            assert c.wait(name, timeout=120) == 0, c.log(name)[-3000:]
        status = http_json(http, "/api/status?rounds=0&hashes=0")
        rounds = sum(f["round"] for f in status["fragments"])  # every round closed, over the fragments
        assert rounds >= 15
        before = ledger_of(http)
        assert sorted(before) == ["worker-a", "worker-b"]
        for name, row in before.items():
            summary = c.summary(name)
            # both pushed to every round (--min-workers 2): each push accepted, each round credited
            assert row["rounds"] == rounds and row["pushes"] == rounds <= summary["pushes"], (row, summary)
            # each fragment's pushes carry the tokens trained since its last push: over P fragments, at
            # most the tokens trained (the steps after a fragment's last push are not pushed)
            assert 0.6 * summary["tokens"] < row["tokens"] <= summary["tokens"], (row, summary)
            assert row["via"] == "nothing" and row["sessions"] == 1 and not row["connected"]
            assert row["connected_seconds"] > 0 and row["late"] == 0 and row["refused"] == {}

        # the live shard, merged by the ledger command: its one shard's numbers
        r = streamdiloco("ledger", "--status-url", f"http://127.0.0.1:{http}", "--format", "json")
        assert r.returncode == 0, r.stderr
        live = {w["worker"]: (w["tokens"], w["rounds"]) for w in json.loads(r.stdout)["workers"]}
        assert live == {n: (pytest.approx(w["tokens"], abs=1e-3), w["rounds"]) for n, w in before.items()}

        # a crash (SIGKILL): the ledger as last written (before each fragment's whole state, or while it
        # changed), and the rounds after it replayed from their logs and credited once
        c.procs["shard"].kill()
        c.procs["shard"].wait()
        _, http = c.shard("shard", *SHARD)
        crashed = ledger_of(http)
        for name, row in before.items():
            assert crashed[name]["tokens"] == pytest.approx(row["tokens"]), (crashed[name], row)
            assert crashed[name]["rounds"] == rounds
        stop(c.procs["shard"])
        r = streamdiloco("ledger", "--checkpoint-dir", str(tmp_path / "shard-checkpoint"), "--format", "json")
        assert r.returncode == 0, r.stderr
        assert {w["worker"]: w["rounds"] for w in json.loads(r.stdout)["workers"]} == dict.fromkeys(
            before, rounds
        )


def _get(port: int, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()
