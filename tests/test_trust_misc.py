"""Trust, round two (issue 26), the smaller items, each against a real server: one name per run token
(Sybils), the lock on a shard's checkpoint directory (two real shard processes), the run view's fetch of
its peers (no redirect carries the read token elsewhere; no read token in clear), client strings in log
lines (control characters escaped), the dashboard's `?token=` (gone from the address bar) and a worker's
`--metrics-host` (loopback unless `--insecure`).
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest

from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.edge.admission import short
from streamdiloco.server.observe.run_view import Peers, RunView
from streamdiloco.server.storage.dirlock import LOCK_NAME, lock_directory
from streamdiloco.server.trust.auth import Auth, token_hash
from tests.support.browser import chromium, wait_for_polls
from tests.support.inthread import InThreadShard, refused
from tests.support.nano_shard import CFG, CHUNK_BYTES, GOOD_FP
from tests.support.procs import Cluster, streamdiloco, wait_until
from tests.support.shards import shard_of

pytestmark = pytest.mark.timeout(120)

RUN = "the-run-token-of-this-test"
READ = "the-read-token-of-this-test"


def shard_with(tmp: Path, auth: Auth, http: bool = False) -> InThreadShard:
    service = shard_of(CFG, "nano", shard=0, num_shards=2, chunk_bytes=CHUNK_BYTES, auth=auth)
    return InThreadShard(service, tmp, GOOD_FP, token=auth.token, http=http)


def one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    return lines[0]


# --- item 3: names per run token -------------------------------------------------------------------------
def test_the_run_token_holds_one_name_per_shard_at_a_time(tmp_path):
    s = shard_with(tmp_path, Auth(token=RUN))
    try:
        a = s.worker("a")
        e = refused(s.join, "b")  # a second name on the same run token: a Sybil, or a second worker
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        assert "--names-per-token" in e.details() and "'a'" in e.details(), e.details()
        # the same name again while its session is open (a dropped link not yet noticed): waits, as before
        assert refused(s.join, "a").code() == grpc.StatusCode.ALREADY_EXISTS
        a.session.close()
        s.wait_for(lambda: not s.service.roster.open, "a's session to end")
        a = s.worker("a")  # the same name comes back (a restarted worker)
        # two Joins before either Hello: the second name's Hello is refused once the first holds a session
        a.session.close()
        s.wait_for(lambda: not s.service.roster.open, "a's session to end")
        first, second = s.join("b"), s.join("c")
        s.open_session(pb.WorkerMessage(hello=pb.Hello(worker="b", session=first.session))).next_message(
            "welcome"
        )
        err = s.open_session(pb.WorkerMessage(hello=pb.Hello(worker="c", session=second.session))).error()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--names-per-token" in err.details()
        assert s.on_loop(lambda: sorted(s.service.roster.open)) == ["b"]
    finally:
        s.shutdown()


def test_names_per_token_admits_that_many_names(tmp_path):
    s = shard_with(tmp_path, Auth(token=RUN, names_per_token=2))
    try:
        s.worker("a")
        s.worker("b")
        e = refused(s.join, "c")
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 2 worker names" in e.details()
    finally:
        s.shutdown()
    with pytest.raises(ValueError, match="--names-per-token"):
        Auth(token=RUN, names_per_token=0)


def test_per_worker_tokens_admit_many_names(tmp_path):
    tokens = {f"w{i}": f"the-token-of-worker-{i}" for i in range(3)}
    s = shard_with(tmp_path, Auth(workers={name: token_hash(t) for name, t in tokens.items()}))
    try:
        for name, token in tokens.items():
            assert s.worker(name, token=token).welcome is not None
    finally:
        s.shutdown()


# --- item 6: the checkpoint directory's lock ---------------------------------------------------------------
def _refused_while_first_runs(c: Cluster, directory: Path):
    """Start shard "first" on `directory`; a second shard on it, with --fresh or without, refuses in one line
    that names the first one. Returns the first's process."""
    c.shard("first", "--model", "nano", "--checkpoint-dir", str(directory))
    first = c.procs["first"]
    for extra in ((), ("--fresh",)):
        r = streamdiloco(
            "server",
            *("--model", "nano", "--port", "0", "--http-port", "0", "--checkpoint-dir", str(directory)),
            *extra,
            timeout=60,
        )
        line = one_line(r)
        assert f"pid {first.pid}" in line and str(directory) in line and "started" in line, line
    assert first.poll() is None  # the first one is unharmed
    return first


def test_a_second_shard_on_a_live_checkpoint_directory_refuses_naming_the_holder(tmp_path):
    directory = tmp_path / "checkpoint"
    with Cluster(tmp_path) as c:
        first = _refused_while_first_runs(c, directory)
        first.kill()
        first.wait()
    # its lock file stays behind, but the kernel let go of its lock: the next shard takes it (the slow test
    # below starts that shard)
    assert (directory / LOCK_NAME).exists()
    lock_directory(directory).release()


# in `make test-slow`; covered by the test above (the same lock, taken by the test after the kill)
@pytest.mark.slow
def test_a_killed_shards_lock_file_blocks_no_restart(tmp_path):
    directory = tmp_path / "checkpoint"
    with Cluster(tmp_path) as c:
        first = _refused_while_first_runs(c, directory)
        first.kill()
        first.wait()
        c.shard("second", "--model", "nano", "--checkpoint-dir", str(directory))
        assert "resumed from checkpoint" in c.log("second")


