"""Quality benchmark: data-parallel against DiLoCo and Streaming DiLoCo, at equal tokens and the same seed.

Runs, for each M in --workers-list: data-parallel; DiLoCo (P=1, tau=0, fp32); Streaming DiLoCo (P strided
fragments, tau=0, fp32); + overlap (tau=1, alpha=0.5); + E3M0 up and down. Prints a table of eval loss
(of the global parameters), bytes each worker sent and received against data-parallel's (fp32 gradients up
and down every step), and the peak bytes of one sync; saves results.md, results.json and loss.png.

    python -m benchmarks.quality                       # the recorded run (see BENCHMARKS.md)
    python -m benchmarks.quality --steps 200 --jobs 2  # a quick look

--jobs N runs N simulations at once, one thread each (on 2 cores, 2 jobs finish ~10% sooner than 1 job
with 2 threads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from streamdiloco.compare import SETUP_LABELS, SETUPS, add_sim_flags, sim_config
from streamdiloco.settings import resolve
from streamdiloco.sim.report import comparison_rows, format_table, plot_curves
from streamdiloco.sim.simulator import simulate

DEFAULT_SETUPS = "dp,diloco,streaming,overlap,full"


def _one(cfg) -> dict:
    import torch

    torch.set_num_threads(1)
    res = simulate(cfg, log=lambda line: print(line, flush=True))
    res.pop("global_params", None)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_flags(p)
    p.set_defaults(steps=1200, eval_every=100, eval_batches=16)
    p.add_argument("--setups", default=DEFAULT_SETUPS, help=f"comma-separated, from: {', '.join(SETUPS)}")
    p.add_argument("--workers-list", default="2,4", help="comma-separated M values (default %(default)s)")
    p.add_argument(
        "--extra", default="full-sr@2", help="more runs as SETUP@M, comma-separated (default %(default)s)"
    )
    p.add_argument("--jobs", type=int, default=2, help="simulations at once (default %(default)s)")
    p.add_argument("--out", default="benchmarks/results/quality", help="output folder")
    args = p.parse_args(argv)
    try:
        resolve(args, args.sections, args.config)  # --config FILE: the flags' values from a file
    except ValueError as e:
        print(f"quality.py: error: {e}", file=sys.stderr)
        return 2
    setups = args.setups.split(",")
    workers = [int(m) for m in args.workers_list.split(",")]
    runs = [(s, m) for m in workers for s in setups]
    runs += [(x.split("@")[0], int(x.split("@")[1])) for x in args.extra.split(",") if x.strip()]
    base = {**vars(args), "method": "streaming"}
    try:
        plan = [(SETUP_LABELS[s], sim_config(base, workers=m, **SETUPS[s])) for s, m in runs]
    except (ValueError, KeyError) as e:
        print(f"quality.py: error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    print(f"{len(plan)} runs of {args.steps} steps, {args.jobs} at a time", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_one, cfg) for _, cfg in plan]
        results = [(label, f.result()) for (label, _), f in zip(plan, futures, strict=True)]
    rows = comparison_rows(results)
    table = format_table(rows)
    print()
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(format_table(rows, markdown=True) + "\n")
    (out / "results.json").write_text(json.dumps([{"label": lbl, **r} for lbl, r in results], indent=2))
    for m in workers:
        plot_curves(
            [(lbl, r) for lbl, r in results if r["workers"] == m],
            out / f"loss_M{m}.png",
            title=f"Eval loss vs tokens, M={m} ({args.model} GPT, {args.steps} steps, H={args.sync_every})",
        )
    print(
        f"\n{time.time() - t0:.0f}s; wrote {out}/results.md, results.json, loss_M*.png "
        f"(cpus: {os.cpu_count()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
