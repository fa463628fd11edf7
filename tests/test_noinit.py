"""Shards without the user's model code, and workers that take the run's settings from the shard: real shard
processes (`streamdiloco server --init FILE`, no --model), workers through connect() and the worker CLI."""

from __future__ import annotations

import json
import re
import signal
import threading
import urllib.error

import grpc
import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from streamdiloco.common.codecspec import CODEC_HELP
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import layout_from_fingerprint, model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.inithash import init_hash
from streamdiloco.common.statefile import FINGERPRINT_KEY, ParamSpec, layout_from_description
from streamdiloco.common.wire import values_to_bytes
from streamdiloco.export import fetch_masters
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker.join import SyncError, connect
from streamdiloco.worker.model import build_gpt
from tests.support.procs import Cluster, http_json, shard_process, streamdiloco, wait_until


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)


class Block(nn.Module):
    def __init__(self, d, experts):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))


class UserLM(nn.Module):
    """A model only this test knows (the shard process cannot import it): tied embedding and head, blocks in
    `body.layers`, and within each block a shorter list of experts (the blocks are the longest list)."""

    def __init__(self, d=16, layers=3, experts=2):
        super().__init__()
        self.embed = nn.Embedding(40, d)
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(Block(d, experts) for _ in range(layers))
        self.head = nn.Linear(d, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for block in self.body.layers:
            h = block.norm(h)
            for e in block.experts:
                h = h + e.down(torch.relu(e.up(h)))
        return self.head(h)


# the fixed schedule for the runs that _train_and_check counts rounds of: under the adaptive one a worker
# that finds itself faster than the pace takes two inner steps for one schedule step, so 12 inner steps
# may close fewer than 6 rounds on a loaded machine
FIXED = ("--sync-schedule", "fixed")


def _train_and_check(model: nn.Module, target: str, http: int, steps: int = 12) -> None:
    """connect() with no settings (H and P from the shard), train, and end with the mirror equal to the
    shard's masters bit for bit."""
    file_values = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(99)
    for p in model.parameters():  # other values than the file's: the worker must take the shard's
        nn.init.normal_(p)
    engine = connect(model, [target], total_steps=steps, name="user")
    try:
        assert (engine.cfg.sync_every, engine.cfg.num_fragments) == (6, 3)  # the shard's, not the defaults
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), file_values, strict=True))
        start = [m.clone() for m in engine.mirrors]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            x = torch.randint(0, 40, (4, 6))
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            engine.step(tokens=x.numel(), loss=loss.item())
        masters = fetch_masters([target])
        assert all(torch.equal(a, b) for a, b in zip(engine.mirrors, masters, strict=True))
        assert not any(torch.equal(a, b) for a, b in zip(start, masters, strict=True))  # trained
    finally:
        engine.close()
    status = http_json(http)
    # 12 steps at H=6: two rounds of each fragment, and the final sync's of those not sent at the last step
    assert sum(f["round"] for f in status["fragments"]) == status["rounds_closed"] >= 6


# in `make test-slow`; covered by test_a_shard_started_from_an_exported_safetensors_file_takes_the_blocks_...
# (the same --init FILE path without model code, from the other file format)
@pytest.mark.slow
def test_a_shard_started_from_a_torch_state_dict_needs_no_model_code(tmp_path):
    torch.manual_seed(1)
    model = UserLM()
    torch.save(model.state_dict(), tmp_path / "model.pt")  # both names of the tied weight
    flags = ["--init", str(tmp_path / "model.pt"), "--blocks-path", "body.layers", *FIXED]
    with shard_process(tmp_path, *flags, "--sync-every", "6", "--num-fragments", "3") as (target, http, _):
        log = (tmp_path / "shard.log").read_text()
        assert "3 blocks in 'body.layers' (from --blocks-path)" in log, log
        _train_and_check(model, target, http)
        masters = fetch_masters([target])
    # restarted once the file is gone: the checkpoint has the layout (and the values)
    (tmp_path / "model.pt").unlink()
    again = [
        *flags,
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        "--checkpoint-dir",
        str(tmp_path / "shard-checkpoint"),
    ]
    with shard_process(tmp_path, *again, name="again") as (target, _, _):
        assert "model.pt is gone: the layout comes from checkpoint" in (tmp_path / "again.log").read_text()
        assert _same(fetch_masters([target]), masters)


