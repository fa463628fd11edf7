"""The run dashboard's data (issue 14, part 7). What workers report with their pushes (total steps, tokens,
compute utilization, the global parameters' eval loss) is kept per worker, bounded, and gives each worker's
pace and ETA; a shard's /api/run shows every shard of the run from its --peers (over TLS, with the read
token), a peer that is down or hangs as down, without holding the page; a real worker with --eval-every
reports its eval losses to the shard and, with --tensorboard, writes them as event files that TensorBoard
reads back; the README's W&B logger fits the worker's loggers hook."""

from __future__ import annotations

import json
import math
import socket
import sys
import time
import urllib.request
from dataclasses import replace
from types import SimpleNamespace

import pytest

from streamdiloco.certs import make_certs
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout
from streamdiloco.common.ports import free_ports
from streamdiloco.common.progress import Progress
from streamdiloco.server.observe import dashboard as dash
from streamdiloco.server.observe.dashboard import DashboardData
from streamdiloco.server.observe.run_view import PEER_TIMEOUT, Peers, parse_peers
from streamdiloco.server.trust.auth import Auth
from streamdiloco.worker.engine import SyncEngine
from streamdiloco.worker.model import build_gpt
from streamdiloco.worker.report import TensorBoardLogger
from tests.support.inthread import InThreadShard, push_messages
from tests.support.nano_shard import CFG, ENC_A, ENC_B, GOOD_FP
from tests.support.nowire import NoWire
from tests.support.procs import shard_process, streamdiloco
from tests.support.shards import shard_of
from tests.support.tls import READ, https, server_tls

NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]


