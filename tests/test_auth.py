"""The shard's authentication, admission and listening rules as pure code (server/trust/auth.py,
server/trust/membership.py), without a network: what each kind of credential proves, that a name is bound to
its credential, that a session id is bound to the name and identity that joined, what a reload revokes,
the read token, and when a shard refuses to listen."""

from __future__ import annotations

import pytest

from streamdiloco.server.trust.auth import Auth, Identity, Refused, listen_plan, parse_workers, token_hash
from streamdiloco.server.trust.membership import Sessions

ALICE, BOB = "alice-token", "bob-token"
WORKERS = {"alice": token_hash(ALICE), "bob": token_hash(BOB)}


def refused(fn, *args) -> Refused:
    with pytest.raises(Refused) as e:
        fn(*args)
    return e.value


def test_token_hash_is_sha256_hex():
    assert token_hash("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_parse_workers_reads_names_and_hashes_and_refuses_anything_else():
    text = f"# the run's workers\n\nalice {WORKERS['alice']}\nbob   {WORKERS['bob'].upper()}  # site 2\n"
    assert parse_workers(text) == WORKERS
    bad = {
        "alice": "expected NAME SHA256-HEX",
        f"alice {'0' * 63}": "expected NAME SHA256-HEX",
        f"alice {'g' * 64}": "expected NAME SHA256-HEX",
        f"alice {WORKERS['alice']} extra": "expected NAME SHA256-HEX",
        f"alice {WORKERS['alice']}\nalice {WORKERS['bob']}": "line 2: worker 'alice' is listed twice",
        f"alice {WORKERS['alice']}\nbob {WORKERS['alice']}": "line 2: 'bob' has the same token as 'alice'",
    }
    for text, words in bad.items():
        with pytest.raises(ValueError, match=words):
            parse_workers(text, "w.txt")


def test_an_open_shard_takes_anyone_under_any_name():
    auth = Auth()
    assert not auth.credentials and not auth.binds_names
    assert auth.authenticate("", None, "anyone") == Identity(None, "nothing")


def test_the_run_token_is_the_simple_mode_any_holder_any_name():
    auth = Auth(token="s3cret")
    assert auth.credentials and not auth.binds_names
    assert (
        auth.authenticate("s3cret", None, "a")
        == auth.authenticate("s3cret", None, "b")
        == Identity(None, "run token")
    )
    for wrong in ("", "s3cret ", "S3CRET", "s3cre"):
        r = refused(auth.authenticate, wrong, None, "a")
        assert r.code == "unauthenticated" and "wrong or missing run token" in r.message


def test_a_worker_token_proves_its_own_name_only():
    auth = Auth(workers=WORKERS)
    assert auth.binds_names
    assert auth.authenticate(ALICE, None, "alice") == Identity("alice", "worker token")
    assert auth.authenticate(ALICE, None, None) == Identity("alice", "worker token")  # Fetch names no one
    r = refused(auth.authenticate, ALICE, None, "bob")  # another worker's name
    assert r.code == "permission_denied" and "worker 'alice''s: it cannot act as 'bob'" in r.message
    r = refused(auth.authenticate, ALICE, None, "made-up-3")  # a name nobody was given
    assert r.code == "permission_denied"
    for wrong in ("", "nope", ALICE + " "):
        r = refused(auth.authenticate, wrong, None, "alice")
        assert r.code == "unauthenticated" and "unknown or revoked worker token" in r.message


def test_a_client_certificate_proves_its_common_name():
    auth = Auth(certificates=True)
    assert auth.authenticate("", "alice", "alice") == Identity("alice", "certificate")
    assert refused(auth.authenticate, "", "alice", "bob").code == "permission_denied"
    r = refused(auth.authenticate, "", None, "alice")
    assert r.code == "unauthenticated" and "client certificate" in r.message


def test_certificate_and_worker_token_must_name_the_same_worker():
    auth = Auth(workers=WORKERS, certificates=True)
    assert auth.authenticate(ALICE, "alice", "alice") == Identity("alice", "worker token and certificate")
    r = refused(auth.authenticate, BOB, "alice", "alice")
    assert r.code == "permission_denied" and "the token is worker 'bob'" in r.message
    assert refused(auth.authenticate, "", "alice", "alice").code == "unauthenticated"


def test_a_shared_token_and_per_worker_tokens_exclude_each_other():
    with pytest.raises(ValueError, match="exclude each other"):
        Auth(token="x", workers=WORKERS)


def test_a_session_id_is_good_only_with_the_identity_that_joined():
    auth = Auth(workers=WORKERS)
    joined = auth.authenticate(ALICE, None, "alice")
    assert auth.session_allowed(joined, auth.authenticate(ALICE, None, "alice")) is None
    r = auth.session_allowed(joined, Identity("bob", "worker token"))
    assert r is not None and r.code == "unauthenticated" and "issued to other credentials" in r.message
    assert auth.session_allowed(joined, Identity(None, "nothing")) is not None


def test_reload_says_whose_credential_it_revoked():
    auth = Auth(workers=WORKERS)
    carol = token_hash("carol-token")
    revoked = auth.reload({"alice": WORKERS["alice"], "carol": carol, "bob": token_hash("bob-new")})
    assert revoked == {"bob"}  # changed token; alice kept; carol new
    assert refused(auth.authenticate, BOB, None, "bob").code == "unauthenticated"
    assert auth.authenticate("bob-new", None, "bob").name == "bob"
    assert auth.authenticate("carol-token", None, "carol").name == "carol"
    assert auth.reload({}) == {"alice", "bob", "carol"}
    assert refused(auth.authenticate, ALICE, None, "alice").code == "unauthenticated"


def test_the_read_token():
    assert Auth().read_allowed(None)  # none set: open (the HTTP port then stays on loopback by default)
    auth = Auth(workers=WORKERS, read_token="r34d")
    assert auth.read_allowed("Bearer r34d") and auth.read_allowed("bearer r34d ")
    assert auth.read_allowed(None, "r34d")
    for header, query in (
        (None, None),
        ("Bearer nope", None),
        ("r34d", None),
        ("Basic r34d", None),
        ("", ""),
    ):
        assert not auth.read_allowed(header, query), (header, query)


def test_listen_plan_refuses_beyond_loopback_without_tls_or_credentials():
    creds, read = Auth(workers=WORKERS), Auth(workers=WORKERS, read_token="r")
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1"):
        assert listen_plan(host, None, False, Auth(), False) == host  # the demo and the tests: as before
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without TLS"):
        listen_plan("0.0.0.0", None, False, creds, False)
    with pytest.raises(ValueError, match="refusing to listen on shard.example.org without credentials"):
        listen_plan("shard.example.org", None, True, Auth(), False)
    # TLS and credentials but no read token: HTTP stays on loopback; with one, it listens where gRPC does
    assert listen_plan("0.0.0.0", None, True, creds, False) == "127.0.0.1"
    assert listen_plan("0.0.0.0", None, True, read, False) == "0.0.0.0"
    assert listen_plan("0.0.0.0", None, True, Auth(certificates=True, read_token="r"), False) == "0.0.0.0"
    with pytest.raises(ValueError, match="refusing to serve /api, /metrics and the dashboard on 0.0.0.0"):
        listen_plan("0.0.0.0", "0.0.0.0", True, creds, False)
    with pytest.raises(ValueError, match="refusing to serve HTTP on 0.0.0.0 without TLS"):
        listen_plan("127.0.0.1", "0.0.0.0", False, read, False)
    # --insecure: the operator's call, as before this rule existed
    assert listen_plan("0.0.0.0", None, False, Auth(), True) == "0.0.0.0"
    assert listen_plan("0.0.0.0", "0.0.0.0", False, creds, True) == "0.0.0.0"


# --- session ids (server/trust/membership.py) ---------------------------------------------------------------
def test_a_session_id_is_good_once_for_its_name_and_identity_and_for_a_while():
    auth = Auth(workers=WORKERS)
    alice, bob = auth.authenticate(ALICE, None, "alice"), auth.authenticate(BOB, None, "bob")
    sessions = Sessions(auth, pending_seconds=300.0)
    sid = sessions.join("alice", alice, now=0.0, connected=set())
    assert len(sid) == 32 and sessions.join("alice", alice, 1.0, set()) != sid  # a fresh id each Join
    refusals = [
        ("made-up", "alice", alice, 1.0, set(), "unknown session"),
        (sid, "bob", bob, 1.0, set(), "unknown session"),  # another name
        (sid, "alice", bob, 1.0, set(), "issued to other credentials"),  # another identity
        (sid, "alice", Identity(None, "nothing"), 1.0, set(), "issued to other credentials"),
        (sid, "alice", alice, 1.0, {"alice"}, "already has a session"),
        (sid, "alice", alice, 301.0, set(), "unknown session"),  # too late
    ]
    for args in refusals:
        with pytest.raises(Refused, match=args[-1]):
            sessions.hello(*args[:-1])
    assert sid in sessions.pending  # none of the refusals used it up
    sessions.hello(sid, "alice", alice, 2.0, set())
    with pytest.raises(Refused, match="unknown session"):
        sessions.hello(sid, "alice", alice, 3.0, set())  # good once


def test_join_refuses_a_name_with_a_session_and_forgets_old_ids():
    sessions = Sessions(Auth(), pending_seconds=10.0)
    nobody = Identity(None, "nothing")
    with pytest.raises(Refused) as e:
        sessions.join("w0", nobody, 0.0, {"w0"})
    assert e.value.code == "already_exists"
    old = sessions.join("w0", nobody, 0.0, set())
    sessions.join("w1", nobody, 11.0, set())
    assert old not in sessions.pending and len(sessions.pending) == 1


def test_revoke_forgets_joins_and_names_the_sessions_to_end():
    sessions = Sessions(Auth())
    nobody = Identity(None, "nothing")
    a, b = sessions.join("a", nobody, 0.0, set()), sessions.join("b", nobody, 0.0, set())
    assert sessions.revoke({"a", "c"}, connected=["c", "d"]) == {"c"}
    assert a not in sessions.pending and b in sessions.pending
