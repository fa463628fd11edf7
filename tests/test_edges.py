"""The edges a new user meets first (issue 14, part 5): a port in use named by its flag, progress while the
shard is not there, a token on one side only, a model the worker CLI cannot train, and the layout given by
the user (blocks_path, fragments) on both sides. Real processes where the behaviour is the CLI's."""

from __future__ import annotations

import contextlib
import json
import re
import socket

import pytest
import torch

from streamdiloco.common.ports import free_port
from tests.support.procs import Cluster, streamdiloco, wait_until


@contextlib.contextmanager
def held_port():
    """A port something listens on, for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def one_error_line(r) -> str:
    """The process's error: exactly one `streamdiloco: error:` line, and no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("streamdiloco: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_shard_port_in_use_is_named_by_its_flag(tmp_path, flag):
    with held_port() as port:
        other = "--http-port" if flag == "--port" else "--port"
        r = streamdiloco(
            "server", "--model", "nano", flag, str(port), other, "0", "--no-checkpoint", timeout=120
        )
    assert r.returncode == 1
    assert one_error_line(r) == (
        f"streamdiloco: error: {flag} {port}: address 127.0.0.1:{port} already in use "
        "(another shard? pick another port or 0)"
    )


def test_a_worker_metrics_port_in_use_is_named_by_its_flag(tmp_path):
    with held_port() as port:
        r = streamdiloco(
            "worker",
            *("--servers", "127.0.0.1:1", "--model", "nano", "--metrics-port", str(port)),
            *("--checkpoint", str(tmp_path / "w.pt")),
            timeout=120,
        )
    assert r.returncode == 1
    assert one_error_line(r) == (
        f"streamdiloco: error: --metrics-port {port}: address 127.0.0.1:{port} already in use "
        "(another worker? pick another port or 0)"
    )


def test_launch_http_port_in_use_is_named_by_its_flag(tmp_path):
    with held_port() as port:
        # shard 1 would take port + 1: the error names the flag's value and the address taken
        r = streamdiloco(
            "launch", "--shards", "1", "--workers", "1", "--http-port", str(port), "--out", str(tmp_path)
        )
    assert r.returncode == 1
    assert one_error_line(r) == (
        f"streamdiloco: error: --http-port {port}: address 127.0.0.1:{port} already in use "
        "(another run? pick another port or 0)"
    )


def test_no_shard_at_the_address_says_so_while_it_waits_then_names_the_flag(tmp_path):
    port = free_port()
    r = streamdiloco(
        "worker",
        *("--servers", f"127.0.0.1:{port}", "--model", "nano", "--join-timeout", "7"),
        *("--checkpoint", str(tmp_path / "w.pt")),
        timeout=120,
    )
    assert r.returncode == 1
    assert f"waiting for shard at 127.0.0.1:{port} (retrying, 5s of --join-timeout 7s)" in r.stderr, r.stderr
    assert one_error_line(r) == (
        f"streamdiloco: error: no shard answered at 127.0.0.1:{port} within --join-timeout 7s: "
        "is it running, and is the address right?"
    )


# in `make test-slow`; covered by test_no_shard_at_the_address_says_so_while_it_waits_then_names_the_flag
# (the worker's wait for a shard) and test_e2e.py's joins
@pytest.mark.slow
def test_a_worker_started_before_its_shard_joins_once_the_shard_is_up(tmp_path):
    port = free_port()
    with Cluster(tmp_path) as c:
        w0 = c.worker("w0", [f"127.0.0.1:{port}"], "--model", "nano", "--steps", "4")

        def waiting() -> bool:
            assert w0.poll() is None, c.log("w0")[-3000:]
            return f"waiting for shard at 127.0.0.1:{port}" in c.log("w0")

        wait_until("the worker to say it waits", waiting, timeout=120)
        c.shard("shard", "--model", "nano", port=port)
        assert c.wait("w0", timeout=300) == 0, c.log("w0")[-3000:]
    assert c.summary("w0")["steps"] == 4


