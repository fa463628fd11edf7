"""Part (c) of the wire benchmark, the demo: `streamdiloco launch --shards 2 --workers 2 --steps 400
--log-every 50` (`make demo`, at half its 800 steps): per worker compute utilization (training time / wall
time of training), blocked seconds, tokens/s. Reference: the same cluster with H = steps (each fragment
syncs at most once before the final sync). Both again with every worker on all the cores (--threads),
torch's default, where launch gives each worker cores / M threads and each shard one.

What (c) runs and reports; the command line is in main.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

from benchmarks.harness import Procs, say, sd, session_cpu, system_busy_seconds, wait_quiet


def run_launch(
    procs: Procs,
    tmp: Path,
    tag: str,
    steps: int,
    extra: list[str],
    max_wait: float,
    log_every: int,
    env_extra: dict | None = None,
) -> dict:
    busy = wait_quiet("c", max_wait)
    out = tmp / tag
    argv = sd(
        "launch", "--shards", "2", "--workers", "2", "--steps", str(steps), "--log-every", str(log_every)
    )
    argv += ["--out", str(out), *extra]
    t0 = time.monotonic()
    sys0 = system_busy_seconds()
    p = procs.start(tag, argv, env_extra=env_extra)
    log = procs.logdir / f"{tag}.log"
    last = 0.0
    ours: dict[int, float] = {}  # the cluster's processes' CPU, last seen (sampled every 0.5 s)
    try:
        while p.poll() is None:
            try:
                p.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
            ours.update(session_cpu(p.pid))
            if time.monotonic() - last > 20:
                last = time.monotonic()
                steps_lines = [ln for ln in log.read_text(errors="replace").splitlines() if " step " in ln]
                if steps_lines:
                    say(f"[c]   {time.monotonic() - t0:.0f}s: {steps_lines[-1].split('INFO ')[-1]}")
            if time.monotonic() - t0 > 900:
                raise RuntimeError(f"{tag} did not finish:\n{procs.tail(tag)}")
        if p.returncode:
            raise RuntimeError(f"{tag} exited with status {p.returncode}:\n{procs.tail(tag, 30)}")
    finally:
        procs.stop(p)
    summary = json.loads((out / "summary.json").read_text())
    env = " ".join(f"{k}={v}" for k, v in (env_extra or {}).items())
    summary["command"] = (env + " " if env else "") + shlex.join(["streamdiloco", *argv[3:]]).replace(
        str(out), "DIR"
    )
    wall = time.monotonic() - t0
    summary["launch_seconds"] = wall
    summary["busy_before"] = busy
    summary["cluster_cores"] = sum(ours.values()) / wall
    summary["machine_cores"] = (system_busy_seconds() - sys0) / wall  # all processes, ours included
    return summary


C_RUNS = {
    "demo": "demo, H=30",
    "reference": "reference, H=steps",
    "demo-all": "demo, H=30, every worker on all cores",
    "reference-all": "reference, H=steps, every worker on all cores",
}


def part_c(args: argparse.Namespace, procs: Procs, tmp: Path) -> dict:
    """The demo cluster, and the same with H = steps; and (not --quick) both again with every worker using as
    many torch threads as the machine has cores (torch's default; launch gives each worker cores / M)."""
    out = {}
    every = ["--threads", str(os.cpu_count() or 1)]
    plan: list[tuple[str, list[str], dict | None]] = [("demo", [], None)]
    if args.c_reference:
        plan.append(("reference", ["--sync-every", str(args.c_steps)], None))
    if args.c_threads:
        plan.append(("demo-all", every, None))
        if args.c_reference:
            plan.append(("reference-all", ["--sync-every", str(args.c_steps), *every], None))
    for key, extra, env in plan:
        say(f"[c] {C_RUNS[key]}: launch --shards 2 --workers 2 --steps {args.c_steps} {' '.join(extra)} ...")
        out[key] = run_launch(
            procs, tmp, f"c-{key}", args.c_steps, extra, args.max_wait, args.c_log_every, env_extra=env
        )
    return out


def table_c(c: dict) -> str:
    lines = [
        "| run | worker | compute utilization | compute s | train s | blocked s | merges that waited | "
        "tokens/s (wall of training) | tokens/s (compute only) | eval loss | cluster CPU | other processes |",
        "|" + "---|" * 12,
    ]
    for key, label in C_RUNS.items():
        if key not in c:
            continue
        run = c[key]
        other = max(0.0, run["machine_cores"] - run["cluster_cores"])
        for w in run["workers"]:
            waited = f"{w['merges_that_waited']} of {w['merges']}" if "merges" in w else "n/a"
            lines.append(
                f"| {label} | {w['worker']} | **{100 * w['compute_utilization']:.1f}%** | "
                f"{w['compute_seconds']:.1f} | {w['train_seconds']:.1f} | {w['blocked_seconds']:.2f} | "
                f"{waited} | "
                f"{w['tokens'] / w['train_seconds']:,.0f} | {w['tokens'] / w['compute_seconds']:,.0f} | "
                f"{w['eval_loss']:.4f} | {run['cluster_cores']:.2f} cores | {other:.2f} cores |"
            )
    return "\n".join(lines)


def report_c(c: dict, steps: int) -> list[str]:
    """Say part (c)'s table and the runs' throughput against the demo's (into c["throughput_vs_demo"]);
    results.md's section."""
    t = table_c(c)
    say(f"\n(c) The demo cluster's compute utilization ({steps} steps)\n")
    say(t)
    extra = [
        f"command: `{c['demo']['command']}`; wall {c['demo']['wall_seconds']:.0f}s; "
        f"mirrors equal masters: {c['demo']['mirrors_match_masters']}"
    ]

    def cluster_tps(run: dict) -> float:
        return sum(w["tokens"] / w["train_seconds"] for w in run["workers"])

    ratios = {}
    for key in C_RUNS:
        if key != "demo" and key in c:
            ratios[key] = cluster_tps(c[key]) / cluster_tps(c["demo"])
            extra.append(
                f"{C_RUNS[key]}: `{c[key]['command']}`; cluster tokens/s (wall of training) "
                f"{cluster_tps(c[key]):,.0f} against the demo's {cluster_tps(c['demo']):,.0f}: "
                f"{ratios[key]:.3f}×"
            )
    c["throughput_vs_demo"] = ratios
    for ln in extra:
        say(ln)
    return [f"## (c) Demo compute utilization ({steps} steps)", "", t, "", *[f"- {x}" for x in extra], ""]
