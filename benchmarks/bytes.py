"""Bytes per parameter per outer step, up and down, for every codec of the registry, measured on the wire.

For each codec (fp32, bf16, int8, e3m0, sq2; the scaled ones at each --block-sizes): an in-process shard (a
real gRPC server, benchmarks/harness/inthread.py's ThreadShard, the whole model on one shard) with that codec
up and down, and --workers worker links (worker/link.py's ShardLink, what a worker uses) that join, then push
every fragment once per outer step (seeded deltas of about 1e-3, encoded as a worker encodes them, each
header with every progress field set) and wait for each round's update. Then each top-k codec of --topk up
(a sparse push: K of every C values) with each downlink of --topk-downlinks at --topk-block (the union of M
sparse pushes is dense, so the downlink is a dense codec). The shard's own per-member counters of
serialized protobuf bytes (status's message_bytes_in and message_bytes_out: chunks, headers, push results,
updates) give what one worker sent up and received down over the measured outer steps, divided by the
model's parameters and the steps.

The links reach the shard through a counting proxy (benchmarks/wire/proxy.py), which splits the TCP payload
into the codec's bytes, protobuf fields, gRPC prefixes and HTTP/2 frames: the second table says what one
push costs beyond its codec bytes (issue 38's part 6: under 5 % of a small top-k push), beside the same push
counted without a network (benchmarks/wire/pushframing.py). TCP/IP headers are in neither.

The reference, DDP with a ring all-reduce of fp32 gradients at every inner step: each worker sends and
receives 2 (M-1)/M x 4 bytes per parameter per step, so 2 (M-1)/M x 4 x H per outer step of H steps, each
direction. The ratio columns are how many times fewer bytes the codec sends than the reference.

    python -m benchmarks.bytes                              # tiny, blocks 128 and 1024, 2 workers, top-k
    python -m benchmarks.bytes --model nano --steps 1       # the test's run (tests/test_bench_bytes.py)

Writes results.md and results.json under --out (default benchmarks/results/bytes). Runs no training and
times nothing: the counts do not depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import bench_parser, say
from benchmarks.harness.inthread import ThreadShard
from benchmarks.wire.proxy import Proxies
from benchmarks.wire.pushframing import (
    FRAME_HEADER,
    GRPC_PREFIX,
    PROGRESS,
    PUSH_LOSS,
    PUSH_WEIGHT,
    push_bytes,
)
from streamdiloco.common.atomic import atomic_write_text
from streamdiloco.common.codecs import CODECS, encode, lookup_codec
from streamdiloco.common.config import ModelSettings, ShardSettings, SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout
from streamdiloco.common.modelspec import build_model
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.shard import Shard
from streamdiloco.server.startup import build_shard
from streamdiloco.worker.link import ShardLink

WAIT = 60.0  # seconds for a round's update to come, a counter to settle
DDP_FORMULA = "DDP ring all-reduce of fp32 gradients each inner step: 2 (M-1)/M x 4 B x H per parameter"
TOPK = "topk64_4096,topk256_4096"  # SparseLoCo's 1.56 %, and 6.25 %
TOPK_DOWN = "e3m0,sq2"  # the compressed downlinks beside a top-k uplink (a union of sparse pushes is dense)


def ddp_bytes_per_param(workers: int, sync_every: int) -> float:
    """Bytes one worker sends (and receives) per parameter per outer step of H = sync_every inner steps in
    a ring all-reduce of fp32 gradients among M = workers."""
    return 2 * (workers - 1) / workers * 4 * sync_every


def wire_counts(proxies: Proxies) -> tuple[Counter, Counter]:
    """What the proxy has forwarded so far, (up, down): bytes by category ("total", and per HTTP/2 frame
    and gRPC message kind on the session streams: benchmarks/wire/proxy.py), read on the proxy's loop."""

    async def read() -> tuple[Counter, Counter]:
        up: Counter = Counter()
        down: Counter = Counter()
        for c in proxies.conns:
            for side, acc in ((c.up, up), (c.down, down)):
                acc.update(c.breakdown(side))
                acc["total"] += side.total
        return up, down

    return asyncio.run_coroutine_threadsafe(read(), proxies.loop).result(WAIT)


