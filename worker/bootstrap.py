"""Before a worker joins: what a shard says of its run (probe), and the first worker's upload of its
starting parameters to a shard started without any (server --init from-worker), or the wait for another
worker's.

These are one-shot calls, each on a channel of its own; they must not keep a session or any state (joining
is worker/join.py's, the session worker/link.py's).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import slice_ranges
from streamdiloco.common.tls import ClientTLS
from streamdiloco.common.wire import auth_metadata, make_channel, parse_target, values_to_bytes
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.worker.connection import ShardConnection, SyncError

log = logging.getLogger("streamdiloco.worker")


@dataclass(frozen=True)
class ShardInfo:
    """What a shard says before a worker joins: the run's settings, its index, and whether it still waits
    for its first worker's parameters (server --init from-worker)."""

    config: SyncConfig
    shard: int
    num_shards: int
    uninitialized: bool


def probe_shard(
    target: str, worker: str, token: str = "", timeout: float = 60.0, tls: ClientTLS | None = None
) -> ShardInfo:
    """The shard's ShardInfo (a Join that asks only for the run's config)."""
    conn = ShardConnection(target, worker, {}, token=token, join_timeout=timeout, tls=tls)
    try:
        config = conn.join(config_only=True)
        assert conn.probed is not None
        return ShardInfo(config, *conn.probed)
    finally:
        conn.close()


INIT_CHUNK_VALUES = 1 << 18  # fp32 values per Initialize message: 1 MiB


def initialize_shard(
    target: str,
    worker: str,
    fingerprint: dict,
    vectors: list[torch.Tensor],
    info: ShardInfo,
    token: str = "",
    timeout: float = 60.0,
    tls: ClientTLS | None = None,
) -> bool:
    """Send this worker's starting parameters (`vectors`: its fragments, flat) to a shard that has none: its
    slice of each fragment, after the fingerprint. True once the shard has them (and has written them to its
    checkpoint); False when another worker's upload got there first (this one then joins as any worker and
    is checked against that worker's fingerprint). SyncError when the shard refuses them."""
    first = {"worker": worker, "token": token, "fingerprint_json": json.dumps(fingerprint)}

    def chunks():
        head = first
        for f, vec in enumerate(vectors):
            lo, hi = slice_ranges(vec.numel(), info.num_shards)[info.shard]
            for a in range(lo, hi, INIT_CHUNK_VALUES):
                b = min(hi, a + INIT_CHUNK_VALUES)
                yield pb.InitChunk(**head, fragment=f, offset=a - lo, values=values_to_bytes(vec[a:b]))
                head = {}
        yield pb.InitChunk(**head, last=True)

    give_up = time.monotonic() + timeout
    with make_channel(parse_target(target), tls) as channel:
        try:
            pb_grpc.ShardStub(channel).Initialize(chunks(), metadata=auth_metadata(token), timeout=timeout)
            log.info("%s: sent its starting parameters to the shard at %s, which had none", worker, target)
            return True
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.ALREADY_EXISTS:
                return False
            if code != grpc.StatusCode.ABORTED:  # ABORTED: another worker is sending them now
                raise SyncError(
                    f"shard at {target} refused this worker's starting parameters: {code.name}: {e.details()}"
                ) from None
    wait_initialized(target, worker, token, max(0.1, give_up - time.monotonic()), tls)
    return False


def wait_initialized(
    target: str, worker: str, token: str = "", timeout: float = 60.0, tls: ClientTLS | None = None
) -> None:
    """Wait until another worker's upload has given the shard its parameters; SyncError after `timeout`."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if not probe_shard(target, worker, token, max(0.1, give_up - time.monotonic()), tls).uninitialized:
            return
        time.sleep(0.2)
    raise SyncError(
        f"the shard at {target} still has no parameters after {timeout:g} s: if the worker that was sending "
        "them stopped, start every shard again with --fresh"
    )
