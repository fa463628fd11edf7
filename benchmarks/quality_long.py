"""Long quality benchmark (issue 15): data-parallel against the full method at M = 2, 4, 8, equal tokens.

Every M gets the same total token budget, --tokens-per-param times the model's parameter count, so the
steps per worker are budget / (M x batch x block). The full method is the `full` setup of
`streamdiloco compare` (strided fragments, tau=1, alpha=0.5, E3M0 both ways) at the defaults otherwise.
Prints a table of eval loss against data-parallel at the same M and the bytes each worker moved; writes
results.json and results.md into --out. One simulation at a time.

    python benchmarks/quality_long.py                # nano, 20 tokens per parameter, M = 2, 4, 8
    python benchmarks/quality_long.py --quick        # a smoke run (a few steps, M = 2)
    python benchmarks/quality_long.py --tokens-per-param 40 --workers-list 4 --outer-lr 0.7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from streamdiloco.cli import _add_sim_flags, run_setups, sim_config
from streamdiloco.common.modelspec import build_model, model_block_size
from streamdiloco.settings import resolve
from streamdiloco.sim.report import comparison_rows, format_table


def steps_for(tokens_per_param: float, params: int, workers: int, batch: int, block: int) -> int:
    """Inner steps per worker for a total budget of tokens_per_param x params tokens over M workers."""
    return max(1, round(tokens_per_param * params / (workers * batch * block)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_sim_flags(p)
    p.set_defaults(eval_every=100, method="streaming")
    p.add_argument("--tokens-per-param", type=float, default=20.0, help="total budget (default %(default)s)")
    p.add_argument("--workers-list", default="2,4,8", help="comma-separated M values (default %(default)s)")
    p.add_argument(
        "--setups", default="dp,full", help="setups of `streamdiloco compare` (default %(default)s)"
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 0.3 tokens per parameter, M = 2")
    p.add_argument("--out", default="benchmarks/results/quality-long", help="output folder")
    args = p.parse_args(argv)
    try:
        settings = resolve(args, args.sections, args.config)  # --config FILE: the flags' values from a file
    except ValueError as e:
        print(f"quality_long.py: error: {e}", file=sys.stderr)
        return 2
    if "model" not in settings.given.get("model", frozenset()):
        args.model = "nano"  # this benchmark's default (resolve() sets the settings' own, tiny)
    if args.quick:
        args.tokens_per_param, args.workers_list, args.eval_every = 0.3, "2", 50
        args.out = str(Path(args.out) / "quick")
    model = build_model(args.model, args.seed, args.block_size)
    params = sum(q.numel() for q in model.parameters())
    block = model_block_size(model, args.block_size)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    t0 = time.time()
    results = []
    try:
        for m in [int(x) for x in args.workers_list.split(",")]:
            args.steps = steps_for(args.tokens_per_param, params, m, args.batch_size, block)
            sim_config(args, workers=m)  # validate before the first run
            print(f"=== M={m}: {args.steps} steps per worker ({time.time() - t0:.0f}s so far)", flush=True)
            results += run_setups(args, setups, [m])
    except (ValueError, KeyError) as e:
        print(f"quality_long.py: error: {e}", file=sys.stderr)
        return 2
    rows = comparison_rows(results)
    print()
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = (
        f"{args.model} GPT ({params:,} parameters), {args.tokens_per_param:g} tokens per parameter "
        f"({round(args.tokens_per_param * params):,} tokens in all), batch {args.batch_size} x {block}, "
        f"seed {args.seed}, H={args.sync_every}, outer lr {args.outer_lr} / momentum {args.outer_momentum}, "
        f"inner lr {args.lr}"
    )
    (out / "results.md").write_text(head + "\n\n" + format_table(rows, markdown=True) + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "settings": head,
                "runs": [
                    {"label": lbl, **{k: v for k, v in r.items() if k != "global_params"}}
                    for lbl, r in results
                ],
            },
            indent=2,
        )
    )
    print(f"\n{time.time() - t0:.0f}s; wrote {out}/results.md and results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
