"""TLS and secrets for the wire: the PEM files a shard and a worker are given, read and checked once (a
one-line error naming the flag), and turned into grpcio's own credentials; and the rule for what counts
as loopback. The certificates themselves are made by `streamdiloco certs` (cli/certs.py).

A shard serves gRPC with `ServerTLS` (its certificate and key; with `client_ca`, mutual TLS: every worker
must show a certificate signed by that CA, and the certificate's common name is the worker's name). A
worker trusts the run's CA (`ClientTLS.ca`) and, under mutual TLS, shows its own certificate.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

MAX_SECRET_BYTES = 4096  # a token file holds one line; anything much larger is the wrong file


def read_pem(path: str, flag: str, kind: str) -> bytes:
    """The bytes of a PEM file, checked to hold what `kind` says ("certificate" or "key")."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    try:
        if kind == "certificate":
            x509.load_pem_x509_certificates(data)
        else:
            load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag} {path}: not a PEM {kind} without a password ({e})") from None
    return data


def read_secret(path: str, flag: str) -> str:
    """A token kept in a file (so that it is not on the command line, where `ps` shows it): its one line."""
    try:
        data = Path(path).read_bytes()[: MAX_SECRET_BYTES + 1]
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    text = data.decode("utf-8", "replace").strip()
    if not text or len(data) > MAX_SECRET_BYTES or "\n" in text:
        raise ValueError(f"{flag} {path}: the file must hold one token on one line")
    return text


def certificate_name(pem: bytes) -> str:
    """The common name of a PEM certificate's subject (a worker certificate's name)."""
    cert = x509.load_pem_x509_certificates(pem)[0]
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


@dataclass(frozen=True)
class ServerTLS:
    """A shard's TLS: its certificate chain and key, and for mutual TLS the CA that signs worker
    certificates. Used for gRPC and for the HTTP port alike."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        read_pem(self.cert, "--tls-cert", "certificate")
        read_pem(self.key, "--tls-key", "key")
        if self.client_ca is not None:
            read_pem(self.client_ca, "--tls-client-ca", "certificate")

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """A worker's TLS: the CA it trusts for the shards' certificates and, for mutual TLS, its own
    certificate and key."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        read_pem(self.ca, "--tls-ca", "certificate")
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together (a worker certificate and its key)")
        if self.cert is not None and self.key is not None:
            read_pem(self.cert, "--tls-cert", "certificate")
            read_pem(self.key, "--tls-key", "key")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(),
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


def client_tls(ca: str | None, cert: str | None = None, key: str | None = None) -> ClientTLS | None:
    """ClientTLS from a worker's flags; None (plaintext) when no CA is given."""
    if ca is None:
        if cert is not None or key is not None:
            raise ValueError("--tls-cert and --tls-key need --tls-ca (the run's CA, to check the shards)")
        return None
    return ClientTLS(ca, cert, key)


def is_loopback(host: str) -> bool:
    """Whether listening on `host` keeps a port on this machine: 127.0.0.0/8, ::1 or `localhost`. Any other
    name may resolve to an address others reach, and 0.0.0.0 / :: is every interface."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
