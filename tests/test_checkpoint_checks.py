"""Checked checkpoints: meta.json lists the sha256 of every file of a shard's checkpoint, and a load refuses,
in one line that names the file, a file whose bytes changed or that holds values that are not finite. A
crash between two writes leaves a checkpoint that loads exactly when it is consistent. A checkpoint of the
previous format (no hashes) loads with a warning and is written again with hashes. And a real shard process
started on a damaged checkpoint exits with that line; started on a good one, it reports the same hashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os

import pytest
import torch

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint, tensor_digest
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.wire import PROTOCOL, make_channel
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import RPC_TIMEOUT, InThreadShard, Session, push_messages
from tests.support.procs import Cluster, http_json, wait_until
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(120)

CFG = SyncConfig(sync_every=6, num_fragments=3)
torch.manual_seed(0)
_MODEL = build_gpt("nano")
_LAYOUT = build_layout(_MODEL, 3)
_INITIAL = [flatten(fragment_params(_MODEL, f)) for f in _LAYOUT.fragments]
FP = model_fingerprint(_LAYOUT, CFG)


def make_state() -> ShardState:
    return ShardState(0, 2, _LAYOUT, CFG, _INITIAL)


def close_rounds(st: ShardState, ck: ShardCheckpoint | None, rounds: list[int]) -> None:
    """Close one round of each fragment in `rounds` (two pushes each), logged as the service does."""
    for i, f in enumerate(rounds):
        r = st.round_of(f)
        lo, hi = st.ranges[f]
        for w in ("a", "b"):
            g = torch.Generator().manual_seed(100 * i + ord(w))
            enc = encode(torch.randn(hi - lo, generator=g) * 1e-2, CFG.uplink_codec, CFG.codec_block_size)
            st.push_chunk(w, f, r, 0, 0, enc.numel, enc, True, 10.0, None)
        job = st.begin_close(f)
        record = job.record()
        job.run()
        if ck is not None:
            assert ck.log_round(f, record) is True
        st.end_close(job)


def key(st: ShardState) -> list:
    """What a load must restore: each fragment's round, master, residual and momentum."""
    out = []
    for f in range(3):
        sgd = st.fragments[f].outer.state_dict()["sgd"]["state"]
        momentum = sgd[0]["momentum_buffer"] if sgd else None
        out.append(
            (
                st.round_of(f),
                tensor_digest(st.master(f)),
                tensor_digest(st.fragments[f].outer.residual),
                None if momentum is None else tensor_digest(momentum),
            )
        )
    return out


def load(directory) -> ShardState:
    st = make_state()
    ShardCheckpoint(directory, FP).load(st)
    return st


def refusal(directory) -> str:
    """The one-line ValueError a load of `directory` gives."""
    with pytest.raises(ValueError) as e:
        load(directory)
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    return text


@pytest.fixture
def saved(tmp_path):
    """A checkpoint whose fragments closed rounds (fragment 0's since its whole state: a logged round)."""
    st = make_state()
    close_rounds(st, None, [0, 0, 2])
    ck = ShardCheckpoint(tmp_path / "ck", FP)
    assert ck.save_all(st)
    close_rounds(st, ck, [0])  # logged, listed in meta.json, replayed at load
    return ck, st


def meta(ck: ShardCheckpoint) -> dict:
    return json.loads((ck.dir / "meta.json").read_text())


