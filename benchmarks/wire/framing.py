"""Part (a) of the wire benchmark, framing: real shard and worker processes talk through the counting
proxies (proxy.py); the bytes each way split by what carries them, against the codec bytes the config
predicts (encoded_nbytes of every slice pushed or received), cross-checked against the workers' summaries,
the shards' counters and the chunks the proxies saw.

What (a) measures and reports; the proxies themselves are in proxy.py, the command line in main.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.harness import Procs, http_json, say, sd, start_shards, wait_quiet
from benchmarks.wire.proxy import Proxies
from streamdiloco.common.codecs import CODECS
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout, slice_ranges
from streamdiloco.common.modelspec import build_model
from streamdiloco.common.schedule import events

A_RUNS: dict[str, dict[str, Any]] = {
    # model: (steps, H, batch, block size): H small for many syncs; small gets a short context so that its
    # steps are quick on 2 cores (the bytes on the wire do not depend on batch or context, only wpe shrinks)
    "tiny": dict(steps=60, sync_every=10, batch_size=16, block_size=None),
    "small": dict(steps=30, sync_every=10, batch_size=2, block_size=64),
}
A_QUICK: dict[str, dict[str, Any]] = {"tiny": dict(steps=30, sync_every=10, batch_size=8, block_size=None)}


def predicted_codec_bytes(model: str, block_size: int | None, cfg: SyncConfig, steps: int, shards: int):
    """Per worker: codec bytes of every push (up) and update (down) the schedule makes, and the pushes."""
    layout = build_layout(build_model(model, 0, block_size), cfg.num_fragments, cfg.fragment_pattern)
    up = down = pushes = 0
    for t in range(1, steps + 1):
        for ev in events(t, cfg, steps):
            numel = layout.fragments[ev.fragment].numel
            codec = cfg.uplink_codec if ev.kind == "send" else cfg.downlink_codec
            n = sum(
                CODECS[codec].encoded_nbytes(hi - lo, cfg.codec_block_size)
                for lo, hi in slice_ranges(numel, shards)
            )
            if ev.kind == "send":
                up, pushes = up + n, pushes + 1
            else:
                down += n
    return up, down, pushes, layout.numel


def run_framing(
    model: str, spec: dict, shards: int, workers: int, procs: Procs, tmp: Path, max_wait: float
) -> dict:
    """One model's run through the proxies: its figures (results.json's "a" has one per model)."""
    wait_quiet("a", max_wait)  # byte counts hardly depend on timing, but pings and window updates do a little
    cfg = SyncConfig(sync_every=spec["sync_every"])
    steps = spec["steps"]
    up_pred, down_pred, pushes, numel = predicted_codec_bytes(model, spec["block_size"], cfg, steps, shards)
    flags = ["--model", model] + (["--block-size", str(spec["block_size"])] if spec["block_size"] else [])
    flags += ["--sync-every", str(cfg.sync_every)]
    say(
        f"[a] {model} ({numel:,} params): {shards} shards, {workers} workers, {steps} steps, "
        f"H={cfg.sync_every}, P={cfg.num_fragments}, {cfg.uplink_codec}/{cfg.downlink_codec}, "
        f"batch {spec['batch_size']}: {pushes} pushes per worker"
    )
    t0 = time.monotonic()
    tag = f"a-{model}"
    shard_flags = ["--min-workers", str(workers), "--round-timeout", "300", *flags]
    shard_procs = start_shards(procs, tmp, tag, shards, shard_flags)
    proxies = Proxies([("127.0.0.1", info["grpc_port"]) for _, _, info in shard_procs])
    try:
        servers = ",".join(f"127.0.0.1:{p}" for p in proxies.start())
        summaries = _train(procs, tmp, tag, servers, workers, spec, flags)
        statuses = [http_json(info["http_port"]) for _, _, info in shard_procs]
        closed = proxies.wait_closed(10)
    finally:
        proxies.stop()
        for _, p, _ in shard_procs:
            procs.stop(p)
    wall = time.monotonic() - t0
    predicted = {"up": up_pred * workers, "down": down_pred * workers}
    slices = pushes * workers * shards  # every push (and every update) is one encoded slice per shard
    dirs = {d: _direction(d, proxies, predicted[d], slices, summaries, statuses) for d in ("up", "down")}
    return {
        "model": model,
        "params": numel,
        "shards": shards,
        "workers": workers,
        **spec,
        "H": cfg.sync_every,
        "P": cfg.num_fragments,
        "codec": f"{cfg.uplink_codec}/{cfg.downlink_codec}",
        "codec_block_size": cfg.codec_block_size,
        "pushes_per_worker": pushes,
        "connections": len(proxies.conns),
        "connections_closed": closed,
        "stream_kinds": Counter(k for c in proxies.conns for k in c.kinds.values()),
        "wall_seconds": wall,
        "directions": dirs,
    }


def _train(
    procs: Procs, tmp: Path, tag: str, servers: str, workers: int, spec: dict, flags: list[str]
) -> list[dict]:
    """Run the workers through the proxies (`servers`) to their end; their summaries."""
    steps = spec["steps"]
    wprocs = []
    for m in range(workers):
        argv = ["worker", "--servers", servers, "--name", f"worker-{m}", "--rank", str(m)]
        argv += ["--steps", str(steps), "--batch-size", str(spec["batch_size"]), "--eval-batches", "1"]
        argv += ["--log-every", str(max(1, steps // 3)), "--summary", str(tmp / f"{tag}-worker{m}.json")]
        argv += ["--checkpoint", str(tmp / f"{tag}-worker{m}.pt")]
        argv += ["--eval-every", "0"]  # compute utilization without evaluations, as recorded
        wprocs.append((f"{tag}-worker{m}", procs.start(f"{tag}-worker{m}", sd(*argv, *flags))))
    deadline = time.monotonic() + 600
    for name, p in wprocs:
        try:
            rc = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name} did not finish in time:\n{procs.tail(name)}") from None
        if rc:
            raise RuntimeError(f"{name} exited with status {rc}:\n{procs.tail(name)}")
    return [json.loads((tmp / f"{tag}-worker{m}.json").read_text()) for m in range(workers)]


def _direction(
    dname: str, proxies: Proxies, pred: int, slices: int, summaries: list[dict], statuses: list[dict]
) -> dict:
    """One direction's bytes ("up": pushes, "down": updates), split, against the `pred` codec bytes."""
    up = dname == "up"
    total: Counter[str] = Counter()
    errors = []
    for c in proxies.conns:
        side = c.up if up else c.down
        total.update(c.breakdown(side))
        total["TOTAL"] += side.total
        if side.error:
            errors.append(side.error)
    sync_total = sum(v for k, v in total.items() if k.startswith(("session", "connection")))
    out = {
        "predicted_codec_bytes": pred,
        "summary_codec_bytes": sum(s["bytes_sent" if up else "bytes_received"] for s in summaries),
        "shard_codec_bytes": sum(st["bytes"]["codec_in" if up else "codec_out"] for st in statuses),
        "proxy_codec_bytes": total.get("session codec", 0),
        "proxy_total_bytes": total["TOTAL"],
        "join_bytes": total.get("join", 0),
        "fetch_bytes": total.get("fetch", 0),
        "other_bytes": total.get("other", 0) + total.get("unparsed", 0),
        "sync_bytes": sync_total,
        "overhead_sync_pct": 100 * (sync_total - pred) / pred,
        "overhead_all_pct": 100 * (total["TOTAL"] - pred) / pred,
        "overhead_bytes_per_slice": (sync_total - pred) / slices,
        "worker_wire_bytes": sum(
            s["message_bytes_sent" if up else "message_bytes_received"] for s in summaries
        ),
        "shard_wire_bytes": sum(
            st["bytes"]["message_bytes_in" if up else "message_bytes_out"] for st in statuses
        ),
        "breakdown": {k: v for k, v in sorted(total.items()) if k != "TOTAL"},
        "parse_errors": errors,
    }
    if errors or out["other_bytes"]:
        say(
            f"[a]   warning: {dname}: {len(errors)} parse errors {errors[:2]}, "
            f"{out['other_bytes']} B not parsed"
        )
    return out


