"""Who may do what on a shard: the credentials it accepts, the identity each proves, and the rules that
bind a worker's name and its session id to that identity. Pure decisions, tested without a network
(tests/test_auth.py); the servicer only passes in what a call carried and turns a `Refused` into a status.

Three kinds of credential, from the simplest:
- the run token (`--token`): one secret shared by every worker. Whoever holds it may use any name: the
  simple mode, for a run among people who trust each other. So that one holder cannot outvote the others
  with made-up names (the defenses against pushes are medians over names), a shard holds at most
  `names_per_token` names on it at once (`--names-per-token`, 1 by default); robustness against workers
  that lie needs per-worker credentials.
- per-worker tokens (`--workers-file`: lines `NAME SHA256-HEX`): a token proves one name, and that name
  only; the file holds hashes, never tokens. `reload` takes a new version of the file without a restart
  and says whose credential was revoked (removed or changed), so that their sessions end.
- client certificates under mutual TLS (`--tls-client-ca`): the certificate's common name is the name.
With both per-worker tokens and certificates, both must name the worker.

A session id from Join is bound to the identity that joined: a Session that presents it must prove the
same identity again, so a sniffed session id is worth nothing without the credential.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from streamdiloco.common.tls import is_loopback

HASH = re.compile(r"[0-9a-f]{64}")
MAX_WORKERS_FILE_BYTES = 16 << 20  # 100,000 workers are 8 MB of lines


class Refused(Exception):
    """A credential that does not allow the call. `code`: "unauthenticated" (no valid credential),
    "permission_denied" (a valid credential for another name) or "resource_exhausted" (the run token holds
    as many names as it may)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Identity:
    """What a call's credentials proved. `name`: the worker name they are bound to; None when they bind
    no name (the run token, or a shard without credentials)."""

    name: str | None
    via: str  # "worker token", "certificate", "worker token and certificate", "run token", "nothing"


def token_hash(token: str) -> str:
    """What a workers file keeps of a token: its SHA-256, hex. Tokens are 256 random bits (`streamdiloco
    certs` and `streamdiloco token` make them), so a plain hash cannot be searched back."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)


def parse_workers(text: str, source: str = "workers file") -> dict[str, str]:
    """`NAME SHA256-HEX` per line (blank lines and `#` comments allowed) -> {name: hash}. ValueError naming
    the line for anything else: a malformed hash, a name twice, or one hash for two names (a token must
    prove one name)."""
    out: dict[str, str] = {}
    owner: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not HASH.fullmatch(parts[1].lower()):
            raise ValueError(
                f"{source} line {n}: expected NAME SHA256-HEX (64 hex digits), got {line[:80]!r}"
            )
        name, digest = parts[0], parts[1].lower()
        if name in out:
            raise ValueError(f"{source} line {n}: worker {name!r} is listed twice")
        if digest in owner:
            raise ValueError(f"{source} line {n}: {name!r} has the same token as {owner[digest]!r}")
        out[name], owner[digest] = digest, name
    return out


class WorkersFile:
    """The workers file on disk, and whether it changed since it was last read (size, mtime, inode: an
    editor's write-and-rename is seen too). The one piece of I/O in this module."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple[int, int, int] | None = None

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def changed(self) -> bool:
        return self._signature() != self._seen

    def load(self) -> dict[str, str]:
        signature = self._signature()
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_WORKERS_FILE_BYTES + 1)
        except OSError as e:
            self._seen = signature  # said once, not every second
            raise ValueError(f"--workers-file {self.path}: cannot read it ({e.strerror or e})") from None
        self._seen = signature
        if len(data) > MAX_WORKERS_FILE_BYTES:
            raise ValueError(f"--workers-file {self.path}: larger than {MAX_WORKERS_FILE_BYTES >> 20} MiB")
        return parse_workers(data.decode("utf-8", "replace"), f"--workers-file {self.path}")


