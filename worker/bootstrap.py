"""Before a worker joins: what a shard says of its run (probe), and the first worker's upload of its
starting parameters to a shard started without any (server --init from-worker), or the wait for another
worker's.

One start in every shard: the shards say the run's init hash at Join (common/inithash.py). A worker uploads
only to shards without parameters, and only while no shard holds another start than its own values'
(`give_parameters`); so a worker with the same model and seed completes an upload that another began and
left (it died between shards), and one with other values never uploads: it waits, then says whose start
the run needs, and takes the run's values by Fetch as any joining worker. Shards that say two init hashes
hold a mix: `check_one_start` refuses to join them, in one line.

A shard's slot for the upload is held by one upload at a time, and only at a pace (server/edge/initialize.py):
an upload told that another holds it (ABORTED), cut off by a flood of calls (RESOURCE_EXHAUSTED), by the
network (UNAVAILABLE) or for falling behind (DEADLINE_EXCEEDED) is sent again after a backoff, saying so,
until the shard has parameters (then this worker joins as any other) or the upload's time is spent.

Nothing a shard says here is taken on trust: its index and shard count must make a run that --servers lists
whole (`check_run`), the init hash it says must be one, and what it says in a refusal goes into the log and
the error escaped and shortened. Every call has a deadline; a shard that stalls or refuses forever costs
the worker --join-timeout plus its upload's time, and a one-line error.

These are one-shot calls, each on a channel of its own; they must not keep a session or any state (joining
is worker/join.py's, the session worker/link.py's).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import torch

from streamdiloco.common.backoff import Backoff
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout, slice_ranges
from streamdiloco.common.inithash import init_hash, parse_init_hash
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.logs import escaped
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
    init_hash: str = ""  # the run's init hash, if the shard took a worker's upload


def probe_shard(
    target: str, worker: str, token: str = "", timeout: float = 60.0, tls: ClientTLS | None = None
) -> ShardInfo:
    """The shard's ShardInfo (a Join that asks only for the run's config)."""
    conn = ShardConnection(target, worker, {}, token=token, join_timeout=timeout, tls=tls)
    try:
        config = conn.join(config_only=True)
        assert conn.probed is not None
        shard, num_shards, uninitialized, said = conn.probed
    finally:
        conn.close()
    if not 0 <= shard < num_shards:
        raise SyncError(f"shard at {target} sent an unusable Join reply (shard {shard} of {num_shards})")
    try:
        said = parse_init_hash(said) if said else ""
    except ValueError:
        raise SyncError(
            f"shard at {target} sent an unusable Join reply: its init hash {said[:80]!r} is not 64 hex digits"
        ) from None
    return ShardInfo(config, shard, num_shards, uninitialized, said)


# fp32 values per Initialize message: 256 KiB, 2 s over 1 Mbit/s, 16 s at the shard's --init-min-rate (a
# message whose values have not all come does not count: the shard refuses 30 s, --init-timeout, without one)
INIT_CHUNK_VALUES = 1 << 16
# The upload's channel notices a dead shard within this many seconds (common/keepalive.py). An uploader hears
# from the shard only its window updates, one per 2 MiB it reads (its 4 MiB receive window): 16 s apart at
# 1 Mbit/s, 64 s at MIN_UPLOAD_RATE. So it pings, after a third of this bound without one, and that ping waits
# behind the up to 4 MiB it has queued: 34 s at 1 Mbit/s, 128 s at MIN_UPLOAD_RATE, where the default bound
# (10 s) gives it 6.7 s and cut every upload over 1 Mbit/s after about 10 s. 300 s: a ping after 100 s of
# silence, 200 s for its ack.
UPLOAD_LIVENESS = 300.0
# bytes a second of the slowest upload a worker goes on with (262 kbit/s): its patience is --join-timeout and
# its values' time at this rate (a 40 MB upload: 60 s + 20 min; it takes 5.3 min over 1 Mbit/s). Twice the
# shard's --init-min-rate (16 KiB/s), so that a worker gives up on its own slow link before a shard would.
MIN_UPLOAD_RATE = 1 << 15
# what a shard may answer an upload that is worth sending again, and what it means
RETRIED = {
    grpc.StatusCode.ABORTED: "another worker's upload holds the shard's only upload slot",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the shard is at its limit of calls",
    grpc.StatusCode.UNAVAILABLE: "the connection broke",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the upload fell behind the shard's pace, or its own deadline",
}
SAID_CHARS = 300  # of what a shard says in a refusal, at most, in a log line or an error


def said(e: grpc.RpcError) -> str:
    """What a shard said in refusing a call: one line, escaped, shortened (it may say anything)."""
    text = escaped(e.details() or "")
    return text if len(text) <= SAID_CHARS else text[:SAID_CHARS] + "..."


def init_messages(
    head: pb.InitChunk, vectors: list[torch.Tensor], slices: list[tuple[int, int]]
) -> Iterator[pb.InitChunk]:
    """An upload's Initialize messages: `head` alone (who, the fingerprint, the init hash and the slices'
    hashes: the call's request, which a shard wants within --request-timeout, 5 s, and which a MiB of values
    would make 8 s long over 1 Mbit/s), each fragment's slice in INIT_CHUNK_VALUES pieces, the last mark."""
    yield head
    for f, (vec, (lo, hi)) in enumerate(zip(vectors, slices, strict=True)):
        for a in range(lo, hi, INIT_CHUNK_VALUES):
            b = min(hi, a + INIT_CHUNK_VALUES)
            yield pb.InitChunk(fragment=f, offset=a - lo, values=values_to_bytes(vec[a:b]))
    yield pb.InitChunk(last=True)