def test_a_shard_started_from_an_exported_safetensors_file_takes_the_blocks_from_its_fingerprint(tmp_path):
    torch.manual_seed(2)
    model = UserLM()
    run = model_fingerprint(build_layout(model, 2), SyncConfig(sync_every=4, num_fragments=2))  # another P
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # safetensors: no sharing
    save_file(state, tmp_path / "model.safetensors", metadata={FINGERPRINT_KEY: json.dumps(run)})
    flags = ["--init", str(tmp_path / "model.safetensors"), "--sync-every", "6", "--num-fragments", "3"]
    with shard_process(tmp_path, *flags, *FIXED) as (target, http, _):
        log = (tmp_path / "shard.log").read_text()
        assert "3 blocks in 'body.layers' (from the file's fingerprint)" in log, log
        _train_and_check(model, target, http)


def test_without_the_fingerprint_the_blocks_are_detected_and_another_model_is_refused(tmp_path):
    torch.manual_seed(3)
    model = UserLM()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    flags = ["--init", str(tmp_path / "model.pt"), "--sync-every", "6", "--num-fragments", "3"]
    with shard_process(tmp_path, *flags) as (target, _, _):
        log = (tmp_path / "shard.log").read_text()
        assert "3 blocks in 'body.layers' (detected from the names)" in log, log
        with pytest.raises(
            SyncError, match="fingerprint differs from the shard's: worker has 4 blocks, shard 3"
        ):
            connect(UserLM(layers=4), [target], name="other")
        with pytest.raises(
            SyncError, match=r"body.layers.0.norm.weight has shape \[8\] on the worker, \[16\]"
        ):
            connect(UserLM(d=8), [target], name="narrow")
    # files that cannot start a shard: one line, before anything listens
    plain = tmp_path / "plain.safetensors"
    save_file({k: v for k, v in model.state_dict().items() if k != "head.weight"}, plain)
    r = streamdiloco("server", "--init", str(plain), "--port", "0", "--http-port", "0", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "streamdiloco: error: --init" in lines[0], r.stderr
    assert "write it with `streamdiloco export`" in lines[0]
    # with a model, --blocks-path names its list of blocks (as connect(blocks_path=)): a wrong one is one line
    r = streamdiloco("server", "--model", "nano", "--blocks-path", "x", "--no-checkpoint", timeout=120)
    assert r.returncode == 2 and "blocks_path 'x' names no submodule of the model" in r.stderr, r.stderr


def test_a_worker_takes_the_settings_it_did_not_set_from_the_shard(tmp_path):
    shard = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--fragment-sync-delay", "2"]
    shard += ["--fragment-update-alpha", "0.25", "--uplink-codec", "int8", "--downlink-codec", "bf16"]
    with shard_process(tmp_path, *shard) as (target, http, _):
        engine = connect(build_gpt("nano"), [target], name="adopts")
        try:
            c = engine.cfg
            assert (c.sync_every, c.num_fragments) == (6, 3)
            assert (c.fragment_sync_delay, c.fragment_update_alpha) == (2, 0.25)
            assert (c.uplink_codec, c.downlink_codec) == ("int8", "bf16")
        finally:
            engine.close()
        # tau and alpha are the worker's own: set (here to the default's value, so said in sync_set), they
        # stay as set
        engine = connect(
            build_gpt("nano"),
            [target],
            SyncConfig(fragment_sync_delay=1),
            name="own-tau",
            sync_set=frozenset({"fragment_sync_delay"}),
        )
        try:
            assert (engine.cfg.fragment_sync_delay, engine.cfg.sync_every) == (1, 6)
        finally:
            engine.close()
        # H set (even to the default's value) and different from the shard's: refused as ever, in one line
        with pytest.raises(SyncError, match="sync_every is 30 on the worker, 6 on the shard"):
            connect(build_gpt("nano"), [target], SyncConfig(), name="w-h", sync_set=frozenset({"sync_every"}))
        with pytest.raises(SyncError, match="sync_every is 12 on the worker, 6 on the shard"):
            connect(build_gpt("nano"), [target], SyncConfig.given({"sync_every": 12}), name="w-h")
        with pytest.raises(ValueError, match="do not go with those of the shard at .*tau=7"):
            connect(build_gpt("nano"), [target], SyncConfig(fragment_sync_delay=7), name="w")
        # the worker CLI: flags left out are the shard's; one set that differs is refused in one line
        r = streamdiloco(
            "worker", "--servers", target, "--model", "nano", "--steps", "2", "--sync-every", "12"
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and "sync_every is 12 on the worker, 6 on the shard" in lines[-1], r.stderr
        assert lines[-1].startswith("streamdiloco: error: ")
        summary = tmp_path / "w.json"
        args = [
            "--servers",
            target,
            "--model",
            "nano",
            "--steps",
            "6",
            "--batch-size",
            "2",
            "--eval-batches",
            "1",
        ]
        with Cluster(tmp_path) as c:
            c.start("cli", "worker", *args, "--name", "cli", "--summary", str(summary))
            assert c.procs["cli"].wait(180) == 0, c.log("cli")[-3000:]
            log = c.log("cli")
        assert re.search(
            r"from the shard at \S+: sync_every=6, num_fragments=3, .*fragment_sync_delay=2", log
        )
        assert "H=6 tau=2 alpha=0.25 int8/bf16" in log
        hashes = json.loads(summary.read_text())["mirror_hashes"]
        status = wait_until("the rounds", lambda: http_json(http))
        assert hashes == [[f["master_hash"]] for f in status["fragments"]]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_shard_without_parameters_takes_the_first_workers_and_a_restart_needs_it_no_more(tmp_path):
    flags = ["--init", "from-worker", "--sync-every", "6", "--num-fragments", "3"]
    with Cluster(tmp_path) as c:
        target, http = c.shard("s", *flags)
        assert "waiting for the first worker's model and parameters" in c.log("s")
        # ready for workers (compose starts them on /readyz), though it has nothing to serve yet
        assert http_json(http, "/readyz") == {
            "ready": True,
            "phase": "waiting for the first worker's parameters",
        }
        with pytest.raises(urllib.error.HTTPError) as e:  # no status without a state
            http_json(http)
        assert e.value.code == 503
        torch.manual_seed(1)
        first = UserLM()
        own = [p.detach().clone() for p in first.parameters()]
        engine = connect(first, [target], total_steps=100, name="first")
        try:
            assert _same([p.detach() for p in first.parameters()], own)  # its own values are the run's start
            assert "took the layout (3 fragments" in c.log("s") and "parameters from first" in c.log("s")
            opt = torch.optim.SGD(first.parameters(), lr=0.1)
            for _ in range(6):  # a round of every fragment
                x = torch.randint(0, 40, (4, 6))
                nn.functional.cross_entropy(first(x).flatten(0, 1), x.flatten()).backward()
                opt.step()
                opt.zero_grad()
                engine.step(tokens=x.numel())
            wait_until("a round of every fragment", lambda: http_json(http)["rounds_closed"] >= 3)
        finally:
            engine.close()
        masters = fetch_masters([target])
        # a later worker is checked against the first one's fingerprint, and takes the run's parameters
        with pytest.raises(
            SyncError, match="fingerprint differs from the shard's: worker has 4 blocks, shard 3"
        ):
            connect(UserLM(layers=4), [target], name="other")
        torch.manual_seed(2)
        second = UserLM()
        engine = connect(second, [target], name="second")
        try:
            assert _same(engine.mirrors, masters) and not _same(
                [p.detach() for p in second.parameters()], own
            )
        finally:
            engine.close()
        # restarted on the same port: the layout and the masters come from its checkpoint, no upload
        c.procs["s"].send_signal(signal.SIGTERM)
        assert c.procs["s"].wait(60) == 0, c.log("s")[-3000:]
        port = int(target.rsplit(":", 1)[1])
        target, http = c.shard("s", *flags, port=port)
        assert http_json(http, "/readyz")["ready"]
        assert _same(fetch_masters([target]), masters)
        torch.manual_seed(3)
        engine = connect(UserLM(), [target], name="third")
        try:
            assert _same(engine.mirrors, masters)
        finally:
            engine.close()
        assert c.log("s").count("took the layout") == 1  # the first start only


def _claim(fp: dict, vectors) -> dict:
    """The init hash and slice hashes of these values on one shard, as a worker sends them (none for a
    fingerprint that lists no layout of them)."""
    try:
        layout = layout_from_fingerprint(fp)
    except ValueError:
        return {}
    if len(vectors) != layout.num_fragments:
        return {}
    h, digests = init_hash(layout, vectors, 1)
    return {"init_hash": h, "slice_hashes": digests}


def _chunks(fp: dict, vectors, token: str = "", worker: str = "up", hold=None, last: bool = True):
    """An Initialize stream: the fingerprint (and the values' init hash), each fragment's values in
    1000-value pieces, the last mark; `hold` (an Event) is waited on after the first message."""
    head = {"worker": worker, "token": token, "fingerprint_json": json.dumps(fp), **_claim(fp, vectors)}
    yield pb.InitChunk(**head)
    if hold is not None:
        hold.wait(60)
    for f, vec in enumerate(vectors):
        for a in range(0, vec.numel(), 1000):
            yield pb.InitChunk(fragment=f, offset=a, values=values_to_bytes(vec[a : a + 1000]))
    if last:
        yield pb.InitChunk(last=True)


def test_a_hostile_upload_is_refused_and_changes_nothing(tmp_path):
    flags = ["--init", "from-worker", "--sync-every", "6", "--num-fragments", "3", "--token", "secret"]
    torch.manual_seed(4)
    model = UserLM()
    layout = build_layout(model, 3)
    fp = model_fingerprint(layout, SyncConfig(sync_every=6, num_fragments=3))
    good = [flatten(fragment_params(model, f)) for f in layout.fragments]
    with Cluster(tmp_path) as c:
        target, http = c.shard("s", *flags)
        channel = grpc.insecure_channel(target)
        stub = pb_grpc.ShardStub(channel)
        auth = (("authorization", "Bearer secret"),)

        def refused(chunks, metadata=auth) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as e:
                stub.Initialize(chunks, metadata=metadata, timeout=30)
            return e.value

        e = refused(_chunks(fp, good), metadata=())
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        e = refused(_chunks(fp, good, token="wrong"), metadata=())
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        bigger = [torch.cat([good[0], torch.zeros(5)]), *good[1:]]
        e = refused(_chunks(fp, bigger, token="secret"))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than the" in e.details(), e.details()
        e = refused(_chunks(fp, [good[0], good[1][:-3], good[2]], token="secret"))
        assert "expected fragment 1 at offset" in e.details() or "ended with fragment" in e.details(), (
            e.details()
        )
        e = refused(_chunks(fp, good, token="secret", last=False))
        assert "ended before its last chunk" in e.details(), e.details()
        nan = [good[0], good[1].clone(), good[2]]
        nan[1][7] = float("nan")
        e = refused(_chunks(fp, nan, token="secret"))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not finite" in e.details(), e.details()
        other = model_fingerprint(layout, SyncConfig(sync_every=12, num_fragments=3))
        e = refused(_chunks(other, good, token="secret"))
        assert (
            e.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "sync_every is 12 on the worker, 6" in e.details()
        )
        # a fingerprint claiming a huge model: refused before anything is held for it
        huge = [ParamSpec("b.0.w", (1 << 36,), "float32"), ParamSpec("b.1.w", (1,), "float32")]
        huge_fp = model_fingerprint(
            layout_from_description(huge, 3), SyncConfig(sync_every=6, num_fragments=3)
        )
        e = refused(_chunks(huge_fp, [], "secret"))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than it takes" in e.details(), (
            e.details()
        )
        # two at once: the second is refused while the first is in; the first then breaks off
        hold = threading.Event()

        def start_slow():
            chunks = _chunks(fp, good, token="secret", hold=hold, last=False)
            return stub.Initialize.future(chunks, metadata=auth)

        slow = start_slow()

        def second_refused():
            nonlocal slow
            if slow.done():  # refused: the refusal before it still held the slot (the status goes out first)
                slow = start_slow()
                return None
            r = refused(_chunks(fp, good, token="secret", last=False))  # could not succeed alone either
            return r if r.code() == grpc.StatusCode.ABORTED and not slow.done() else None

        e = wait_until("the second upload to be refused while the first is in", second_refused)
        assert "is sending the parameters now" in e.details()
        hold.set()
        with pytest.raises(grpc.RpcError):
            slow.result(30)
        # nothing changed: still waiting, nothing written
        assert http_json(http, "/healthz")["phase"] == "waiting for the first worker's parameters"
        assert not (tmp_path / "s-checkpoint" / "meta.json").exists()
        assert "took the layout" not in c.log("s")
        stub.Initialize(_chunks(fp, good, token="secret"), metadata=auth, timeout=30)  # a good one is taken
        assert (tmp_path / "s-checkpoint" / "meta.json").exists()
        assert _same(fetch_masters([target], token="secret"), good)
        e = refused(_chunks(fp, good, token="secret"))
        assert e.code() == grpc.StatusCode.ALREADY_EXISTS
        channel.close()


def test_two_workers_at_once_on_shards_without_parameters_start_from_one_workers_values(tmp_path):
    flags = ["--init", "from-worker", "--sync-every", "6", "--num-fragments", "3", "--num-shards", "2"]
    with Cluster(tmp_path) as c:
        targets = [c.shard(f"s{i}", *flags, "--shard", str(i))[0] for i in range(2)]
        models, engines, errors = {}, {}, []
        for seed in (5, 6):
            torch.manual_seed(seed)
            models[f"w{seed}"] = UserLM()

        def join(name: str) -> None:
            try:
                engines[name] = connect(models[name], targets, name=name)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=join, args=(name,)) for name in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert not errors, errors
            # one worker's values on both shards, not a mix of the two
            uploader = {re.search(r"starting parameters from (w\d)", c.log(f"s{i}"))[1] for i in range(2)}
            assert len(uploader) == 1 and all(c.log(f"s{i}").count("took the layout") == 1 for i in range(2))
            want = [p.detach() for p in models[uploader.pop()].parameters()]
            for name, model in models.items():  # both hold the uploader's values, the other one fetched them
                assert _same([p.detach() for p in model.parameters()], want), name
            assert _same(engines["w5"].mirrors, engines["w6"].mirrors)
        finally:
            for e in engines.values():
                e.close()