def measure(
    model: str, up_codec: str, down_codec: str, block: int, workers: int, steps: int, workdir: Path
) -> dict[str, Any]:
    """One uplink and downlink codec: each worker's message bytes in each direction over `steps` outer
    steps, as the shard counts them, and the bytes through a counting proxy (TCP payload: HTTP/2 and gRPC
    framing included)."""
    cfg = SyncConfig(uplink_codec=up_codec, downlink_codec=down_codec, codec_block_size=block)
    settings = ShardSettings(min_workers=workers, round_timeout=WAIT)
    service = build_shard(ShardConfig(model=ModelSettings(model), sync=cfg, server=settings))
    assert isinstance(service, Shard)  # a model is given: never the shard waiting for an upload
    layout = build_layout(build_model(model, 0), cfg.num_fragments, cfg.fragment_pattern)
    fingerprint = model_fingerprint(layout, cfg)
    shard = ThreadShard(service, workdir)
    proxies = Proxies([("127.0.0.1", shard.port)])
    names = [f"w{i}" for i in range(workers)]
    try:
        target = f"127.0.0.1:{proxies.start()[0]}"
        links = [ShardLink(target, n, fingerprint) for n in names]
        try:
            for link in links:
                link.report_progress(lambda: PROGRESS)
                link.start()
            welcomes = [link.ready() for link in links]
            first = list(welcomes[0].rounds)
            before = [shard.counters(n) for n in names]
            wire_before = wire_counts(proxies)
            g = torch.Generator().manual_seed(0)
            for step in range(steps):
                for f, frag in enumerate(layout.fragments):
                    for link in links:
                        enc = encode(torch.randn(frag.numel, generator=g) * 1e-3, up_codec, block)
                        link.push(f, first[f] + step, enc, weight=PUSH_WEIGHT, loss=PUSH_LOSS)
                    for link in links:
                        link.wait_update(f, first[f] + step, timeout=WAIT)
            for link in links:  # every push answered: its PushResult is in the counts
                if not link.flush(WAIT):
                    raise RuntimeError(f"{link.conn.worker}: pushes not answered")
            refused = [r.reason for link in links for r in link.refusals]
            if refused:
                raise RuntimeError(f"{up_codec}/{down_codec}: pushes refused: {refused}")
            # every push was read before its round closed, and the update was counted as it was sent
            after = [shard.counters(n) for n in names]
            wire_after = wire_counts(proxies)
        finally:
            for link in links:
                link.close()
    finally:
        proxies.stop()
        shard.close()
    numel = sum(frag.numel for frag in layout.fragments)
    per = numel * steps
    up = [(a[0] - b[0]) / per for a, b in zip(after, before, strict=True)]
    down = [(a[1] - b[1]) / per for a, b in zip(after, before, strict=True)]
    wire_up, wire_down = (a - b for a, b in zip(wire_after, wire_before, strict=True))
    pushes = len(layout.fragments) * steps * workers
    up_spec, down_spec = lookup_codec(up_codec), lookup_codec(down_codec)
    sizes = [up_spec.encoded_nbytes(frag.numel, block) for frag in layout.fragments]
    return {
        "codec": up_codec if up_codec == down_codec else f"{up_codec}/{down_codec}",
        "up_codec": up_codec,
        "down_codec": down_codec,
        "block": block if up_spec.scaled or down_spec.scaled else None,
        "bits_per_value": up_spec.bits_per_value(block),
        "down_bits_per_value": down_spec.bits_per_value(block),
        "up_b_per_param": max(up),  # the workers push the same sizes; max: the one that sent most
        "down_b_per_param": max(down),
        # payload and side values alone, without the messages' framing
        "codec_b_per_param": sum(sizes) / numel,
        "down_codec_b_per_param": sum(down_spec.encoded_nbytes(f.numel, block) for f in layout.fragments)
        / numel,
        "params": numel,
        "sync_every": cfg.sync_every,
        "push": push_framing(wire_up, wire_down, pushes, min(sizes), max(sizes)),
        "push_model": smallest_push(layout, up_codec, block, first),
        "wire_up_b_per_param": wire_up["total"] / (per * workers),
        "wire_down_b_per_param": wire_down["total"] / (per * workers),
    }


