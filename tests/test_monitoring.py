"""Monitoring: /healthz, /readyz, /metrics and /api/series on a shard, /metrics on a worker, and a real
Prometheus (Debian's package) scraping a running 2-shard, 2-worker system.

`promtool` and `prometheus` come from Debian's `prometheus` package, which `scripts/system-deps.sh`
installs (`make test` and `.ci/run` run it); without them these tests fail and say so, they do not skip.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamdiloco.common.ports import free_port, free_ports
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.main import serve
from streamdiloco.server.observe import dashboard as dashboard_module
from streamdiloco.worker.metrics import WorkerMetrics
from tests.support.inthread import InThreadShard, push_messages
from tests.support.nano_shard import CFG, ENC_A, ENC_B, GOOD_FP, build
from tests.support.procs import Cluster, http_json, stop, streamdiloco, wait_until


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: install Debian's prometheus package (scripts/system-deps.sh)"
    return path


def nobody_listens(port: int) -> None:
    with socket.socket() as s:  # SO_REUSEADDR: connections in TIME_WAIT do not count, a listener does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(series name, sorted labels): value} of an exposition page."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def promtool_check_metrics(text: str) -> None:
    r = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, f"promtool check metrics: {r.stdout}{r.stderr}"


# === one shard in a thread, with its HTTP app =========================================================
@pytest.fixture
def shard(tmp_path, shards):
    return shards.add(InThreadShard(build(), tmp_path, GOOD_FP, http=True))


def test_metrics_and_series_count_what_the_shard_did(shard):
    a, b = shard.worker("a"), shard.worker("b")
    a.push(push_messages(ENC_A, weight=100.0, loss=2.5, step=12, blocked=0.25))
    assert a.session.result().accepted
    b.push(push_messages(ENC_B, weight=300.0, loss=3.5, step=12, blocked=1.5))
    assert b.session.result().accepted
    a.session.update(), b.session.update()  # the round closed and both got its update
    a.push(push_messages(ENC_A, weight=100.0, step=13))  # round 0 has closed: late
    assert a.session.result().reason == "late"
    a.push(push_messages(ENC_A, round=0, weight=-1.0, step=13))  # bad input (and late): refused
    a.push(push_messages(ENC_A, round=1, weight=-1.0, step=13))
    assert a.session.result().reason == "late"
    assert a.session.result().reason == "bad_weight"
    shard.quiesce(a)

    code, text = get(shard.http_port, "/metrics")
    assert code == 200
    promtool_check_metrics(text)
    m = samples(text)
    status = shard.status()
    p = "streamdiloco_shard"
    assert m[(f"{p}_pushes_total", (("outcome", "accepted"),))] == 2 == status["pushes_accepted"]
    assert m[(f"{p}_pushes_total", (("outcome", "late"),))] == 2
    assert m[(f"{p}_pushes_total", (("outcome", "refused"),))] == 1
    assert m[(f"{p}_pushes_total", (("outcome", "duplicate"),))] == 0
    assert m[(f"{p}_rounds_total", (("outcome", "complete"),))] == 1
    assert m[(f"{p}_rounds_total", (("outcome", "deadline"),))] == 0
    assert m[(f"{p}_fragment_round", (("fragment", "0"),))] == 1
    assert m[(f"{p}_fragment_round", (("fragment", "1"),))] == 0
    assert m[(f"{p}_members", ())] == 2
    assert m[(f"{p}_ready", ())] == 1
    # b's 300 tokens count as the lower of the two, a's 100 (the weight cap: tests/test_robust.py)
    assert m[(f"{p}_training_loss", ())] == pytest.approx((2.5 * 100 + 3.5 * 100) / 200)
    assert m[(f"{p}_round_duration_seconds_count", ())] == 1
    assert m[(f"{p}_push_size_bytes_count", ())] == 2
    assert m[(f"{p}_push_size_bytes_sum", ())] == status["bytes"]["codec_in"] == 2 * ENC_A.nbytes
    assert m[(f"{p}_push_transfer_seconds_count", ())] == 2
    assert m[(f"{p}_received_bytes_total", ())] == status["bytes"]["message_bytes_in"]
    assert m[(f"{p}_sent_bytes_total", (("stream", "session"),))] == status["bytes"]["message_bytes_out"]
    assert m[(f"{p}_update_size_bytes_count", ())] == 1
    info = next(k for k in m if k[0] == f"{p}_info")
    assert dict(info[1])["num_shards"] == "2" and dict(info[1])["fragments"] == str(CFG.num_fragments)
    # per-worker labels only on the contribution ledger's series, and bounded there (metrics.CREDIT_LABELS)
    assert not any("worker" in dict(labels) for name, labels in m if not name.startswith(f"{p}_credit_"))
    assert {dict(labels)["worker"] for name, labels in m if name == f"{p}_credit_tokens"} == {"a", "b", ""}

    members = {x["name"]: x for x in status["members"]}
    assert (members["a"]["step"], members["a"]["blocked_seconds"]) == (12, 0.25)  # refused: not reported
    assert (members["b"]["step"], members["b"]["blocked_seconds"]) == (12, 1.5)

    series = http_json(shard.http_port, "/api/series")
    assert [(r["fragment"], r["round"], r["why"], r["contributors"]) for r in series["rounds"]] == [
        (0, 0, "all", 2)
    ]
    assert series["rounds"][0]["mean_loss"] == pytest.approx((2.5 * 100 + 3.5 * 100) / 200)
    b_points = series["workers"]["b"]
    assert [(x["step"], x["loss"], x["blocked_seconds"]) for x in b_points] == [(12, 3.5, 1.5)]
    assert [x["step"] for x in series["workers"]["a"]] == [12]  # late and refused pushes report nothing
    assert series["samples"] and series["samples"][-1]["members"] == 2
    assert all(f["master_hash"] for f in status["fragments"])
    assert all(
        f["master_hash"] is None for f in http_json(shard.http_port, "/api/status?hashes=0")["fragments"]
    )
    later = http_json(shard.http_port, f"/api/series?since={series['now']}")
    assert later["rounds"] == [] and later["workers"] == {"a": [], "b": []}
    code, body = get(shard.http_port, "/api/series?since=nan")
    assert code == 422, body
    code, body = get(shard.http_port, "/api/series?since=-1")
    assert code == 422, body


def test_progress_is_kept_for_a_bounded_number_of_workers(shard):
    svc = shard.service
    n = dashboard_module.PROGRESS_WORKERS

    def report():
        for i in range(n + 5):
            svc.dashboard.record_progress(f"w{i}", i, 1.0, 0.0)
        for _ in range(dashboard_module.PROGRESS_POINTS + 10):
            svc.dashboard.record_progress(f"w{n + 4}", 1, 1.0, 0.0)

    shard.on_loop(report)
    kept = shard.on_loop(lambda: {w: len(p) for w, p in svc.dashboard.progress.items()})
    assert len(kept) == n
    assert "w0" not in kept and "w4" not in kept and "w5" in kept  # the longest silent went first
    assert kept[f"w{n + 4}"] == dashboard_module.PROGRESS_POINTS


def where(http_port: int, ready_file) -> ShardConfig:
    """The test's shard config for serve(): gRPC on any port, HTTP on `http_port`."""
    ready = str(ready_file) if ready_file is not None else None
    return ShardConfig(sync=CFG, port=0, http_port=http_port, ready_file=ready)


