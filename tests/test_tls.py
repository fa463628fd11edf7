"""TLS, over real channels on loopback: a TLS shard refuses plaintext clients and clients that do not
trust its CA; under mutual TLS a certificate proves its name and nothing else; the HTTP port serves TLS
and needs the read token for all but health; a capture of the loopback traffic (tcpdump, root only)
shows the token and the session id in clear without TLS and nowhere with it; `streamdiloco certs` makes
credentials that carry a real run of shard and worker processes; and a shard refuses to listen beyond
loopback without TLS and credentials.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from streamdiloco.certs import make_certs
from streamdiloco.common.tls import ClientTLS, certificate_name
from streamdiloco.common.wire import PROTOCOL, auth_metadata, make_channel
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.trust.auth import Auth, token_hash
from tests.support.browser import chromium, wait_for_polls
from tests.support.inthread import RPC_TIMEOUT, InThreadShard, Session, refused
from tests.support.nano_shard import CFG, CHUNK_BYTES, GOOD_FP
from tests.support.procs import Cluster, streamdiloco, wait_until
from tests.support.shards import shard_of
from tests.support.tls import READ, client_tls, https, server_tls

pytestmark = pytest.mark.timeout(120)

TOKEN = "tok-5ecd1b0e7a9c4e2f8d6b3a1c0e9f7d5b"  # distinctive bytes to look for in a capture


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    make_certs(out, None, ["alice", "bob"])
    return out


def shard(tmp: Path, certs: Path | None, auth: Auth, mutual: bool = False, http: bool = False, client=None):
    service = shard_of(CFG, "nano", shard=0, num_shards=2, chunk_bytes=CHUNK_BYTES, auth=auth)
    tls = server_tls(certs, mutual) if certs is not None else None
    if client is None and certs is not None:
        client = client_tls(certs, "alice" if mutual else None)
    return InThreadShard(service, tmp, GOOD_FP, token=auth.token, http=http, tls=tls, client=client)


def join(channel: grpc.Channel, name: str, token: str = "") -> pb.JoinReply:
    request = pb.JoinRequest(worker=name, token=token, fingerprint_json=GOOD_FP, protocol=PROTOCOL)
    return pb_grpc.ShardStub(channel).Join(request, metadata=auth_metadata(token), timeout=RPC_TIMEOUT)


def test_the_certs_command_writes_a_ca_server_and_worker_credentials(tmp_path):
    out = tmp_path / "run"
    r = streamdiloco(
        "certs", "--out", str(out), "--server-names", "shard.example.org,10.1.2.3", "--workers", "w0"
    )
    assert r.returncode == 0, r.stderr
    from cryptography import x509

    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == {"shard.example.org", "localhost"}
    assert {str(a) for a in sans.get_values_for_type(x509.IPAddress)} == {"10.1.2.3", "127.0.0.1", "::1"}
    assert certificate_name((out / "workers" / "w0.pem").read_bytes()) == "w0"
    for secret in ("ca.key", "server.key", "workers/w0.key", "workers/w0.token", "read.token"):
        assert (out / secret).stat().st_mode & 0o077 == 0, f"{secret} is readable by others"
    token = (out / "workers" / "w0.token").read_text().strip()
    assert (out / "workers.txt").read_text() == f"w0 {token_hash(token)}\n"
    # run again to add a worker: the CA stays, the new worker is appended; an existing one is kept as it is
    ca = (out / "ca.pem").read_bytes()
    assert streamdiloco("certs", "--out", str(out), "--workers", "w0,w1").returncode == 0
    assert (out / "ca.pem").read_bytes() == ca and (out / "workers" / "w0.token").read_text().strip() == token
    assert len((out / "workers.txt").read_text().splitlines()) == 2
    r = streamdiloco("certs", "--out", str(out), "--workers", "w1,../x")
    assert r.returncode == 2 and "worker name '../x'" in r.stderr
    r = streamdiloco("token", "w2", "--out", str(tmp_path / "w2.token"))
    assert r.returncode == 0 and r.stdout.startswith("w2 ") and len(r.stdout.split()[1]) == 64


def test_a_tls_shard_refuses_plaintext_and_clients_that_do_not_trust_its_ca(tmp_path, certs):
    other = tmp_path / "other-ca"
    make_certs(other, None, [])
    s = shard(tmp_path, certs, Auth(token=TOKEN))
    try:
        assert join(s.channel, "w0", TOKEN).session  # TLS, trusting the run's CA
        with make_channel(s.target) as plain:
            e = refused(join, plain, "w0", TOKEN)
            assert e.code() == grpc.StatusCode.UNAVAILABLE
        with make_channel(s.target, ClientTLS(str(other / "ca.pem"))) as wrong_ca:
            assert refused(join, wrong_ca, "w0", TOKEN).code() == grpc.StatusCode.UNAVAILABLE
        assert s.on_loop(lambda: len(s.service.roster.joins.pending)) == 1  # only the TLS Join got in
    finally:
        s.shutdown()


def test_under_mutual_tls_a_certificate_proves_its_name_only(tmp_path, certs):
    s = shard(tmp_path, certs, Auth(certificates=True), mutual=True)  # certificates are the credential
    try:
        reply = join(s.channel, "alice")
        e = refused(join, s.channel, "bob")
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "cannot act as 'bob'" in e.details()
        with make_channel(s.target, client_tls(certs)) as no_cert:  # TLS, but no client certificate
            assert refused(join, no_cert, "alice").code() == grpc.StatusCode.UNAVAILABLE
        with make_channel(s.target, client_tls(certs, "bob")) as bobs:
            # alice's session id, sniffed, presented by bob's connection
            hello = pb.WorkerMessage(hello=pb.Hello(worker="alice", session=reply.session))
            err = Session(pb_grpc.ShardStub(bobs), hello).error()
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert join(bobs, "bob").session
        welcome = s.open_session(pb.WorkerMessage(hello=pb.Hello(worker="alice", session=reply.session)))
        assert welcome.next_message("welcome").welcome.member
    finally:
        s.shutdown()


def test_http_serves_tls_and_needs_the_read_token_for_all_but_health(tmp_path, certs):
    s = shard(tmp_path, certs, Auth(token=TOKEN, read_token=READ), http=True)
    ca = certs / "ca.pem"
    try:
        for path in ("/healthz", "/readyz", "/static/dashboard.js"):
            assert https(s.http_port, path, ca)[0] == 200, path
        for path in ("/api/status", "/api/series", "/metrics", "/"):
            for token in (None, "", "wrong", TOKEN):  # the run token is not the read token
                status, body = https(s.http_port, path, ca, token)
                assert status == 401, (path, token)
                assert b"members" not in body and b"streamdiloco_shard" not in body
            assert https(s.http_port, path, ca, READ)[0] == 200, path
        status, body = https(s.http_port, "/api/status", ca, READ)
        assert json.loads(body)["shard"] == 0
        assert https(s.http_port, f"/?token={READ}", ca)[0] == 200  # the page, from a browser's address bar
        assert https(s.http_port, f"/api/status?token={READ}", ca)[0] == 401  # the API: the header only
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP to the TLS port
            urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/healthz", timeout=RPC_TIMEOUT).read()
    finally:
        s.shutdown()


def _capture(tmp: Path, port: int, name: str) -> tuple[subprocess.Popen, Path]:
    pcap, err = tmp / f"{name}.pcap", tmp / f"{name}.err"
    with open(err, "w") as e:
        proc = subprocess.Popen(
            [
                "tcpdump",
                "-i",
                "lo",
                "--immediate-mode",
                "-U",
                "-s",
                "0",
                "-w",
                str(pcap),
                "tcp",
                "port",
                str(port),
            ],
            stderr=e,
        )
    wait_until(
        "tcpdump to listen", lambda: proc.poll() is None and "listening on" in err.read_text(), timeout=30
    )
    return proc, pcap


def _talk(s: InThreadShard, name: str) -> str:
    """Join (token in metadata and message), a session (Hello with the session id, Welcome), a Fetch."""
    reply = join(s.channel, name, TOKEN)
    session = s.open_session(pb.WorkerMessage(hello=pb.Hello(worker=name, session=reply.session)), TOKEN)
    assert session.next_message("welcome").welcome.member
    assert s.fetch([2], token=TOKEN)
    session.close()
    s.wait_for(lambda: not s.service.roster.open, f"{name} to leave")
    return reply.session


@pytest.mark.skipif(os.geteuid() != 0, reason="capturing packets needs root (CI runs as root)")
def test_a_capture_of_the_traffic_shows_no_token_with_tls(tmp_path, certs):
    assert shutil.which("tcpdump"), "tcpdump is missing: `bash scripts/system-deps.sh` installs it"
    seen = {}
    for name, use_tls in (("plain", False), ("tls", True)):
        s = shard(tmp_path, certs if use_tls else None, Auth(token=TOKEN))
        try:
            proc, pcap = _capture(tmp_path, s.port, name)
            try:
                session = _talk(s, f"w-{name}")
                # the Fetch's chunks alone are tens of kB: wait until the capture holds them
                wait_until(
                    f"the {name} capture to hold the traffic", lambda path=pcap: path.stat().st_size > 20_000
                )
            finally:
                proc.send_signal(signal.SIGINT)  # tcpdump writes what it has and exits
                proc.wait(30)
        finally:
            s.shutdown()
        data = pcap.read_bytes()
        seen[name] = tuple(secret.encode() in data for secret in (TOKEN, session, f"w-{name}"))
    assert seen["plain"] == (True, True, True), "without TLS the capture shows the secrets (the control)"
    assert seen["tls"] == (False, False, False), "with TLS, neither the token nor the session id is in clear"


def test_a_shard_refuses_to_listen_beyond_loopback_without_tls_and_credentials(tmp_path, certs):
    base = ["server", "--no-checkpoint", "--port", "0", "--http-port", "0", "--model", "nano"]
    tls = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    workers = tmp_path / "workers.txt"
    workers.write_text("")
    cases = {
        "refusing to listen on 0.0.0.0 without TLS": ["--host", "0.0.0.0", "--token", TOKEN],
        "refusing to listen on 0.0.0.0 without credentials": ["--host", "0.0.0.0", *tls],
        "refusing to serve /api, /metrics and the dashboard on 0.0.0.0": [
            *("--host", "0.0.0.0", "--http-host", "0.0.0.0", "--workers-file", str(workers), *tls)
        ],
        "refusing to serve HTTP on 0.0.0.0 without TLS": ["--http-host", "0.0.0.0", "--read-token", READ],
        "--token and --workers-file exclude each other": ["--token", "x", "--workers-file", str(workers)],
        "--tls-cert and --tls-key go together": ["--tls-cert", str(certs / "server.pem")],
    }
    for words, flags in cases.items():
        r = streamdiloco(*base, *flags, timeout=60)
        assert r.returncode == 2, (flags, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (flags, r.stderr)


NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--merge-policy", "fixed"]


def test_credentials_from_the_certs_command_carry_a_real_tls_run(tmp_path):
    certs = tmp_path / "certs"
    r = streamdiloco("certs", "--out", str(certs), "--workers", "w0,w1")
    assert r.returncode == 0, r.stderr
    c_ = str(certs)
    security = [
        *(
            "--tls-cert",
            f"{c_}/server.pem",
            "--tls-key",
            f"{c_}/server.key",
            "--tls-client-ca",
            f"{c_}/ca.pem",
        ),
        *("--workers-file", f"{c_}/workers.txt", "--read-token-file", f"{c_}/read.token"),
    ]
    read = (certs / "read.token").read_text().strip()
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *NANO, "--min-workers", "2", *security)
        for m, name in enumerate(("w0", "w1")):
            c.worker(
                name,
                [target],
                *NANO,
                *("--steps", "18", "--checkpoint-every", "0", "--log-every", "6", "--rank", str(m)),
                *("--tls-ca", f"{c_}/ca.pem", "--tls-cert", f"{c_}/workers/{name}.pem"),
                *("--tls-key", f"{c_}/workers/{name}.key", "--token-file", f"{c_}/workers/{name}.token"),
            )
        for name in ("w0", "w1"):
            assert c.wait(name) == 0, c.log(name)[-3000:]
        status = json.loads(https(http, "/api/status", certs / "ca.pem", read)[1])
        log = c.log("shard")
        assert "(mutual TLS)" in log and "their own token and a client certificate" in log
        # SIGHUP re-reads the workers file at once, changed or not (the periodic check only when changed)
        assert f"read {c_}/workers.txt" not in log
        c.procs["shard"].send_signal(signal.SIGHUP)
        wait_until(
            "the shard to re-read its workers file", lambda: f"read {c_}/workers.txt: 2" in c.log("shard")
        )
    assert status["rounds_closed"] >= 3 and status["pushes_accepted"] >= 6, status
    masters = [[f["master_hash"]] for f in status["fragments"]]
    for name in ("w0", "w1"):
        summary = c.summary(name)
        assert summary["mirror_hashes"] == masters, name  # every mirror equals the masters, bit for bit


# in `make test-slow`; covered by test_credentials_from_the_certs_command_carry_a_real_tls_run (the same
# credentials through a real shard and worker)
@pytest.mark.slow
def test_launch_tls_runs_a_local_cluster_as_on_the_internet(tmp_path):
    out = tmp_path / "run"
    r = streamdiloco(
        *("launch", "--tls", "--shards", "1", "--workers", "2", "--out", str(out), "--save-global"),
        *(*NANO, "--steps", "12"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(mutual TLS, credentials in" in r.stdout and "https://127.0.0.1:" in r.stdout
    assert "every worker's mirror equals the shards' masters: yes" in r.stdout
    assert "(mutual TLS)" in (out / "shard0.log").read_text()
    assert (out / "masters.pt").exists()  # fetched with worker-0's certificate and token
    assert (out / "model.safetensors").exists()  # the same Fetch, checked as `export` checks it


def test_bad_worker_security_flags_are_one_line(tmp_path, certs):
    token = tmp_path / "t.token"
    token.write_text("a\nb\n")
    base = ["worker", "--servers", "127.0.0.1:1", "--model", "nano"]
    cases = {
        "--tls-ca /nonexistent/ca.pem: cannot read it": ["--tls-ca", "/nonexistent/ca.pem"],
        f"--tls-ca {certs}/server.key: not a PEM certificate": ["--tls-ca", f"{certs}/server.key"],
        "--tls-cert and --tls-key need --tls-ca": ["--tls-cert", f"{certs}/workers/alice.pem"],
        "--tls-cert and --tls-key go together": [
            "--tls-ca",
            f"{certs}/ca.pem",
            "--tls-cert",
            f"{certs}/ca.pem",
        ],
        "--token-file /nonexistent/t: cannot read it": ["--token-file", "/nonexistent/t"],
        "the file must hold one token on one line": ["--token-file", str(token)],
        "give --token or --token-file, not both": ["--token", "x", "--token-file", f"{certs}/read.token"],
    }
    for words, flags in cases.items():
        r = streamdiloco(*base, *flags, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and words in lines[0], (flags, r.stderr)


def test_the_dashboard_page_passes_its_read_token_on_over_tls(tmp_path, certs):
    """The page, opened as /?token=..., polls the API with it as a header (the API takes no ?token=)."""
    s = shard(tmp_path, certs, Auth(token=TOKEN, read_token=READ), http=True)
    try:
        with chromium() as browser:
            page = browser.new_context(ignore_https_errors=True).new_page()  # the run's own CA
            assert page.goto(f"https://127.0.0.1:{s.http_port}/", timeout=30_000).status == 401
            assert page.goto(f"https://127.0.0.1:{s.http_port}/?token={READ}", timeout=30_000).status == 200
            wait_for_polls(page)
            assert page.evaluate("() => window.sdDashboard.lastStatus.shard") == 0
    finally:
        s.shutdown()
