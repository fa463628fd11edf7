"""The worker's side of the wire: one background session per shard, and the Transport the engine uses.

Each ShardLink joins its shard, then keeps a bidirectional Session open: pushes are cut into chunks and
queued (the training thread never waits for the network), and a receiver thread assembles the updates that
come down and wakes whoever waits for them. GrpcTransport bundles the links of all S shards, ordered by
shard index, and is what SyncEngine calls.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

import grpc
import torch

from streamdiloco.common.codecs import Encoded, concat, expected_sizes, get_codec
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.wire import (
    PROTOCOL,
    bytes_to_values,
    from_chunk,
    make_channel,
    parse_target,
    to_chunks,
)
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

log = logging.getLogger("streamdiloco.worker")


WAIT_LOG_SECONDS = 30.0  # log while waiting this long for an update


class SyncError(RuntimeError):
    """The session with a shard failed: the worker cannot go on syncing."""


class ShardLink:
    def __init__(
        self,
        target: str,
        worker: str,
        fingerprint: dict,
        token: str = "",
        join_timeout: float = 60.0,
    ):
        self.target, self.worker, self.token = parse_target(target), worker, token
        self.channel = make_channel(self.target)
        self.stub = pb_grpc.ShardStub(self.channel)
        try:
            reply = self.stub.Join(
                pb.JoinRequest(
                    worker=worker, token=token, fingerprint_json=json.dumps(fingerprint), protocol=PROTOCOL
                ),
                timeout=join_timeout,
                wait_for_ready=True,  # the shard may still be starting
            )
        except grpc.RpcError as e:
            self.channel.close()
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise SyncError(
                    f"no answer from a shard at {self.target} within {join_timeout:g} s"
                ) from None
            raise SyncError(f"shard at {self.target} refused Join: {e.code().name}: {e.details()}") from None
        try:
            self.config = SyncConfig.from_dict(json.loads(reply.config_json))
        except (ValueError, TypeError) as e:
            self.channel.close()
            raise SyncError(f"shard at {self.target} sent a config this worker cannot read: {e}") from None
        if any(reply.rounds):
            self.channel.close()
            raise SyncError(
                f"the run at {self.target} is in progress (open rounds {list(reply.rounds)}): joining a run "
                "in progress is not supported yet; start the workers together, or restart the shards"
            )
        self.shard, self.num_shards = reply.shard, reply.num_shards
        self.slices = [(s.offset, s.length) for s in reply.slices]
        self.chunk_values = reply.chunk_values
        self._outbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._updates: dict[tuple[int, int], Encoded] = {}
        self._partial: dict[tuple[int, int], list[Encoded]] = {}
        self.refusals: list[pb.PushResult] = []
        self.error: str | None = None
        self.msg_out = 0
        self.msg_in = 0
        self._closing = False
        self._call = self.stub.Session(self._requests(reply.session))
        self._receiver = threading.Thread(target=self._receive, name=f"shard{self.shard}-rx", daemon=True)
        self._receiver.start()

    def _requests(self, session: str):
        hello = pb.WorkerMessage(hello=pb.Hello(worker=self.worker, session=session))
        self.msg_out += hello.ByteSize()
        yield hello
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            self.msg_out += msg.ByteSize()
            yield msg

    def _receive(self) -> None:
        try:
            for msg in self._call:
                self.msg_in += msg.ByteSize()
                kind = msg.WhichOneof("kind")
                if kind == "update":
                    self._on_update(msg.update)
                elif kind == "result" and not msg.result.accepted:
                    self._on_refused(msg.result)
            if not self._closing:
                self._fail(f"shard {self.shard} at {self.target} ended the session")
        except grpc.RpcError as e:
            if not self._closing:
                self._fail(
                    f"session with shard {self.shard} at {self.target} broke: {e.code().name}: {e.details()}"
                )
        except SyncError as e:
            self._fail(str(e))
        except Exception as e:  # a malformed message must not end the thread silently
            self._fail(f"shard {self.shard} sent what this worker cannot read: {type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        with self._cond:
            self.error = message
            self._cond.notify_all()
        log.error(message)

    def _on_refused(self, r: pb.PushResult) -> None:
        self.refusals.append(r)
        if r.reason == "late":  # the round closed without us: its update still comes, and we apply it
            log.warning("shard %d: %s", self.shard, r.message)
        else:
            self._fail(f"shard {self.shard} refused a push ({r.reason}): {r.message}")

    def _on_update(self, c: pb.Chunk) -> None:
        key = (c.fragment, c.round)
        if not 0 <= c.fragment < len(self.slices):
            raise SyncError(f"shard {self.shard} sent an update for unknown fragment {c.fragment}")
        want_total = self.slices[c.fragment][1]
        parts = self._partial.setdefault(key, [])
        at = sum(p.numel for p in parts)
        if c.codec != self.config.downlink_codec or c.block_size != (
            self.config.codec_block_size if get_codec(self.config.downlink_codec).scaled else 0
        ):
            raise SyncError(
                f"shard {self.shard} sent an update in {c.codec!r} with block size {c.block_size}"
            )
        part = from_chunk(c)
        payload, scales = expected_sizes(c.codec, c.numel, c.block_size or 1)
        if (
            c.total != want_total
            or c.offset != at
            or c.seq != len(parts)
            or part.payload.numel() != payload
            or part.scales.numel() != scales
            or c.last != (at + c.numel == want_total)
        ):
            raise SyncError(
                f"shard {self.shard} sent a malformed update chunk for fragment {c.fragment} round {c.round}"
            )
        parts.append(part)
        if c.last:
            del self._partial[key]
            with self._cond:
                self._updates[key] = concat(parts)
                self._cond.notify_all()

    # --- what the transport calls ----------------------------------------------------------------------
    def push(self, fragment: int, round: int, enc: Encoded, weight: float, loss: float | None) -> None:
        if self.error:
            raise SyncError(self.error)
        header = pb.PushHeader(weight=weight, has_loss=loss is not None, loss=loss or 0.0)
        for chunk in to_chunks(enc, fragment, round, self.chunk_values):
            self._outbox.put(
                pb.WorkerMessage(push=pb.Push(chunk=chunk, header=header if chunk.seq == 0 else None))
            )

    def has_update(self, fragment: int, round: int) -> bool:
        with self._cond:
            return (fragment, round) in self._updates

    def wait_update(self, fragment: int, round: int, timeout: float | None = None) -> Encoded:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (fragment, round) not in self._updates:
                if self.error:
                    raise SyncError(self.error)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SyncError(
                        f"no update for fragment {fragment} round {round} from shard {self.shard}"
                    )
                if not self._cond.wait(min(left, WAIT_LOG_SECONDS) if left is not None else WAIT_LOG_SECONDS):
                    log.info(
                        "still waiting for fragment %d round %d from shard %d (a round waits for every "
                        "member's push or its deadline, and for --min-workers members)",
                        fragment,
                        round,
                        self.shard,
                    )
            enc = self._updates.pop((fragment, round))
            for key in [k for k in self._updates if k[0] == fragment and k[1] < round]:
                del self._updates[key]  # rounds we joined too late for
            return enc

    def fetch(self, fragments: list[int] | None = None, attempts: int = 3) -> dict[int, torch.Tensor]:
        """The current master slices (fp32), resuming from the last chunk received if the stream breaks."""
        want = list(fragments) if fragments is not None else list(range(len(self.slices)))
        got: dict[int, list[torch.Tensor]] = {f: [] for f in want}
        rounds: dict[int, int] = {}  # the round each fragment's chunks so far belong to
        done: set[int] = set()
        for attempt in range(attempts):
            todo = [f for f in want if f not in done]
            if not todo:
                break
            offset = sum(t.numel() for t in got[todo[0]])
            try:
                request = pb.FetchRequest(fragments=todo, offset=offset, token=self.token)
                call = self.stub.Fetch(request)  # no deadline: big models on slow links take long
                for m in call:
                    self.msg_in += m.ByteSize()
                    if m.fragment not in got or m.offset != sum(t.numel() for t in got[m.fragment]):
                        raise SyncError(
                            f"shard {self.shard} sent fragment {m.fragment} out of order in Fetch"
                        )
                    if rounds.setdefault(m.fragment, m.round) != m.round:
                        # a round closed between a broken stream and its resumption: fetch it anew
                        got[m.fragment], rounds[m.fragment] = [], m.round
                        call.cancel()
                        break
                    got[m.fragment].append(bytes_to_values(m.values))
                    if m.last:
                        done.add(m.fragment)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED:
                    continue  # we cancelled it, to start the fragment again
                if attempt + 1 == attempts or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise SyncError(
                        f"Fetch from shard {self.shard} failed: {e.code().name}: {e.details()}"
                    ) from None
                time.sleep(0.5 * (attempt + 1))
        out = {f: torch.cat(got[f]) if got[f] else torch.empty(0) for f in want}
        for f, t in out.items():
            if t.numel() != self.slices[f][1]:
                raise SyncError(
                    f"shard {self.shard} sent {t.numel()} values of fragment {f}, want {self.slices[f][1]}"
                )
        return out

    def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        self._outbox.put(None)
        self._receiver.join(timeout)
        if self._receiver.is_alive():
            self._call.cancel()
        self.channel.close()


class GrpcTransport:
    """The engine's Transport over gRPC: one ShardLink per shard, ordered by shard index."""

    def __init__(self, links: list[ShardLink]):
        by_index = sorted(links, key=lambda link: link.shard)
        num = by_index[0].num_shards
        if [link.shard for link in by_index] != list(range(num)) or any(
            link.num_shards != num for link in by_index
        ):
            got = ", ".join(f"{link.target} is shard {link.shard}/{link.num_shards}" for link in links)
            raise SyncError(f"--servers must list each of the run's shards once: {got}")
        self.links, self.num_shards = by_index, num

    @classmethod
    def connect(
        cls, targets: list[str], worker: str, fingerprint: dict, token: str = "", join_timeout: float = 60.0
    ) -> GrpcTransport:
        links: list[ShardLink] = []
        try:
            for t in targets:
                links.append(ShardLink(t, worker, fingerprint, token, join_timeout))
            return cls(links)
        except BaseException:
            for link in links:
                link.close()
            raise

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        for link, enc in zip(self.links, slices, strict=True):
            link.push(fragment, round, enc, weight, loss)

    def update(self, fragment: int, round: int) -> list[Encoded]:
        return [link.wait_update(fragment, round) for link in self.links]

    def ready(self, fragment: int, round: int) -> bool:
        return all(link.has_update(fragment, round) for link in self.links)

    def fetch(self, num_fragments: int) -> list[torch.Tensor]:
        """Every fragment's full master vector, joined from all shards' slices."""
        parts = [link.fetch(list(range(num_fragments))) for link in self.links]
        return [torch.cat([p[f] for p in parts]) for f in range(num_fragments)]

    @property
    def message_bytes(self) -> tuple[int, int]:
        """Serialized protobuf bytes sent and received (gRPC and HTTP/2 framing not included)."""
        return sum(link.msg_out for link in self.links), sum(link.msg_in for link in self.links)

    def close(self) -> None:
        for link in self.links:
            link.close()