def push_framing(up: Counter, down: Counter, pushes: int, smallest: int, largest: int) -> dict[str, Any]:
    """Bytes a push costs beyond its codec bytes, per push, from the proxy's counts of the session streams:
    up, the chunk messages' protobuf fields (PushHeader included), gRPC's 5-byte prefixes and HTTP/2 DATA
    frame headers; down, the PushResult message with its prefix and frame header. The framing up as a share
    of the smallest and of the largest push's codec bytes (the fragments differ in size)."""
    codec = up["session codec"] / pushes
    protobuf = up["session protobuf fields"] / pushes
    h2 = (up["session gRPC prefixes"] + up["session DATA frame headers"]) / pushes
    # the PushResult with its prefix and a frame header of its own (gRPC may share a frame with an update's)
    answer = down["session other messages"] / pushes + GRPC_PREFIX + FRAME_HEADER
    each = protobuf + h2
    return {
        "codec_bytes": codec,
        "smallest_bytes": smallest,
        "largest_bytes": largest,
        "protobuf_bytes": protobuf,
        "grpc_http2_bytes": h2,
        "up_bytes": each,
        "up_pct_of_smallest": 100 * each / smallest,
        "up_pct_of_largest": 100 * each / largest,
        "answer_bytes": answer,
        "flow_control_down_bytes": (down["session WINDOW_UPDATE"] + down["connection WINDOW_UPDATE"])
        / pushes,
    }


