"""Monitoring benchmark: what watching a run costs. Each figure is measured beside a reference in the same
run.

(a) endpoints   In this process: a shard (tiny GPT, one shard of two) whose dashboard buffers are full
                (16 workers' progress at 600 points each, 500 closed rounds, 15 minutes of samples): the
                time to render the bodies of /metrics, /api/status and /api/series (all of it: a page
                that opens; the last 2 seconds: what the page asks for at each poll) as the handlers do,
                on the shard's event loop, and the bytes served. Reference: one round's close (average,
                outer step, E3M0 update) of one fragment.
(b) overhead    `streamdiloco server` x2 and `streamdiloco worker` x2 (tiny GPT), every process serving
                /metrics: the workers' tokens/s and blocked seconds while a scraper fetches every shard's
                /metrics, /api/status and /api/series and every worker's /metrics once a second (a
                1-second Prometheus plus an open dashboard page), against the same cluster not watched.

    python -m benchmarks.monitoring              # the recorded run (BENCHMARKS.md), about 8 minutes
    python -m benchmarks.monitoring --quick      # fewer steps and repeats
    python -m benchmarks.monitoring --parts a    # some parts

Writes results.md, results.json and run.log under --out (default benchmarks/results/monitoring).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from benchmarks.harness import Procs, Run, Session, bench_parser, free_ports, say, wait_quiet
from streamdiloco.common.codecs import encode
from streamdiloco.common.config import ModelSettings, SyncConfig
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.observe import dashboard as dashboard_module
from streamdiloco.server.shard import Shard
from streamdiloco.server.startup import build_shard


# --- (a) ----------------------------------------------------------------------------------------------------
def _median_ms(fn, reps: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        size = len(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), size


def part_a(reps: int) -> dict:
    cfg = SyncConfig()
    svc = build_shard(ShardConfig(model=ModelSettings("tiny"), sync=cfg, shard=0, num_shards=2))
    assert isinstance(svc, Shard)  # a model, not --init from-worker
    st = svc.state
    now = time.time()
    dash = svc.dashboard
    n = dashboard_module.PROGRESS_POINTS
    for w in range(16):  # full buffers: what a long run with many workers has, a push a second each
        dash.record_progress(f"site-{w:02d}", 0, 2.5, 0.0)
        dash.progress[f"site-{w:02d}"].extend(
            (now - n + i, i * 30, 2.5, 0.01 * i, i * 30 * 2048, 0.9) for i in range(n)
        )
    for i in range(dashboard_module.SAMPLES):
        dash.samples.append((now - dashboard_module.SAMPLES + i, i * 10**6, i * 2 * 10**6, 16, 0))
    for i in range(dashboard_module.HISTORY):
        dash.record_round(
            {
                "fragment": i % 5,
                "round": i // 5,
                "contributors": [f"site-{w:02d}" for w in range(16)],
                "why": "all",
                "seconds": 0.2,
                "mean_loss": 2.5,
                "closed_at": now - dashboard_module.HISTORY + i,
            }
        )
    since = time.time() - 2.0
    rows: list[dict[str, Any]] = []
    for name, fn in [
        ("/metrics", svc.metrics.render),
        ("/api/status", lambda: JSONResponse(svc.view.status(20)).body),
        ("/api/series (all)", lambda: JSONResponse(svc.view.series(0.0)).body),
        ("/api/series (last 2 s)", lambda: JSONResponse(svc.view.series(since)).body),
        # what FastAPI does with a returned dict (the first version did that): jsonable_encoder, then dumps
        (
            "/api/series (all), FastAPI's encoder",
            lambda: JSONResponse(jsonable_encoder(svc.view.series(0.0))).body,
        ),
    ]:
        ms, size = _median_ms(fn, reps)
        rows.append({"endpoint": name, "ms": ms, "bytes": size})
    # reference: one fragment's round close on the same shard state
    g = torch.Generator().manual_seed(0)
    closes = []
    for r in range(reps):
        lo, hi = st.ranges[0]
        st.add_member("w")
        st.push(
            "w", 0, r, encode(torch.randn(hi - lo, generator=g) * 1e-3, "e3m0", cfg.codec_block_size), 1.0
        )
        t0 = time.perf_counter()
        st.close_round(0, "all")
        closes.append((time.perf_counter() - t0) * 1e3)
    ref = statistics.median(closes)
    for row in rows:
        row["vs_close"] = row["ms"] / ref
    return {"rows": rows, "close_ms": ref, "values_per_fragment_slice": st.ranges[0][1] - st.ranges[0][0]}


def table_a(a: dict) -> str:
    out = [
        f"Reference: one round's close of one fragment on this shard, {a['close_ms']:.2f} ms "
        f"({a['values_per_fragment_slice']:,} values).",
        "",
        "| endpoint | median ms | bytes | ÷ a round's close |",
        "|---|---:|---:|---:|",
    ]
    for r in a["rows"]:
        out.append(f"| `{r['endpoint']}` | {r['ms']:.2f} | {r['bytes']:,} | {r['vs_close']:.2f}× |")
    return "\n".join(out)


# --- (b) ----------------------------------------------------------------------------------------------------
class Scraper:
    """Fetches every URL once a second in a thread; counts requests and failures."""

    def __init__(self, urls: list[str]):
        self.urls, self.ok, self.failed, self.bytes = urls, 0, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        self.bytes += len(r.read())
                    self.ok += 1
                except OSError:  # a worker that finished and stopped serving
                    self.failed += 1


def cluster_run(procs: Procs, tmp: Path, tag: str, steps: int, watched: bool) -> dict:
    sync = ["--model", "tiny", "--sync-every", "30", "--num-fragments", "5"]
    run = Run(procs, tmp, tag)
    ports = [run.shard(s, 2, [*sync, "--min-workers", "2", "--no-checkpoint"]) for s in range(2)]
    servers = ",".join(f"127.0.0.1:{p['grpc_port']}" for p in ports)
    metrics = free_ports(2)
    for m in range(2):
        flags = [*sync, "--steps", str(steps), "--log-every", "50", "--checkpoint-every", "0"]
        flags += ["--eval-batches", "2", "--metrics-port", str(metrics[m])]
        run.worker(m, servers, flags, threads=1)
    scraper = None
    if watched:
        urls = [
            f"http://127.0.0.1:{p['http_port']}{path}" for p in ports for path in ("/metrics", "/api/status")
        ]
        urls += [f"http://127.0.0.1:{p['http_port']}/api/series?since={time.time() - 2:.0f}" for p in ports]
        urls += [f"http://127.0.0.1:{port}/metrics" for port in metrics]
        scraper = Scraper(urls)
        scraper.thread.start()
    try:
        ws = run.wait_workers(["w0", "w1"])
    finally:
        if scraper is not None:
            scraper.stop.set()
            scraper.thread.join(10)
        run.stop_shards()
    out = {
        "tag": tag,
        "watched": watched,
        "tok_s": statistics.mean(w["tokens"] / w["train_seconds"] for w in ws),
        "blocked": statistics.mean(w["blocked_seconds"] for w in ws),
        "eval_loss": ws[0]["eval_loss"],
    }
    if scraper is not None:
        out.update(requests=scraper.ok, failed=scraper.failed, scraped_bytes=scraper.bytes)
    return out


def part_b(procs: Procs, tmp: Path, steps: int, reps: int, max_wait: float) -> dict:
    rows: dict[str, list[dict]] = {"quiet": [], "watched": []}
    for i in range(reps):
        for kind in ("quiet", "watched"):
            wait_quiet(f"{kind}{i}", max_wait)
            r = cluster_run(procs, tmp, f"{kind}{i}", steps, watched=kind == "watched")
            rows[kind].append(r)
            extra = f", {r['requests']} requests ({r['failed']} failed)" if kind == "watched" else ""
            say(f"[b] {kind} #{i}: {r['tok_s']:,.0f} tok/s per worker, blocked {r['blocked']:.2f}s{extra}")
    return {"rows": rows, "steps": steps}


def table_b(b: dict) -> str:
    q, w = b["rows"]["quiet"], b["rows"]["watched"]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def runs(rows: list[dict]) -> str:
        return ", ".join(f"{r['tok_s']:,.0f}" for r in rows)

    return "\n".join(
        [
            f"2 shards × 2 workers, tiny GPT, {b['steps']} steps, {len(q)} runs each, alternating; medians.",
            "",
            "| cluster | tokens/s per worker | blocked s per worker | requests served |",
            "|---|---:|---:|---:|",
            f"| not watched (reference) | {med(q, 'tok_s'):,.0f} | {med(q, 'blocked'):.2f} | 0 |",
            f"| watched every second | {med(w, 'tok_s'):,.0f} | {med(w, 'blocked'):.2f} | "
            f"{med(w, 'requests'):,.0f} |",
            "",
            f"Ratio watched ÷ not watched, tokens/s: {med(w, 'tok_s') / med(q, 'tok_s'):.3f} "
            f"(runs: {runs(q)} vs {runs(w)}).",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = bench_parser(__doc__, "monitoring", parts="a,b", parts_help="a, b").parse_args(argv)
    parts = set(a.parts.split(","))
    md: list[str] = []
    with Session("monitoring", argv, Path(a.out)) as s:
        if "a" in parts:
            s.results["a"] = part_a(20 if a.quick else 50)
            md += ["## (a) endpoint cost on a shard with full buffers", "", table_a(s.results["a"]), ""]
            say(table_a(s.results["a"]))
        if "b" in parts:
            s.results["b"] = part_b(s.procs, s.tmp, 120 if a.quick else 240, 1 if a.quick else 3, a.max_wait)
            md += ["## (b) training watched every second vs not watched", "", table_b(s.results["b"]), ""]
    return s.finish(md)


if __name__ == "__main__":
    sys.exit(main())
