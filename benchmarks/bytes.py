"""Bytes per parameter per outer step, up and down, for every codec of the registry, measured on the wire.

For each codec (fp32, bf16, int8, e3m0, sq2; the scaled ones at each --block-sizes): an in-process shard (a
real gRPC server, `streamdiloco.server.main.serve` in a thread of this process, the whole model on one
shard) with that codec up and down, and --workers worker links (worker/link.py's ShardLink, what a worker
uses) that join, then push every fragment once per outer step (seeded deltas of about 1e-3, encoded as a
worker encodes them) and wait for each round's update. The shard's own per-member counters of serialized
protobuf bytes (status's message_bytes_in and message_bytes_out: chunks, headers, push results, updates)
give what one worker sent up and received down over the measured outer steps, divided by the model's
parameters and the steps. Framing above protobuf (HTTP/2 frames, gRPC's 5-byte prefix, TCP, TLS) is not
counted: benchmarks/wire measured it separately.

The reference, DDP with a ring all-reduce of fp32 gradients at every inner step: each worker sends and
receives 2 (M-1)/M x 4 bytes per parameter per step, so 2 (M-1)/M x 4 x H per outer step of H steps, each
direction. The ratio columns are how many times fewer bytes the codec sends than the reference.

    python -m benchmarks.bytes                              # tiny, blocks 128 and 1024, 2 workers
    python -m benchmarks.bytes --model nano --steps 1       # the test's run (tests/test_bench_bytes.py)

Writes results.md and results.json under --out (default benchmarks/results/bytes). Runs no training and
times nothing: the counts do not depend on the machine's load.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import bench_parser, say
from streamdiloco.common.atomic import atomic_write_text
from streamdiloco.common.codecs import CODECS, encode
from streamdiloco.common.config import ModelSettings, ShardSettings, SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout
from streamdiloco.common.modelspec import build_model
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.main import serve
from streamdiloco.server.shard import Shard
from streamdiloco.server.startup import build_shard
from streamdiloco.worker.link import ShardLink

WAIT = 60.0  # seconds for a shard to start, a round's update to come, a counter to settle
DDP_FORMULA = "DDP ring all-reduce of fp32 gradients each inner step: 2 (M-1)/M x 4 B x H per parameter"


def ddp_bytes_per_param(workers: int, sync_every: int) -> float:
    """Bytes one worker sends (and receives) per parameter per outer step of H = sync_every inner steps in
    a ring all-reduce of fp32 gradients among M = workers."""
    return 2 * (workers - 1) / workers * 4 * sync_every


def codec_bits(codec: str, block: int) -> float:
    """The codec's bits per value with its side values (scales or codebook) spread over the block."""
    spec = CODECS[codec]
    return spec.bits + (32 * spec.scales_per_block / block if spec.scaled else 0.0)