def initialize_shard(
    target: str,
    worker: str,
    fingerprint: dict,
    vectors: list[torch.Tensor],
    info: ShardInfo,
    init: tuple[str, list[bytes]],
    token: str = "",
    timeout: float = 60.0,
    tls: ClientTLS | None = None,
) -> bool:
    """Send this worker's starting parameters (`vectors`: its fragments, flat) to a shard that has none: its
    slice of each fragment, after the fingerprint and `init` (their init hash and every slice's hash:
    common/inithash.py). True once the shard has them (and has written them to its checkpoint); False when
    another worker's upload got there first (this one then joins as any worker and is checked against that
    worker's fingerprint). A refusal of RETRIED is sent again after a backoff, saying so, for up to
    `timeout` plus the upload's time at MIN_UPLOAD_RATE. SyncError when the shard refuses them, or
    still has none by then."""
    slices = [slice_ranges(vec.numel(), info.num_shards)[info.shard] for vec in vectors]
    head = pb.InitChunk(worker=worker, token=token, fingerprint_json=json.dumps(fingerprint))
    head.init_hash, head.slice_hashes[:] = init
    # `timeout`, and time to send the values at MIN_UPLOAD_RATE at least: a large model's upload is no Join
    patience = timeout + 4 * sum(hi - lo for lo, hi in slices) / MIN_UPLOAD_RATE
    give_up, backoff = time.monotonic() + patience, Backoff(first=1.0)
    with make_channel(parse_target(target), tls, LinkSettings(liveness_timeout=UPLOAD_LIVENESS)) as channel:
        stub = pb_grpc.ShardStub(channel)
        attempt = 0
        while True:
            attempt += 1
            try:
                left = max(1.0, give_up - time.monotonic())
                stub.Initialize(
                    init_messages(head, vectors, slices), metadata=auth_metadata(token), timeout=left
                )
                log.info(
                    "%s: sent its starting parameters to the shard at %s, which had none", worker, target
                )
                return True
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    return False
                refusal = f"{code.name}: {said(e)}"
                if code not in RETRIED:
                    raise SyncError(
                        f"shard at {target} refused this worker's starting parameters: {refusal}"
                    ) from None
            wait = backoff.next()
            if time.monotonic() + wait >= give_up:
                raise SyncError(
                    f"the shard at {target} still has no parameters after {patience:.0f} s of trying to send "
                    f"them ({attempt} attempts; the last: {refusal}): if another worker's upload held the "
                    "slot, start this one again once it is done"
                )
            log.info(
                "%s: shard at %s: %s (%s); sending again in %.1f s",
                worker,
                target,
                RETRIED[code],
                refusal,
                wait,
            )
            time.sleep(wait)
            again = probe_shard(
                target, worker, token, min(timeout, max(0.1, give_up - time.monotonic())), tls
            )
            if (again.shard, again.num_shards) != (info.shard, info.num_shards):
                raise SyncError(f"the shard at {target} came back as another shard of another run")
            if not again.uninitialized:  # another worker's upload went in meanwhile
                return False