def smallest_push(layout: Any, codec: str, block: int, rounds: list[int]) -> dict[str, Any]:
    """The smallest fragment's push counted without a network (benchmarks/wire/pushframing.py), to set
    beside what the proxy saw."""
    f = min(range(len(layout.fragments)), key=lambda i: layout.fragments[i].numel)
    values = torch.randn(layout.fragments[f].numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    p = push_bytes(values, codec, block, f, rounds[f])
    return {
        "fragment": f,
        "codec_bytes": p.codec,
        "protobuf_bytes": p.protobuf,
        "grpc_http2_bytes": p.grpc + p.http2,
        "framing_pct": p.framing_pct,
        "answer_bytes": p.answer,
    }


def plan(blocks: list[int], topk: list[str], topk_down: list[str], topk_block: int) -> list[tuple]:
    """(up codec, down codec, block) of each row: every dense codec both ways at each block (fp32 and bf16
    at the first), then each top-k codec up with each compressed downlink at `topk_block`."""
    rows = [(c, c, b) for c, spec in CODECS.items() for b in (blocks if spec.scaled else blocks[:1])]
    return rows + [(k, d, topk_block) for k in topk for d in topk_down]


def run(
    model: str,
    blocks: list[int],
    workers: int,
    steps: int,
    topk: list[str],
    topk_down: list[str],
    topk_block: int,
) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-bytes-") as tmp:
        for up, down, block in plan(blocks, topk, topk_down, topk_block):
            workdir = Path(tmp) / f"{up}-{down}-{block}"
            workdir.mkdir()
            say(f"{up} up, {down} down (block {block}): {workers} workers, {steps} outer steps")
            rows.append(measure(model, up, down, block, workers, steps, workdir))
    h = rows[0]["sync_every"]
    ddp = ddp_bytes_per_param(workers, h)
    fp32 = next(r for r in rows if r["codec"] == "fp32")
    e3m0 = {r["block"]: r for r in rows if r["codec"] == "e3m0"}
    for r in rows:
        ref = e3m0.get(r["block"], e3m0[blocks[0]])
        for d in ("up", "down"):
            b = r[f"{d}_b_per_param"]
            r[f"{d}_vs_fp32"] = fp32[f"{d}_b_per_param"] / b
            r[f"{d}_vs_e3m0"] = ref[f"{d}_b_per_param"] / b
            r[f"{d}_vs_ddp"] = ddp / b
    return {
        "model": model,
        "workers": workers,
        "outer_steps": steps,
        "sync_every": h,
        "ddp_b_per_param": ddp,
        "ddp_formula": DDP_FORMULA,
        "progress_header": asdict(PROGRESS),
        "rows": rows,
    }


def table(res: dict[str, Any]) -> str:
    m, h = res["workers"], res["sync_every"]
    out = [
        f"Model {res['model']} ({res['rows'][0]['params']:,} parameters), M = {m} workers, H = {h}, "
        f"{res['outer_steps']} outer step(s) measured; bytes are serialized protobuf messages as the shard "
        "counts them (message_bytes_in/out of one member), per parameter per outer step.",
        f"{res['ddp_formula']} = 2 ({m}-1)/{m} x 4 x {h} = {res['ddp_b_per_param']:.1f} B each direction.",
        "Ratios: the reference's bytes over the codec's (times fewer); vs e3m0 at the same block (fp32 and "
        "bf16: at the first). Framing up: the messages' bytes over the codec's payload and side values. "
        "A top-k row (topkK_C/down) pushes K of every C values and takes its updates in the downlink codec "
        "named (the union of M sparse pushes is dense); its bits/value counts positions and codebooks.",
        "",
        "| codec (up/down) | block | bits/value up | up B/param | down B/param | vs fp32 (up/down) "
        "| vs e3m0 (up/down) | vs DDP (up/down) | framing up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        block = "-" if r["block"] is None else str(r["block"])
        out.append(
            f"| {r['codec']} | {block} | {r['bits_per_value']:.3f} | {r['up_b_per_param']:.4f} "
            f"| {r['down_b_per_param']:.4f} | {r['up_vs_fp32']:.2f}× / {r['down_vs_fp32']:.2f}× "
            f"| {r['up_vs_e3m0']:.2f}× / {r['down_vs_e3m0']:.2f}× "
            f"| {r['up_vs_ddp']:.0f}× / {r['down_vs_ddp']:.0f}× "
            f"| {100 * (r['up_b_per_param'] / r['codec_b_per_param'] - 1):.2f} % |"
        )
    return "\n".join(out)


def push_table(res: dict[str, Any]) -> str:
    """Part 6 of issue 38: what one push costs on the wire beyond its codec bytes."""
    out = [
        "What one push costs beyond its codec bytes, measured by a counting proxy between the workers and "
        "the shard (benchmarks/wire/proxy.py: TCP payload; TCP/IP headers not counted), per push: the chunk "
        "messages' protobuf fields (Chunk and a PushHeader with every progress field set), gRPC's 5-byte "
        "prefix and the HTTP/2 DATA frame headers, averaged over the pushes; as a share of the smallest and "
        "the largest push (the fragments differ). Down, the push's answer (PushResult, prefix, frame) and "
        "the flow control (WINDOW_UPDATE) the shard sends per push. Counted, smallest: the smallest push's "
        "framing counted without a network (benchmarks/wire/pushframing.py, the same messages). Whole-run "
        "bytes through the proxy per parameter per outer step (all frames, pings and flow control) beside.",
        "",
        "| codec (up/down) | block | push codec B (smallest-largest) | protobuf B | gRPC + HTTP/2 B "
        "| framing % (smallest / largest) | counted, smallest | answer down B | WINDOW_UPDATE down B "
        "| wire up B/param | wire down B/param |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        p, model = r["push"], r["push_model"]
        block = "-" if r["block"] is None else str(r["block"])
        out.append(
            f"| {r['codec']} | {block} | {p['smallest_bytes']:,}-{p['largest_bytes']:,} "
            f"| {p['protobuf_bytes']:.0f} | {p['grpc_http2_bytes']:.0f} "
            f"| {p['up_pct_of_smallest']:.2f} % / {p['up_pct_of_largest']:.2f} % "
            f"| {model['framing_pct']:.2f} % "
            f"| {p['answer_bytes']:.0f} | {p['flow_control_down_bytes']:.0f} "
            f"| {r['wire_up_b_per_param']:.4f} | {r['wire_down_b_per_param']:.4f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "bytes")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--block-sizes", default="128,1024", help="block sizes of the scaled codecs")
    ap.add_argument("--workers", type=int, default=2, help="M, workers pushing to the shard")
    ap.add_argument("--steps", type=int, default=2, help="outer steps measured")
    ap.add_argument("--topk", default=TOPK, help="top-k uplink codecs (comma-separated; '' for none)")
    ap.add_argument("--topk-downlinks", default=TOPK_DOWN, help="downlink codecs beside each top-k uplink")
    ap.add_argument("--topk-block", type=int, default=1024, help="--codec-block-size of the top-k rows")
    a = ap.parse_args(argv)
    blocks = [int(b) for b in a.block_sizes.split(",")]
    topk = [c for c in a.topk.split(",") if c]
    topk_down = [c for c in a.topk_downlinks.split(",") if c]
    res = run(a.model, blocks, a.workers, 1 if a.quick else a.steps, topk, topk_down, a.topk_block)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = f"{table(res)}\n\n## What a push costs on the wire\n\n{push_table(res)}"
    atomic_write_text(out / "results.json", json.dumps(res, indent=2) + "\n")
    atomic_write_text(out / "results.md", f"# Bytes per parameter per outer step\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