def fetch_masters(targets: list[str], token: str = "", timeout: float = 60.0) -> list[torch.Tensor]:
    """The run's global parameters, fragment by fragment, read from the shards listed in shard order
    (no Join: Fetch is read-only). For tools and tests; workers fetch through their links."""
    per_shard: list[dict[int, list[torch.Tensor]]] = []
    for target in targets:
        with make_channel(parse_target(target)) as channel:
            got: dict[int, list[torch.Tensor]] = {}
            for m in pb_grpc.ShardStub(channel).Fetch(pb.FetchRequest(token=token), timeout=timeout):
                got.setdefault(m.fragment, []).append(bytes_to_values(m.values))
            per_shard.append(got)
    return [torch.cat([torch.cat(s[f]) for s in per_shard]) for f in sorted(per_shard[0])]


def connect(
    model: torch.nn.Module,
    servers: list[str] | str,
    sync: SyncConfig | None = None,
    total_steps: int | None = None,
    name: str | None = None,
    token: str = "",
    seed: int = 0,
    rank: int = 0,
    join_timeout: float = 60.0,
):
    """Join a run around your own model and loop. Joins every shard (the model's fingerprint must match
    theirs), sets the model's parameters to the run's global ones, and returns the SyncEngine: call its
    `step(tokens, loss)` right after every `inner_optimizer.step()`, and `close()` at the end.

    `sync` must equal the shards' Streaming DiLoCo settings (default: SyncConfig()); `total_steps` lets the
    engine sync every fragment at the last step (final_sync)."""
    import os
    import socket

    from streamdiloco.common.fingerprint import model_fingerprint
    from streamdiloco.common.fragments import build_layout, fragment_params, unflatten_into
    from streamdiloco.worker.engine import SyncEngine

    sync = sync or SyncConfig()
    targets = [s.strip() for s in servers.split(",")] if isinstance(servers, str) else list(servers)
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    layout = build_layout(model, sync.num_fragments, sync.fragment_pattern)
    transport = GrpcTransport.connect(targets, name, model_fingerprint(layout, sync), token, join_timeout)
    try:
        masters = transport.fetch(layout.num_fragments)
        with torch.no_grad():
            for frag, vec in zip(layout.fragments, masters, strict=True):
                unflatten_into(vec, fragment_params(model, frag))
        return SyncEngine(model, layout, sync, transport, total_steps=total_steps, seed=seed, rank=rank)
    except BaseException:
        transport.close()
        raise
