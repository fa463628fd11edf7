"""A worker of 2 ranks (torchrun, gloo) against a worker of 1 rank: throughput and bytes per site.

Each run: 2 `streamdiloco server` shards on loopback and one worker, `streamdiloco worker` (1 rank) or
`torchrun --nproc-per-node 2 -m streamdiloco worker` (2 ranks), with the same per-rank batch: the 2-rank
worker trains on twice the tokens per step (weak scaling, as a site of 2 GPUs would). Figures from the
worker's summary (rank 0's): tokens/s over its training time, bytes it sent to the shards (the WAN's
traffic per site), bytes it broadcast to the other rank (the site's own links), its time in the group's
collectives. The ratio is the 2-rank worker's over the 1-rank worker's, medians of --repeats runs made in
alternation.

Two kinds of step:
  cpu       the built-in GPT computes its steps on this machine's CPU, 1 thread per rank: on a 2-core
            machine the 2 ranks and the shards share the cores (a lower bound of the scaling);
  emulated  a GPU-like step: --step-delay (the training thread sleeps) on a nano model with a small batch,
            so that the CPU is nearly free and what remains is the group's own cost per step (its
            all-reduce and broadcasts, DDP's gradient all-reduce) against the step.

    python -m benchmarks.process_group              # the recorded run (BENCHMARKS.md), about 6 minutes
    python -m benchmarks.process_group --quick      # 1 repeat, fewer steps

Writes results.md, results.json and run.log under --out (default benchmarks/results/process_group). Every
process it starts is stopped at the end, on an error and on Ctrl+C.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.harness import (
    Procs,
    Session,
    bench_parser,
    free_port,
    say,
    sd,
    start_shards,
    wait_quiet,
)

# fragments every 2 steps at H=8, P=4: the merges (and their broadcasts) come often
SYNC = ["--sync-every", "8", "--num-fragments", "4"]
KINDS = {
    "cpu": {"model": "tiny", "batch": 8, "delay": 0.0},
    "emulated": {"model": "nano", "batch": 4, "delay": 0.1},
}


def one_run(procs: Procs, tmp: Path, tag: str, kind: str, ranks: int, steps: int) -> dict:
    k = KINDS[kind]
    model = str(k["model"])
    shard_flags = ["--model", model, *SYNC]
    shards = start_shards(procs, tmp, tag, 2, shard_flags, checkpoint=False)
    servers = ",".join(f"127.0.0.1:{info['grpc_port']}" for _, _, info in shards)
    summary = tmp / f"{tag}.json"
    argv = ["worker", "--servers", servers, "--name", tag, "--model", model, *SYNC]
    argv += ["--steps", str(steps), "--batch-size", str(k["batch"]), "--step-delay", str(k["delay"])]
    argv += ["--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0", "--log-every", "20"]
    argv += ["--summary", str(summary), "--checkpoint", str(tmp / f"{tag}.pt")]
    if ranks == 1:
        cmd = sd(*argv)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        cmd += ["-m", "streamdiloco", *argv]
    p = procs.start(tag, cmd, env_extra={"OMP_NUM_THREADS": "1"})
    code = p.wait(600)
    if code != 0:
        raise RuntimeError(f"{tag} exited with {code}:\n{procs.tail(tag, 30)}")
    for _, sp, _ in shards:
        procs.stop(sp)
    s = json.loads(summary.read_text())
    row = {
        "kind": kind,
        "ranks": ranks,
        "tokens": s["tokens"],
        "train_seconds": s["train_seconds"],
        "tokens_per_second": s["tokens"] / s["train_seconds"],
        "bytes_sent": s["bytes_sent"],
        "message_bytes_sent": s["message_bytes_sent"],
        "group_broadcast_bytes": s["group_broadcast_bytes"],
        "group_seconds": s["group_seconds"],
        "compute_utilization": s["compute_utilization"],
        "eval_loss": s["eval_loss"],
    }
    say(
        f"[{tag}] {row['tokens_per_second']:,.0f} tok/s, sent {row['bytes_sent']:,} B, broadcast "
        f"{row['group_broadcast_bytes']:,} B, group {row['group_seconds']:.2f} s "
        f"of {row['train_seconds']:.1f} s"
    )
    return row


def table(rows: list[dict]) -> str:
    out = [
        "| step | ranks | tokens/step | tokens/s (median) | ratio | bytes sent to the shards | "
        "bytes broadcast in the site | time in group collectives | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        ref = None
        for ranks in (1, 2):
            rs = [r for r in rows if r["kind"] == kind and r["ranks"] == ranks]
            if not rs:
                continue
            tps = statistics.median(r["tokens_per_second"] for r in rs)
            ref = tps if ranks == 1 else ref
            ratio = f"{tps / ref:.2f}x" if ref else "-"
            frac = statistics.median(r["group_seconds"] / r["train_seconds"] for r in rs)
            out.append(
                f"| {kind} | {ranks} | {per_step_tokens(rs[0]):,} | {tps:,.0f} | {ratio} | "
                f"{statistics.median(r['bytes_sent'] for r in rs):,.0f} | "
                f"{statistics.median(r['group_broadcast_bytes'] for r in rs):,.0f} | "
                f"{100 * frac:.1f} % | {len(rs)} |"
            )
    return "\n".join(out)


def per_step_tokens(row: dict) -> int:
    return row["tokens"] // STEPS[row["kind"]]


STEPS: dict[str, int] = {}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_parser(__doc__, "process_group")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="cpu,emulated")
    a = ap.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            raise SystemExit(f"process_group.py: error: --kinds: unknown {k!r} (cpu, emulated)")
    repeats = 1 if a.quick else a.repeats
    STEPS.update({"cpu": 40 if a.quick else 80, "emulated": 40 if a.quick else 80})
    with Session("process_group", argv, Path(a.out), scratch_in_out=True) as s:
        s.results["runs"] = []
        for rep in range(repeats):
            for kind in kinds:
                for ranks in (1, 2):
                    wait_quiet(f"{kind}-{ranks}", a.max_wait)
                    tag = f"{kind}-r{ranks}-{rep}"
                    s.results["runs"].append(one_run(s.procs, s.tmp, tag, kind, ranks, STEPS[kind]))
    return s.finish([table(s.results["runs"]), ""])


if __name__ == "__main__":
    sys.exit(main())
