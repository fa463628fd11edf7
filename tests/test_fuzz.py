"""A seeded fuzzer of the shard's wire: every field of every message a client can send (JoinRequest, the
Session's Hello, Ready and Push chunks with their headers, FetchRequest), boundary and absurd values,
wrong lengths, empty and (boundedly) huge strings and bytes, repeated and reordered messages, and raw
bytes, truncated or random, sent through gRPC's generic calls with no serializer so that the shard sees
exactly those bytes. Against a real in-process shard (support/inthread.py) with two honest member workers.

Invariants, checked after every case:
- the shard neither crashes nor hangs: every call ends within its deadline and Fetch is still answered;
- every refusal is a clear gRPC status (a code from a known set, never UNKNOWN or INTERNAL for a message
  that decodes) or PushResult (a short reason), with a one-line, bounded message;
- refused input changes nothing: the masters (by hash), round numbers, open rounds' sums, staged pushes,
  counters of accepted pushes and the member set are exactly as before. (A push whose mutations happened
  to leave it valid is accepted: that case may only change its open round.)
And every 100 cases and at the end, the honest workers close a round of each fragment, which must give
exactly the update and master that the pure ShardState gives from the fragment's state before the round.

Two more targets, further down: Initialize uploads to a `--init from-worker` shard (refused cleanly, the
shard still waiting, unless the upload was a valid one), and the worker's side facing a hostile shard (Join
replies, Welcomes, update chunks and Fetch streams through the worker's own readers: the clear error or a
sane acceptance, mirrors finite, buffers bounded).

Failures name the seed and the case; `FUZZ_SEED=N pytest tests/test_fuzz.py` reruns a seed (cases depend
only on the seed and on what the shard answered before).
"""

from __future__ import annotations

import json
import math
import os
import queue
import random
import re
import struct
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from streamdiloco.common.chunks import MAX_ABS_VALUE, out_of_bounds
from streamdiloco.common.codecs import add_into, concat, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fetch import FetchError, fetch_slices
from streamdiloco.common.fingerprint import model_fingerprint, tensor_digest
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.inithash import init_hash
from streamdiloco.common.wire import PROTOCOL, auth_metadata, bytes_to_values, from_chunk, to_chunks
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.storage.ledgerstate import to_state as ledger_to_state
from streamdiloco.worker.connection import ShardConnection
from streamdiloco.worker.model import build_gpt
from streamdiloco.worker.session import MAX_UPDATES_UNDER_WAY, SyncError, Updates
from tests.support.inthread import RPC_TIMEOUT, WAIT, InThreadShard, Session, Worker, push_messages
from tests.support.shards import shard_of

CFG = SyncConfig(sync_every=6, num_fragments=3)
TOKEN = "fuzz-token"
PIECE_TOKENS = 4096  # shard 0's data ledger: pieces of this many tokens
SEED = int(os.environ.get("FUZZ_SEED", "1125"))
FAST_CASES = 200  # `make test`; test-slow runs 3 seeds of SLOW_CASES
SLOW_CASES = 5000
HONEST_EVERY = 100

MAX_DETAILS = 1200  # characters a refusal's message may have: one line, bounded whatever the client sent
HUGE = 256 << 10  # the largest string or bytes field a case sends: big enough to be absurd, small enough
SERVICE = "/streamdiloco.v1.Shard/"
REFUSAL_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# bytes that do not decode as the method's message: the shard refuses them (INVALID_ARGUMENT, one throttled
# log line, no traceback), and the message must say that the bytes did not parse
UNDECODABLE_CODES = REFUSAL_CODES
UNDECODABLE_WORDS = re.compile(r"pars|decod|deserializ", re.IGNORECASE)
REASON = re.compile(r"[a-z_]{1,40}")

U32 = [0, 1, 2, 3, 7, 127, 128, 129, 2**31 - 1, 2**31, 2**32 - 1]
U64 = [0, 1, 2, 511, 512, 513, 2**31, 2**32 - 1, 2**32, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1]
DOUBLES = [0.0, -0.0, -1.0, 5e-324, 1e-300, 0.5, 1.0, 3.0, 2.0**53, 2.0**53 + 2, 1e30, 1.1e30, 1e300,
           1.7976931348623157e308, math.inf, -math.inf, math.nan, -1e308]  # fmt: skip


def fingerprint() -> dict:
    torch.manual_seed(0)
    return model_fingerprint(build_layout(build_gpt("nano"), CFG.num_fragments), CFG)


GOOD_FP = json.dumps(fingerprint())


def build():
    from streamdiloco.server.trust.auth import Auth

    auth = Auth(token=TOKEN, names_per_token=1 << 16)  # the fuzzer's many names share the run token
    return shard_of(
        CFG,
        "nano",
        shard=0,
        num_shards=2,
        min_workers=1,
        round_timeout=3600.0,
        auth=auth,
        chunk_bytes=256,
        piece_tokens=PIECE_TOKENS,
    )


torch.manual_seed(0)
_MODEL = build_gpt("nano")
_LAYOUT = build_layout(_MODEL, CFG.num_fragments)
_INITIAL = [flatten(fragment_params(_MODEL, f)) for f in _LAYOUT.fragments]


def pure_state() -> ShardState:
    """The shard's state as build() makes it, without a service: the reference for honest rounds."""
    return ShardState(0, 2, _LAYOUT, CFG, _INITIAL, 0, 1, 3600.0)


SLICE_LEN = [hi - lo for lo, hi in pure_state().ranges]


def one_bounded_line(text: str) -> bool:
    return bool(text) and "\n" not in text and len(text) <= MAX_DETAILS


# --- a client that sends raw bytes ------------------------------------------------------------------------
class RawSession:
    """A Session call whose messages are bytes, sent as they are; what the shard sends comes back parsed
    (ShardMessage), then END or the call's RpcError."""

    END = "END"

    def __init__(self, channel: grpc.Channel):
        call = channel.stream_stream(SERVICE + "Session", request_serializer=None, response_deserializer=None)
        self.out: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.call = call(iter(self.out.get, None), timeout=RPC_TIMEOUT * 3, metadata=auth_metadata(TOKEN))
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        try:
            for raw in self.call:
                self.inbox.put(pb.ShardMessage.FromString(raw))
            self.inbox.put(self.END)
        except grpc.RpcError as e:
            self.inbox.put(e)

    def send(self, raw: bytes) -> None:
        self.out.put(raw)

    def finish(self) -> list:
        """Half-close and wait for the end: everything the shard sent, its last item END or an RpcError."""
        self.out.put(None)
        self.thread.join(WAIT * 2)
        if self.thread.is_alive():
            self.call.cancel()
            self.thread.join(WAIT)
            raise AssertionError("the shard did not end a session the worker had closed")
        return _drain(self.inbox)