def wait_initialized(
    target: str,
    worker: str,
    token: str = "",
    timeout: float = 60.0,
    tls: ClientTLS | None = None,
    fix: str = "if the worker that was sending them stopped, start it again (same model and seed)",
) -> ShardInfo:
    """Wait until another worker's upload has given the shard its parameters (its ShardInfo then); SyncError
    after `timeout`, saying `fix`."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        info = probe_shard(target, worker, token, max(0.1, give_up - time.monotonic()), tls)
        if not info.uninitialized:
            return info
        time.sleep(0.2)
    raise SyncError(f"the shard at {target} still has no parameters after {timeout:g} s: {fix}")


def check_run(targets: list[str], infos: list[ShardInfo]) -> None:
    """SyncError unless the shards make one run that `targets` lists whole: each says the same number of
    shards, len(targets), and its own index (so a shard cannot make a worker hash or slice its values for
    2^32 shards)."""
    if sorted(i.shard for i in infos) != list(range(len(targets))) or any(
        i.num_shards != len(targets) for i in infos
    ):
        got = ", ".join(f"{t} is shard {i.shard}/{i.num_shards}" for t, i in zip(targets, infos, strict=True))
        raise SyncError(f"--servers must list each of the run's shards once: {got}")


def check_one_start(targets: list[str], infos: list[ShardInfo]) -> str | None:
    """The run's init hash (None: no shard took a worker's upload); SyncError when two shards say two: they
    started from two workers' values, a mix that no worker may train; or when they make no run (check_run)."""
    check_run(targets, infos)
    told = {(t, i.init_hash) for t, i in zip(targets, infos, strict=True) if i.init_hash}
    hashes = sorted({h for _, h in told})
    if len(hashes) > 1:
        where = ", ".join(f"{t} {h[:16]}..." for t, h in sorted(told))
        raise SyncError(
            f"the shards started from different parameters (init hashes {where}): two workers' uploads; "
            "start every shard again with --fresh (and --init-expect to pin one)"
        )
    return hashes[0] if hashes else None


def give_parameters(
    targets: list[str],
    infos: list[ShardInfo],
    worker: str,
    layout: FragmentLayout,
    fingerprint: dict,
    vectors: list[torch.Tensor],
    token: str = "",
    timeout: float = 60.0,
    tls: ClientTLS | None = None,
) -> None:
    """Shards without parameters get this worker's (`vectors`, its fragments flat), while they are the
    run's start: no shard holds another init hash. Others' shards are waited for. SyncError when the
    shards hold (or would hold) two starts, or one stays without parameters past `timeout`."""
    run = check_one_start(targets, infos)
    init = init_hash(layout, vectors, infos[0].num_shards)
    log.info("%s: the init hash of its starting parameters is %s", worker, init[0])
    # in the shards' order, whatever the order of --servers: every uploader tries shard 0 first, so that
    # two at once do not each take one shard
    for t, info in sorted(zip(targets, infos, strict=True), key=lambda pair: pair[1].shard):
        if not info.uninitialized:
            continue
        if run is not None and run != init[0]:  # another worker's start: its uploader's to complete
            fix = (
                f"the run started from init hash {run[:16]}..., and this worker's values are not those "
                f"({init[0][:16]}...): start a worker with the run's model and seed, which completes the "
                "upload, or every shard again with --fresh"
            )
            wait_initialized(t, worker, token, timeout, tls, fix)
        elif initialize_shard(t, worker, fingerprint, vectors, info, init, token, timeout, tls):
            run = init[0]
        elif run is None:  # another worker's upload got there first: its start is the run's
            run = probe_shard(t, worker, token, timeout, tls).init_hash or None
    check_one_start(targets, [probe_shard(t, worker, token, timeout, tls) for t in targets])