def flip_inside(path, tensor: torch.Tensor) -> None:
    """Flip one bit of one value of `tensor` where the file stores it (legacy torch format: raw bytes)."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().numpy().tobytes()
    at = data.find(raw[:4096])
    assert at >= 0 and data[at : at + len(raw)] == raw, "the tensor's bytes are not in the file"
    data[at + len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(data))


# === hashes ===============================================================================================
def test_meta_json_lists_the_sha256_of_every_file_and_a_good_checkpoint_loads_bit_for_bit(saved):
    ck, st = saved
    listed = meta(ck)["files"]
    on_disk = {p.relative_to(ck.dir).as_posix() for p in ck.dir.rglob("*.pt")}
    assert set(listed) == on_disk == {f"fragment-{f}.pt" for f in range(3)} | {"rounds/fragment-0-round-2.pt"}
    for name, sha in listed.items():
        assert hashlib.sha256((ck.dir / name).read_bytes()).hexdigest() == sha
    assert meta(ck)["format"] == 2 and meta(ck)["incoming"] == {}
    assert key(load(ck.dir)) == key(st)


def test_a_byte_flipped_inside_a_master_is_refused_naming_the_file(saved):
    ck, st = saved
    saved_master = torch.load(ck.dir / "fragment-1.pt", weights_only=True)["outer"]["master"]
    flip_inside(ck.dir / "fragment-1.pt", saved_master)
    text = refusal(ck.dir)
    assert "fragment-1.pt is damaged: its sha256 is" in text and "meta.json lists" in text
    assert str(ck.dir) in text and "--fresh" in text


def test_a_byte_flipped_inside_a_round_log_is_refused_naming_the_file(saved):
    ck, _ = saved
    path = ck.dir / "rounds" / "fragment-0-round-2.pt"
    record = torch.load(path, weights_only=True)
    flip_inside(path, record["pushes"][0]["parts"][0]["payload"])
    assert "rounds/fragment-0-round-2.pt is damaged: its sha256 is" in refusal(ck.dir)


def _with(saved_state: dict, where: str, value: float) -> dict:
    outer = saved_state["outer"]
    if where == "momentum":
        t = outer["sgd"]["state"][0]["momentum_buffer"]
    else:
        t = outer[where]
    t[7] = value
    return saved_state


@pytest.mark.parametrize("where", ["master", "residual", "momentum"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_value_that_is_not_finite_is_refused_even_with_a_matching_hash(saved, where, value):
    ck, st = saved
    bad = _with(st.fragment_state(2), where, value)  # written by the checkpoint itself: its hash is listed
    assert ck.save(2, bad)
    text = refusal(ck.dir)
    path = {"master": "outer.master", "residual": "outer.residual", "momentum": "momentum_buffer"}[where]
    assert "fragment-2.pt is damaged:" in text and path in text and "1 of" in text and "not finite" in text


def test_a_partial_sum_that_is_not_finite_in_a_round_log_is_refused(tmp_path):
    st = make_state()
    ck = ShardCheckpoint(tmp_path / "ck", FP)
    assert ck.save_all(st)
    close_rounds(st, ck, [1])
    path = ck.dir / "rounds" / "fragment-1-round-0.pt"
    record = torch.load(path, weights_only=True)
    record["partial"] = torch.zeros(st.ranges[1][1] - st.ranges[1][0], dtype=torch.float64)
    record["partial"][3] = math.nan
    assert ck.log_round(1, record)  # listed with its hash
    text = refusal(ck.dir)
    assert "rounds/fragment-1-round-0.pt is damaged: partial: 1 of" in text


def test_a_listed_file_that_is_missing_or_a_gap_in_the_logs_is_refused(saved):
    ck, st = saved
    close_rounds(st, ck, [0, 0])  # logs of rounds 2, 3 and 4
    (ck.dir / "rounds" / "fragment-0-round-3.pt").unlink()
    text = refusal(ck.dir)
    assert "rounds/fragment-0-round-3.pt is missing" in text
    m = meta(ck)
    del m["files"]["rounds/fragment-0-round-3.pt"]
    (ck.dir / "meta.json").write_text(json.dumps(m))
    text = refusal(ck.dir)
    assert "meta.json lists rounds/fragment-0-round-4.pt but not rounds/fragment-0-round-3.pt" in text


def test_meta_json_without_hash_tables_is_refused(saved):
    ck, _ = saved
    m = meta(ck)
    m["files"] = ["fragment-0.pt"]
    (ck.dir / "meta.json").write_text(json.dumps(m))
    assert "meta.json's 'files' is not a table of file hashes" in refusal(ck.dir)


# === crashes between writes ===============================================================================
class Crash(OSError):
    pass


def test_a_crash_before_a_new_fragment_state_is_renamed_in_keeps_the_old_one(saved, monkeypatch):
    ck, st = saved
    before = key(st)
    close_rounds(st, None, [1])
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("fragment-1.pt"):
            raise Crash("killed between the announce and the rename")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)  # common/atomic.py renames with it
    assert ck.save_fragment(st, 1) is False
    assert "fragment-1.pt" in meta(ck)["incoming"]  # the new hash was announced, the old file stays
    assert key(load(ck.dir)) == before


def test_a_crash_after_a_new_fragment_state_is_renamed_in_loads_the_new_one(saved, monkeypatch):
    ck, st = saved
    close_rounds(st, None, [1])
    real, calls = ShardCheckpoint._write_meta, []

    def write_meta(self):
        calls.append(1)
        if len(calls) == 2:  # the first announces the new hash; the second would list it alone
            raise Crash("killed after the rename")
        real(self)

    monkeypatch.setattr(ShardCheckpoint, "_write_meta", write_meta)
    assert ck.save_fragment(st, 1) is False
    monkeypatch.setattr(ShardCheckpoint, "_write_meta", real)
    assert key(load(ck.dir)) == key(st)


def test_a_round_log_written_but_not_listed_was_never_acknowledged_and_is_ignored(saved, monkeypatch):
    ck, st = saved
    before = key(st)

    def write_meta(self):
        raise Crash("killed before the log was listed")

    monkeypatch.setattr(ShardCheckpoint, "_write_meta", write_meta)
    job = st.begin_close(1)
    record = job.record()
    job.run()
    assert ck.log_round(1, record) is False  # the service stops the shard: the update never goes out
    monkeypatch.undo()
    assert (ck.dir / "rounds" / "fragment-1-round-0.pt").exists()
    assert key(load(ck.dir)) == before


def test_a_new_run_that_crashes_before_its_meta_json_leaves_no_checkpoint(saved, monkeypatch):
    ck, _ = saved  # an old run's checkpoint; the new run (--fresh) writes over it
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("fragment-2.pt"):
            raise Crash("killed midway")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)  # common/atomic.py renames with it
    assert ShardCheckpoint(ck.dir, FP).save_all(make_state()) is False
    assert not ShardCheckpoint(ck.dir, FP).exists()  # a new run next time, not a mix of two runs


# === the previous format ================================================================================
def _as_format_1(ck: ShardCheckpoint) -> None:
    m = meta(ck)
    del m["files"], m["incoming"]
    (ck.dir / "meta.json").write_text(json.dumps({**m, "format": 1}))


def test_a_checkpoint_without_hashes_loads_with_a_warning_and_is_written_again_with_them(saved, caplog):
    ck, st = saved
    _as_format_1(ck)
    again, restored = ShardCheckpoint(ck.dir, FP), make_state()
    with caplog.at_level(logging.WARNING, "streamdiloco.shard"):
        again.load(restored)
    assert "was written without file hashes (format 1): loading it unchecked" in caplog.text
    assert key(restored) == key(st) and again.pending_initial  # the shard writes it again before serving
    assert again.save_all(restored)
    m = meta(ck)
    assert m["format"] == 2 and set(m["files"]) == {"fragment-0.pt", "fragment-1.pt", "fragment-2.pt"}
    assert key(load(ck.dir)) == key(st)


def test_a_checkpoint_without_hashes_is_still_checked_finite(saved):
    ck, st = saved
    assert ck.save(1, _with(st.fragment_state(1), "master", math.nan))
    _as_format_1(ck)
    assert "fragment-1.pt is damaged: outer.master: 1 of" in refusal(ck.dir)


def test_a_shard_started_on_a_checkpoint_without_hashes_writes_them_before_it_serves(saved, tmp_path):
    ck, st = saved
    _as_format_1(ck)
    service = shard_of(CFG, "nano", shard=0, num_shards=2, checkpoint_dir=str(ck.dir))
    shard = InThreadShard(service, tmp_path, json.dumps(FP))
    try:
        m = meta(ck)  # written before the shard said it serves, with its contribution ledger
        files = {f"fragment-{f}.pt" for f in range(3)} | {"credits.json"}
        assert m["format"] == 2 and set(m["files"]) == files
        fragments = shard.status()["fragments"]
        assert [x["master_hash"] for x in fragments] == [tensor_digest(st.master(f)) for f in range(3)]
        assert [x["round"] for x in fragments] == [st.round_of(f) for f in range(3)]
    finally:
        shard.shutdown()
    assert key(load(ck.dir)) == key(st)


# === a real shard process ===============================================================================
NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]


def _push_one_round(target: str) -> None:
    """Join the shard as worker w and push fragment 0's round 0, which closes with it (min_workers 1)."""
    channel = make_channel(target)
    try:
        stub = pb_grpc.ShardStub(channel)
        reply = stub.Join(
            pb.JoinRequest(worker="w", fingerprint_json=json.dumps(FP), protocol=PROTOCOL),
            timeout=RPC_TIMEOUT,
        )
        s = Session(stub, pb.WorkerMessage(hello=pb.Hello(worker="w", session=reply.session)))
        s.next_message("welcome")
        n = reply.slices[0].length
        enc = encode(torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2, "e3m0", 128)
        for m in push_messages(enc, values_per_chunk=reply.chunk_values):
            s.send(m)
        assert s.result().accepted
        assert s.update()[-1].last
        s.close()
    finally:
        channel.close()