def test_health_and_readiness_through_loading_serving_and_stopping(tmp_path):
    """HTTP answers while the model and checkpoint load (ready: no); ready once serving; not while stopping;
    a build that fails ends serve() with its error."""
    release, built = threading.Event(), []
    http_port = free_port()
    ready_file = tmp_path / "ready.json"
    loop = asyncio.new_event_loop()
    stop_event = asyncio.Event()
    failure: list[BaseException] = []

    def slow_build():
        assert release.wait(30), "the test never released the build"
        built.append(build(min_workers=1))
        return built[0]

    def run() -> None:
        try:
            loop.run_until_complete(serve(slow_build, where(http_port, ready_file), stop_event))
        except BaseException as e:  # noqa: BLE001
            failure.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        health = wait_until("/healthz while loading", lambda: json.loads(get(http_port, "/healthz")[1]))
        assert health == {"ok": True, "phase": "loading"}
        assert get(http_port, "/readyz") == (
            503,
            json.dumps({"ready": False, "phase": "loading"}, separators=(",", ":")),
        )
        code, text = get(http_port, "/metrics")
        assert code == 200 and samples(text)[("streamdiloco_shard_ready", ())] == 0
        promtool_check_metrics(text)
        assert get(http_port, "/api/status")[0] == 503
        assert not ready_file.exists()  # no gRPC port to hand out yet

        release.set()
        wait_until("the shard to serve", ready_file.exists, timeout=30)
        code, body = get(http_port, "/readyz")
        assert (code, json.loads(body)) == (200, {"ready": True, "phase": "serving"})
        assert samples(get(http_port, "/metrics")[1])[("streamdiloco_shard_ready", ())] == 1
        assert get(http_port, "/")[0] == 200

        async def begin_stopping():
            built[0].runner.stop()

        asyncio.run_coroutine_threadsafe(begin_stopping(), loop).result(5)
        code, body = get(http_port, "/readyz")
        assert code == 503 and json.loads(body)["ready"] is False
        assert samples(get(http_port, "/metrics")[1])[("streamdiloco_shard_ready", ())] == 0
    finally:
        release.set()
        loop.call_soon_threadsafe(stop_event.set)
        t.join(20)
    assert not t.is_alive() and not failure, failure

    # stopped while it loads: once loaded it stops, without opening gRPC or writing the ready file
    loaded = []

    def build_then_stop():
        loaded.append(build(min_workers=1))
        return loaded[0]

    async def stop_during_load():
        stopping = asyncio.Event()
        stopping.set()
        await serve(build_then_stop, where(http_port, tmp_path / "ready2.json"), stopping)

    asyncio.run(stop_during_load())
    assert loaded and not (tmp_path / "ready2.json").exists() and not loaded[0].serving
    nobody_listens(http_port)

    def broken_build():
        raise ValueError("--init x: no such file")

    with pytest.raises(ValueError, match="no such file"):
        asyncio.run(serve(broken_build, where(http_port, None), asyncio.Event()))
    nobody_listens(http_port)  # the HTTP server was stopped


