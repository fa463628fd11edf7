"""Part (b)'s load, in processes of their own (`python -m benchmarks.wire _ROLE ...`, started by ingest.py):
`_grpc-client` joins the shards with worker.link.ShardLink and pushes the same E3M0 slice every round,
waiting for the round's update; `_tcp-sender` sends the same bytes over a plain TCP socket to the
`_tcp-receiver`, one asyncio process that reads and discards them, or also decodes and sums them like the
shard, or also runs the outer step and sends the update back (the references of the shard's ingest rate).

Also the plan they share with the parent (the fragment, its size, the chunks' cut) and the payload file.
Each role writes its timings (per round: start, end, CPU) to a JSON file; the figures are computed by the
parent (ingest.py), never here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from streamdiloco.common.atomic import atomic_write_text
from streamdiloco.common.codecs import CODECS, Encoded, chunk_values, decode, encode, expected_sizes
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, slice_ranges
from streamdiloco.common.modelspec import build_model

ROLES = ("_grpc-client", "_tcp-sender", "_tcp-receiver")


def ingest_plan(model: str, fragment: int) -> dict:
    """What every client pushes: `fragment` of `model` (the run's defaults), E3M0 in chunks as a worker
    cuts them; the fingerprint the shard asks of a Join."""
    cfg = SyncConfig()
    layout = build_layout(build_model(model, 0), cfg.num_fragments, cfg.fragment_pattern)
    numel = layout.fragments[fragment].numel
    return {
        "model": model,
        "fragment": fragment,
        "numel": numel,
        "codec_bytes": CODECS["e3m0"].encoded_nbytes(numel, cfg.codec_block_size),
        "block_size": cfg.codec_block_size,
        "chunk_values": chunk_values("e3m0", cfg.codec_block_size),
        "fingerprint": model_fingerprint(layout, cfg),
    }


def push_bytes(plan: dict, shards: int) -> int:
    """E3M0 bytes one client pushes per round to S shards together: each shard's slice encoded on its own
    (a slice that does not end on a block boundary carries one more scale than the whole would)."""
    return sum(
        CODECS["e3m0"].encoded_nbytes(hi - lo, plan["block_size"])
        for lo, hi in slice_ranges(plan["numel"], shards)
    )


def write_payload(plan: dict, path: Path) -> None:
    """One E3M0-encoded outer gradient of the slice; every client pushes these bytes every round."""
    g = torch.Generator().manual_seed(1)
    enc = encode(torch.randn(plan["numel"], generator=g) * 1e-3, "e3m0", plan["block_size"])
    path.write_bytes(enc.scales.numpy().tobytes() + enc.payload.numpy().tobytes())


def read_payload(plan: dict, path: Path) -> Encoded:
    """The payload `write_payload` wrote, as the codec's Encoded."""
    data = bytearray(path.read_bytes())
    payload_n, scales_n = expected_sizes("e3m0", plan["numel"], plan["block_size"])
    scales = torch.frombuffer(data[: 4 * scales_n], dtype=torch.float32)
    payload = torch.frombuffer(data[4 * scales_n :], dtype=torch.uint8)
    assert payload.numel() == payload_n
    return Encoded("e3m0", plan["numel"], payload, scales, plan["block_size"])


def chunk_layout(plan: dict) -> list[tuple[int, int, int, int]]:
    """(offset, values, payload bytes, scales) of each chunk: the same cut as the gRPC pushes."""
    out = []
    n, cv = plan["numel"], plan["chunk_values"]
    for lo in range(0, n, cv):
        hi = min(n, lo + cv)
        p, s = expected_sizes("e3m0", hi - lo, plan["block_size"])
        out.append((lo, hi - lo, p, s))
    return out


def _client_go(ready: Path) -> float:
    """Say ready, wait for the go line on stdin; returns the process's CPU seconds at go."""
    ready.write_text("ready")
    sys.stdin.readline()
    return time.process_time()


def grpc_client_main(a: argparse.Namespace) -> int:
    """Join with ShardLink, then each round: push the slice, wait for the round's update."""
    from streamdiloco.worker.link import ShardLink

    plan = json.loads(Path(a.plan).read_text())
    enc = read_payload(plan, Path(a.payload))
    f = plan["fragment"]
    links = [ShardLink(t, a.name, plan["fingerprint"]) for t in a.target.split(",")]
    try:
        for link in links:
            link.start()
        welcomes = [link.ready() for link in links]  # every client joins before the first push
        if len(links) == 1:
            assert links[0].slices[f][1] == plan["numel"], links[0].slices
            encs = [enc]
        else:  # each shard its slice of the same values, encoded as a worker would
            want = [(lo, hi - lo) for lo, hi in slice_ranges(plan["numel"], len(links))]
            assert [x.slices[f] for x in links] == want, [x.slices[f] for x in links]
            values = decode(enc)
            encs = [
                encode(values[lo : lo + n], "e3m0", plan["block_size"])
                for lo, n in (x.slices[f] for x in links)
            ]
        # --pipeline F: pushes go to fragments f, f+1, ..., f+F-1 in turn (the same values: the fragments are
        # the same size), each waiting only for the update of the push F before it, as a worker's fragments
        # overlap: the shard takes one fragment's pushes while it closes another's round
        frags = [f + i for i in range(a.pipeline)]
        firsts = [[w.rounds[g] for g in frags] for w in welcomes]
        cpu0 = _client_go(Path(a.ready))
        starts, ends, cpu = [], [], []

        def wait(k: int) -> None:
            g = k % a.pipeline
            for link, first in zip(links, firsts, strict=True):
                link.wait_update(frags[g], first[g] + k // a.pipeline, timeout=300)
            ends.append(time.monotonic())
            cpu.append(time.process_time() - cpu0)

        for k in range(a.rounds):
            g = k % a.pipeline
            starts.append(time.monotonic())
            for link, first, e in zip(links, firsts, encs, strict=True):
                link.push(frags[g], first[g] + k // a.pipeline, e, weight=1.0, loss=None)
            if k - a.pipeline + 1 >= 0:
                wait(k - a.pipeline + 1)
        for k in range(max(0, a.rounds - a.pipeline + 1), a.rounds):
            wait(k)
        refused = [r.reason for link in links for r in link.refusals]
        result = {"starts": starts, "ends": ends, "cpu": cpu, "refused": refused}
        Path(a.result).write_text(json.dumps(result))
    finally:
        for link in links:
            link.close()
    return 0


def tcp_sender_main(a: argparse.Namespace) -> int:
    """Send the same chunks' bytes (scales, payload) every round; wait for the receiver's reply."""
    import socket

    plan = json.loads(Path(a.plan).read_text())
    enc = read_payload(plan, Path(a.payload))
    pieces = []
    for lo, _n, p, s in chunk_layout(plan):
        b0, s0 = lo // 2, lo // plan["block_size"]
        pieces.append(enc.scales[s0 : s0 + s].numpy().tobytes() + enc.payload[b0 : b0 + p].numpy().tobytes())
    reply_n = plan["codec_bytes"] if a.mode == "full" else 1
    reply = bytearray(reply_n)
    view = memoryview(reply)
    sock = socket.create_connection(("127.0.0.1", a.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    cpu0 = _client_go(Path(a.ready))
    starts, ends, cpu = [], [], []
    for _ in range(a.rounds):
        starts.append(time.monotonic())
        for piece in pieces:
            sock.sendall(piece)
        got = 0
        while got < reply_n:
            n = sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("receiver closed the connection")
            got += n
        ends.append(time.monotonic())
        cpu.append(time.process_time() - cpu0)
    sock.close()
    Path(a.result).write_text(json.dumps({"starts": starts, "ends": ends, "cpu": cpu, "refused": []}))
    return 0


def tcp_receiver_main(a: argparse.Namespace) -> int:
    """One asyncio event loop, like the shard's. `discard` reads every sender's chunks; `decode` also
    dequantizes them and sums them into an fp64 accumulator once a sender's slice is complete (what
    ShardState.push_chunk does); `full` also closes the round with the outer step and the E3M0 update
    (OuterOptimizer.step, what close_round does) and sends the update to every sender. The other modes reply
    with one byte when all senders' slices are in."""
    from streamdiloco.common.outer import OuterOptimizer

    plan = json.loads(Path(a.plan).read_text())
    layout = chunk_layout(plan)
    bs, n = plan["block_size"], plan["numel"]
    cfg = SyncConfig()
    opt = OuterOptimizer(torch.zeros(n), cfg.outer_lr, cfg.outer_momentum, True, "e3m0", bs)

    async def run() -> None:
        state: dict[str, Any] = {"acc": torch.zeros(n, dtype=torch.float64), "count": 0, "weight": 0.0}
        writers: list[asyncio.StreamWriter] = []

        async def close_round() -> None:
            if a.mode == "full":
                upd, _ = opt.step((state["acc"] / state["weight"]).to(torch.float32))
                reply = upd.scales.numpy().tobytes() + upd.payload.numpy().tobytes()
            else:
                reply = b"\x01"
            state.update(acc=torch.zeros(n, dtype=torch.float64), count=0, weight=0.0)
            for w in writers:
                w.write(reply)
            for w in writers:
                await w.drain()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            for _ in range(a.rounds):
                parts = []
                for lo, cnt, p, s in layout:
                    data = await reader.readexactly(4 * s + p)
                    if a.mode != "discard":
                        scales = torch.frombuffer(bytearray(data[: 4 * s]), dtype=torch.float32)
                        payload = torch.frombuffer(bytearray(data[4 * s :]), dtype=torch.uint8)
                        parts.append((lo, Encoded("e3m0", cnt, payload, scales, bs)))
                for lo, part in parts:
                    state["acc"][lo : lo + part.numel].add_(decode(part).to(torch.float64), alpha=1.0)
                state["count"] += 1
                state["weight"] += 1.0
                if state["count"] == a.senders:
                    await close_round()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        atomic_write_text(a.port_file, str(server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()  # until stopped: the benchmark reads our CPU time after the senders end

    asyncio.run(run())
    return 0


def run_role(argv: list[str]) -> int:
    """`python -m benchmarks.wire _ROLE ...`: run one of the ROLES to its end."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.wire (internal)")
    p.add_argument("role", choices=ROLES)
    p.add_argument("--plan", required=True)
    p.add_argument("--payload")
    p.add_argument("--target")
    p.add_argument("--name")
    p.add_argument("--mode", default="discard")
    p.add_argument("--port", type=int)
    p.add_argument("--port-file")
    p.add_argument("--senders", type=int, default=8)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--ready")
    p.add_argument("--result")
    a = p.parse_args(argv)
    if a.role != "_tcp-receiver":  # the load generators; the receiver keeps torch's default, like the shard
        torch.set_num_threads(1)
    if a.role == "_grpc-client":
        return grpc_client_main(a)
    if a.role == "_tcp-sender":
        return tcp_sender_main(a)
    return tcp_receiver_main(a)