def test_a_shard_restarted_on_its_checkpoint_reports_the_same_hashes_and_on_a_damaged_one_exits(tmp_path):
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *NANO)
        _push_one_round(target)
        status = wait_until("round 0 to close", lambda: (s := http_json(http))["rounds_closed"] == 1 and s)
        hashes = [f["master_hash"] for f in status["fragments"]]
        c.procs["shard"].terminate()  # SIGTERM: the shard writes its checkpoint and stops
        assert c.wait("shard", timeout=60) == 0, c.log("shard")[-3000:]

        _, http = c.shard("shard", *NANO)
        again = http_json(http)
        assert [f["master_hash"] for f in again["fragments"]] == hashes
        assert [f["round"] for f in again["fragments"]] == [1, 0, 0]
        c.procs["shard"].terminate()
        assert c.wait("shard", timeout=60) == 0

        ckdir = tmp_path / "shard-checkpoint"
        master = torch.load(ckdir / "fragment-0.pt", weights_only=True)["outer"]["master"]
        flip_inside(ckdir / "fragment-0.pt", master)
        proc = c.start("shard-damaged", "server", *NANO, "--port", "0", "--http-port", "0",
                       "--checkpoint-dir", str(ckdir))  # fmt: skip
        assert c.wait("shard-damaged", timeout=60) == 2
        lines = [x for x in c.log("shard-damaged").splitlines() if "error" in x]
        assert lines[-1].startswith("streamdiloco: error: checkpoint "), lines
        assert "fragment-0.pt is damaged: its sha256 is" in lines[-1], lines
        assert proc.returncode == 2