class Auth:
    """The credentials a shard accepts, and what a call's credentials prove."""

    def __init__(
        self,
        token: str = "",
        workers: dict[str, str] | None = None,
        certificates: bool = False,
        read_token: str = "",
        names_per_token: int = 1,
    ):
        if names_per_token < 1:
            raise ValueError(f"--names-per-token must be at least 1, got {names_per_token}")
        if token and workers is not None:
            raise ValueError(
                "--token and --workers-file exclude each other: a shared token would let anyone take any "
                "name; give each worker its own token in the workers file"
            )
        self.token, self.certificates, self.read_token = token, certificates, read_token
        self.names_per_token = names_per_token  # names the run token may hold sessions for at once
        self.workers: dict[str, str] | None = None
        self._owner: dict[str, str] = {}
        if workers is not None:
            self.reload(workers)

    @property
    def credentials(self) -> bool:
        """Whether a worker needs any credential at all."""
        return bool(self.token) or self.workers is not None or self.certificates

    @property
    def checks_tokens(self) -> bool:
        """Whether a worker's token means anything here (the run token, or per-worker tokens)."""
        return bool(self.token) or self.workers is not None

    def unchecked_token(self, token: str) -> Refused | None:
        """A worker that offers a token to a shard that checks none is refused: its operator believes the
        run is closed, and it is not (a shard started without --token, perhaps with --insecure, takes anyone;
        or the worker found another shard than the run's). Joining anyway would hide that; one flag on
        either side fixes it."""
        if not token or self.checks_tokens:
            return None
        takes = "client certificates only" if self.certificates else "no credential at all"
        return Refused(
            "failed_precondition",
            f"the worker sent a token, but this shard checks none (started without --token or "
            f"--workers-file, it takes {takes}): start the shard with the run's --token, or drop the "
            "worker's --token",
        )

    @property
    def binds_names(self) -> bool:
        """Whether a credential proves one name (so that nobody else can use it)."""
        return self.workers is not None or self.certificates

    def reload(self, workers: dict[str, str]) -> set[str]:
        """Take a new workers table; returns the names whose credential it revoked (gone, or changed)."""
        old = self.workers or {}
        self.workers = dict(workers)
        self._owner = {digest: name for name, digest in workers.items()}
        return {name for name, digest in old.items() if workers.get(name) != digest}

    def authenticate(self, token: str, certificate: str | None, name: str | None = None) -> Identity:
        """The identity proved by a call's `token` and the common name of its client `certificate` (None
        without one), for a call made as worker `name` (None: a call that names no worker, Fetch).
        Raises Refused."""
        proved: list[str] = []
        bound: str | None = None
        if self.certificates:
            if not certificate:
                raise Refused("unauthenticated", "this shard needs a client certificate (mutual TLS)")
            bound = certificate
            proved.append("certificate")
        if self.workers is not None:
            if not token:
                raise Refused(
                    "unauthenticated",
                    "unknown or revoked worker token (see --token-file): the worker sent none, and this "
                    "shard needs each worker's own: give the worker --token-file workers/NAME.token",
                )
            owner = self._owner.get(token_hash(token))
            if owner is None:
                raise Refused("unauthenticated", "unknown or revoked worker token (see --token-file)")
            if bound is not None and owner != bound:
                raise Refused(
                    "permission_denied",
                    f"the token is worker {owner!r}'s, the certificate worker {bound!r}'s",
                )
            bound = owner
            proved.insert(0, "worker token")
        elif self.token:
            if not token:
                raise Refused(
                    "unauthenticated",
                    "wrong or missing run token (--token): the worker sent none, and this shard needs the "
                    "run token: give the worker --token or --token-file",
                )
            if not secrets.compare_digest(token.encode(), self.token.encode()):
                raise Refused("unauthenticated", "wrong or missing run token (--token)")
            proved.append("run token")
        if name is not None and bound is not None and name != bound:
            raise Refused(
                "permission_denied",
                f"this credential is worker {bound!r}'s: it cannot act as {_clip(name)!r}",
            )
        return Identity(bound, " and ".join(proved) or "nothing")

    def names_allowed(self, identity: Identity, name: str, held: Iterable[str]) -> Refused | None:
        """Whether `identity` may use worker `name` now that the run token holds sessions for `held` (the
        names of the shard's sessions that the run token proved). Only the run token is counted: it binds
        no name, so one holder could otherwise add names until they outvote the others. The same name
        again (a reconnect, a restarted worker) is not another name."""
        if identity.via != "run token":
            return None
        others = sorted(set(held) - {name})
        if len(others) < self.names_per_token:
            return None
        return Refused(
            "resource_exhausted",
            f"this shard takes at most {self.names_per_token} worker name"
            f"{'s' * (self.names_per_token != 1)} on the run token at once, and "
            f"{', '.join(repr(n) for n in others[:3])}{' ...' * (len(others) > 3)} "
            f"{'has' if len(others) == 1 else 'have'} a session: give each worker its own credential "
            "(--workers-file, or client certificates), or start the shards with --names-per-token N (N: the "
            "run's workers)",
        )

    def session_allowed(self, joined: Identity, now: Identity) -> Refused | None:
        """A Session presents a session id that Join gave to `joined`; `now` is what its own credentials
        prove. The same identity, or a refusal."""
        if joined != now:
            return Refused(
                "unauthenticated",
                "this session id was issued to other credentials: present the ones used at Join",
            )
        return None

    def read_allowed(self, authorization: str | None, query_token: str | None = None) -> bool:
        """Whether an HTTP request may read /api/*, /metrics or the page: `Authorization: Bearer TOKEN`
        (or, for the page, `?token=TOKEN`) with the read token, when there is one."""
        if not self.read_token:
            return True
        offered = ""
        if authorization and authorization[:7].lower() == "bearer ":
            offered = authorization[7:].strip()
        elif query_token:
            offered = query_token
        return bool(offered) and secrets.compare_digest(offered.encode(), self.read_token.encode())


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


LOOPBACK = "127.0.0.1"


def listen_plan(host: str, http_host: str | None, tls: bool, auth: Auth, insecure: bool) -> str:
    """Where the shard's HTTP port listens, or a one-line reason not to start (ValueError). gRPC beyond
    loopback needs TLS and a credential; HTTP beyond loopback needs TLS and, with credentials on, the read
    token. `--insecure` allows either without. Unless told (`http_host`), HTTP listens where gRPC does,
    except beyond loopback without a read token: then on loopback only."""
    if not is_loopback(host) and not insecure:
        if not tls:
            raise ValueError(
                f"refusing to listen on {host} without TLS: give --tls-cert and --tls-key (`streamdiloco "
                "certs` makes them), listen on 127.0.0.1, or say --insecure"
            )
        if not auth.credentials:
            raise ValueError(
                f"refusing to listen on {host} without credentials: give --workers-file (per-worker "
                "tokens), --tls-client-ca (worker certificates) or --token, or say --insecure"
            )
    if http_host is None:
        http_host = host if is_loopback(host) or insecure or auth.read_token else LOOPBACK
    if not is_loopback(http_host) and not insecure:
        if not tls:
            raise ValueError(
                f"refusing to serve HTTP on {http_host} without TLS (the read token would travel in "
                "clear): give --tls-cert and --tls-key, or say --insecure"
            )
        if auth.credentials and not auth.read_token:
            raise ValueError(
                f"refusing to serve /api, /metrics and the dashboard on {http_host} to anyone: give "
                "--read-token (or --read-token-file), or say --insecure"
            )
    return http_host
