"""Sites of unequal speed (issue 16): two sites, one twice as slow, with --sync-schedule adaptive (a faster
site does more inner steps per schedule step: common/pace.py) against today's fixed schedule (one inner
step per schedule step everywhere), measured in the same run.

(a) processes   `streamdiloco server` x2 and `streamdiloco worker` x2 (nano GPT, one torch thread each) on
                loopback. Each worker's step is an EMULATED accelerator step: --step-delay sleeps (0.1 s on
                the fast site, 0.2 s on the slow one) after its CPU step, and the sleep counts as compute,
                as a GPU's busy time would. Per schedule: each site's compute utilization and inner steps,
                the slow site's training seconds (the run's wall time: the same number of schedule steps),
                and the eval loss of the final global parameters. Medians over --reps runs.
(b) simulator   The in-process simulator (the same engine, shards and pace functions) with emulated step
                times 0.5 s and 1.0 s, defaults otherwise (H = 30, P = 5): the eval loss of the global
                parameters at equal emulated wall time along the run, and each site's utilization. One run
                each (the simulator is deterministic). A control with equal speeds shows adaptive = fixed.

    python -m benchmarks.unequal_speed            # the recorded run (BENCHMARKS.md), about 15 minutes
    python -m benchmarks.unequal_speed --quick    # fewer steps, one repeat (about 5 minutes)

Writes results.md, results.json and run.log under --out (default benchmarks/results/unequal_speed). Every
process it starts is stopped at the end, on an error and on Ctrl+C.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import Procs, Session, bench_parser, say, sd, start_shards, wait_quiet
from streamdiloco.common.config import ModelSettings, RunSettings, SyncConfig
from streamdiloco.export import fetch_masters
from streamdiloco.sim.simulator import SimConfig, simulate

SCHEDULES = ("fixed", "adaptive")
DELAYS = {"fast": 0.1, "slow": 0.2}  # seconds of emulated accelerator step per inner step


# --- (a) ----------------------------------------------------------------------------------------------------
def process_run(procs: Procs, tmp: Path, schedule: str, steps: int, rep: int) -> dict:
    tag = f"{schedule}{rep}"
    sync = ["--model", "nano", "--sync-every", "12", "--num-fragments", "3"]
    shards = start_shards(
        procs, tmp, tag, 2, [*sync, "--sync-schedule", schedule, "--min-workers", "2"], checkpoint=False
    )
    servers = ",".join(f"127.0.0.1:{info['grpc_port']}" for _, _, info in shards)
    started = {}
    for rank, (site, delay) in enumerate(DELAYS.items()):
        name = f"{tag}-{site}"
        argv = ["worker", "--servers", servers, "--name", site, "--rank", str(rank), *sync]
        argv += ["--steps", str(steps), "--eval-every", "0", "--checkpoint-every", "0", "--log-every", "60"]
        argv += ["--step-delay", str(delay), "--summary", str(tmp / f"{name}.json")]
        argv += ["--checkpoint", str(tmp / f"{name}.pt"), "--save-global", str(tmp / f"{name}-global.pt")]
        started[site] = procs.start(name, sd(*argv), env_extra={"OMP_NUM_THREADS": "1"})
    for site, p in started.items():
        if p.wait(900) != 0:
            raise RuntimeError(f"{tag}-{site} exited with {p.returncode}:\n{procs.tail(f'{tag}-{site}')}")
    out = {site: json.loads((tmp / f"{tag}-{site}.json").read_text()) for site in DELAYS}
    masters = fetch_masters([f"127.0.0.1:{info['grpc_port']}" for _, _, info in shards])
    mirrors_equal = all(
        all(
            torch.equal(a, b)
            for a, b in zip(torch.load(tmp / f"{tag}-{site}-global.pt"), masters, strict=True)
        )
        for site in DELAYS
    )
    for _, p, _ in shards:
        procs.stop(p)
    row = {
        "schedule": schedule,
        "rep": rep,
        "mirrors_equal_masters": mirrors_equal,
        "wall_seconds": out["slow"]["train_seconds"],
        "eval_loss": out["slow"]["eval_loss"],  # the global parameters: the same on both sites
    }
    for site, s in out.items():
        row[f"{site}_utilization"] = s["compute_utilization"]
        row[f"{site}_inner_steps"] = s["inner_steps"]
        row[f"{site}_tokens"] = s["tokens"]
        row[f"{site}_blocked"] = s["blocked_seconds"]
    say(
        f"  {schedule:8s} rep {rep}: utilization fast {row['fast_utilization']:.3f} slow "
        f"{row['slow_utilization']:.3f}, inner steps {row['fast_inner_steps']}/{row['slow_inner_steps']}, "
        f"wall {row['wall_seconds']:.1f} s, eval loss {row['eval_loss']:.4f}, mirrors = masters "
        f"{mirrors_equal}"
    )
    return row


def table_a(rows: list[dict], steps: int) -> str:
    def med(schedule: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["schedule"] == schedule)

    ref = med("fixed", "eval_loss")
    lines = [
        f"Two sites, nano GPT, {steps} schedule steps, H = 12, P = 3, tau = 1; emulated accelerator steps of "
        f"{DELAYS['fast']} s (fast) and {DELAYS['slow']} s (slow). Medians of "
        f"{sum(r['schedule'] == 'fixed' for r in rows)} runs.",
        "",
        "| schedule | fast site utilization | slow site utilization | inner steps fast / slow | fast site "
        "blocked s | wall s | eval loss | ratio vs fixed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in SCHEDULES:
        lines.append(
            f"| {s} | {med(s, 'fast_utilization'):.3f} | {med(s, 'slow_utilization'):.3f} | "
            f"{med(s, 'fast_inner_steps'):.0f} / {med(s, 'slow_inner_steps'):.0f} | "
            f"{med(s, 'fast_blocked'):.2f} | "
            f"{med(s, 'wall_seconds'):.1f} | {med(s, 'eval_loss'):.4f} | {med(s, 'eval_loss') / ref:.3f} |"
        )
    return "\n".join(lines)


# --- (b) ----------------------------------------------------------------------------------------------------
def sim_runs(steps: int, model: str) -> list[dict]:
    rows = []
    for times in ((0.5, 1.0), (1.0, 1.0)):
        for schedule in SCHEDULES:
            t0 = time.perf_counter()
            cfg = SimConfig(
                workers=2,
                run=RunSettings(steps=steps),
                model=ModelSettings(model=model),
                eval_every=max(1, steps // 6),
                step_seconds=times,
                sync=SyncConfig(sync_schedule=schedule),
            )
            r = simulate(cfg, log=None)
            rows.append(
                {
                    "step_seconds": list(times),
                    "schedule": schedule,
                    "curve": r["curve"],
                    "eval_loss": r["eval_loss"],
                    "utilization": r["compute_utilization"],
                    "inner_steps": r["inner_steps"],
                    "mirrors_match_masters": r["mirrors_match_masters"],
                    "seconds": time.perf_counter() - t0,
                }
            )
            say(
                f"  sim {times} {schedule:8s}: eval loss {r['eval_loss']:.4f}, utilization "
                f"{[round(u, 3) for u in r['compute_utilization']]}, {time.perf_counter() - t0:.0f} s"
            )
    return rows


def table_b(rows: list[dict], steps: int, model: str) -> str:
    lines = [
        f"Simulator, {model} GPT, M = 2, {steps} schedule steps, defaults (H = 30, P = 5, tau = 1); emulated "
        "step times per site. Eval loss of the global parameters at equal emulated wall time (seconds):",
        "",
    ]
    walls = [p["wall_seconds"] for p in rows[0]["curve"]][1:]
    lines += [
        "| step times | schedule | " + " | ".join(f"{w:.0f} s" for w in walls) + " | utilization "
        "fast / slow | ratio vs fixed at the end |",
        "|---|---|" + "---:|" * (len(walls) + 2),
    ]
    for r in rows:
        ref = next(x for x in rows if x["step_seconds"] == r["step_seconds"] and x["schedule"] == "fixed")
        losses = " | ".join(f"{p['eval_loss']:.4f}" for p in r["curve"][1:])
        u = r["utilization"]
        lines.append(
            f"| {r['step_seconds'][0]:g} / {r['step_seconds'][1]:g} s | {r['schedule']} | {losses} | "
            f"{u[0]:.2f} / {u[1]:.2f} | {r['eval_loss'] / ref['eval_loss']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_parser(
        __doc__, "unequal_speed", parts="a,b", parts_help="a (processes), b (simulator)", max_wait=60.0
    )
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    steps_a, reps = (120, 1) if a.quick else (240, 3)
    steps_b, model = (240, "nano") if a.quick else (600, "nano")
    md: list[str] = []
    with Session("unequal_speed", argv, Path(a.out)) as s:
        if "a" in parts:
            s.results["a"] = []
            for rep in range(reps):
                for schedule in SCHEDULES:  # alternated: a load that comes and goes hits both alike
                    wait_quiet(f"{schedule}{rep}", a.max_wait)
                    s.results["a"].append(process_run(s.procs, s.tmp, schedule, steps_a, rep))
            md += [
                "## (a) two sites, one twice as slow (processes)",
                "",
                table_a(s.results["a"], steps_a),
                "",
            ]
        if "b" in parts:
            s.results["b"] = sim_runs(steps_b, model)
            md += [
                "## (b) the same in the simulator, at equal wall time",
                "",
                table_b(s.results["b"], steps_b, model),
                "",
            ]
    return s.finish(md)


if __name__ == "__main__":
    sys.exit(main())
