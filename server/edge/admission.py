"""Who a shard admits, decided in one place: every Join (the running shard's and the pending shard's of
`--init from-worker`) and the first message of an upload pass through `admit`, which takes what the call
carried and the shard's credentials and fingerprint and returns the identity admitted or raises a
`Refusal` (a status code and a message that says what to change). Pure but for the gRPC status codes it
names: no I/O, no state (tests/test_admission.py).

The gRPC edge of admission is here too, so that both servicers share it: `credentials` (what a call's
metadata and client certificate offer), `authenticate` and `abort` (a refusal as the call's status), the
checks of a worker's name and of messages that do not parse (`parse`). What this module must not do: keep
sessions or members (server/trust/membership.py and the roster do), or read anything beyond the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from streamdiloco.common.fingerprint import fingerprint_diff, parse_fingerprint
from streamdiloco.common.logs import escaped
from streamdiloco.common.wire import PROTOCOL
from streamdiloco.server.trust.auth import Auth, Identity, Refused

MAX_NAME = 128

_STATUS = {
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Refusal(Exception):
    """A call the shard refuses: the status it ends with and a message that says what to change. `kind`
    names refusals that the servicer logs (throttled): "unchecked-token", "fingerprint"; "" for others."""

    def __init__(self, code: grpc.StatusCode, message: str, kind: str = ""):
        super().__init__(message)
        self.code, self.message, self.kind = code, message, kind

    @classmethod
    def of(cls, refused: Refused, kind: str = "") -> Refusal:
        """An auth or membership refusal (server/trust/auth.py's codes) as a call's status."""
        return cls(_STATUS[refused.code], refused.message, kind)


def short(text: str, limit: int = 300) -> str:
    """Client-supplied text as it goes back into messages and logs: its control characters escaped
    (common/logs.py's `escaped`: it cannot forge a log line), and bounded. Every log line of the shard's
    that carries a string a client sent passes it through here."""
    text = escaped(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def check_name(name: str) -> str | None:
    """What is wrong with a worker name (None: nothing)."""
    if not name or len(name) > MAX_NAME or not name.isprintable() or name != name.strip():
        return (
            f"worker name must be 1..{MAX_NAME} printable characters without surrounding spaces, "
            f"got {short(repr(name), 60)}"
        )
    return None


@dataclass(frozen=True)
class Credentials:
    """What a call offers to prove who it is: a token (its metadata's bearer token, else the one in its
    message) and the common name of its client certificate under mutual TLS (None without one)."""

    token: str
    certificate: str | None = None


def admit(
    auth: Auth,
    offered: Credentials,
    worker: str,
    protocol: int | None,
    fingerprint_json: str | None = None,
    fingerprint: dict | None = None,
) -> Identity:
    """Admit a worker's Join (or upload): the identity its credentials prove for `worker`, if the shard
    speaks its `protocol`, the name is one, it offers no token that this shard would not check, and, when
    the shard has a `fingerprint` (not pending its first worker's), `fingerprint_json` (the worker's) is
    the shard's. `protocol` None: an upload, which says none (its Join did). Raises Refusal."""
    try:
        identity = auth.authenticate(offered.token, offered.certificate, worker)
    except Refused as r:
        raise Refusal.of(r) from None
    if protocol is not None and protocol != PROTOCOL:
        raise Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the worker speaks protocol {protocol}, this shard {PROTOCOL}: upgrade the older side",
        )
    if problem := check_name(worker):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, problem)
    if (unchecked := auth.unchecked_token(offered.token)) is not None:
        raise Refusal.of(unchecked, "unchecked-token")
    if fingerprint is not None and fingerprint_json is not None:
        check_fingerprint(fingerprint_json, fingerprint)
    return identity


def check_fingerprint(fingerprint_json: str, ours: dict) -> None:
    """Refuse a worker's fingerprint that does not parse, is not a fingerprint's shape, or differs from
    the shard's `ours` (the message names the first difference)."""
    try:
        theirs = parse_fingerprint(fingerprint_json)
    except ValueError as e:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
    try:
        diff = fingerprint_diff(theirs, ours, us="worker", them="shard")
    except (TypeError, KeyError, IndexError, AttributeError) as e:  # JSON, but not a fingerprint's shape
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model fingerprint is malformed: {type(e).__name__}: {short(str(e), 200)}",
        ) from None
    if diff:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, short(diff, 1000), "fingerprint")


def fetch_fragments(requested: list[int], offset: int, ranges: list[tuple[int, int]]) -> list[int]:
    """The fragments a Fetch asks for, in its order (none named: all of them, `ranges` being this shard's
    slice of each), each at most once, that exist, with `offset` within the first one's slice; Refusal
    otherwise."""
    nfrag = len(ranges)
    if len(requested) > nfrag:  # each fragment at most once
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"a Fetch names at most the run's {nfrag} fragments, got {len(requested)}",
        )
    if len(set(requested)) != len(requested):
        twice = next(f for i, f in enumerate(requested) if f in requested[:i])
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT, f"fragment {twice} is named twice: name each fragment once"
        )
    fragments = requested or list(range(nfrag))
    for f in fragments:
        if not 0 <= f < nfrag:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"fragment {f} does not exist: this run has fragments 0..{nfrag - 1}",
            )
    first_len = ranges[fragments[0]][1] - ranges[fragments[0]][0]
    if offset > first_len:
        raise Refusal(
            grpc.StatusCode.OUT_OF_RANGE,
            f"offset {offset} is past the end of fragment {fragments[0]}'s {first_len}-value slice",
        )
    return fragments


# --- the gRPC edge ---------------------------------------------------------------------------------------
def credentials(context: grpc.aio.ServicerContext, token: str) -> Credentials:
    """What a call offers: its metadata's bearer token, else `token` from the message, and its client
    certificate's common name."""
    offered = token
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            offered = value[7:].strip()
    names = (context.auth_context() or {}).get("x509_common_name") or ()
    certificate = next(iter(names), b"").decode("utf-8", "replace") or None
    return Credentials(offered, certificate)


async def abort(context: grpc.aio.ServicerContext, refusal: Refusal | Refused) -> NoReturn:
    """End the call with the refusal's status."""
    if isinstance(refusal, Refused):
        refusal = Refusal.of(refusal)
    await context.abort(refusal.code, refusal.message)
    raise AssertionError("not reached: abort raises")


async def authenticate(
    auth: Auth, context: grpc.aio.ServicerContext, token: str, name: str | None
) -> Identity:
    """What the call's credentials prove for worker `name` (None: a call that names none, Fetch); aborts
    the call when they do not allow it."""
    offered = credentials(context, token)
    try:
        return auth.authenticate(offered.token, offered.certificate, name)
    except Refused as r:
        await abort(context, r)


@dataclass
class Undecodable:
    """What a message that does not parse becomes: the servicer refuses it with one throttled line, where
    gRPC would log a traceback for each."""

    kind: str  # the message type it should have been
    size: int
    error: str


def parse(cls: Any):
    """A request deserializer for message type `cls` that turns what does not parse into Undecodable."""

    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Undecodable(cls.__name__, len(data), short(str(e), 120))

    return parse