def test_worker_metrics_before_training_and_when_served(tmp_path):
    m = WorkerMetrics("w1", "nano", "cpu", 50)
    port = m.serve(0)
    try:
        code, text = get(port, "/metrics")
        assert code == 200
        promtool_check_metrics(text)
        s = samples(text)
        assert s[("streamdiloco_worker_phase", (("phase", "joining"),))] == 1
        assert s[("streamdiloco_worker_steps", ())] == 50
        assert s[("streamdiloco_worker_tokens_total", ())] == 0
        assert ("streamdiloco_worker_training_loss", ()) not in s  # no loss before the first step
        info = next(k for k in s if k[0] == "streamdiloco_worker_info")
        assert dict(info[1])["worker"] == "w1"
    finally:
        m.close()
    nobody_listens(port)  # close() let the port go


def test_compute_utilization_is_that_of_the_last_window(monkeypatch):
    from streamdiloco.worker import metrics as metrics_module

    monkeypatch.setattr(metrics_module, "UTILIZATION_WINDOW", 0.3)
    m = WorkerMetrics("w1", "nano", "cpu", 50)
    assert m.utilization() == 0.0  # before the first step
    m.mark(0.0)
    time.sleep(0.2)
    m.mark(0.2)  # all computing
    assert 0.8 < m.utilization() <= 1.0
    time.sleep(0.4)
    m.mark(0.2)  # then blocked for longer than the window: the busy start falls out of it
    time.sleep(0.1)
    m.mark(0.2)
    assert m.utilization() < 0.5


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--metrics-port", "70000"], "--metrics-port must be 0..65535, got 70000"),
        (["--metrics-port", "x"], "argument --metrics-port: invalid int value"),
    ],
)
def test_bad_metrics_flags_are_one_line_errors(flags, words):
    r = streamdiloco("worker", "--servers", "127.0.0.1:1", *flags, timeout=60)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_auto_resume_resumes_only_when_the_checkpoint_exists(tmp_path):
    ckpt = tmp_path / "w.pt"
    common = ("worker", "--servers", "127.0.0.1:1", "--name", "w", "--checkpoint", str(ckpt), "--auto-resume")
    r = streamdiloco(*common, "--join-timeout", "1", "--model", "nano", timeout=120)
    assert r.returncode == 1 and "no checkpoint at" in r.stderr and "--resume" not in r.stderr, r.stderr
    ckpt.write_bytes(b"not a checkpoint")
    r = streamdiloco(*common, "--model", "nano", timeout=120)
    assert r.returncode == 2 and f"--auto-resume: {ckpt} is not a worker checkpoint" in r.stderr, r.stderr
    # without --name the checkpoint names the worker (the default name, host-pid, changes every start)
    r = streamdiloco(
        "worker", "--servers", "127.0.0.1:1", "--checkpoint", str(ckpt), "--auto-resume", timeout=120
    )
    assert r.returncode == 2 and f"--auto-resume: {ckpt} is not a worker checkpoint" in r.stderr, r.stderr
    r = streamdiloco("worker", "--servers", "127.0.0.1:1", "--auto-resume", timeout=120)
    assert r.returncode == 2 and "--auto-resume needs the worker's --name" in r.stderr, r.stderr