# in `make test-slow`; covered by tests/test_admission.py (the same refusal, at Join and at the pending
# shard) and test_a_worker_without_the_shards_token_is_told_to_give_one (a token refusal, end to end)
@pytest.mark.slow
def test_a_token_a_shard_does_not_check_is_refused_by_name_and_logged_once_per_worker(tmp_path):
    with Cluster(tmp_path) as c:
        target, _ = c.shard("shard", "--model", "nano")  # no --token: loopback, checks nothing
        for name in ("w0", "w0", "w1"):  # w0 again, as a restart policy would
            r = streamdiloco(
                "worker",
                *("--servers", target, "--name", name, "--model", "nano", "--token", "s3cret"),
                *("--checkpoint", str(tmp_path / f"{name}.pt")),
                timeout=120,
            )
            assert r.returncode == 1
            assert one_error_line(r) == (
                f"streamdiloco: error: shard at {target} refused Join: FAILED_PRECONDITION: the worker sent "
                "a token, but this shard checks none (started without --token or --workers-file, it takes no "
                "credential at all): start the shard with the run's --token, or drop the worker's --token"
            )
        log = c.log("shard")
        assert log.count("refused w0 at Join: the worker sent a token") == 1, log
        assert log.count("refused w1 at Join: the worker sent a token") == 1, log


def test_a_worker_without_the_shards_token_is_told_to_give_one(tmp_path):
    with Cluster(tmp_path) as c:
        target, _ = c.shard("shard", "--model", "nano", "--token", "s3cret")
        r = streamdiloco(
            "worker",
            *("--servers", target, "--name", "w0", "--model", "nano"),
            *("--checkpoint", str(tmp_path / "w0.pt")),
            timeout=120,
        )
    assert r.returncode == 1
    assert one_error_line(r) == (
        f"streamdiloco: error: shard at {target} refused Join: UNAUTHENTICATED: wrong or missing run token "
        "(--token): the worker sent none, and this shard needs the run token: give the worker --token or "
        "--token-file"
    )


def test_auth_refuses_a_token_it_does_not_check():
    from streamdiloco.server.trust.auth import Auth

    assert Auth().unchecked_token("") is None  # no token on either side: loopback's simple case
    assert Auth(token="t").unchecked_token("t") is None
    assert Auth(workers={}).unchecked_token("t") is None
    assert "takes no credential at all" in Auth().unchecked_token("t").message
    refused = Auth(certificates=True).unchecked_token("t")
    assert refused.code == "failed_precondition" and "takes client certificates only" in refused.message


LOGITS_ONLY = """
import torch.nn as nn


class LogitsOnly(nn.Module):
    \"\"\"A model for another loop: forward(idx) returns the logits, no loss.\"\"\"

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 256)

    def forward(self, idx, targets=None):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build():
    return LogitsOnly()
"""


