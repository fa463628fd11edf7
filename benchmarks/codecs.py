"""Codec throughput against a memcpy, on one CPU core (issue 11).

For each codec: encode, decode into a buffer, add into a buffer (the worker's mirror update) and accumulate
into an fp64 sum (the shard's aggregation), in millions of fp32 values per second, beside a plain copy of
the same fp32 values into a preallocated buffer measured in the same run (per row: the median of three
copies, two timed before the row's figures and one after, which the row's ratios are against). Each figure
is the median of --repeats timings. The top-k codecs (topk64_4096 and topk256_4096: 1.56 % and 6.25 % of the
values) count every value of the tensor: their decode writes every value (zeros but the kept ones), their
add and accumulate touch only the kept values. Also the same operations through the torch reference ops
(what the CPU ran before the compiled kernels, and what runs when numba is missing or
STREAMDILOCO_CODECS_NUMBA=0), for the ratio.

    python -m benchmarks.codecs            # 16M values, about a minute
    python -m benchmarks.codecs --quick    # 1M values
    python -m benchmarks.codecs --values 64M --repeats 9 --json out.json
    python -m benchmarks.codecs --codecs sq2,topk64_4096 --repeats 9   # some rows only
    python -m benchmarks.codecs --device cuda --values 64M   # on a GPU, against a device-to-device copy

On a GPU (`--device cuda`, `device_table()`) the same four operations run on the tensor's device (the torch
reference ops: common/codecs.py has no other CUDA kernels), each timed between two synchronizations, against
a device-to-device copy of the same fp32 values (`copy_` into a preallocated buffer) in the same run.

The table is per core (one codec thread, torch.set_num_threads(1)); a last line gives e3m0 on the codec
threads that large tensors get (STREAMDILOCO_CODEC_THREADS, default the CPUs up to 4) against torch's copy
on as many threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from streamdiloco.common import codecs as C
from streamdiloco.common import topk

OPS = ("encode", "decode", "add_into", "accumulate")
CODECS = ("sq2", "topk64_4096", "topk256_4096", "e3m0", "int8", "bf16", "fp32")


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: compiled, pages touched
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _ops(x: torch.Tensor, codec: str, block: int, compiled: bool) -> dict[str, Callable[[], object]]:
    """The four operations on x, through the compiled kernels or the torch reference ops."""
    spec = C.get_codec(codec)
    enc = C.encode(x, codec, block)
    out = torch.empty_like(x)
    acc = torch.zeros(x.numel(), dtype=torch.float64)
    if compiled:
        return {
            "encode": lambda: C.encode(x, codec, block),
            "decode": lambda: C.decode(enc, out=out),
            "add_into": lambda: C.add_into(enc, out),
            "accumulate": lambda: C.accumulate(enc, acc, 0.5),
        }
    if spec.sparse:  # top-k's reference: its own torch ops (they touch only the kept values too)
        n, p, b = enc.numel, enc.payload, enc.scales
        return {
            "encode": lambda: topk.encode_torch(x, spec, False, 0, C.uniform_at),
            "decode": lambda: topk.apply_torch(p, b, spec, n, out, 0.0, 0),
            "add_into": lambda: topk.apply_torch(p, b, spec, n, out, 1.0, 1),
            "accumulate": lambda: topk.apply_torch(p, b, spec, n, acc, 0.5, 1),
        }
    return {
        "encode": lambda: C._encode_torch(x, spec, block, False, 0),
        "decode": lambda: C._decode_torch(enc, out),
        "add_into": lambda: out.add_(C._decode_torch(enc)),
        "accumulate": lambda: acc.add_(C._decode_torch(enc).to(torch.float64), alpha=0.5),
    }


def codec_table(
    quick: bool = False,
    values: int | None = None,
    repeats: int | None = None,
    codecs: tuple[str, ...] = CODECS,
) -> tuple[str, dict]:
    """Run the measurements; (a markdown table, the raw numbers)."""
    threads = C.codec_threads()  # what large tensors get by default
    os.environ["STREAMDILOCO_CODEC_THREADS"] = "1"
    torch.set_num_threads(1)
    n = values or (1 << 20 if quick else 1 << 24)
    repeats = repeats or (3 if quick else 5)
    block = 128
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)
    memcpy = n / _time(lambda: dst.copy_(x), repeats) / 1e6
    compiled = C.cpu_kernels() is not None
    rows: list[dict[str, Any]] = []
    for codec in codecs:
        # each row against copies timed around it (a loaded machine's speed drifts over a run)
        copies = [n / _time(lambda: dst.copy_(x), repeats) / 1e6 for _ in range(2)]
        fast = {op: n / _time(fn, repeats) / 1e6 for op, fn in _ops(x, codec, block, compiled).items()}
        ref = {op: n / _time(fn, repeats) / 1e6 for op, fn in _ops(x, codec, block, False).items()}
        copies.append(n / _time(lambda: dst.copy_(x), repeats) / 1e6)
        copy = statistics.median(copies)
        rows.append({"codec": codec, "memcpy": copy, "compiled": fast, "torch_ops": ref})
        print(f"  {codec}: " + ", ".join(f"{op} {fast[op]:.0f} M/s" for op in OPS), file=sys.stderr)
    lines = [
        f"{n / 1e6:.3g}M fp32 values, block {block} (top-k: its own chunk), 1 thread (codec, torch); memcpy "
        f"(copy_ into a buffer) {memcpy:.0f} M values/s at the start of the run and, per row, the median of "
        f"three copies timed around that row's figures, which its ratios are against; M values/s (x that "
        f"memcpy), median of {repeats}; "
        f"{'compiled kernels' if compiled else 'NO compiled kernels (numba missing or switched off)'} "
        "against the torch reference ops",
        "",
        "| codec | memcpy | "
        + " | ".join(f"{op}" for op in OPS)
        + " | "
        + " | ".join(f"{op} (torch ops)" for op in OPS)
        + " |",
        "|---|" + "---:|" * (2 * len(OPS) + 1),
    ]
    for r in rows:
        cells = [f"{r['compiled'][op]:.0f} ({r['compiled'][op] / r['memcpy']:.2f}x)" for op in OPS]
        cells += [f"{r['torch_ops'][op]:.0f} ({r['torch_ops'][op] / r['memcpy']:.2f}x)" for op in OPS]
        lines.append(f"| {r['codec']} | {r['memcpy']:.0f} | " + " | ".join(cells) + " |")
    # large tensors are split over the codec threads: e3m0 with them, against torch's copy on as many
    os.environ["STREAMDILOCO_CODEC_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    memcpy_n = n / _time(lambda: dst.copy_(x), repeats) / 1e6
    par = {op: n / _time(fn, repeats) / 1e6 for op, fn in _ops(x, "e3m0", block, compiled).items()}
    lines += [
        "",
        f"e3m0 on {threads} threads (tensors of {C.PARALLEL_VALUES / 2**20:.0f}M values or more are split "
        f"over them), against a copy on {threads} torch threads ({memcpy_n:.0f} M values/s): "
        + ", ".join(f"{op} {par[op]:.0f} ({par[op] / memcpy_n:.2f}x)" for op in OPS),
    ]
    raw = {
        "threads": threads,
        "memcpy_threads": memcpy_n,
        "e3m0_threads": par,
        "values": n,
        "block_size": block,
        "repeats": repeats,
        "compiled": compiled,
        "memcpy": memcpy,
        "rows": rows,
    }
    return "\n".join(lines), raw


def _device_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of fn() on `device`, the queue drained before and after each (a GPU runs fn's kernels
    asynchronously: the time is until they are done)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed() -> None:
        fn()
        sync()

    sync()
    return _time(timed, repeats)


def device_table(device: str, values: int | None = None, repeats: int | None = None) -> tuple[str, dict]:
    """The four operations on `device` (cuda: the torch ops on the GPU) against a device-to-device copy of
    the same fp32 values; (a markdown table, the raw numbers). On the CPU it measures the same calls (what
    scripts/gpu-check.py's dry run exercises)."""
    dev = torch.device(device)
    n = values or 1 << 26
    repeats = repeats or 5
    block = 128
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dev)
    dst = torch.empty_like(x)
    copy = n / _device_time(lambda: dst.copy_(x), repeats, dev) / 1e6
    rows: list[dict[str, Any]] = []
    for codec in CODECS:
        enc = C.encode(x, codec, block)
        out = torch.empty_like(x)
        acc = torch.zeros(n, dtype=torch.float64, device=dev)
        ops: dict[str, Callable[[], object]] = {  # timed within this iteration: no late binding
            "encode": lambda: C.encode(x, codec, block),  # noqa: B023
            "decode": lambda: C.decode(enc, out=out),  # noqa: B023
            "add_into": lambda: C.add_into(enc, out),  # noqa: B023
            "accumulate": lambda: C.accumulate(enc, acc, 0.5),  # noqa: B023
        }
        speed = {op: n / _device_time(fn, repeats, dev) / 1e6 for op, fn in ops.items()}
        ratio = {op: v / copy for op, v in speed.items()}
        rows.append({"codec": codec, "values_per_second_m": speed, "x_copy": ratio})
        print(f"  {codec} on {dev}: " + ", ".join(f"{op} {speed[op]:.0f} M/s" for op in OPS), file=sys.stderr)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    lines = [
        f"{n / 1e6:.3g}M fp32 values on {dev} ({name}), block {block}; a device-to-device copy (copy_ into a "
        f"buffer) {copy:.0f} M values/s in the same run; M values/s (x copy), median of {repeats}",
        "",
        "| codec | " + " | ".join(OPS) + " |",
        "|---|" + "---:|" * len(OPS),
    ]
    for r in rows:
        cells = [f"{r['values_per_second_m'][op]:.0f} ({r['x_copy'][op]:.2f}x)" for op in OPS]
        lines.append(f"| {r['codec']} | " + " | ".join(cells) + " |")
    raw = {"device": str(dev), "device_name": name, "values": n, "block_size": block, "repeats": repeats}
    return "\n".join(lines), {**raw, "copy": copy, "rows": rows}


def _count(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1M values, 3 repeats")
    ap.add_argument("--values", type=_count, help="values per tensor (e.g. 16M; default 16M, quick 1M)")
    ap.add_argument("--repeats", type=int, help="timings per figure, median (default 5, quick 3)")
    ap.add_argument(
        "--device",
        help="measure on this device (cuda: the GPU) against a device-to-device copy (device_table)",
    )
    ap.add_argument("--codecs", help=f"comma-separated rows to measure (default all: {','.join(CODECS)})")
    ap.add_argument("--json", help="write the raw numbers here")
    a = ap.parse_args(argv)
    if a.values is not None and a.values < 256:
        ap.error("--values must be at least 256")
    if a.repeats is not None and a.repeats < 1:
        ap.error("--repeats must be at least 1")
    if a.device:
        md, raw = device_table(a.device, a.values, a.repeats)
    else:
        md, raw = codec_table(
            a.quick, a.values, a.repeats, tuple(a.codecs.split(",")) if a.codecs else CODECS
        )
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