@pytest.fixture
def clock(monkeypatch):
    """DashboardData's time.time(), moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(dash, "time", SimpleNamespace(time=lambda: now[0]))
    return now


# --- DashboardData ---------------------------------------------------------------------------------------
def test_a_workers_reports_give_its_pace_and_one_eval_point_per_evaluation(clock):
    d = DashboardData()
    for k in range(5):  # a push every 2 s, 10 steps of 1000 tokens apart; evaluated at steps 0 and 30
        clock[0] = 1000.0 + 2 * k
        report = Progress(
            step=10 * k,
            blocked_seconds=0.5 * k,
            total_steps=100,
            tokens=10_000 * k,
            compute_utilization=0.9,
            eval_loss=2.5 if k >= 3 else 3.1,
            eval_step=30 if k >= 3 else 0,
        )
        d.record_progress("a", report.step, 3.0 - 0.1 * k, report.blocked_seconds, report)
    assert d.rates("a") == {"steps_per_second": 5.0, "tokens_per_second": 5000.0}
    assert d.rates("nobody") == {"steps_per_second": None, "tokens_per_second": None}
    series = d.series(0.0, (clock[0], 0, 0, 0, 0))
    assert series["workers"]["a"][-1] == {
        "t": 1008.0,
        "step": 40,
        "loss": pytest.approx(2.6),
        "blocked_seconds": 2.0,
        "tokens": 40_000,
        "utilization": 0.9,
    }
    # one point per evaluation (not per push), with the tokens the worker had at the eval's step
    assert series["evals"]["a"] == [
        {"t": 1000.0, "step": 0, "tokens": 0, "eval_loss": 3.1},
        {"t": 1006.0, "step": 30, "tokens": 30_000, "eval_loss": 2.5},
    ]
    assert d.series(1006.0, (clock[0], 0, 0, 0, 0))["evals"]["a"] == []  # only what is new


def test_the_pace_is_over_the_last_minute_and_unknown_without_progress(clock):
    d = DashboardData()
    d.record_progress("a", 0, None, 0.0, Progress(step=0, tokens=0))
    assert d.rates("a")["steps_per_second"] is None  # one report: no pace yet
    clock[0] += 100
    d.record_progress("a", 100, None, 0.0, Progress(step=100, tokens=100))  # 1 step/s, long ago
    for k in range(1, 7):
        clock[0] += 10
        d.record_progress("a", 100 + 30 * k, None, 0.0, Progress(step=100 + 30 * k, tokens=100 + 30 * k))
    assert d.rates("a")["steps_per_second"] == pytest.approx(3.0)  # the last minute's pace only
    clock[0] += 10
    d.record_progress("a", 280, None, 0.0, Progress(step=280, tokens=0))  # counters went back: no rate
    assert d.rates("a")["tokens_per_second"] is None


def test_what_a_worker_reports_is_bounded_per_worker_and_in_workers(clock):
    d = DashboardData()
    for k in range(dash.PROGRESS_POINTS + 50):
        clock[0] += 1
        d.record_progress("a", k, 1.0, 0.0, Progress(step=k, eval_loss=1.0, eval_step=k))
    assert len(d.progress["a"]) == dash.PROGRESS_POINTS
    assert len(d.evals["a"]) == dash.EVAL_POINTS
    assert d.evals["a"][-1][1] == dash.PROGRESS_POINTS + 49  # the newest kept
    for w in range(dash.PROGRESS_WORKERS + 10):  # new names: the longest silent are forgotten, evals too
        clock[0] += 1
        d.record_progress(f"w{w}", 1, None, 0.0, Progress(step=1, eval_loss=2.0, eval_step=1))
    assert len(d.progress) == dash.PROGRESS_WORKERS and "a" not in d.progress
    assert set(d.evals) <= set(d.progress)


def test_a_worker_that_reports_again_is_not_the_one_forgotten(clock):
    d = DashboardData()
    for w in range(dash.PROGRESS_WORKERS):
        clock[0] += 1
        d.record_progress(f"w{w}", 1, None, 0.0)
    clock[0] += 1
    d.record_progress("w0", 2, None, 0.0)  # the first to report, but it reports again: no longer the oldest
    d.record_progress("new", 1, None, 0.0)
    assert "w0" in d.progress and "w1" not in d.progress and "new" in d.progress
    assert [p[1] for p in d.progress["w0"]] == [1, 2]  # its series kept, not started again


# --- the shard: status per worker, and the run view ----------------------------------------------------
def _shard(tmp_path, shard: int = 0, peers: Peers | None = None) -> InThreadShard:
    service = shard_of(CFG, "nano", shard=shard, num_shards=2, min_workers=2, chunk_bytes=256)
    return InThreadShard(service, tmp_path, GOOD_FP, http=True, peers=peers)


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())


def test_the_shard_shows_each_workers_step_of_total_pace_eta_utilization_and_eval_loss(tmp_path):
    s = _shard(tmp_path)
    try:
        a, b = s.worker("a"), s.worker("b")
        progress = dict(total_steps=600, has_utilization=True, has_eval_loss=True)
        a.push(push_messages(ENC_A, step=6, tokens=6000, compute_utilization=0.8, eval_loss=3.5, **progress))
        assert a.session.result().accepted
        b.push(push_messages(ENC_B, step=6, tokens=6000, total_steps=600))
        assert b.session.result().accepted
        a.session.update(), b.session.update()  # round 0 closed
        # steps 7..12 later, a pushes round 1: its pace, and the ETA for the 588 steps left at that pace
        s.wait_for(lambda: time.time() > s.service.dashboard.progress["a"][-1][0] + 0.05, "time to pass")
        a.push(
            push_messages(
                ENC_A, round=1, step=12, tokens=12_000, compute_utilization=0.9, eval_loss=3.5, **progress
            )
        )
        assert a.session.result().accepted
        s.quiesce(a)
        members = {m["name"]: m for m in s.status()["members"]}
        ma, mb = members["a"], members["b"]
        assert (ma["step"], ma["total_steps"], ma["tokens"], ma["compute_utilization"]) == (
            12,
            600,
            12_000,
            0.9,
        )
        assert (ma["eval_loss"], ma["eval_step"]) == (3.5, 0)
        rate = ma["steps_per_second"]
        assert rate > 0 and ma["tokens_per_second"] == pytest.approx(1000 * rate)
        assert ma["eta_seconds"] == pytest.approx(588 / rate)
        # b said nothing of utilization or eval, and has one report: no pace, no ETA
        assert mb["compute_utilization"] is None and mb["eval_loss"] is None and mb["eval_step"] is None
        assert mb["eta_seconds"] is None and mb["total_steps"] == 600
        series = _get(s.http_port, "/api/series")
        assert [p["eval_loss"] for p in series["evals"]["a"]] == [3.5]  # one evaluation, reported twice
        assert "b" not in series["evals"]
    finally:
        s.shutdown()


def test_peers_must_be_http_base_urls():
    assert parse_peers(" http://a:1, https://b:2/ ") == ("http://a:1", "https://b:2")
    assert parse_peers("") == ()
    for bad, words in [
        ("a:1", "http(s)://HOST:PORT, got 'a:1'"),
        ("http://a", "http(s)://HOST:PORT"),
        ("http://a:1/api/status", "only scheme, host and port"),
        ("http://a:1,http://a:1", "listed twice"),
        ("http://a:99999", "not a URL"),
        (",".join(f"http://a:{p}" for p in range(1, 70)), "at most 64 shards, got 69"),
    ]:
        with pytest.raises(ValueError, match="^--peers: ") as e:
            parse_peers(bad)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_the_run_view_shows_every_shard_and_a_peer_down_or_hanging_as_down(tmp_path):
    dead = free_ports(1)[0]  # nothing listens there
    hang = socket.socket()  # listens and never answers: the page must not wait for it
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    s1 = _shard(tmp_path, shard=1)
    peers = (
        f"http://127.0.0.1:{s1.http_port}",
        f"http://127.0.0.1:{dead}",
        f"http://127.0.0.1:{hang.getsockname()[1]}",
    )
    s0 = _shard(tmp_path, shard=0, peers=Peers(peers))
    try:
        w = s1.worker("a")
        w.push(push_messages(ENC_A, step=6))  # a push to shard 1 only: the run view counts it there
        assert w.session.result().accepted
        t0 = time.monotonic()
        run = _get(s0.http_port, "/api/run")
        took = time.monotonic() - t0
        assert took < PEER_TIMEOUT + 3, took
        shards = run["shards"]
        assert [(x["up"], x.get("shard")) for x in shards] == [
            (True, 0),
            (True, 1),
            (False, None),
            (False, None),
        ]
        assert shards[0]["url"] is None  # this shard, not in --peers: from its own state
        assert shards[1]["url"] == peers[0] and shards[1]["num_shards"] == 2
        assert shards[1]["members"] == 1 and shards[1]["pushes_accepted"] == 1
        assert shards[1]["rounds"] == [0, 0, 0]
        down = {x["url"]: x["error"] for x in shards[2:]}
        assert "refused" in down[peers[1]].lower(), down
        assert "timed out" in down[peers[2]] or "in time" in down[peers[2]], down
        totals = run["totals"]
        assert (totals["shards"], totals["shards_up"], totals["num_shards"]) == (4, 2, 2)
        assert totals["pushes_accepted"] == 1 and totals["bytes_in"] > 0
        assert _get(s0.http_port, "/api/run")["now"] == run["now"]  # cached: one fetch a second
    finally:
        s0.shutdown()
        s1.shutdown()
        hang.close()


# --- the worker: --eval-every reported to the shard, --tensorboard -------------------------------------
def test_the_engine_reports_what_the_shards_take_and_leaves_out_an_eval_loss_they_would_refuse():
    model = build_gpt("nano")
    engine = SyncEngine(
        model, build_layout(model, 3, "strided"), SyncConfig(num_fragments=3), NoWire(), total_steps=90
    )
    assert engine.progress() == Progress(total_steps=90)  # nothing measured yet: nothing said
    engine.step(512, 3.0)  # step 1: nothing to send yet
    engine.report(eval_loss=2.5, compute_utilization=0.75)
    assert engine.progress() == Progress(1, 0.0, 90, 512, 0.75, 2.5, 1)
    engine.step(512, 3.0)
    engine.report(eval_loss=math.nan, compute_utilization=1.0000001)  # a push would be refused for NaN
    engine.report(eval_loss=-1.0)
    engine.report(eval_loss=1e5)
    got = engine.progress()
    # the second step's time is measured (the adaptive schedule reports it with pushes): a real duration
    assert got.step_seconds is not None and 0 < got.step_seconds < 60
    assert replace(got, step_seconds=None) == Progress(
        2, 0.0, 90, 1024, 1.0, 2.5, 1
    )  # the last good; clamped


def test_tensorboard_logger_writes_scalars_that_tensorboard_reads_back(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logger = TensorBoardLogger(str(tmp_path / "tb"))
    logger.log_scalars(0, {"train/loss": 5.5, "eval/loss": 5.6})
    logger.log_scalars(10, {"train/loss": 4.5})
    logger.close()
    ea = accumulator.EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == [(0, 5.5), (10, 4.5)]
    assert [(e.step, e.value) for e in ea.Scalars("eval/loss")] == [(0, pytest.approx(5.6))]


def test_tensorboard_without_the_package_is_a_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
    with pytest.raises(ValueError) as e:
        TensorBoardLogger(str(tmp_path / "tb"))
    assert str(e.value).startswith("--tensorboard needs the tensorboard package: pip install")
    assert "\n" not in str(e.value)


def test_a_worker_evaluates_every_n_steps_reports_it_to_the_shard_and_to_tensorboard(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    with shard_process(tmp_path, *NANO) as (target, http_port, _):
        work = [*NANO, "--steps", "40", "--eval-every", "10", "--checkpoint-every", "0"]
        done = streamdiloco(
            "worker",
            *("--servers", target, "--name", "w", "--checkpoint", str(tmp_path / "w.pt")),
            *("--summary", str(tmp_path / "w.json"), "--tensorboard", str(tmp_path / "tb"), *work),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        series = _get(http_port, "/api/series")
    # the start's eval (step 0) and every 10 steps, reported with the pushes that followed
    evals = series["evals"]["w"]
    assert [p["step"] for p in evals] == [0, 10, 20, 30]
    assert all(0 < p["eval_loss"] < 10 for p in evals) and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    last = series["workers"]["w"][-1]
    assert last["step"] == 40 and last["tokens"] == 40 * 16 * 32 and 0 < last["utilization"] <= 1
    summary = json.loads((tmp_path / "w.json").read_text())
    assert summary["eval_seconds"] > 0  # what the evaluations cost, inside the training time
    assert "eval loss" in done.stderr and "(global params," in done.stderr
    ea = accumulator.EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert {"train/loss", "eval/loss", "perf/tokens_per_second", "perf/compute_utilization"} <= set(
        ea.Tags()["scalars"]
    ) and {"sync/blocked_seconds", "sync/bytes_sent", "sync/bytes_received"} <= set(ea.Tags()["scalars"])
    assert [e.step for e in ea.Scalars("eval/loss")] == [0, 10, 20, 30, 40]  # and the end's
    assert ea.Scalars("eval/loss")[-1].value == pytest.approx(summary["eval_loss"])
    assert all(math.isfinite(e.value) for e in ea.Scalars("train/loss"))


def test_the_run_view_reads_its_peers_over_tls_with_the_read_token(tmp_path):
    certs = tmp_path / "certs"
    make_certs(certs, None, [])
    ca = str(certs / "ca.pem")

    def tls_shard(shard: int, peers: Peers | None = None, read: str = READ) -> InThreadShard:
        auth = Auth(read_token=read)
        service = shard_of(CFG, "nano", shard=shard, num_shards=2, chunk_bytes=256, auth=auth)
        return InThreadShard(service, tmp_path, GOOD_FP, http=True, tls=server_tls(certs), peers=peers)

    s1 = tls_shard(1)
    other = tls_shard(1, read="another run's read token")
    urls = (f"https://127.0.0.1:{s1.http_port}", f"https://127.0.0.1:{other.http_port}")
    s0 = tls_shard(0, Peers(urls, READ, ca))
    try:
        assert https(s0.http_port, "/api/run", certs / "ca.pem")[0] == 401  # the run view needs it too
        code, body = https(s0.http_port, "/api/run", certs / "ca.pem", READ)
        assert code == 200
        shards = json.loads(body)["shards"]
        assert [(x["up"], x.get("shard"), x["url"]) for x in shards] == [
            (True, 0, None),
            (True, 1, urls[0]),
            (False, None, urls[1]),
        ]
        assert shards[2]["error"] == "HTTP 401"  # a shard whose read token is not ours: down, and why
    finally:
        for s in (s0, s1, other):
            s.shutdown()