class ThreadShard:
    """A shard serving on 127.0.0.1 (a free port) on an event loop in a thread of this process."""

    def __init__(self, service: Shard, workdir: Path):
        self.service = service
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        self.failure: BaseException | None = None
        ready = workdir / "ready.json"
        config = replace(service.config, host="127.0.0.1", port=0, http_port=None, ready_file=str(ready))
        self.thread = threading.Thread(target=self._run, args=(config,), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT
        while not ready.exists():
            if self.failure is not None or not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the shard did not start: {self.failure!r}")
            time.sleep(0.01)
        self.target = f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"

    def _run(self, config: ShardConfig) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.stop = asyncio.Event()
            await serve(self.service, config, self.stop)

        try:
            self.loop.run_until_complete(main())
        except BaseException as e:  # noqa: BLE001 - raised by close()
            self.failure = e
        finally:
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self.loop.close()

    def counters(self, name: str) -> tuple[int, int]:
        """(message bytes in, out) of the member `name`, read on the shard's loop."""

        async def read() -> tuple[int, int]:
            m = self.service.roster.open[name]
            return m.msg_in, m.msg_out

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(WAIT)

    def close(self) -> None:
        if self.stop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(WAIT)
        if self.failure is not None:
            raise RuntimeError(f"the shard failed: {self.failure!r}")


def measure(model: str, codec: str, block: int, workers: int, steps: int, workdir: Path) -> dict[str, Any]:
    """One codec up and down: each worker's message bytes in each direction over `steps` outer steps."""
    cfg = SyncConfig(uplink_codec=codec, downlink_codec=codec, codec_block_size=block)
    settings = ShardSettings(min_workers=workers, round_timeout=WAIT)
    service = build_shard(ShardConfig(model=ModelSettings(model), sync=cfg, server=settings))
    assert isinstance(service, Shard)  # a model is given: never the shard waiting for an upload
    layout = build_layout(build_model(model, 0), cfg.num_fragments, cfg.fragment_pattern)
    fingerprint = model_fingerprint(layout, cfg)
    shard = ThreadShard(service, workdir)
    names = [f"w{i}" for i in range(workers)]
    links = [ShardLink(shard.target, n, fingerprint) for n in names]
    try:
        for link in links:
            link.start()
        welcomes = [link.ready() for link in links]
        first = list(welcomes[0].rounds)
        before = [shard.counters(n) for n in names]
        g = torch.Generator().manual_seed(0)
        for step in range(steps):
            for f, frag in enumerate(layout.fragments):
                for link in links:
                    enc = encode(torch.randn(frag.numel, generator=g) * 1e-3, codec, block)
                    link.push(f, first[f] + step, enc, weight=1.0, loss=None)
                for link in links:
                    link.wait_update(f, first[f] + step, timeout=WAIT)
        refused = [r.reason for link in links for r in link.refusals]
        if refused:
            raise RuntimeError(f"{codec}: pushes refused: {refused}")
        # every push was read before its round closed, and the update was counted as it was sent
        after = [shard.counters(n) for n in names]
    finally:
        for link in links:
            link.close()
        shard.close()
    numel = sum(frag.numel for frag in layout.fragments)
    up = [(a[0] - b[0]) / (numel * steps) for a, b in zip(after, before, strict=True)]
    down = [(a[1] - b[1]) / (numel * steps) for a, b in zip(after, before, strict=True)]
    codec_up = sum(CODECS[codec].encoded_nbytes(frag.numel, block) for frag in layout.fragments) / numel
    return {
        "codec": codec,
        "block": block if CODECS[codec].scaled else None,
        "bits_per_value": codec_bits(codec, block),
        "up_b_per_param": max(up),  # the workers push the same sizes; max: the one that sent most
        "down_b_per_param": max(down),
        "codec_b_per_param": codec_up,  # payload and side values alone, without the messages' framing
        "params": numel,
        "sync_every": cfg.sync_every,
    }


def run(model: str, blocks: list[int], workers: int, steps: int) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-bytes-") as tmp:
        for codec, spec in CODECS.items():
            for block in blocks if spec.scaled else blocks[:1]:
                workdir = Path(tmp) / f"{codec}-{block}"
                workdir.mkdir()
                shown = block if spec.scaled else "-"
                say(f"{codec} (block {shown}): {workers} workers, {steps} outer steps")
                rows.append(measure(model, codec, block, workers, steps, workdir))
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
        "bf16: at the first). Framing up: the messages' bytes over the codec's payload and side values.",
        "",
        "| codec | block | bits/value | up B/param | down B/param | vs fp32 (up/down) | vs e3m0 (up/down) "
        "| vs DDP (up/down) | framing up |",
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


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, "bytes")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--block-sizes", default="128,1024", help="block sizes of the scaled codecs")
    ap.add_argument("--workers", type=int, default=2, help="M, workers pushing to the shard")
    ap.add_argument("--steps", type=int, default=2, help="outer steps measured")
    a = ap.parse_args(argv)
    blocks = [int(b) for b in a.block_sizes.split(",")]
    res = run(a.model, blocks, a.workers, 1 if a.quick else a.steps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(res)
    atomic_write_text(out / "results.json", json.dumps(res, indent=2) + "\n")
    atomic_write_text(out / "results.md", f"# Bytes per parameter per outer step\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
