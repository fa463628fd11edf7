"""TLS for the tests: a run's certificates as `streamdiloco certs` writes them made into the shard's and a
client's credentials, and an HTTPS GET that returns the status and body whatever they are. What it must
not do: make certificates of its own (the tests use the real command's), or skip verification.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

from streamdiloco.common.tls import ClientTLS, ServerTLS
from tests.support.inthread import RPC_TIMEOUT

READ = "read-2b9f4c7d1e8a6f3b5c0d9e7a4b2c1f8e"  # a dashboard read token, distinctive in a capture


def server_tls(certs: Path, mutual: bool = False) -> ServerTLS:
    """The shard's side (`mutual`: it asks workers for their certificates too)."""
    return ServerTLS(
        str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem") if mutual else None
    )


def client_tls(certs: Path, name: str | None = None) -> ClientTLS:
    """A client that trusts the run's CA, with worker `name`'s certificate if given."""
    if name is None:
        return ClientTLS(str(certs / "ca.pem"))
    return ClientTLS(
        str(certs / "ca.pem"), str(certs / "workers" / f"{name}.pem"), str(certs / "workers" / f"{name}.key")
    )


def https(port: int, path: str, ca: Path, token: str | None = None) -> tuple[int, bytes]:
    """GET https://127.0.0.1:port/path trusting `ca` (with a bearer `token`): (status, body)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=RPC_TIMEOUT, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