def test_a_model_the_worker_cli_cannot_train_is_one_line_before_joining(tmp_path, monkeypatch):
    (tmp_path / "logits_only.py").write_text(LOGITS_ONLY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    port = free_port()  # nothing listens: the check comes before the worker looks for a shard
    r = streamdiloco(
        "worker",
        *("--servers", f"127.0.0.1:{port}", "--model", "logits_only:build", "--block-size", "16"),
        *("--checkpoint", str(tmp_path / "w.pt")),
        timeout=120,
    )
    assert r.returncode == 2
    assert one_error_line(r) == (
        "streamdiloco: error: --model logits_only:build: forward(idx, targets) returned a tensor of shape "
        "[16, 16, 256]: the worker CLI trains models whose forward(idx, targets) returns (logits, loss), as "
        "the built-in GPT's does; train any other model with your own loop and "
        "streamdiloco.worker.join.connect() "
        "(docs/library.md: your own model and loop)"
    )
    assert "waiting for shard" not in r.stderr


def test_check_model_output_takes_the_builtin_gpt_and_names_what_others_return():
    from streamdiloco.common.modelspec import build_model
    from streamdiloco.worker.train import check_model_output

    gpt = build_model("nano")
    x = torch.zeros(2, 8, dtype=torch.long)
    check_model_output(gpt, x, x, "nano")  # (logits, loss): nothing to say
    assert gpt.training  # the check leaves the mode as it was

    class Pair(torch.nn.Module):
        def forward(self, idx, targets):
            return idx.float(), idx.float()  # a pair, but no scalar loss

    class Fails(torch.nn.Module):
        def forward(self, idx):  # no targets argument
            return idx

    with pytest.raises(ValueError, match="returned a pair whose second item is a tensor of shape"):
        check_model_output(Pair(), x, x, "m:pair")
    with pytest.raises(ValueError, match=r"^--model m:fails: forward\(idx, targets\) failed \(TypeError: "):
        check_model_output(Fails(), x, x, "m:fails")


# --- the layout given by the user: blocks_path, fragments ----------------------------------------------


class TwoLists(torch.nn.Module):
    """Blocks in `layers` (3), and a longer nn.ModuleList that is not blocks: the largest is the wrong one."""

    def __init__(self):
        nn = torch.nn
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.probes = nn.ModuleList(nn.Linear(4, 1, bias=False) for _ in range(5))
        self.head = nn.Linear(4, 16)


def names(layout) -> list[list[str]]:
    return [list(f.names) for f in layout.fragments]


def test_blocks_path_names_the_list_of_blocks():
    from streamdiloco.common.fragments import build_layout

    model = TwoLists()
    assert build_layout(model, 3).blocks_path == "probes"  # the largest list, not the blocks
    layout = build_layout(model, 3, "sequential", blocks_path="layers")
    assert layout.blocks_path == "layers" and [f.blocks for f in layout.fragments] == [(0, 1), (2,), ()]
    assert names(layout)[0] == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    assert "probes.4.weight" in names(layout)[2] and "embed.weight" in names(layout)[2]
    with pytest.raises(ValueError, match="blocks_path 'head' is a Linear, not an nn.ModuleList"):
        build_layout(model, 3, blocks_path="head")


def test_fragments_group_parameters_by_name_and_the_rest_makes_one_more():
    from streamdiloco.common.fragments import build_layout

    model = TwoLists()
    layout = build_layout(model, 3, user_groups=[["embed", "head.weight"], ["layers"]])
    assert names(layout) == [
        ["embed.weight", "head.weight"],
        [f"layers.{i}.{p}" for i in range(3) for p in ("weight", "bias")],
        [f"probes.{i}.weight" for i in range(5)] + ["head.bias"],  # named by no group: the last fragment
    ]
    assert layout.pattern == "custom" and all(f.blocks == () for f in layout.fragments)
    assert [e.offset for e in layout.fragments[0].entries] == [0, 64]  # one flat vector per fragment
    # the longer name wins: layers.2 goes with the second group, the rest of `layers` with the first
    layout = build_layout(model, 2, user_groups=[["layers", "embed", "probes", "head"], ["layers.2"]])
    assert names(layout)[1] == ["layers.2.weight", "layers.2.bias"]


@pytest.mark.parametrize(
    ("groups", "P", "words"),
    [
        ([["embed"], ["layer"]], 3, "fragments: 'layer' (group 1) names no parameter or module"),
        ([["embed"], []], 3, "each a non-empty list of names"),
        (
            [["layers.0"], ["layers", "layers.0.weight", "layers.0.bias"]],
            2,
            "group 0 ['layers.0'] gets no parameter",
        ),
        ([["layers"], ["embed", "layers"]], 2, "'layers' is in group 0 and group 1: name it once"),
        (
            [["embed"], ["layers"]],
            5,
            "2 groups and the parameters they do not name make 3 fragments, but num_fragments is 5: set "
            "num_fragments (--num-fragments) to 3",
        ),
    ],
)
def test_fragments_that_do_not_fit_the_model_are_one_line_errors(groups, P, words):
    from streamdiloco.common.fragments import build_layout

    with pytest.raises(ValueError, match=re.escape(words)):
        build_layout(TwoLists(), P, user_groups=groups)


def test_the_cli_spelling_of_fragments():
    from streamdiloco.common.config import parse_groups

    assert parse_groups(" embed, head ;layers.0") == (("embed", "head"), ("layers.0",))
    for bad in ("", "a;;b", ";"):
        with pytest.raises(ValueError, match="--fragments"):
            parse_groups(bad)


def test_the_fingerprint_carries_the_groups_and_a_shard_with_another_layout_says_so():
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.common.fingerprint import fingerprint_diff, model_fingerprint
    from streamdiloco.common.fragments import build_layout

    model, cfg = TwoLists(), SyncConfig(sync_every=30, num_fragments=3)
    plain = model_fingerprint(build_layout(model, 3, blocks_path="layers"), cfg)
    assert "fragment_groups" not in plain  # a run without groups keeps its fingerprint (and checkpoints)
    grouped = model_fingerprint(build_layout(model, 3, user_groups=[["embed", "head"], ["layers"]]), cfg)
    assert grouped["fragment_groups"] == [["embed", "head"], ["layers"]]
    assert fingerprint_diff(grouped, plain, them="shard") == (
        "model fingerprint differs from the shard's: the worker groups parameters as 'embed,head;layers', "
        "the shard splits the blocks of 'layers': give both the same fragments (connect(fragments=...), "
        "--fragments)"
    )
    other = model_fingerprint(build_layout(model, 3, user_groups=[["embed"], ["layers", "head"]]), cfg)
    assert "groups parameters as 'embed;layers,head'" in fingerprint_diff(grouped, other)
    assert fingerprint_diff(grouped, dict(grouped)) is None


NANO_GROUPS = "transformer.h.0,transformer.h.1;transformer.h.2,transformer.h.3"


def test_shard_and_worker_cli_train_with_the_users_fragments_and_another_grouping_is_refused(tmp_path):
    layout = ("--model", "nano", "--num-fragments", "3", "--fragments", NANO_GROUPS)
    with Cluster(tmp_path) as c:
        target, _ = c.shard("shard", *layout)
        other = streamdiloco(
            "worker",
            *("--servers", target, "--name", "other", "--model", "nano", "--num-fragments", "3"),
            *("--checkpoint", str(tmp_path / "other.pt")),
            timeout=120,
        )
        assert other.returncode == 1
        assert (
            "the worker splits the blocks of 'transformer.h', the shard groups parameters as "
            in one_error_line(other)
        )
        c.worker("w0", [target], *layout, "--steps", "4")
        assert c.wait("w0", timeout=300) == 0, c.log("w0")[-3000:]
    assert c.summary("w0")["steps"] == 4
    assert "3 fragments" in c.log("w0")


def test_a_bad_fragments_flag_is_one_line_before_anything_starts(tmp_path):
    r = streamdiloco("server", "--model", "nano", "--fragments", "a;;b", "--port", "0", "--http-port", "0")
    assert r.returncode == 2 and "--fragments 'a;;b': give groups" in one_error_line(r)
    r = streamdiloco("worker", "--servers", "127.0.0.1:1", "--blocks-path", "x", "--fragments", "a")
    assert r.returncode == 2 and one_error_line(r) == (
        "streamdiloco: error: give --blocks-path or --fragments, not both"
    )


# in `make test-slow`; covered by test_shard_and_worker_cli_train_with_the_users_fragments_and_another_...
# (the same flags through shard and worker; launch hands them on as it hands on every sync flag)
@pytest.mark.slow
def test_launch_gives_the_users_fragments_to_its_shards_and_workers(tmp_path):
    from streamdiloco.common.modelspec import build_model

    groups = "transformer.h.0;transformer.h.1,transformer.h.2,transformer.h.3"  # unlike any built-in split
    r = streamdiloco(
        *("launch", "--shards", "1", "--workers", "1", "--steps", "4", "--log-every", "2", "--save-global"),
        *("--model", "nano", "--num-fragments", "3", "--fragments", groups, "--out", str(tmp_path)),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    block = sum(p.numel() for p in build_model("nano").transformer.h[0].parameters())
    masters = torch.load(tmp_path / "masters.pt")
    assert [m.numel() for m in masters[:2]] == [block, 3 * block]  # the shard's layout is the user's
    assert json.loads((tmp_path / "summary.json").read_text())["mirrors_match_masters"]


def test_a_shard_refuses_malformed_fragment_groups_with_a_status_not_a_crash(tmp_path):
    """fragment_groups crosses the network in a worker's fingerprint: whatever shape a client gives it, the
    shard answers with a status and one line, and keeps serving."""
    import grpc

    from streamdiloco.common.config import SyncConfig
    from streamdiloco.common.fingerprint import model_fingerprint
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.common.modelspec import build_model
    from tests.support.inthread import InThreadShard
    from tests.support.shards import shard_of

    cfg = SyncConfig(sync_every=6, num_fragments=3)
    good = model_fingerprint(build_layout(build_model("nano"), 3), cfg)
    shard = InThreadShard(shard_of(cfg, "nano", 0, 1), tmp_path, json.dumps(good))
    try:
        for bad in (5, "x" * 100_000, [[1, [2]], None], {"a": 1}, [[]] * 10_000):
            with pytest.raises(grpc.RpcError) as e:
                shard.join("w0", fp=json.dumps({**good, "fragment_groups": bad}))
            assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            assert "\n" not in e.value.details() and len(e.value.details()) <= 1200, e.value.details()[:300]
        assert shard.join("w0").session  # still serving
    finally:
        shard.shutdown()