def test_a_worker_setting_that_is_wrong_on_its_own_is_said_before_any_shard_is_asked():
    r = streamdiloco("worker", "--servers", "127.0.0.1:1", "--sync-every", "12", "--uplink-codec", "fp4")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    want = f"streamdiloco: error: unknown uplink_codec 'fp4': choose one of {CODEC_HELP}"
    assert lines[0] == want


def test_an_upload_is_checked_piece_by_piece_and_gives_the_shards_slices():
    from streamdiloco.server.edge.initialize import InitRefused, Upload, shard_fingerprint

    specs = [
        ParamSpec("b.0.w", (5,), "float32"),
        ParamSpec("b.1.w", (1,), "float32"),
        ParamSpec("e", (4,), "bfloat16"),
    ]
    layout = layout_from_description(specs, 3)  # fragments of 5, 1 and 4 values
    cfg = SyncConfig(sync_every=6, num_fragments=3)
    fp = {**model_fingerprint(layout, cfg), "model_config": {"n_head": 2}}
    got, ours = shard_fingerprint(fp, cfg)
    assert got == layout and ours == fp  # a key beyond the layout is kept, to compare later workers with
    # shard 1 of 2: values 3..5 of fragment 0, none of fragment 1 (1 value: shard 0's), 2..4 of fragment 2
    up = Upload(layout, 1, 2)
    bad = [
        (lambda u: u.add(0, 1, values_to_bytes(torch.ones(2)), False), "expected fragment 0 at offset 0"),
        (lambda u: u.add(0, 0, values_to_bytes(torch.ones(3)), False), "more than the 2 values"),
        (lambda u: u.add(0, 0, b"\x00" * 7, False), "whole 4-byte numbers"),
        (lambda u: u.add(0, 0, values_to_bytes(torch.tensor([1.0, float("inf")])), False), "not finite"),
        (lambda u: u.add(0, 0, b"", True), "ended with fragment 0 at 0 of its 2 values"),
    ]
    for call, words in bad:
        with pytest.raises(InitRefused, match=words):
            call(Upload(layout, 1, 2))
    up.add(0, 0, values_to_bytes(torch.tensor([1.0, 2.0])), False)
    up.add(2, 0, values_to_bytes(torch.tensor([3.0, 4.0])), True)  # fragment 1 has nothing here
    with pytest.raises(InitRefused, match="a chunk after the last one"):
        up.add(2, 2, b"", True)
    initial = up.initial()
    assert [t.tolist() for t in initial] == [[0, 0, 0, 1, 2], [0], [0, 0, 3, 4]]
    with pytest.raises(InitRefused, match="sync_every is 6 on the worker, 12 on the shard"):
        shard_fingerprint(fp, SyncConfig(sync_every=12, num_fragments=3))
    with pytest.raises(InitRefused, match="do not hold every parameter once"):
        shard_fingerprint({**fp, "fragments": fp["fragments"][:2]}, cfg)
