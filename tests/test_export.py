"""`streamdiloco export`: the run's global model out of the shards' checkpoint directories and out of a live
run (Fetch), as safetensors with no model code, round-tripping into a fresh model bit for bit; with a model,
its whole state_dict and, for a transformers model, a save_pretrained folder."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, load_model

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import layout_from_fingerprint, model_fingerprint
from streamdiloco.common.fragments import build_layout
from streamdiloco.common.globalmodel import ROUNDS_KEY, agree_rounds, fetch_masters, from_servers
from streamdiloco.common.modelspec import build_model
from streamdiloco.common.statefile import FINGERPRINT_KEY
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import InThreadShard, push_messages
from tests.support.procs import Cluster, http_json, streamdiloco
from tests.support.shards import shard_of

RUN = ["--sync-every", "6", "--num-fragments", "3"]
TOKEN = "export-test-token"


def global_params(model: torch.nn.Module, masters: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The masters (fetched fragment vectors) cut into the model's parameters, in their dtypes."""
    layout = build_layout(model, 3, "strided")
    return {
        e.name: masters[f][e.offset : e.offset + e.numel].view(e.shape)
        for f, frag in enumerate(layout.fragments)
        for e in frag.entries
    }


def run(tmp, model: str, steps: int = 12) -> tuple[Cluster, list[str], list[int]]:
    """Two shards and one worker of `model` for `steps` steps (two rounds of each fragment at H=6); the
    shards keep running. Returns the cluster (the caller exits it), the shards' targets and the open round
    of each fragment at the end."""
    c = Cluster(tmp).__enter__()
    flags = ["--model", model, *RUN, "--num-shards", "2", "--token", TOKEN]
    shards = [c.shard(f"shard{s}", *flags, "--shard", str(s)) for s in range(2)]
    targets = [target for target, _ in shards]
    c.worker(
        "w0", targets, "--model", model, *RUN, "--steps", str(steps), "--token", TOKEN, "--log-every", "6"
    )
    assert c.wait("w0") == 0, c.log("w0")[-3000:]
    rounds = [[f["round"] for f in http_json(http)["fragments"]] for _, http in shards]
    assert rounds[0] == rounds[1]
    return c, targets, rounds[0]


def export(*args: str):
    return streamdiloco("export", *args, timeout=300)


@pytest.fixture(scope="module")
def nano_run(tmp_path_factory):
    """A finished nano run: the masters (Fetched while the shards served), a live export, and the shards'
    checkpoint directories after the shards were killed (SIGKILL: the last rounds come from their logs)."""
    tmp = tmp_path_factory.mktemp("nano")
    c, targets, rounds = run(tmp, "nano")
    try:
        masters = fetch_masters(targets, TOKEN)
        live = export(
            "--servers", ",".join(targets), "--token", TOKEN, "--out", str(tmp / "live.safetensors")
        )
        bad_token = export(
            "--servers", ",".join(targets), "--token", "wrong", "--out", str(tmp / "no.safetensors")
        )
        reversed_order = export(
            "--servers", ",".join(targets[::-1]), "--token", TOKEN, "--out", str(tmp / "no.safetensors")
        )
        for s in range(2):
            c.procs[f"shard{s}"].send_signal(signal.SIGKILL)
            c.procs[f"shard{s}"].wait()
    finally:
        c.__exit__(None, None, None)
    dirs = [tmp / f"shard{s}-checkpoint" for s in range(2)]
    return {
        "tmp": tmp,
        "masters": masters,
        "rounds": rounds,
        "live": live,
        "bad_token": bad_token,
        "reversed": reversed_order,
        "dirs": dirs,
    }


def test_the_layout_comes_back_from_the_fingerprint_alone():
    model = build_gpt("nano")
    for p, pattern in ((1, "strided"), (3, "strided"), (3, "sequential")):
        layout = build_layout(model, p, pattern)
        fp = json.loads(
            json.dumps(
                model_fingerprint(
                    layout, SyncConfig(sync_every=6 * p, num_fragments=p, fragment_pattern=pattern)
                )
            )
        )
        assert layout_from_fingerprint(fp) == layout


