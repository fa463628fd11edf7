"""`streamdiloco certs` and `streamdiloco token`: a run's credentials, made with Python's `cryptography`.

One folder holds a run's secrets:
  ca.pem, ca.key            the run's own CA (keep ca.key offline once every certificate is made)
  server.pem, server.key    every shard's certificate: the names and addresses workers dial are its SANs
  workers/NAME.pem, .key    a worker's client certificate (common name NAME) for mutual TLS
  workers/NAME.token        a worker's own token; workers.txt lists NAME SHA256-HEX for --workers-file
  read.token                the read token for the shards' /api, /metrics and dashboard
Run again with more --workers to add workers to a run: the CA, the read token and every worker that has
credentials already are kept (so running it again changes nothing: a compose stack runs it at every
start); --server-names given again remakes the server certificate. To give a worker new credentials,
revoke it first: remove its line from workers.txt and its files.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from streamdiloco.common.atomic import atomic_write_bytes
from streamdiloco.server.trust.auth import new_token, token_hash

WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # also a file name and a certificate CN
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # always in the server certificate: health checks, tests


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, secret: bool) -> None:
    """Write atomically; secrets readable by their owner only (created so, never widened later)."""
    atomic_write_bytes(path, data, mode=0o600 if secret else 0o644)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    days: int,
    sans: list[x509.GeneralName] | None = None,
    usage: list[x509.ObjectIdentifier] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little behind
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.BasicConstraints(ca=issuer is None, path_length=0 if issuer is None else None), True
        )
    )
    if issuer is None:
        b = b.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        b = b.add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
        )
        b = b.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
        )
    b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def check_worker_name(name: str) -> str:
    if not WORKER_NAME.fullmatch(name):
        raise ValueError(
            f"worker name {name[:60]!r}: use 1..128 letters, digits, '.', '_' or '-' (it names files and "
            "the certificate)"
        )
    return name


def make_certs(
    out: str | Path,
    server_names: list[str] | None = None,
    workers: Sequence[str] = (),
    days: int = 365,
) -> list[Path]:
    """Make (or add to) a run's credentials in `out`; returns the files written."""
    out = Path(out)
    for w in workers:
        check_worker_name(w)
    if len(set(workers)) != len(workers):
        raise ValueError("--workers names a worker twice")
    for n in server_names or ():
        if not n or any(c.isspace() for c in n):
            raise ValueError(f"--server-names: {n!r} is not a host name or address")
    (out / "workers").mkdir(parents=True, exist_ok=True)
    workers = [w for w in workers if not (out / "workers" / f"{w}.token").exists()]  # the others are kept
    written: list[Path] = []

    def put(name: str, data: bytes, secret: bool = False) -> None:
        _write(out / name, data, secret)
        written.append(out / name)

    if (out / "ca.pem").exists() and (out / "ca.key").exists():
        ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
        loaded = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{out / 'ca.key'} is not the key `streamdiloco certs` made")
        ca_key = loaded
    else:
        ca_key = _key()
        ca = _cert("streamdiloco run CA", ca_key, None, ca_key, days=10 * days)
        put("ca.key", _key_pem(ca_key), secret=True)
        put("ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    if server_names is not None or not (out / "server.pem").exists():
        names = list(dict.fromkeys([*(server_names or []), *LOOPBACK_NAMES]))
        key = _key()
        cert = _cert(
            names[0], key, ca, ca_key, days, [_san(n) for n in names], [ExtendedKeyUsageOID.SERVER_AUTH]
        )
        put("server.key", _key_pem(key), secret=True)
        put("server.pem", cert.public_bytes(serialization.Encoding.PEM))
    lines = []
    for w in workers:
        key = _key()
        cert = _cert(w, key, ca, ca_key, days, None, [ExtendedKeyUsageOID.CLIENT_AUTH])
        token = new_token()
        put(f"workers/{w}.key", _key_pem(key), secret=True)
        put(f"workers/{w}.pem", cert.public_bytes(serialization.Encoding.PEM))
        put(f"workers/{w}.token", (token + "\n").encode(), secret=True)
        lines.append(f"{w} {token_hash(token)}\n")
    if lines or not (out / "workers.txt").exists():
        with open(out / "workers.txt", "a") as f:  # appended: the shards re-read it and take the new ones
            f.writelines(lines)
        written.append(out / "workers.txt")
    if not (out / "read.token").exists():
        put("read.token", (new_token() + "\n").encode(), secret=True)
    return written


def make_token(path: str | Path, name: str) -> str:
    """A new token for worker `name`, written to `path` (owner-only); returns its workers-file line."""
    check_worker_name(name)
    path = Path(path)
    if path.exists():
        raise ValueError(f"{path} exists: a token file is never overwritten (choose another path)")
    token = new_token()
    _write(path, (token + "\n").encode(), secret=True)
    return f"{name} {token_hash(token)}"