# --- item 7: the run view's fetch ------------------------------------------------------------------------
class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers 302 to `location` if it has one, else 200 with `{}`; keeps every request's headers."""

    location: str | None = None
    seen: list[dict] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.seen.append(dict(self.headers))
        if self.location:
            self.send_response(302)
            self.send_header("Location", self.location)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _serve(handler: type) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_peer_that_redirects_never_passes_the_read_token_on():
    elsewhere = _serve(type("Elsewhere", (_Recorder,), {"seen": []}))
    target = f"http://127.0.0.1:{elsewhere.server_address[1]}/api/status"
    peer = _serve(type("Redirecting", (_Recorder,), {"seen": [], "location": target}))
    try:
        url = f"http://127.0.0.1:{peer.server_address[1]}"
        got = RunView(Peers((url,), READ), lambda: None).fetch(url)
        assert got["up"] is False and got["error"] == "HTTP 302", got
        assert [h.get("Authorization") for h in peer.RequestHandlerClass.seen] == [f"Bearer {READ}"]
        assert not any("Authorization" in h for h in elsewhere.RequestHandlerClass.seen)
        assert elsewhere.RequestHandlerClass.seen == []  # not followed at all
    finally:
        peer.shutdown()
        elsewhere.shutdown()


def test_http_peers_are_refused_with_a_read_token():
    from streamdiloco.server.observe.run_view import check_peers

    with pytest.raises(ValueError, match=r"^--peers: http://10\.1\.2\.3:8080 .*https"):
        check_peers(("http://10.1.2.3:8080",), READ)
    check_peers(("http://10.1.2.3:8080",), "")  # no token to leak
    check_peers(("https://10.1.2.3:8080", "http://127.0.0.1:8080", "http://[::1]:8080"), READ)  # loopback
    check_peers(("http://10.1.2.3:8080",), READ, insecure=True)
    r = streamdiloco(
        "server", "--model", "nano", "--no-checkpoint", "--read-token", READ,
        "--peers", "http://10.1.2.3:8080,http://10.1.2.4:8080", timeout=60,
    )  # fmt: skip
    assert one_line(r).startswith("streamdiloco: error: --peers: http://10.1.2.3:8080 "), r.stderr


# --- item 10: client strings in log lines ---------------------------------------------------------------
def test_escaped_writes_control_characters_as_escapes():
    from streamdiloco.common.logs import escaped

    assert escaped("plain text, [64] ünïcode") == "plain text, [64] ünïcode"
    assert escaped("[64]\nFORGED\r\x1b[31m\x00\u2028\t") == "[64]\\nFORGED\\r\\x1b[31m\\x00\\u2028\\t"
    assert short("a\nb") == "a\\nb" and "\n" not in short("x\n" * 500)


def test_a_fingerprint_cannot_forge_a_log_line(tmp_path, caplog):
    fp = json.loads(GOOD_FP)
    fp["params"][0][1] = "[64]\nFORGED everything is fine"
    s = shard_with(tmp_path, Auth())
    try:
        with caplog.at_level(logging.INFO):
            e = refused(s.join, "w0", fp=json.dumps(fp))
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "\n" not in e.details(), e.details()
            assert "[64]\\nFORGED" in e.details()
            wait_until("the refusal's log line", lambda: "refused w0 at Join" in caplog.text, timeout=10)
    finally:
        s.shutdown()
    lines = [line for r in caplog.records for line in r.getMessage().splitlines()]
    assert not [line for line in lines if line.startswith("FORGED")], lines


# --- item 11: the dashboard's ?token=, a worker's --metrics-host ----------------------------------------
def test_the_dashboard_page_takes_its_token_out_of_the_address_bar(tmp_path):
    s = shard_with(tmp_path, Auth(read_token=READ), http=True)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{s.http_port}/static/dashboard.js", headers={"Authorization": f"Bearer {READ}"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert "history.replaceState" in r.read().decode()
        with chromium() as browser:
            page = browser.new_page()
            assert page.goto(f"http://127.0.0.1:{s.http_port}/?token={READ}", timeout=30_000).status == 200
            wait_for_polls(page)
            assert "token" not in page.url and READ not in page.evaluate("() => location.href"), page.url
    finally:
        s.shutdown()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_a_worker_serves_metrics_beyond_loopback_only_with_insecure(host):
    r = streamdiloco(
        "worker", "--servers", "127.0.0.1:1", "--model", "nano",
        "--metrics-port", "0", "--metrics-host", host, timeout=60,
    )  # fmt: skip
    line = one_line(r)
    assert f"--metrics-host {host}" in line and "--insecure" in line, line


def test_the_worker_metrics_host_check():
    from streamdiloco.checks import check_metrics_host

    for host in ("127.0.0.1", "localhost", "::1"):
        check_metrics_host(host, insecure=False)
    check_metrics_host("0.0.0.0", insecure=True)
    with pytest.raises(ValueError, match="--metrics-host 0.0.0.0"):
        check_metrics_host("0.0.0.0", insecure=False)