def table_a(runs: list[dict]) -> str:
    head = (
        "| model | dir | codec bytes predicted | = summaries / shards / proxy-parsed | bytes through proxy | "
        "of which Join + Fetch | sync bytes (Session + connection) | overhead, sync | per slice pushed | "
        "overhead, all |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in runs:
        for d in ("up", "down"):
            x = r["directions"][d]
            same = (
                "yes"
                if x["summary_codec_bytes"]
                == x["shard_codec_bytes"]
                == x["proxy_codec_bytes"]
                == x["predicted_codec_bytes"]
                else (
                    f"{x['summary_codec_bytes']:,} / {x['shard_codec_bytes']:,} / {x['proxy_codec_bytes']:,}"
                )
            )
            lines.append(
                f"| {r['model']} | {d} | {x['predicted_codec_bytes']:,} | {same} | "
                f"{x['proxy_total_bytes']:,} | "
                f"{x['join_bytes']:,} + {x['fetch_bytes']:,} | {x['sync_bytes']:,} | "
                f"+{x['overhead_sync_pct']:.2f}% | {x['overhead_bytes_per_slice']:.0f} B | "
                f"+{x['overhead_all_pct']:.1f}% |"
            )
    return "\n".join(lines)


BREAKDOWN_ROWS = [
    ("session codec", "codec payload + scales (Chunk.payload, Chunk.scales)"),
    ("session protobuf fields", "protobuf fields of the chunk messages"),
    ("session other messages", "Hello, Welcome, PushResult messages"),
    ("session gRPC prefixes", "gRPC 5-byte message prefixes"),
    ("session DATA frame headers", "HTTP/2 DATA frame headers (9 B each)"),
    ("session HEADERS", "HTTP/2 HEADERS (call start, trailers)"),
    ("session WINDOW_UPDATE", "HTTP/2 WINDOW_UPDATE on the stream"),
    ("session RST_STREAM", "HTTP/2 RST_STREAM"),
    ("connection preface", "HTTP/2 connection preface"),
    ("connection SETTINGS", "HTTP/2 SETTINGS (+acks)"),
    ("connection WINDOW_UPDATE", "HTTP/2 WINDOW_UPDATE on the connection"),
    ("connection PING", "HTTP/2 PING (keepalive, BDP probes, acks)"),
    ("connection GOAWAY", "HTTP/2 GOAWAY"),
    ("join", "Join call (all frames)"),
    ("fetch", "Fetch call (all frames: fp32 masters)"),
]


def table_a_breakdown(r: dict) -> str:
    up, down = r["directions"]["up"], r["directions"]["down"]
    lines = ["| bytes | up | % of codec | down | % of codec |", "|---|---|---|---|---|"]
    keys = set(up["breakdown"]) | set(down["breakdown"])
    known = {k for k, _ in BREAKDOWN_ROWS}
    rows = BREAKDOWN_ROWS + [(k, k) for k in sorted(keys - known)]
    for key, label in rows:
        u, d = up["breakdown"].get(key, 0), down["breakdown"].get(key, 0)
        if not u and not d:
            continue
        pu = 100 * u / up["predicted_codec_bytes"]
        pd = 100 * d / down["predicted_codec_bytes"]
        lines.append(f"| {label} | {u:,} | {pu:.3f}% | {d:,} | {pd:.3f}% |")
    lines.append(
        f"| **total through the proxy** | {up['proxy_total_bytes']:,} | | {down['proxy_total_bytes']:,} | |"
    )
    return "\n".join(lines)


def part_a(models: list[str], quick: bool, procs: Procs, tmp: Path, max_wait: float) -> list[dict]:
    """Part (a): one run per model, 2 shards and 2 workers each."""
    runs = []
    for m in models:
        spec = (A_QUICK if quick else A_RUNS).get(m) or A_RUNS.get(m) or dict(A_RUNS["tiny"])
        runs.append(run_framing(m, spec, 2, 2, procs, tmp, max_wait))
        d = runs[-1]["directions"]
        say(
            f"[a]   {runs[-1]['wall_seconds']:.0f}s; overhead of the sync traffic: "
            f"up +{d['up']['overhead_sync_pct']:.2f}%, down +{d['down']['overhead_sync_pct']:.2f}%"
        )
    return runs


def report_a(runs: list[dict]) -> list[str]:
    """Say part (a)'s tables; results.md's section."""
    t = table_a(runs)
    say("\n(a) Framing overhead: bytes through the proxies against the codec bytes the config predicts\n")
    say(t)
    md = ["## (a) Framing overhead", "", t, ""]
    for r in runs:
        bt = table_a_breakdown(r)
        u, d = r["directions"]["up"], r["directions"]["down"]
        bt += (
            "\n\nThe processes' own counters (protobuf message bytes, ByteSize): workers' "
            f"message_bytes_sent {u['worker_wire_bytes']:,}, received {d['worker_wire_bytes']:,} "
            f"(Fetch included); shards' wire_in {u['shard_wire_bytes']:,}, "
            f"wire_out {d['shard_wire_bytes']:,}. "
            f"Streams seen: {dict(r['stream_kinds'])} on {r['connections']} connections."
        )
        say(f"\n(a) {r['model']}: where the bytes go (all connections, both shards)\n")
        say(bt)
        md += [f"### (a) {r['model']}: where the bytes go", "", bt, ""]
    return md
