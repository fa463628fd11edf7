"""Elasticity benchmark: what checkpoints cost, how fast a run recovers from a shard that dies, and whether
workers that join hold up the ones already training. Each figure is measured beside a reference in the
same run.

(a) checkpoint   In this process: a shard's state for one shard of the model; per fragment, the time of
                 one round's close (average, outer step, E3M0 update with error feedback) and of writing
                 that fragment's checkpoint file (torch.save, fsync, rename, fsync of the directory),
                 which the shard does between the two. Reference: the close itself.
(b) overhead     `streamdiloco server` x2 and `streamdiloco worker` x2 (tiny GPT): workers' tokens/s and
                 blocked seconds with the shards checkpointing every round (the default). Reference: the
                 same cluster with --no-checkpoint.
(c) recovery     The same cluster; shard 0 is killed with SIGKILL mid-run and started again at once from
                 its checkpoint on the same port: seconds until it serves again, until its first round
                 closes after that, and the workers' wall time against (b)'s uninterrupted run. Also
                 checks that the final global parameters equal the uninterrupted run's, bit for bit.
(d) joining      One shard, two workers that train with a 0.1 s step (--step-delay: a GPU-like step that
                 leaves the CPUs free), then k workers join at once mid-run: the first two workers'
                 blocked seconds and waited merges, and the longest round, against k = 0.

    python -m benchmarks.elastic                # the recorded run (BENCHMARKS.md), about 10 minutes
    python -m benchmarks.elastic --quick        # fewer steps and repeats (about 4 minutes)
    python -m benchmarks.elastic --parts a,d    # some parts

Writes results.md, results.json and run.log under --out (default benchmarks/results/elastic). Every process
it starts is stopped at the end, on an error and on Ctrl+C.
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Procs, Run, Session, bench_parser, http_json, say, wait_quiet
from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.modelspec import build_model
from streamdiloco.export import fetch_masters
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.storage.checkpoint import ShardCheckpoint


# --- (a) ----------------------------------------------------------------------------------------------------
def part_a(models: list[str], reps: int, scratch: Path) -> list[dict]:
    cfg = SyncConfig()
    rows = []
    for model_name in models:
        model = build_model(model_name, 0)
        layout = build_layout(model, cfg.num_fragments, cfg.fragment_pattern)
        initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
        state = ShardState(0, 1, layout, cfg, initial)
        ckpt = ShardCheckpoint(scratch / model_name, model_fingerprint(layout, cfg))
        ckpt.save_all(state)
        close_ms, save_ms, sizes = [], [], []
        g = torch.Generator().manual_seed(0)
        for r in range(reps):
            for f in range(layout.num_fragments):
                lo, hi = state.ranges[f]
                delta = torch.randn(hi - lo, generator=g) * 1e-3
                state.push("w", f, r, encode(delta, cfg.uplink_codec, cfg.codec_block_size), 1.0)
                state.add_member("w")
                t0 = time.perf_counter()
                state.close_round(f, "all")
                t1 = time.perf_counter()
                assert ckpt.save_fragment(state, f)
                t2 = time.perf_counter()
                close_ms.append(1e3 * (t1 - t0))
                save_ms.append(1e3 * (t2 - t1))
                sizes.append((ckpt.dir / f"fragment-{f}.pt").stat().st_size)
        row: dict[str, Any] = {
            "model": model_name,
            "params": sum(p.numel() for p in model.parameters()),
            "fragment_mb": statistics.median(sizes) / 1e6,
            "close_ms": statistics.median(close_ms),
            "save_ms": statistics.median(save_ms),
            "save_ms_max": max(save_ms),
        }
        row["ratio"] = row["save_ms"] / row["close_ms"]
        rows.append(row)
        say(
            f"[a] {model_name}: {row['params']:,} params, {row['fragment_mb']:.2f} MB per fragment file; "
            f"close {row['close_ms']:.1f} ms, checkpoint {row['save_ms']:.1f} ms (x{row['ratio']:.2f})"
        )
    return rows


def table_a(rows: list[dict]) -> str:
    out = [
        "| model | params | fragment file | close a round (ref) | write its checkpoint | ratio "
        "| slowest write |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['params']:,} | {r['fragment_mb']:.2f} MB | {r['close_ms']:.1f} ms | "
            f"{r['save_ms']:.1f} ms | {r['ratio']:.2f}x | {r['save_ms_max']:.1f} ms |"
        )
    return "\n".join(out)


# --- clusters for (b), (c), (d) -----------------------------------------------------------------------------
def _wait(what: str, pred, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def cluster_run(
    procs: Procs, tmp: Path, tag: str, steps: int, checkpoint: bool, kill_at_round: int | None = None
) -> dict:
    """2 shards, 2 workers (tiny), --min-workers 2; optionally shard 0 killed at a round and restarted."""
    sync = ["--model", "tiny", "--sync-every", "30", "--num-fragments", "5"]
    shard_flags = [*sync, "--min-workers", "2", "--round-timeout", "300"]
    shard_flags += (
        ["--checkpoint-dir", str(tmp / f"{tag}-ckpt{{s}}"), "--fresh"] if checkpoint else ["--no-checkpoint"]
    )
    run = Run(procs, tmp, tag)
    ports = [run.shard(s, 2, [x.replace("{s}", str(s)) for x in shard_flags]) for s in range(2)]
    servers = ",".join(f"127.0.0.1:{p['grpc_port']}" for p in ports)
    work = [
        *sync,
        "--steps",
        str(steps),
        "--log-every",
        "50",
        "--checkpoint-every",
        "0",
        "--eval-batches",
        "2",
    ]
    for m in range(2):
        run.worker(m, servers, work, threads=1)
    out: dict = {"tag": tag, "checkpoint": checkpoint}
    if kill_at_round is not None:
        _wait(
            f"round {kill_at_round}",
            lambda: http_json(ports[0]["http_port"])["fragments"][0]["round"] >= kill_at_round,
            timeout=600,
        )
        p0 = run.p[f"{tag}-shard0"]
        t_kill = time.time()
        p0.send_signal(signal.SIGKILL)
        p0.wait()
        flags0 = [x.replace("{s}", "0") for x in shard_flags if x != "--fresh"]
        ports[0] = run.shard(0, 2, flags0, port=ports[0]["grpc_port"])
        t_ready = time.time()

        def first_close() -> float | None:
            rounds = http_json(ports[0]["http_port"])["recent_rounds"]
            return rounds[0]["closed_at"] if rounds else None

        _wait("a round on the restarted shard", lambda: first_close() is not None, timeout=600)
        out["restart_seconds"] = t_ready - t_kill
        out["first_round_seconds"] = first_close() - t_ready  # type: ignore[operator]
    ws = run.wait_workers(["w0", "w1"])
    out["masters"] = fetch_masters(servers.split(","))
    out["tok_s"] = statistics.mean(w["tokens"] / w["train_seconds"] for w in ws)
    out["blocked"] = statistics.mean(w["blocked_seconds"] for w in ws)
    out["train_seconds"] = statistics.mean(w["train_seconds"] for w in ws)
    out["resent"] = sum(w["pushes_resent"] for w in ws)
    out["reconnects"] = sum(w["reconnects"] for w in ws)
    out["eval_loss"] = ws[0]["eval_loss"]
    run.stop_shards()
    return out


def part_b_c(procs: Procs, tmp: Path, steps: int, reps: int, max_wait: float) -> dict:
    rows: dict[str, list[dict]] = {"off": [], "on": [], "kill": []}
    for i in range(reps):
        for kind in ("off", "on", "kill"):
            wait_quiet(f"{kind}{i}", max_wait)
            r = cluster_run(
                procs,
                tmp,
                f"{kind}{i}",
                steps,
                checkpoint=kind != "off",
                kill_at_round=3 if kind == "kill" else None,
            )
            rows[kind].append(r)
            extra = (
                f", restart {r['restart_seconds']:.1f}s, first round {r['first_round_seconds']:.2f}s later, "
                f"{r['resent']} pushes resent"
                if kind == "kill"
                else ""
            )
            say(
                f"[b/c] {kind} #{i}: {r['tok_s']:,.0f} tok/s per worker, blocked {r['blocked']:.2f}s, "
                f"train {r['train_seconds']:.1f}s{extra}"
            )
    ref = rows["on"][0]["masters"]
    same = all(
        all(torch.equal(a, b) for a, b in zip(r["masters"], ref, strict=True))
        for r in rows["on"] + rows["kill"]
    )
    for r in rows["on"] + rows["kill"] + rows["off"]:
        del r["masters"]
    return {"rows": rows, "same_params": same}


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table_b(bc: dict) -> str:
    rows = bc["rows"]
    off_tok, off_train = _med(rows["off"], "tok_s"), _med(rows["off"], "train_seconds")
    out = [
        "| run | tokens/s per worker | ratio | blocked s | train s | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, label in (
        ("off", "--no-checkpoint (ref)"),
        ("on", "checkpoint every round"),
        ("kill", "+ shard 0 killed, restarted"),
    ):
        tok, train = _med(rows[kind], "tok_s"), _med(rows[kind], "train_seconds")
        out.append(
            f"| {label} | {tok:,.0f} | {tok / off_tok:.3f} | {_med(rows[kind], 'blocked'):.2f} | "
            f"{train:.1f} | {train / off_train:.3f} |"
        )
    k = rows["kill"]
    out += [
        "",
        f"Shard 0 killed at its fragment 0's round 3: serving again {_med(k, 'restart_seconds'):.1f} s "
        f"after the kill (a new process: Python, torch, the model), its first round closed "
        f"{_med(k, 'first_round_seconds'):.2f} s after that; pushes sent again: "
        f"{', '.join(str(r['resent']) for r in k)}. Final global parameters of every checkpointing and "
        f"killed run equal to the first uninterrupted one, bit for bit: "
        f"{'yes' if bc['same_params'] else 'NO'}.",
    ]
    return "\n".join(out)


# --- (d) ----------------------------------------------------------------------------------------------------
def joining_run(procs: Procs, tmp: Path, k: int, steps: int) -> dict:
    sync = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]
    tag = f"join{k}"
    run = Run(procs, tmp, tag)
    port = run.shard(0, 1, [*sync, "--min-workers", "1", "--round-timeout", "60", "--no-checkpoint"])
    servers = f"127.0.0.1:{port['grpc_port']}"
    work = [
        *sync,
        "--steps",
        str(steps),
        "--log-every",
        "60",
        "--checkpoint-every",
        "0",
        "--eval-batches",
        "1",
    ]
    work += ["--step-delay", "0.1"]
    for m in range(2):
        run.worker(m, servers, work, threads=1)
    _wait("round 5", lambda: http_json(port["http_port"])["fragments"][0]["round"] >= 5, timeout=300)
    t_join = time.time()
    for m in range(2, 2 + k):
        run.worker(m, servers, work, threads=1)
    ws = run.wait_workers([f"w{m}" for m in range(2 + k)])
    rounds = http_json(port["http_port"], "/api/status?rounds=500")["recent_rounds"]
    after = [r for r in rounds if r["closed_at"] >= t_join and r["seconds"] is not None]
    members = ws[:2]
    out = {
        "k": k,
        "blocked": statistics.mean(w["blocked_seconds"] for w in members),
        "waited": statistics.mean(w["merges_that_waited"] for w in members),
        "merges": members[0]["merges"],
        "train_seconds": statistics.mean(w["train_seconds"] for w in members),
        "max_round_after": max((r["seconds"] for r in after), default=0.0),
        "median_round_after": statistics.median([r["seconds"] for r in after]) if after else 0.0,
        "joiner_first_steps": [w["first_step"] for w in ws[2:]],
    }
    run.stop_shards()
    say(
        f"[d] k={k}: members blocked {out['blocked']:.2f}s "
        f"({out['waited']:.1f} of {out['merges']} merges waited), "
        f"train {out['train_seconds']:.1f}s; rounds after the join: median {out['median_round_after']:.3f}s, "
        f"max {out['max_round_after']:.3f}s; joiners started at steps {out['joiner_first_steps']}"
    )
    return out


def table_d(rows: list[dict]) -> str:
    ref = next(r for r in rows if r["k"] == 0)
    out = [
        "| joiners | members' blocked s | waited merges | members' train s | ratio "
        "| rounds after join: median / max s | joiners' first step |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['k']} | {r['blocked']:.2f} | {r['waited']:.1f} of {r['merges']} | "
            f"{r['train_seconds']:.1f} | "
            f"{r['train_seconds'] / ref['train_seconds']:.3f} | {r['median_round_after']:.3f} / "
            f"{r['max_round_after']:.3f} | {', '.join(map(str, r['joiner_first_steps'])) or '-'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = bench_parser(__doc__, "elastic", parts="a,b,d", parts_help="a, b (b includes c), d").parse_args(argv)
    parts = set(a.parts.split(","))
    md: list[str] = []
    with Session("elastic", argv, Path(a.out), scratch_in_out=True) as s:
        procs, tmp, results = s.procs, s.tmp, s.results
        if "a" in parts:
            results["a"] = part_a(
                ["nano", "tiny", "small"] if a.quick else ["nano", "tiny", "small", "medium"],
                3 if a.quick else 5,
                tmp / "a",
            )
            md += ["## (a) checkpoint cost per round", "", table_a(results["a"]), ""]
        if "b" in parts:
            results["bc"] = part_b_c(procs, tmp, 120 if a.quick else 240, 1 if a.quick else 3, a.max_wait)
            md += ["## (b, c) checkpoint overhead and recovery", "", table_b(results["bc"]), ""]
        if "d" in parts:
            steps = 90 if a.quick else 150
            results["d"] = []
            for k in (0, 2, 4):
                wait_quiet(f"join{k}", a.max_wait)
                results["d"].append(joining_run(procs, tmp, k, steps))
            md += ["## (d) workers joining at once", "", table_d(results["d"]), ""]
    return s.finish(md)


if __name__ == "__main__":
    sys.exit(main())