def _drain(q: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


# --- the cases ----------------------------------------------------------------------------------------
@dataclass
class Case:
    """One fuzz case: its words (for failure messages) and what the checks need to know."""

    seed: int
    index: int
    what: list[str] = field(default_factory=list)
    undecodable: bool = False  # some message sent may not parse: gRPC's own refusal is allowed
    pushes: int = 0  # pushes the case sent (each may stay valid whatever its mutations)
    leased: bool = False  # a Pieces call was answered: the data ledger may have changed (its leases)

    def say(self, text: str) -> None:
        self.what.append(text)

    def __str__(self) -> str:
        return f"[seed {self.seed}, case {self.index}: {'; '.join(self.what)[:600]}]"


def some_string(rng: random.Random) -> str:
    return rng.choice(
        [
            "",
            " ",
            "x",
            "x" * 128,
            "x" * 129,
            "\x00",
            "a\nb",
            "\u00e9\u4e2d\U0001f600",
            "fp32",
            "e3m0",
            "int8",
            "sq2",  # a codec that exists, not this run's: bad_codec, as any other name
            "E3M0",
            "e3m0 ",
            "x" * 4096,
            "y" * HUGE,
            "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(1, 64))),
        ]
    )


def some_bytes(rng: random.Random, right: int) -> bytes:
    n = rng.choice([0, 1, 3, right - 1, right + 1, right + 4, 4096, HUGE, max(right, 0)])
    n = max(0, n)
    kind = rng.randrange(3)
    if kind == 0:
        return rng.randbytes(n)
    if kind == 1:
        return b"\xff" * n
    return b"\x00" * n


def scales_bytes(rng: random.Random, count: int) -> bytes:
    """Scales of the right count with absurd values, or the wrong count."""
    values = rng.choice([math.nan, math.inf, -math.inf, 1e30, 3.4e38, -1.0, 0.0, 1e-45, 1.0])
    mode = rng.randrange(3)
    if mode == 0:  # every scale that value
        return struct.pack(f"<{count}f", *([values] * count))
    if mode == 1:  # one of them
        data = bytearray(struct.pack(f"<{count}f", *([1e-3] * count)))
        at = rng.randrange(max(count, 1))
        data[4 * at : 4 * at + 4] = struct.pack("<f", values)
        return bytes(data[: 4 * count])
    return some_bytes(rng, 4 * count)


def mutate_chunk(rng: random.Random, c: pb.Chunk, case: Case) -> None:
    name = rng.choice(
        [
            "fragment",
            "round",
            "seq",
            "offset",
            "numel",
            "total",
            "codec",
            "block_size",
            "scales",
            "payload",
            "last",
        ]  # fmt: skip
    )
    if name == "fragment":
        c.fragment = rng.choice(U32 + [(c.fragment + 1) % 3])
    elif name in ("round", "offset", "numel", "total"):
        here = getattr(c, name)
        setattr(c, name, min(rng.choice(U64 + [max(here - 1, 0), here + 1, here + 512]), 2**64 - 1))
    elif name == "seq":
        c.seq = min(rng.choice(U32 + [c.seq + 1, max(c.seq - 1, 0)]), 2**32 - 1)
    elif name == "codec":
        c.codec = some_string(rng)
    elif name == "block_size":
        c.block_size = rng.choice(U32 + [64, 256])
    elif name == "scales":
        c.scales = scales_bytes(rng, len(c.scales) // 4)
    elif name == "payload":
        c.payload = some_bytes(rng, len(c.payload))
    else:
        c.last = not c.last
    shown = getattr(c, name)
    shown = f"{len(shown)} chars/bytes" if isinstance(shown, str | bytes) else shown
    case.say(f"chunk {c.seq}.{name} = {shown}")


def mutate_header(rng: random.Random, h: pb.PushHeader, case: Case) -> None:
    name = rng.choice(
        ["weight", "loss", "has_loss", "step", "blocked_seconds", "step_seconds", "tokens", "total_steps"]
    )
    if name in ("weight", "loss", "blocked_seconds", "step_seconds"):  # step_seconds: a claimed speed
        setattr(h, name, rng.choice(DOUBLES + [1e-6, 3600.0, 3600.5]))
    elif name in ("step", "tokens", "total_steps"):
        setattr(h, name, rng.choice(U64))
    else:
        h.has_loss = not h.has_loss
    case.say(f"header.{name} = {getattr(h, name)}")


def mangled_fingerprint(rng: random.Random, case: Case) -> str:
    """The honest fingerprint's JSON bent one way (truncated, deep, fields of other types, long)."""
    fp = fingerprint()
    kind = rng.randrange(7)
    case.say(f"fingerprint mangle {kind}")
    if kind == 0:
        return GOOD_FP[: rng.randrange(len(GOOD_FP))]  # truncated JSON
    if kind == 1:
        return "[" * rng.choice([10, 1000, 100_000])
    if kind == 2:  # a field of another type
        fp[rng.choice(list(fp))] = rng.choice([None, 0, -1, 2**70, "x" * 1000, [], {}, [[1]], 1e308])
    elif kind == 3:  # a parameter entry bent out of shape
        p = fp["params"][rng.randrange(len(fp["params"]))]
        p[rng.randrange(3)] = rng.choice([None, 0, "x" * 5000, [[]], {"a": 1}, [2**64]])
    elif kind == 4:  # an extra parameter with a long name
        fp["params"].append(["z" * rng.choice([10, 5000, 100_000]), [1], "torch.float32"])
    elif kind == 5:  # a number with many digits
        return GOOD_FP.replace('"sync_every": 6', '"sync_every": ' + "9" * 5000)
    else:
        fp["fragments"] = rng.choice([[], [[]], [[[0]] * 3], "fragments"])
    return json.dumps(fp)


class Fuzzer:
    def __init__(self, shard: InThreadShard, honest: list, seed: int):
        self.shard, self.honest, self.seed = shard, honest, seed
        self.rng = random.Random(seed)
        self.stats: dict[str, int] = {}

    # --- what the shard holds ---
    def snapshot(self) -> dict:
        """What refused input must leave unchanged: the shard's state, and shard 0's data ledger."""
        snap = self.shard.snapshot()
        snap["ledger"] = self.shard.on_loop(lambda: ledger_state(self.shard.service.pieces.ledger))
        return snap

    def rounds(self) -> list[int]:
        return self.shard.on_loop(lambda: [self.shard.service.state.round_of(f) for f in range(3)])

    # --- one case ---
    def run_case(self, i: int) -> None:
        case = Case(self.seed, i)
        before = self.snapshot()
        kind = self.rng.choices(["push", "hello", "join", "fetch", "raw", "pieces"], [46, 11, 13, 11, 11, 8])[
            0
        ]
        self.stats[kind] = self.stats.get(kind, 0) + 1
        case.say(kind)
        name = f"fz{i}"
        getattr(self, f"case_{kind}")(case, name)
        sessions = self.shard.service.roster.open
        self.shard.wait_for(lambda: name not in sessions, f"{name}'s session to end {case}")
        assert self.shard.failure is None and self.shard.thread.is_alive(), f"the shard died {case}"
        self.check_health(case)
        after = self.snapshot()
        if case.leased:  # an answered Pieces call leased pieces (released when its session ended)
            before.pop("ledger"), after.pop("ledger")
        if after["accepted"] == before["accepted"]:
            assert after == before, f"refused input changed the shard {case}: {_diff(before, after)}"
        else:  # a push whose mutations left it valid: only its open round changed
            self.stats["accepted"] = self.stats.get("accepted", 0) + 1
            accepted = after["accepted"] - before["accepted"]
            assert accepted <= case.pushes, f"{accepted} pushes accepted of {case.pushes} sent {case}"
            for k in ("rounds_closed", "members"):
                assert after[k] == before[k], f"{k} changed {case}"
            assert [f[:2] for f in after["fragments"]] == [f[:2] for f in before["fragments"]], str(case)

    def check_health(self, case: Case) -> None:
        """Fetch is answered (one small call: the end of fragment 2's slice)."""
        try:
            got = self.shard.fetch([2], offset=SLICE_LEN[2], token=TOKEN)
        except grpc.RpcError as e:
            raise AssertionError(f"Fetch is no longer answered: {e.code()} {e.details()} {case}") from None
        assert len(got) == 1 and got[0].last, str(case)

    def check_status(self, case: Case, e: grpc.RpcError, more: frozenset = frozenset()) -> None:
        details = e.details() or ""
        allowed = (UNDECODABLE_CODES if case.undecodable else REFUSAL_CODES) | more
        code = e.code()
        assert code in allowed, f"refused with {code}: {details[:300]!r} {case}"
        if code not in REFUSAL_CODES | more:
            assert UNDECODABLE_WORDS.search(details), f"{code} that is not about parsing: {details!r} {case}"
        assert one_bounded_line(details), (
            f"not one bounded line: {len(details)} chars {details[:300]!r} {case}"
        )
        self.stats[code.name] = self.stats.get(code.name, 0) + 1

    def check_session_items(self, case: Case, items: list) -> None:
        assert items, f"a session ended without END or a status {case}"
        *messages, last = items
        for m in messages:
            assert isinstance(m, pb.ShardMessage), f"{m!r} before the session's end {case}"
            if m.WhichOneof("kind") == "result" and not m.result.accepted:
                r = m.result
                assert REASON.fullmatch(r.reason), f"reason {r.reason[:100]!r} {case}"
                assert one_bounded_line(r.message), (
                    f"not one bounded line: {len(r.message)} chars {r.message[:300]!r} {case}"
                )
                self.stats[f"reason:{r.reason}"] = self.stats.get(f"reason:{r.reason}", 0) + 1
        if isinstance(last, grpc.RpcError):
            self.check_status(case, last)
        else:
            assert last == RawSession.END, f"the session ended with {last!r} {case}"

    def channel(self) -> grpc.Channel:
        return self.shard.channel

    def join(self, name: str) -> pb.JoinReply:
        return self.shard.join(name, token=TOKEN)

    # --- Join ---
    def case_join(self, case: Case, name: str) -> None:
        rng = self.rng
        req = pb.JoinRequest(worker=name, token=TOKEN, fingerprint_json=GOOD_FP, protocol=PROTOCOL)
        for _ in range(rng.randint(1, 2)):
            f = rng.choice(["worker", "token", "fingerprint_json", "protocol"])
            if f == "protocol":
                req.protocol = rng.choice(U32)
            elif f == "fingerprint_json":
                req.fingerprint_json = self.mangled_fingerprint(case)
            else:
                setattr(req, f, some_string(rng))
            if f == "protocol":
                case.say(f"protocol = {req.protocol}")
            elif f != "fingerprint_json":
                case.say(f"{f} = {len(getattr(req, f))} chars")
        try:
            reply = self.shard.stub.Join(req, timeout=RPC_TIMEOUT)
        except grpc.RpcError as e:
            self.check_status(case, e)
            return
        assert list(reply.rounds) == self.rounds() and reply.session, str(case)

    def mangled_fingerprint(self, case: Case) -> str:
        return mangled_fingerprint(self.rng, case)

    # --- Fetch ---
    def case_fetch(self, case: Case, name: str) -> None:
        rng = self.rng
        fragments = [
            rng.choice([0, 1, 2, 2, 3, 2**31, 2**32 - 1]) for _ in range(rng.choice([0, 1, 2, 5, 8]))
        ]
        first = fragments[0] if fragments and fragments[0] < 3 else 0
        offset = rng.choice(U64 + [SLICE_LEN[first] + d for d in (-1, 0, 1)])
        token = rng.choice([TOKEN] * 4 + ["", "wrong", TOKEN + " ", "x" * HUGE])
        case.say(f"fragments {fragments} offset {offset} token {len(token)} chars")
        req = pb.FetchRequest(fragments=fragments, offset=offset, token=token)
        try:
            chunks = list(self.shard.stub.Fetch(req, timeout=RPC_TIMEOUT))
        except grpc.RpcError as e:
            self.check_status(case, e)
            return
        # answered: the masters as they are, from the offset on, fragment by fragment as asked
        asked = fragments or [0, 1, 2]
        masters = self.shard.on_loop(lambda: [self.shard.service.state.master(f).clone() for f in range(3)])
        got: list[tuple[int, torch.Tensor]] = []
        new = True  # the next chunk starts a fragment: the first one, or the one after a last chunk
        for c in chunks:
            if new:
                got.append((c.fragment, bytes_to_values(c.values)))
            else:
                assert c.fragment == got[-1][0], f"fragment {c.fragment} within fragment {got[-1][0]} {case}"
                got[-1] = (c.fragment, torch.cat([got[-1][1], bytes_to_values(c.values)]))
            new = c.last
        assert new, f"Fetch ended within a fragment {case}"
        assert [f for f, _ in got] == asked, f"Fetch answered fragments {[f for f, _ in got]} {case}"
        for j, (f, values) in enumerate(got):
            assert torch.equal(values, masters[f][offset if j == 0 else 0 :]), f"fragment {f}'s values {case}"

    # --- Pieces: shard 0's data ledger ---
    def case_pieces(self, case: Case, name: str) -> None:
        """A Pieces call with its fields bent, from a worker with an open session (or not, or passive)."""
        rng = self.rng
        reply = self.join(name)
        passive = rng.random() < 0.15
        s = RawSession(self.channel())
        s.send(
            pb.WorkerMessage(
                hello=pb.Hello(worker=name, session=reply.session, passive=passive)
            ).SerializeToString()
        )
        self.settle(name, s, 0)
        req = pb.PiecesRequest(
            worker=name,
            session=reply.session,
            token=TOKEN,
            train_tokens=1 << 20,
            data_sha256="ab" * 32,
            want=2,
        )
        for _ in range(rng.choice([0, 1, 1, 2, 3])):  # none: an honest ask, answered
            self.mutate_pieces(req, case)
        case.say(f"passive {passive}")
        try:
            got = self.shard.stub.Pieces(req, timeout=RPC_TIMEOUT)
        except grpc.RpcError as e:  # UNAVAILABLE: a passive session's ask, which workers retry
            self.check_status(case, e, frozenset({grpc.StatusCode.UNAVAILABLE}))
        else:
            case.leased = True
            self.stats["leased"] = self.stats.get("leased", 0) + 1
            self.check_pieces_reply(case, req, got)
        self.check_session_items(case, s.finish())

    def mutate_pieces(self, req: pb.PiecesRequest, case: Case) -> None:
        rng = self.rng
        f = rng.choice(
            ["worker", "session", "token", "train_tokens", "data_sha256"] + ["done", "held", "want"] * 2
        )
        if f in ("worker", "session", "token"):
            setattr(req, f, rng.choice([some_string(rng), "", "h0", getattr(req, f) + "x"]))
        elif f == "train_tokens":
            req.train_tokens = rng.choice(U64 + [PIECE_TOKENS - 1, PIECE_TOKENS, PIECE_TOKENS + 1])
        elif f == "data_sha256":
            req.data_sha256 = rng.choice(
                ["AB" * 32, "ab" * 31, "ab" * 33, "g" * 64, "cd" * 32, some_string(rng)]
            )
        elif f in ("done", "held"):
            ids = [
                rng.choice(U32) if rng.random() < 0.5 else rng.randrange(64)
                for _ in range(rng.choice([1, 8, 64, 65, 300]))
            ]
            getattr(req, f).extend(ids)
        else:
            req.want = rng.choice(U32 + [8, 9])
        shown = getattr(req, f)
        shown = f"{len(shown)} chars/ids" if isinstance(shown, str) or not isinstance(shown, int) else shown
        case.say(f"pieces.{f} = {shown}")

    def check_pieces_reply(self, case: Case, req: pb.PiecesRequest, got: pb.PiecesReply) -> None:
        """An answered ask: its leases lie within the data it named, whole pieces, at most what it wanted."""
        assert got.piece_tokens == PIECE_TOKENS and got.pieces_done <= got.pieces_total, f"{got} {case}"
        assert len(got.held) <= max(req.want, len(req.held)), f"{len(got.held)} pieces held {case}"
        for r in got.held:
            assert r.start < r.end <= req.train_tokens and r.end - r.start <= PIECE_TOKENS, f"{r} {case}"
            assert r.id < got.pieces_total and r.start == r.id * PIECE_TOKENS, f"{r} {case}"

    # --- a Session's first message ---
    def case_hello(self, case: Case, name: str) -> None:
        rng = self.rng
        reply = self.join(name)
        hello = pb.Hello(worker=name, session=reply.session, passive=rng.random() < 0.3)
        kind = rng.randrange(9)
        if kind == 0:
            hello.session = rng.choice(["", "0" * 32, "x" * HUGE, some_string(rng)])
        elif kind == 1:
            hello.worker = rng.choice(["", "h0", some_string(rng), "x" * HUGE])
        elif kind == 2:
            other = self.join(name + "-other")
            hello.session = other.session  # another Join's session
        first: list[bytes]
        if kind == 3:
            first = [pb.WorkerMessage().SerializeToString()]  # a message of no kind
        elif kind == 4:
            first = [pb.WorkerMessage(ready=pb.Ready(from_rounds=[0, 0, 0])).SerializeToString()]
        elif kind == 5:
            first = [self.push_messages(case, mutate=False)[0]]
        elif kind == 6:
            first = []  # the worker closes at once
        elif kind == 7:  # two Hellos
            first = [pb.WorkerMessage(hello=hello).SerializeToString()] * 2
        else:
            first = [pb.WorkerMessage(hello=hello).SerializeToString()]
        case.say(f"hello kind {kind}: worker {len(hello.worker)} chars, session {len(hello.session)} chars")
        if kind in (7, 8) and rng.random() < 0.5:  # and some more: Ready, in order or not
            ready = pb.Ready(
                from_rounds=rng.choice([[], [0, 0, 0], [2**63 - 1] * 3, [1, 2], [2**64 - 1] * 3])
            )
            first.append(pb.WorkerMessage(ready=ready).SerializeToString())
            case.say(f"then Ready {list(ready.from_rounds)}")
        s = RawSession(self.channel())
        for m in first:
            s.send(m)
        if first:  # what follows a Hello, read once it is taken
            self.settle(name, s, sum(len(m) for m in first[1:]))
        self.check_session_items(case, s.finish())

    def settle(self, name: str, s: RawSession, sent: int) -> None:
        """Give the shard the time to read what was sent and to answer it, before the worker closes: wait
        (bounded) until the session has ended or its member has read `sent` bytes and has nothing queued."""
        svc = self.shard.service
        deadline = time.monotonic() + WAIT

        def done() -> bool:
            m = svc.roster.open.get(name)
            return m is not None and m.msg_in >= sent and m.queue.empty()

        while time.monotonic() < deadline and s.thread.is_alive():
            if self.shard.on_loop(done):
                return
            time.sleep(0.005)

    # --- pushes on a session ---
    def push_messages(self, case: Case, mutate: bool = True) -> list[bytes]:
        """A push of the open round of a random fragment, as serialized messages, mutated (`mutate`)."""
        rng = self.rng
        f = rng.randrange(3)
        rnd = self.rounds()[f]
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        enc = encode(torch.randn(SLICE_LEN[f], generator=g) * 1e-2, "e3m0", 128)
        per_chunk = rng.choice([512, 2048, 4096, -(-SLICE_LEN[f] // 128) * 128])  # the last: one chunk
        msgs = push_messages(
            enc,
            fragment=f,
            round=rnd,
            weight=100.0,
            loss=3.0,
            values_per_chunk=per_chunk,
            step=12,
            blocked=0.5,
        )
        case.say(f"push of fragment {f} round {rnd} in {len(msgs)} chunks")
        case.pushes += 1
        for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3]) if mutate else 0):
            j = rng.choice([0, len(msgs) - 1, rng.randrange(len(msgs))])
            if rng.random() < 0.75:
                mutate_chunk(rng, msgs[j].push.chunk, case)
            else:
                mutate_header(rng, msgs[j].push.header, case)
        raw = [m.SerializeToString() for m in msgs]
        for _ in range(rng.choice([0, 0, 1, 2]) if mutate else 0):  # the order of messages
            raw = self.reorder(raw, case)
        return raw

    def reorder(self, raw: list[bytes], case: Case) -> list[bytes]:
        rng = self.rng
        if not raw:  # an earlier reordering cut it to nothing
            return raw
        j = rng.randrange(len(raw))
        kind = rng.randrange(8)
        case.say(f"order {kind} at {j}")
        if kind == 0:
            return raw[:j] + raw[j + 1 :]  # a chunk missing
        if kind == 1:
            return raw[: j + 1] + raw[j:]  # a chunk twice
        if kind == 2:
            k = rng.randrange(len(raw))
            raw = list(raw)
            raw[j], raw[k] = raw[k], raw[j]
            return raw
        if kind == 3:
            return raw[:j]  # cut short: the last chunk never comes
        if kind == 4:
            return raw[: j + 1] + raw  # starts again
        if kind == 5:
            return raw[::-1]
        if kind == 6:  # a truncated message in between: undecodable, or a message cut to its first fields
            case.undecodable = True
            return raw[:j] + [raw[j][: rng.randrange(len(raw[j]))]] + raw[j + 1 :]
        case.undecodable = True  # random bytes in between
        return raw[:j] + [rng.randbytes(rng.choice([1, 5, 64, 1000]))] + raw[j:]

    def case_push(self, case: Case, name: str) -> None:
        rng = self.rng
        reply = self.join(name)
        passive = rng.random() < 0.1
        hello = pb.WorkerMessage(hello=pb.Hello(worker=name, session=reply.session, passive=passive))
        raw = self.push_messages(case)
        if passive:
            case.say("passive")
            if rng.random() < 0.5:  # ready part way
                from_rounds = rng.choice([[], [0, 0, 0], [2**53 + 1] * 3, [0]])
                ready = pb.WorkerMessage(ready=pb.Ready(from_rounds=from_rounds))
                raw.insert(rng.randrange(len(raw) + 1), ready.SerializeToString())
                case.say(f"Ready {from_rounds}")
        if rng.random() < 0.15:  # a second push after the first, of another fragment, as it comes
            raw += self.push_messages(case)
        if rng.random() < 0.1:
            kind = rng.choice(["hello", "empty", "ready"])
            extra = {
                "hello": hello,
                "empty": pb.WorkerMessage(),
                "ready": pb.WorkerMessage(ready=pb.Ready(from_rounds=[2**64 - 1] * 3)),
            }[kind]
            raw.insert(rng.randrange(len(raw) + 1), extra.SerializeToString())
            case.say(f"a {kind} message among the chunks")
        s = RawSession(self.channel())
        s.send(hello.SerializeToString())
        sent = 0
        for m in raw:
            s.send(m)
            try:
                sent += pb.WorkerMessage.FromString(m).ByteSize()
            except Exception:  # noqa: BLE001 - undecodable on purpose: the shard ends the session
                pass
        self.settle(name, s, sent)
        self.check_session_items(case, s.finish())

    # --- raw bytes on every method ---
    def case_raw(self, case: Case, name: str) -> None:
        rng = self.rng
        case.undecodable = True
        method = rng.choice(["Join", "Fetch", "Session", "Session-after-hello"])
        good = {
            "Join": pb.JoinRequest(worker=name, token=TOKEN, fingerprint_json=GOOD_FP, protocol=PROTOCOL),
            "Fetch": pb.FetchRequest(fragments=[1], token=TOKEN),
        }
        if method.startswith("Session"):
            reply = self.join(name)
            hello = pb.WorkerMessage(hello=pb.Hello(worker=name, session=reply.session)).SerializeToString()
            body = hello if method == "Session" else self.push_messages(case, mutate=False)[0]
        else:
            body = good[method].SerializeToString()
        kind = rng.randrange(4)
        if kind == 0:
            data = body[: rng.randrange(len(body))]
        elif kind == 1:
            data = rng.randbytes(rng.choice([1, 2, 7, 100, 4096]))
        elif kind == 2:  # a byte changed
            data = bytearray(body)
            data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        else:  # a length prefix that claims more than there is
            data = body[:1] + b"\xff\xff\xff\xff\x0f" + body[1:]
        case.say(f"{method} raw kind {kind}, {len(data)} bytes")
        if method == "Join":
            call = self.channel().unary_unary(
                SERVICE + "Join", request_serializer=None, response_deserializer=None
            )
            try:
                reply = pb.JoinReply.FromString(call(data, timeout=RPC_TIMEOUT))
                assert reply.session, str(case)
            except grpc.RpcError as e:
                self.check_status(case, e)
        elif method == "Fetch":
            call = self.channel().unary_stream(
                SERVICE + "Fetch", request_serializer=None, response_deserializer=None
            )
            try:
                for item in call(data, timeout=RPC_TIMEOUT):
                    pb.MasterChunk.FromString(item)
            except grpc.RpcError as e:
                self.check_status(case, e)
        else:
            s = RawSession(self.channel())
            if method == "Session":
                s.send(data)
                after = 0
            else:
                s.send(hello)
                s.send(data)
                try:
                    after = pb.WorkerMessage.FromString(data).ByteSize()
                except Exception:  # noqa: BLE001 - undecodable: the shard ends the session
                    after = 1 << 62
            self.settle(name, s, after)
            self.check_session_items(case, s.finish())

    # --- honest rounds ---
    def honest_rounds(self, label: str) -> None:
        """Each fragment: the honest workers push its open round and it closes. A round that holds a push a
        fuzz case left (accepted) closes first, unchecked; then the next round must give exactly what the
        pure ShardState gives from the fragment's state before it."""
        sh, svc = self.shard, self.shard.service
        for f in range(3):
            if sh.on_loop(lambda f=f: svc.state.contributors(f)):
                self._honest_round(f, label, check=False)
            self._honest_round(f, label, check=True)

    def _honest_round(self, f: int, label: str, check: bool) -> None:
        sh, svc = self.shard, self.shard.service
        where = f"[seed {self.seed}, {label}, honest round of fragment {f}]"
        saved, rnd = sh.on_loop(lambda: (svc.state.fragment_state(f), svc.state.round_of(f)))
        encs = []
        for k, w in enumerate(self.honest):
            g = torch.Generator().manual_seed(self.seed * 7919 + rnd * 31 + f * 3 + k)
            encs.append(encode(torch.randn(SLICE_LEN[f], generator=g) * 1e-2, "e3m0", 128))
            w.push(push_messages(encs[-1], fragment=f, round=rnd, weight=100.0 * (k + 1), loss=2.0 + k))
        for w in self.honest:
            r = w.session.result()
            assert r.accepted and (r.fragment, r.round) == (f, rnd), f"{r} {where}"
        updates = [w.session.update() for w in self.honest]
        got = [concat([from_chunk(c) for c in u]) for u in updates]
        assert all(c.fragment == f and c.round == rnd for u in updates for c in u), where
        assert all(
            torch.equal(g.payload, got[0].payload) and torch.equal(g.scales, got[0].scales) for g in got
        ), f"the workers got different updates {where}"
        master = sh.on_loop(lambda: svc.state.master(f))
        assert bool(torch.isfinite(master).all()), f"a master is not finite {where}"
        if not check:
            return
        ref = pure_state()  # from the fragment's state before the round
        ref.load_fragment_state(f, saved)
        for k, (w, enc) in enumerate(zip(self.honest, encs)):
            ref.add_member(w.name)
            ref.push(w.name, f, rnd, enc, 100.0 * (k + 1), 2.0 + k)
        closed = ref.close_round(f)
        assert torch.equal(got[0].payload, closed.update.payload), f"the update differs {where}"
        assert torch.equal(got[0].scales, closed.update.scales), f"the update's scales differ {where}"
        assert tensor_digest(master) == tensor_digest(ref.master(f)), f"the master differs {where}"


def ledger_state(ledger) -> str:
    """Shard 0's data ledger as ledger.json would keep it (its binding, epoch, done set, leases, counts)."""
    if ledger.dataset is None:
        return "unbound"
    return json.dumps(ledger_to_state(ledger), sort_keys=True)


def _diff(before: dict, after: dict) -> str:
    return ", ".join(k for k in before if before[k] != after.get(k))[:300]


def honest_worker(shard: InThreadShard, name: str) -> Worker:
    """A member whose session lasts as long as the fuzzing does."""
    reply = shard.join(name)
    hello = pb.WorkerMessage(hello=pb.Hello(worker=name, session=reply.session))
    s = Session(shard.stub, hello, auth_metadata(TOKEN), timeout=3600.0)
    shard.sessions.append(s)  # cancelled when the shard shuts down
    s.next_message("welcome")
    return Worker(name, s, reply)


def run_fuzz(tmp_path, seed: int, cases: int) -> dict:
    shard = InThreadShard(build(), tmp_path, GOOD_FP, token=TOKEN)
    try:
        honest = [honest_worker(shard, "h0"), honest_worker(shard, "h1")]
        fuzzer = Fuzzer(shard, honest, seed)
        fuzzer.honest_rounds("before the cases")
        for i in range(cases):
            fuzzer.run_case(i)
            if (i + 1) % HONEST_EVERY == 0:
                fuzzer.honest_rounds(f"after case {i}")
        fuzzer.honest_rounds("after the cases")
        assert shard.on_loop(lambda: sorted(shard.service.state.members)) == ["h0", "h1"]
        return fuzzer.stats
    finally:
        shard.shutdown()


@pytest.mark.timeout(300)
def test_fuzzed_messages_are_refused_cleanly_and_change_nothing(tmp_path):
    stats = run_fuzz(tmp_path, SEED, FAST_CASES)
    # the cases reached every method and both outcomes: refusals, and pushes that stayed valid
    assert all(
        stats.get(k, 0) > 0 for k in ("push", "hello", "join", "fetch", "raw", "pieces", "accepted")
    ), stats
    assert sum(v for k, v in stats.items() if k.startswith("reason:")) > FAST_CASES // 5, stats


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [SEED + 1, SEED + 2, SEED + 3])
def test_fuzzed_messages_many_more_cases(tmp_path, seed):
    run_fuzz(tmp_path, seed, SLOW_CASES)


# --- what the fuzzer found, pinned ---------------------------------------------------------------------
@pytest.fixture
def shard(tmp_path, shards):
    return shards.add(InThreadShard(build(), tmp_path, GOOD_FP, token=TOKEN))


def test_a_token_that_is_not_ascii_is_a_wrong_token_not_a_shard_error(shard):
    # secrets.compare_digest raises TypeError on str with non-ASCII characters: Join and Fetch answered
    # UNKNOWN ("Unexpected <class 'TypeError'>") with a traceback in the shard's log
    for token in ("\u00e9", "fuzz-token\u4e2d"):
        for call, args in ((shard.join, ("w",)), (shard.fetch, ([0],))):
            with pytest.raises(grpc.RpcError) as e:
                call(*args, token=token)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert e.value.details() == "wrong or missing run token (--token)"


def test_a_codec_string_is_quoted_by_its_first_characters_only(shard):
    # a refused chunk's codec was echoed whole into the PushResult and the log (a 256 KiB string: 256 KiB
    # of message and of log line)
    w = honest_worker(shard, "w")
    msgs = push_messages(encode(torch.zeros(SLICE_LEN[0]), "e3m0", 128), values_per_chunk=4096)
    msgs[0].push.chunk.codec = "y" * HUGE
    w.push(msgs)
    r = w.session.result()
    assert (r.accepted, r.reason) == (False, "bad_codec")
    assert r.message.endswith(f"got {'y' * 40!r}... ({HUGE} characters)") and len(r.message) < 200, r.message


# --- Initialize: the upload to a `--init from-worker` shard ------------------------------------------------
# Random and mutated fingerprints and chunk sequences (fields, order, drops, repeats, values that are not
# finite, raw bytes that do not parse) against a real pending shard. Invariants: every call ends with a
# clear status (a known code, one bounded line), never a traceback; a refused upload leaves the shard
# without parameters (Join still says `uninitialized`); an upload the shard takes was a valid one: its
# masters are exactly the values sent. After the cases an honest upload is taken, whole.
INIT_CASES = 24  # `make test`; test-slow runs 3 seeds of INIT_SLOW_CASES
INIT_SLOW_CASES = 1000
INIT_CHUNK = 4096  # values per honest InitChunk
INIT_CODES = REFUSAL_CODES | {grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED}
_RANGES = pure_state().ranges  # shard 0 of 2: its slice of each fragment


def pending_shard(tmp_path) -> InThreadShard:
    service = shard_of(
        CFG, None, 0, 2, min_workers=1, round_timeout=3600.0, token=TOKEN, chunk_bytes=256, init="from-worker"
    )
    return InThreadShard(service, tmp_path, GOOD_FP, token=TOKEN)


def honest_upload(name: str = "up") -> list[pb.InitChunk]:
    """What worker/bootstrap.py sends: the fingerprint, then this shard's slice of each fragment in order."""
    out = []
    for f, (lo, hi) in enumerate(_RANGES):
        for a in range(lo, hi, INIT_CHUNK):
            b = min(hi, a + INIT_CHUNK)
            out.append(pb.InitChunk(fragment=f, offset=a - lo, values=_INITIAL[f][a:b].numpy().tobytes()))
    out.append(pb.InitChunk(last=True))
    out[0].worker, out[0].token, out[0].fingerprint_json = name, TOKEN, GOOD_FP
    out[0].init_hash, digests = init_hash(_LAYOUT, _INITIAL, 2)  # and every slice's digest, as workers do
    out[0].slice_hashes.extend(digests)
    return out


def float_bytes(rng: random.Random, right: int) -> bytes:
    """fp32 values of the right length with one absurd value, or bytes of another length."""
    if rng.random() < 0.3 or right < 4:
        return some_bytes(rng, right)
    data = bytearray(b"\0" * right)
    at = 4 * rng.randrange(right // 4)
    data[at : at + 4] = struct.pack("<f", rng.choice([math.nan, math.inf, -math.inf, 3e38, 1e31, -1e35]))
    return bytes(data)


def mutate_list(rng: random.Random, items: list, case: Case) -> None:
    """Drop, repeat, swap or cut the messages of a stream."""
    op = rng.choice(["drop", "repeat", "swap", "cut", "reverse"])
    i, j = rng.randrange(len(items)), rng.randrange(len(items))
    if op == "drop" and len(items) > 1:
        del items[i]
    elif op == "repeat":
        items.insert(i, type(items[i]).FromString(items[i].SerializeToString()))
    elif op == "swap":
        items[i], items[j] = items[j], items[i]
    elif op == "cut":
        del items[max(1, i) :]
    else:
        items.reverse()
    case.say(f"{op} {i} {j}")


class InitFuzzer:
    def __init__(self, tmp_path, seed: int):
        self.tmp_path, self.seed = tmp_path, seed
        self.rng = random.Random(seed)
        self.stats: dict[str, int] = {}
        self.shard = pending_shard(tmp_path)

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def mutated(self, case: Case) -> list[pb.InitChunk]:
        rng, msgs = self.rng, honest_upload(f"fz{case.index}")
        for _ in range(rng.choice([1, 1, 2, 3])):
            what = rng.choice(
                ["fingerprint", "worker", "token", "fragment", "offset", "values", "last", "list", "hash"]
            )
            c = msgs[rng.randrange(len(msgs))]
            if what == "fingerprint":
                msgs[0].fingerprint_json = rng.choice([mangled_fingerprint(rng, case), some_string(rng)])
            elif what in ("worker", "token"):
                setattr(msgs[0], what, some_string(rng))
            elif what == "fragment":
                c.fragment = rng.choice(U32 + [c.fragment + 1, max(c.fragment - 1, 0)])
            elif what == "offset":
                c.offset = min(
                    rng.choice(U64 + [c.offset + 1, c.offset + INIT_CHUNK, max(c.offset - 1, 0)]), 2**64 - 1
                )
            elif what == "values":
                c.values = float_bytes(rng, len(c.values))
            elif what == "last":
                c.last = not c.last
            elif what == "hash":  # the claimed init hash, or one slice's digest, wrong or missing
                if rng.random() < 0.5:
                    msgs[0].init_hash = rng.choice(["", some_string(rng), "0" * 64])
                elif msgs[0].slice_hashes:
                    k = rng.randrange(len(msgs[0].slice_hashes))
                    msgs[0].slice_hashes[k] = rng.choice([b"", rng.randbytes(32), b"\0" * 31])
            else:
                mutate_list(rng, msgs, case)
            case.say(what)
        return msgs

    def run_case(self, i: int) -> None:
        case = Case(self.seed, i)
        raw = self.rng.random() < 0.1
        msgs = self.mutated(case)
        data = [m.SerializeToString() for m in msgs]
        if raw:  # bytes that may not parse as an InitChunk
            case.undecodable = True
            k = self.rng.randrange(len(data))
            data[k] = self.rng.choice(
                [data[k][: max(0, len(data[k]) - 3)], self.rng.randbytes(64), b"\xff" * 9]
            )
            case.say(f"raw {k}")
        call = self.shard.channel.stream_unary(
            SERVICE + "Initialize", request_serializer=None, response_deserializer=None
        )
        try:
            call(iter(data), timeout=RPC_TIMEOUT, metadata=auth_metadata(TOKEN))
        except grpc.RpcError as e:
            self.refused(case, e)
            return
        self.accepted(case, msgs)

    def refused(self, case: Case, e: grpc.RpcError) -> None:
        details, code = e.details() or "", e.code()
        allowed = UNDECODABLE_CODES | INIT_CODES if case.undecodable else INIT_CODES
        assert code in allowed, f"refused with {code}: {details[:300]!r} {case}"
        assert one_bounded_line(details), f"not one bounded line: {details[:300]!r} {case}"
        self.count(code.name)
        reply = self.shard.join("probe", fp="")
        assert reply.uninitialized, f"a refused upload gave the shard its parameters {case}"

    def accepted(self, case: Case, msgs: list[pb.InitChunk], fresh: bool = True) -> None:
        """The shard took the upload: it must have been a valid one, and the masters are what it sent (then
        the cases go on with a `fresh` shard)."""
        self.count("accepted")
        sent: list[list[torch.Tensor]] = [[] for _ in _RANGES]
        for m in msgs:
            if m.values:
                sent[m.fragment].append(bytes_to_values(m.values))
        for f, (lo, hi) in enumerate(_RANGES):
            want = torch.cat(sent[f]) if sent[f] else torch.zeros(0)
            got = torch.cat([bytes_to_values(c.values) for c in self.shard.fetch([f], token=TOKEN)])
            assert want.numel() == hi - lo and torch.equal(got, want), (
                f"fragment {f} is not what was sent {case}"
            )
            assert out_of_bounds(got) is None, f"the shard took masters no worker can fetch {case}"
        if fresh:
            self.shard.shutdown()
            self.shard = pending_shard(self.tmp_path)

    def honest(self) -> None:
        self.shard.stub.Initialize(iter(honest_upload()), timeout=RPC_TIMEOUT, metadata=auth_metadata(TOKEN))
        with pytest.raises(grpc.RpcError) as e:  # once taken, an upload is refused
            self.shard.stub.Initialize(
                iter(honest_upload()), timeout=RPC_TIMEOUT, metadata=auth_metadata(TOKEN)
            )
        assert e.value.code() in INIT_CODES and one_bounded_line(e.value.details() or "")
        self.accepted(Case(self.seed, -1, ["honest upload"]), honest_upload(), fresh=False)


def run_init_fuzz(tmp_path, seed: int, cases: int) -> dict:
    fuzzer = InitFuzzer(tmp_path, seed)
    try:
        for i in range(cases):
            fuzzer.run_case(i)
        fuzzer.honest()
        return fuzzer.stats
    finally:
        fuzzer.shard.shutdown()


@pytest.mark.timeout(120)
def test_fuzzed_uploads_are_refused_cleanly_and_leave_the_shard_waiting(tmp_path):
    stats = run_init_fuzz(tmp_path, SEED, INIT_CASES)
    assert stats.get("INVALID_ARGUMENT", 0) > INIT_CASES // 4, stats


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [SEED + 1, SEED + 2, SEED + 3])
def test_fuzzed_uploads_many_more_cases(tmp_path, seed):
    run_init_fuzz(tmp_path, seed, INIT_SLOW_CASES)


# --- the worker's side: what a hostile shard sends ---------------------------------------------------------
# Join replies, the session's Welcome and update chunks, and Fetch streams, mutated, through the worker's own
# readers (worker/connection.py's take_reply, worker/session.py's Updates, common/fetch.py's fetch_slices):
# each either
# raises the project's clear error (SyncError, FetchError: one bounded line) or accepts, never anything
# else; what is accepted is sane (a Join's shard index and chunk size, an update's or a master's values
# finite and within MAX_ABS_VALUE), and a mirror that takes every accepted update stays finite. The buffers
# of updates under way stay within their bound. No network: the readers are fed directly.
WORKER_CASES = 300  # `make test`; test-slow runs 3 seeds of WORKER_SLOW_CASES
WORKER_SLOW_CASES = 10_000


class _Stub:
    """A Fetch that answers call i with streams[i] (the last one again after that)."""

    def __init__(self, streams: list[list[pb.MasterChunk]]):
        self.streams, self.calls = streams, 0

    def Fetch(self, request, metadata=None, timeout=None):
        self.calls += 1
        return iter(self.streams[min(self.calls, len(self.streams)) - 1])


def honest_reply() -> pb.JoinReply:
    return pb.JoinReply(
        config_json=json.dumps(CFG.to_dict()),
        shard=0,
        num_shards=2,
        slices=[pb.SliceRange(offset=lo, length=hi - lo) for lo, hi in _RANGES],
        rounds=[0, 0, 0],
        session="s",
        chunk_values=512,
    )


def honest_masters(rng: random.Random, fragments: list[int]) -> list[pb.MasterChunk]:
    out, per = [], rng.choice([128, 1000, 4096])
    for f in fragments:
        n = SLICE_LEN[f]
        x = _INITIAL[f][_RANGES[f][0] : _RANGES[f][1]]
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            out.append(
                pb.MasterChunk(
                    fragment=f, round=3, offset=lo, total=n, values=x[lo:hi].numpy().tobytes(), last=hi == n
                )
            )
    return out


class WorkerFuzzer:
    def __init__(self, seed: int):
        self.seed, self.rng = seed, random.Random(seed)
        self.stats: dict[str, int] = {}

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def run_case(self, i: int) -> None:
        case = Case(self.seed, i)
        kind = self.rng.choice(["join", "updates", "updates", "fetch"])
        case.say(kind)
        self.count(kind)
        getattr(self, f"case_{kind}")(case)

    def refused(self, case: Case, e: Exception) -> None:
        assert isinstance(e, SyncError | FetchError), f"{type(e).__name__}: {e} {case}"
        assert one_bounded_line(str(e)), f"not one bounded line: {str(e)[:300]!r} {case}"
        self.count("refused")

    # --- Join ---
    def case_join(self, case: Case) -> None:
        rng, reply = self.rng, honest_reply()
        for _ in range(rng.choice([1, 2])):
            what = rng.choice(["config", "shard", "num_shards", "slices", "chunk_values", "uninitialized"])
            if what == "config":
                cfg = CFG.to_dict()
                key = rng.choice(list(cfg))
                cfg[key] = rng.choice([None, 0, -1, 2**70, "x" * 1000, [], {}, 1e308, math.nan, True, "e3m0"])
                reply.config_json = rng.choice(
                    [
                        json.dumps(cfg),
                        reply.config_json[: rng.randrange(max(1, len(reply.config_json)))],  # may be empty
                        "[1]",
                        "1",
                        "null",
                        "{" * 100_000,
                        some_string(rng),
                    ]  # fmt: skip
                )
            elif what in ("shard", "num_shards", "chunk_values"):
                setattr(reply, what, rng.choice(U32))
            elif what == "slices":
                del reply.slices[rng.randrange(3) :]
                for _ in range(rng.choice([0, 1, 5])):
                    reply.slices.append(pb.SliceRange(offset=rng.choice(U64), length=rng.choice(U64)))
            else:
                reply.uninitialized = not reply.uninitialized
            case.say(what)
        conn = ShardConnection("127.0.0.1:9", "fz", {})  # never connected: its checks only
        try:
            config = conn.take_reply(reply, config_only=rng.random() < 0.2)
        except Exception as e:  # noqa: BLE001 - the fuzzer's point: which ones
            self.refused(case, e)
            return
        finally:
            conn.close()
        assert isinstance(config, SyncConfig), str(case)
        if conn.config is not None:
            assert 0 <= conn.shard < conn.num_shards and conn.chunk_values > 0, str(case)

    # --- a session: its Welcome and update chunks ---
    def case_updates(self, case: Case) -> None:
        rng = self.rng
        slices = [(lo, hi - lo) for lo, hi in _RANGES]
        welcome = pb.Welcome(
            rounds=[rng.choice([0, 0, 5, 2**64 - 1]) for _ in range(rng.choice([3, 3, 0, 4]))]
        )
        updates = Updates(0, slices, CFG, welcome, "shard 0 at fz")
        rounds = [min(r, 2**40) for r in updates.rounds]
        chunks: list[pb.Chunk] = []
        for _ in range(rng.choice([1, 2, 4])):
            f = rng.randrange(3)
            delta = torch.randn(SLICE_LEN[f], generator=torch.Generator().manual_seed(rng.randrange(1000)))
            enc = encode(delta * rng.choice([1e-3, 1.0, 1e29]), CFG.downlink_codec, CFG.codec_block_size)
            chunks += to_chunks(enc, f, rounds[f], rng.choice([128, 512, 4096]))
            rounds[f] += 1
        for _ in range(rng.choice([1, 1, 2, 3])):
            if rng.random() < 0.3:
                mutate_list(rng, chunks, case)
            else:
                mutate_chunk(rng, chunks[rng.randrange(len(chunks))], case)
        mirrors = [_INITIAL[f][lo:hi].clone() for f, (lo, hi) in enumerate(_RANGES)]
        for c in chunks:
            try:
                done = updates.take(c)
            except Exception as e:  # noqa: BLE001
                self.refused(case, e)
                break
            assert len(updates.partial) <= MAX_UPDATES_UNDER_WAY * 3, str(case)
            if done is not None:
                f, _, parts = done
                assert sum(p.numel for _, p in parts) == SLICE_LEN[f], str(case)
                for off, p in parts:  # as the engine adds an update into its mirror (worker/fragment.py)
                    add_into(p, mirrors[f][off : off + p.numel])
                self.count("update taken")
        for m in mirrors:
            top = float(m.abs().amax())
            assert math.isfinite(top), f"a mirror is not finite {case}"

    # --- Fetch ---
    def case_fetch(self, case: Case) -> None:
        rng = self.rng
        fragments = rng.sample([0, 1, 2], rng.choice([1, 2, 3]))
        streams = [honest_masters(rng, fragments) for _ in range(rng.choice([1, 2]))]
        for _ in range(rng.choice([1, 1, 2, 3])):
            stream = streams[rng.randrange(len(streams))]
            if rng.random() < 0.3:
                mutate_list(rng, stream, case)
                continue
            c = stream[rng.randrange(len(stream))]
            what = rng.choice(["fragment", "round", "offset", "total", "values", "last"])
            if what == "fragment":
                c.fragment = rng.choice(U32 + [(c.fragment + 1) % 3])
            elif what in ("round", "offset", "total"):
                here = getattr(c, what)
                setattr(c, what, min(rng.choice(U64 + [max(here - 1, 0), here + 1, here + 128]), 2**64 - 1))
            elif what == "values":
                c.values = float_bytes(rng, len(c.values))
            else:
                c.last = not c.last
            case.say(what)
        try:
            got = fetch_slices(_Stub(streams), {f: SLICE_LEN[f] for f in fragments}, where="shard 0 at fz")
        except Exception as e:  # noqa: BLE001
            self.refused(case, e)
            return
        self.count("fetch taken")
        assert sorted(got.slices) == sorted(fragments), str(case)
        for f, x in got.slices.items():
            top = float(x.abs().amax()) if x.numel() else 0.0
            assert x.numel() == SLICE_LEN[f] and math.isfinite(top) and top <= MAX_ABS_VALUE, str(case)


def run_worker_fuzz(seed: int, cases: int) -> dict:
    fuzzer = WorkerFuzzer(seed)
    for i in range(cases):
        fuzzer.run_case(i)
    return fuzzer.stats


@pytest.mark.timeout(120)
def test_what_a_hostile_shard_sends_is_refused_cleanly_by_the_worker():
    stats = run_worker_fuzz(SEED, WORKER_CASES)
    # every reader was reached, with both outcomes
    assert all(
        stats.get(k, 0) > 0 for k in ("join", "updates", "fetch", "refused", "update taken", "fetch taken")
    ), stats


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [SEED + 1, SEED + 2, SEED + 3])
def test_what_a_hostile_shard_sends_many_more_cases(seed):
    run_worker_fuzz(seed, WORKER_SLOW_CASES)