def test_export_from_checkpoints_round_trips_into_a_fresh_model_bit_for_bit(nano_run):
    out = nano_run["tmp"] / "model.safetensors"
    dirs = nano_run["dirs"][::-1]  # any order
    r = export("--checkpoints", ",".join(map(str, dirs)), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "shard 1 of 2" in r.stderr and "wrote" in r.stderr  # progress
    fresh = build_gpt("nano")
    want = global_params(fresh, nano_run["masters"])
    got = load_file(out)
    assert set(got) == set(want)  # each parameter once: the tied embedding and head under one name
    missing, unexpected = fresh.load_state_dict(got, strict=False)
    assert not unexpected and missing == ["lm_head.weight"]  # the tied head: the embedding's other name
    for name, p in fresh.named_parameters():
        assert torch.equal(p, want[name]), name
    assert not torch.equal(want["transformer.wte.weight"], build_model("nano", 0).transformer.wte.weight)
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    fp = json.loads(meta[FINGERPRINT_KEY])
    assert fp["num_fragments"] == 3 and fp["sync_every"] == 6
    assert json.loads(meta[ROUNDS_KEY]) == nano_run["rounds"]  # the shards' open rounds at the end


def test_the_library_reads_the_checkpoints_as_the_command_does(nano_run):
    """server/storage/export.py's from_checkpoints (the library under `export --checkpoints`): the masters,
    the rounds and the fingerprint's layout; `streamdiloco.export` still names the library's objects."""
    import streamdiloco.export as command
    from streamdiloco.common import globalmodel, tokenizer
    from streamdiloco.server.storage.export import from_checkpoints

    said: list[str] = []
    gm = from_checkpoints(nano_run["dirs"][::-1], progress=said.append)
    assert [torch.equal(a, b) for a, b in zip(gm.vectors, nano_run["masters"], strict=True)] == [True] * 3
    assert gm.rounds == nano_run["rounds"] and len(said) == 2
    assert gm.layout == layout_from_fingerprint(gm.fingerprint)
    assert command.from_checkpoints is from_checkpoints and command.GlobalModel is globalmodel.GlobalModel
    assert command.fetch_masters is globalmodel.fetch_masters
    assert command.read_tokenizer is tokenizer.read_tokenizer


def test_export_from_a_live_run_over_fetch_equals_the_masters(nano_run):
    r = nano_run["live"]
    assert r.returncode == 0, r.stderr
    fresh = build_gpt("nano")
    want = global_params(fresh, nano_run["masters"])
    got = load_file(nano_run["tmp"] / "live.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with safe_open(nano_run["tmp"] / "live.safetensors", "pt") as f:
        assert json.loads(f.metadata()[ROUNDS_KEY]) == nano_run["rounds"]


def test_with_the_model_the_file_holds_its_state_dict_and_loads_strictly(nano_run):
    out = nano_run["tmp"] / "full.safetensors"
    r = export("--checkpoints", ",".join(map(str, nano_run["dirs"])), "--model", "nano", "--out", str(out))
    assert r.returncode == 0, r.stderr
    fresh = build_gpt("nano")
    load_model(fresh, out)  # strict: every name of the state_dict (the tied head from the embedding)
    want = global_params(fresh, nano_run["masters"])
    want["lm_head.weight"] = want["transformer.wte.weight"]
    assert set(fresh.state_dict()) == set(want)
    assert all(torch.equal(t, want[name]) for name, t in fresh.state_dict().items())


def one_line_error(r, *words: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("streamdiloco: error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert all(w in lines[-1] for w in words), lines[-1]


def test_bad_inputs_give_one_line_errors_and_write_nothing(nano_run, tmp_path):
    d0, d1 = nano_run["dirs"]
    out = tmp_path / "model.safetensors"
    one_line_error(export("--checkpoints", str(d0), "--out", str(out)), "shard 1 of 2 is missing")
    one_line_error(export("--checkpoints", f"{d0},{d0}", "--out", str(out)), "both shard 0")
    one_line_error(export("--checkpoints", f"{d0},{tmp_path}", "--out", str(out)), "no meta.json")
    damaged = tmp_path / "damaged"
    shutil.copytree(d1, damaged)
    data = bytearray((damaged / "fragment-0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (damaged / "fragment-0.pt").write_bytes(data)
    one_line_error(export("--checkpoints", f"{d0},{damaged}", "--out", str(out)), "fragment-0.pt is damaged")
    # shard 1 of another run (H=12): its fingerprint differs
    with Cluster(tmp_path) as c:
        c.shard(
            "other",
            "--model",
            "nano",
            "--sync-every",
            "12",
            "--num-fragments",
            "3",
            "--num-shards",
            "2",
            "--shard",
            "1",
        )
        c.procs["other"].send_signal(signal.SIGTERM)
        assert c.wait("other", 60) == 0, c.log("other")
    r = export("--checkpoints", f"{d0},{tmp_path / 'other-checkpoint'}", "--out", str(out))
    one_line_error(r, "different runs", "sync_every")
    one_line_error(
        export("--checkpoints", ",".join(map(str, nano_run["dirs"])), "--model", "tiny", "--out", str(out)),
        "--model tiny does not fit the run",
    )
    one_line_error(nano_run["bad_token"], "refused the credentials", "--token")
    one_line_error(nano_run["reversed"], "in place 0 of 2", "is shard 1 of 2", "in order")
    assert not out.exists() and not (nano_run["tmp"] / "no.safetensors").exists()
    assert not list(tmp_path.glob("*.tmp")) and not list(nano_run["tmp"].glob("*.tmp"))


# in `make test-slow` (a tiny GPT-2 run, transformers imported twice); the default run covers export's
# layout (test_export_from_checkpoints_round_trips_...) and a transformers GPT-2's fingerprint
# (test_settings.py::test_model_config_of_a_transformers_gpt2_keeps_heads_and_drops_dropout)
@pytest.mark.slow
def test_a_transformers_gpt2_comes_back_through_from_pretrained_bit_for_bit(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
    spec = "tests.support.hf_gpt2:tiny_gpt2"
    c, targets, _ = run(tmp_path, spec)
    try:
        masters = fetch_masters(targets, TOKEN)
        for s in range(2):
            c.procs[f"shard{s}"].send_signal(signal.SIGTERM)
            assert c.wait(f"shard{s}", 60) == 0
    finally:
        c.__exit__(None, None, None)
    dirs = ",".join(str(tmp_path / f"shard{s}-checkpoint") for s in range(2))
    r = export(
        "--checkpoints",
        dirs,
        "--model",
        spec,
        "--out",
        str(tmp_path / "m.safetensors"),
        "--hf-out",
        str(tmp_path / "hf"),
    )
    assert r.returncode == 0, r.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    want = global_params(hf, masters)
    for name, p in hf.named_parameters():
        assert torch.equal(p, want[name]), name
    assert torch.equal(hf.lm_head.weight, want["transformer.wte.weight"])  # tied as GPT-2 ties them
    r = export(
        "--checkpoints",
        dirs,
        "--model",
        "nano",
        "--hf-out",
        str(tmp_path / "x"),
        "--out",
        str(tmp_path / "n.safetensors"),
    )
    one_line_error(r, "--hf-out needs a transformers model: --model nano builds a GPT")
    assert not (tmp_path / "x").exists() and not (tmp_path / "n.safetensors").exists()
    plain = transformers.GPT2LMHeadModel(hf.config)
    load_model(plain, tmp_path / "m.safetensors")  # --model's file: the whole state_dict, strictly
    assert all(torch.equal(p, want[name]) for name, p in plain.named_parameters())


# in `make test-slow`; covered by test_export_from_checkpoints_round_trips_into_a_fresh_model_bit_for_bit
# (the same file, from the shards) and tests/test_cli.py::test_launch_stops_every_process_it_started[sigterm]
@pytest.mark.slow
def test_launch_save_global_writes_the_global_model_as_safetensors(tmp_path):
    out = tmp_path / "run"
    r = streamdiloco(
        "launch", "--shards", "2", "--workers", "1", "--out", str(out), "--save-global", "--model", "nano",
        "--steps", "12", *RUN, "--log-every", "6",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    masters = torch.load(out / "masters.pt")
    mirror = torch.load(out / "worker-0-global.pt")
    assert all(torch.equal(a, b) for a, b in zip(mirror, masters, strict=True))
    want = global_params(build_gpt("nano"), masters)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def fingerprint() -> dict:
    model = build_gpt("nano")
    return json.loads(
        json.dumps(model_fingerprint(build_layout(model, 3), SyncConfig(sync_every=6, num_fragments=3)))
    )


def _set(fp: dict, path: tuple, value) -> dict:
    target = fp
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return fp


@pytest.mark.parametrize(
    "path, value, words",
    [
        (("params",), None, "lacks its lists"),
        (("fragments",), [], "lacks its lists"),
        (("params", 0), ["x", [2]], "not [name, shape, dtype]"),
        (("params", 0, 1), [-1, 4], "the shape"),
        (("params", 0, 1), [1 << 30, 1 << 30], "claims more than"),
        (("params", 0, 1), [True], "the shape"),
        (("params", 0, 2), "int64", "not a float dtype"),
        (("params", 0, 2), "Tensor", "not a float dtype"),
        (("params", 1, 0), "transformer.wte.weight", "twice"),
        (("fragments", 0, 1, 0), "nope", "not a parameter"),
        (("fragments", 0), "blocks", "not [blocks, names]"),
        (("fragments", 2, 1), [], "in order, each once"),
        (("blocks_path",), 3, "must be strings"),
    ],
)
def test_a_fingerprint_that_is_not_one_is_refused_in_one_line(path, value, words):
    """A shard's fingerprint comes off the network: every field is checked before anything is allocated."""
    fp = fingerprint()
    if path == ("params", 1, 0):
        value = fp["params"][0][0]
    with pytest.raises(ValueError) as e:
        layout_from_fingerprint(_set(fp, path, value), "the shard's fingerprint")
    assert (
        words in str(e.value)
        and str(e.value).startswith("the shard's fingerprint")
        and "\n" not in str(e.value)
    )


def test_shards_at_different_rounds_are_named_unless_mixed_rounds_is_given():
    where = ["dirA", "dirB"].__getitem__
    assert agree_rounds([[3, 2, 2], [3, 2, 2]], False, where) == [3, 2, 2]
    with pytest.raises(ValueError) as e:
        agree_rounds([[3, 2, 2], [3, 1, 2]], False, where)
    assert str(e.value).startswith(
        "the shards hold different rounds of fragment 1: 2 on shard 0 (dirA), 1 on"
    )
    assert "--mixed-rounds" in str(e.value)
    assert agree_rounds([[3, 2, 2], [3, 1, 2]], True, where) == [3, [2, 1], 2]


def test_a_live_export_waits_for_a_round_that_closed_on_one_shard_to_close_on_the_other(tmp_path):
    """Two in-process shards; a worker's push closes round 0 of fragment 0 on shard 0 only. The export
    names the difference (or, with mixed_rounds, keeps each slice's round); given time, it fetches the
    fragment again once the round has closed on shard 1 too, and every slice is of round 1."""
    cfg = SyncConfig(sync_every=6, num_fragments=3)
    fp = json.dumps(model_fingerprint(build_layout(build_model("nano", 0), 3), cfg))
    shards = [
        InThreadShard(shard_of(cfg, "nano", s, 2, min_workers=1, token=TOKEN), tmp_path, fp, token=TOKEN)
        for s in range(2)
    ]
    try:
        workers = [s.worker("w0") for s in shards]

        def close_round_0(s: int) -> None:
            lo, hi = shards[s].service.state.ranges[0]
            workers[s].push(push_messages(encode(torch.randn(hi - lo) * 1e-2, "e3m0", 128)))
            assert workers[s].session.result().accepted
            shards[s].wait_for(lambda: shards[s].service.state.round_of(0) == 1, f"round 0 to close on {s}")

        close_round_0(0)
        assert not any(c.fingerprint_json for c in shards[0].fetch())  # workers' Fetches: no description
        described = list(shards[1].stub.Fetch(pb.FetchRequest(token=TOKEN, describe=True), timeout=10))
        assert json.loads(described[0].fingerprint_json) == json.loads(fp)
        assert (described[0].shard, described[0].num_shards) == (1, 2)
        assert not any(c.fingerprint_json for c in described[1:])  # once per stream
        targets = [s.target for s in shards]
        with pytest.raises(
            ValueError, match=r"different rounds of fragment 0: 1 on shard 0 \(127.0.0.1:\d+\), 0 on"
        ):
            from_servers(targets, TOKEN, settle=0.2)
        mixed = from_servers(targets, TOKEN, settle=0.0, mixed_rounds=True)
        assert mixed.rounds == [[1, 0], 0, 0]

        def progress(line: str) -> None:  # shard 0 fetched at round 1 of fragment 0, shard 1 at round 0 ...
            if line.startswith("shard 1 of 2"):
                close_round_0(1)  # ... and now the round closes there too

        gm = from_servers(targets, TOKEN, settle=30.0, progress=progress)
        assert gm.rounds == [1, 0, 0]
        for f, vec in enumerate(gm.vectors):
            masters = [s.on_loop(lambda s=s, f=f: s.service.state.master(f).clone()) for s in shards]
            assert torch.equal(vec, torch.cat(masters))
    finally:
        for s in shards:
            s.shutdown()


class FakeShard(pb_grpc.ShardServicer):
    """A shard that answers Fetch with whatever the test makes of an honest stream."""

    def __init__(self, stream):
        self.stream = stream

    def Fetch(self, request, context):
        yield from self.stream(request)


NANO_FP = model_fingerprint(
    build_layout(build_model("nano", 0), 3), SyncConfig(sync_every=6, num_fragments=3)
)
NANO_VALUES = [
    torch.randn(f.numel, generator=torch.Generator().manual_seed(f.index))
    for f in build_layout(build_model("nano", 0), 3).fragments
]


def honest(request: pb.FetchRequest) -> list[pb.MasterChunk]:
    """One shard of one: every fragment whole, in chunks of 5,000 values, round 4; described if asked."""
    out = []
    for f, values in enumerate(NANO_VALUES):
        for lo in range(0, values.numel(), 5000):
            hi = min(values.numel(), lo + 5000)
            chunk = values[lo:hi].numpy().tobytes()
            last = hi == values.numel()
            out.append(
                pb.MasterChunk(fragment=f, round=4, offset=lo, total=values.numel(), values=chunk, last=last)
            )
    if request.describe:
        out[0].fingerprint_json, out[0].shard, out[0].num_shards = json.dumps(NANO_FP), 0, 1
    return out


def _changed(**fields):
    def change(chunks: list[pb.MasterChunk], i: int) -> list[pb.MasterChunk]:
        for k, v in fields.items():
            setattr(chunks[i], k, v)
        return chunks

    return change


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda c: c, None),
        (lambda c: _changed(fingerprint_json="")(c, 0), "does not say which run it serves"),
        (lambda c: _changed(shard=1, num_shards=2)(c, 0), "in place 0 of 1, but it is shard 1 of 2"),
        (lambda c: _changed(fingerprint_json="{not json")(c, 0), "a fingerprint that is not JSON"),
        (lambda c: _changed(fingerprint_json='{"params": 3}')(c, 0), "lacks its lists of parameters"),
        (lambda c: _changed(total=7)(c, 1), "fragment 0: the slice has 24704 values, the shard says 7"),
        (lambda c: _changed(offset=3)(c, 1), "fragment 0: offset 3, expected 5000"),
        (lambda c: _changed(round=5)(c, 1), "fragment 0: round 5 after chunks of round 4"),
        (lambda c: _changed(values=b"\0" * 7)(c, 1), "whole 4-byte numbers"),
        (
            lambda c: _changed(values=torch.full((5000,), float("nan")).numpy().tobytes())(c, 1),
            "non-finite values",
        ),
        (lambda c: [x for x in c if x.fragment != 1], "sent fragment 2 where fragment 1 was due"),
        (lambda c: c + [c[-1]], "sent fragment 2 where the Fetch was over"),
        (lambda c: [x for x in c if x.fragment == 0], "ended the Fetch after 1 of 3 fragments"),
        (lambda c: c[:-1], "ended the Fetch after 2 of 3 fragments"),
    ],
)
def test_a_shard_that_sends_a_bad_fetch_stream_is_refused_in_one_line(mutate, words):
    """What comes off the network is checked: the description, then each chunk (chunks.MasterAssembly)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_ShardServicer_to_server(FakeShard(lambda request: mutate(honest(request))), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        if words is None:
            gm = from_servers([f"127.0.0.1:{port}"], timeout=30)
            assert gm.rounds == [4, 4, 4] and gm.fingerprint == NANO_FP
            assert all(torch.equal(a, b) for a, b in zip(gm.vectors, NANO_VALUES))
            return
        with pytest.raises(ValueError) as e:
            from_servers([f"127.0.0.1:{port}"], timeout=30)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    finally:
        server.stop(None)