# === a real Prometheus scraping real processes =========================================================
def promql(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_shards_and_workers_of_a_running_system(tmp_path):
    prometheus, promtool = tool("prometheus"), tool("promtool")
    with Cluster(tmp_path) as c:
        model = ("--model", "nano", "--num-shards", "2", "--sync-every", "6", "--num-fragments", "2")
        shards = [c.shard(f"shard{s}", "--shard", str(s), *model, "--min-workers", "2") for s in range(2)]
        targets = [t for t, _ in shards]
        metrics_ports = free_ports(2)
        for i, port in enumerate(metrics_ports):
            c.worker(
                f"worker-{i}",
                targets,
                *model[:2],
                *model[4:],
                *("--steps", "400", "--batch-size", "4", "--metrics-port", str(port), "--step-delay", "0.02"),
            )
        config = tmp_path / "prometheus.yml"
        jobs = {"shard": [p for _, p in shards], "worker": metrics_ports}
        config.write_text(  # YAML, written as JSON
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
                        for job, ports in jobs.items()
                    ],
                }
            )
        )
        r = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        prom_port = free_port()
        log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115
        prom = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
            + [f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until("Prometheus to be ready", lambda: get(prom_port, "/-/ready")[0] == 200, timeout=60)

            def all_up():
                up = promql(prom_port, "up")
                return len(up) == 4 and all(x["value"][1] == "1" for x in up) and up

            wait_until("all four targets to be up", all_up, timeout=60, every=0.5)
            # training progresses as Prometheus sees it: rounds close on both shards, workers count steps
            wait_until(
                "rounds closed on both shards",
                lambda: (
                    len(promql(prom_port, 'streamdiloco_shard_rounds_total{outcome="complete"} > 2')) == 2
                ),
                timeout=90,
                every=0.5,
            )
            members = promql(prom_port, "streamdiloco_shard_members")
            assert sorted(x["metric"]["instance"] for x in members) == sorted(
                f"127.0.0.1:{p}" for _, p in shards
            )
            assert all(x["value"][1] == "2" for x in members)
            names = promql(prom_port, "streamdiloco_worker_info")
            assert sorted(x["metric"]["worker"] for x in names) == ["worker-0", "worker-1"]
            wait_until(
                "both workers' steps to rise",
                lambda: (
                    len(promql(prom_port, "increase(streamdiloco_worker_inner_steps_total[10s]) > 0")) == 2
                ),
                timeout=60,
                every=0.5,
            )
            loss = promql(
                prom_port,
                "streamdiloco_worker_training_loss"
                " * on(instance) group_left(worker) streamdiloco_worker_info",
            )
            assert sorted(x["metric"]["worker"] for x in loss) == ["worker-0", "worker-1"]
            assert all(0 < float(x["value"][1]) < 10 for x in loss)
            p95_query = (  # a rate needs two scrapes of the histogram: waited for, not assumed
                "histogram_quantile(0.95,"
                " sum by (le) (rate(streamdiloco_shard_round_duration_seconds_bucket[1m])))"
            )
            p95 = wait_until(
                "a round-duration quantile",
                lambda: [x for x in promql(prom_port, p95_query) if 0 <= float(x["value"][1]) < 600],
                timeout=30,
                every=0.5,
            )
            assert len(p95) == 1
            sent = promql(prom_port, "sum(streamdiloco_worker_sent_bytes_total)")
            received = promql(prom_port, "sum(streamdiloco_shard_received_bytes_total)")
            assert float(sent[0]["value"][1]) > 0 and float(received[0]["value"][1]) > 0

            # every /metrics page of the running system passes promtool's lint
            for port in [p for _, p in shards] + metrics_ports:
                code, text = get(port, "/metrics")
                assert code == 200
                promtool_check_metrics(text)
        finally:
            stop(prom)
            log.close()
        for i in range(2):
            assert c.wait(f"worker-{i}", timeout=240) == 0, c.log(f"worker-{i}")[-3000:]
