"""Long quality benchmark (issue 15): data-parallel against the full method as M grows, equal tokens.

Every M gets the same total token budget, --tokens-per-param times the model's parameter count, so the
steps per worker are budget / (M x batch x block). The full method is the `full` setup of
`streamdiloco compare` (strided fragments, tau=1, alpha=0.5, E3M0 both ways).

Two comparisons per text and M, because the first one flatters the method:
- **at the default inner lr**: both methods with the run's --lr (the comparison BENCHMARKS.md made before);
- **tuned against tuned**: data-parallel at its best inner lr of --dp-lrs, the full method at its best of
  --full-variants (an inner lr, optionally with an outer lr and momentum: `1.2e-2:1.0:0`). Data-parallel's
  M-times-larger global batch takes a larger lr than a worker's own batch; a fair baseline is tuned too.

Texts: the built-in plays, and a second text the defaults were never tuned on: the English quotations of
Debian's `fortunes` package (`apt-get install fortunes`; the '%' separator lines dropped).
Writes results.md, results.json and quality-long.png into --out; every finished run is kept in runs.jsonl
there, so an interrupted benchmark goes on where it stopped (--fresh starts over). One run at a time.

    python -m benchmarks.quality_long           # nano, 20 tokens/param; plays: M = 2, 4, 8; fortunes: 2, 4
    python -m benchmarks.quality_long --quick   # a smoke run (a few steps, M = 2, one lr each)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from benchmarks.harness import fortune_files
from streamdiloco.common.modelspec import build_model, model_block_size
from streamdiloco.compare import SETUPS, add_sim_flags, sim_config
from streamdiloco.settings import resolve

MARGINS = {2: 1.0, 4: 2.0, 8: 3.0}  # the allowed gap to data-parallel, in %


def steps_for(tokens_per_param: float, params: int, workers: int, batch: int, block: int) -> int:
    """Inner steps per worker for a total budget of tokens_per_param x params tokens over M workers."""
    return max(1, round(tokens_per_param * params / (workers * batch * block)))


def fortunes_text(folder: Path) -> Path:
    """Debian's fortunes as one text file, folder/fortunes.txt (written once; sweep.sh uses it too)."""
    path = folder / "fortunes.txt"
    if path.is_file() and path.stat().st_size:
        return path
    text = "\n".join(
        re.sub(r"(?m)^%\n", "\n", p.read_text(encoding="utf-8", errors="replace")) for p in fortune_files()
    )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def parse_variant(spec: str, outer_lr: float, outer_momentum: float) -> tuple[float, float, float]:
    """`LR` or `LR:OUTER_LR:OUTER_MOMENTUM` -> (lr, outer lr, outer momentum)."""
    parts = [float(x) for x in spec.split(":")]
    if len(parts) == 1:
        return parts[0], outer_lr, outer_momentum
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    raise ValueError(f"--full-variants entry {spec!r}: give LR or LR:OUTER_LR:OUTER_MOMENTUM")


def run_one(args, cache: dict, cache_file: Path, key: str, workers: int, setup: str, **over) -> dict:
    """One simulation (or its cached figures)."""
    from streamdiloco.sim.simulator import simulate

    if key in cache:
        return cache[key]
    cfg = sim_config(args, workers=workers, **SETUPS[setup], **over)
    t = time.time()
    r = simulate(cfg)
    keep = {k: v for k, v in r.items() if k not in ("global_params", "curve", "history")}
    keep.update(key=key, seconds=round(time.time() - t, 1))
    cache[key] = keep
    with cache_file.open("a") as f:
        f.write(json.dumps(keep) + "\n")
    print(f"    {key}: eval loss {r['eval_loss']:.4f} ({keep['seconds']:.0f}s)", flush=True)
    return keep


def moved(r: dict) -> float:
    return r["bytes_sent_per_worker"] + r["bytes_received_per_worker"]


def pct(a: float, b: float) -> float:
    return 100 * (a / b - 1)


def rows_for(text: str, m: int, runs: dict, default: tuple[float, float, float]) -> dict:
    """The table's row for one text and M; `runs` maps (method, lr, outer lr, momentum) to figures."""
    dps = {v[1]: r for v, r in runs.items() if v[0] == "dp"}
    fulls = {v: r for v, r in runs.items() if v[0] == "full"}
    dp0, full0 = dps[default[0]], fulls[("full", *default)]
    best_dp_lr = min(dps, key=lambda lr: dps[lr]["eval_loss"])
    best_full = min(fulls, key=lambda v: fulls[v]["eval_loss"])
    bd, bf = dps[best_dp_lr], fulls[best_full]
    return {
        "text": text,
        "M": m,
        "dp_default": dp0["eval_loss"],
        "full_default": full0["eval_loss"],
        "gap_default_pct": pct(full0["eval_loss"], dp0["eval_loss"]),
        "best_dp": bd["eval_loss"],
        "best_dp_lr": best_dp_lr,
        "best_full": bf["eval_loss"],
        "best_full_setting": f"lr {best_full[1]:g}, outer {best_full[2]:g}/{best_full[3]:g}",
        "gap_tuned_pct": pct(bf["eval_loss"], bd["eval_loss"]),
        "fewer_bytes_x": moved(dp0) / moved(full0),
        "margin_pct": MARGINS.get(m),
    }


def table(rows: list[dict]) -> str:
    head = (
        "| text | M | DP | full | gap | best DP (lr) | best full (setting) | gap, tuned | margin "
        "| fewer bytes |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        margin = f"{r['margin_pct']:g} %" if r["margin_pct"] is not None else ""
        lines.append(
            f"| {r['text']} | {r['M']} | {r['dp_default']:.4f} | {r['full_default']:.4f} "
            f"| {r['gap_default_pct']:+.2f} % | {r['best_dp']:.4f} ({r['best_dp_lr']:g}) "
            f"| {r['best_full']:.4f} ({r['best_full_setting']}) | {r['gap_tuned_pct']:+.2f} % | {margin} "
            f"| {r['fewer_bytes_x']:.0f}× |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for text, marker, color in (("plays", "o", "tab:blue"), ("fortunes", "s", "tab:red")):
        rs = [r for r in rows if r["text"] == text]
        if not rs:
            continue
        ms = [r["M"] for r in rs]
        default, tuned = [r["gap_default_pct"] for r in rs], [r["gap_tuned_pct"] for r in rs]
        ax.plot(ms, default, marker=marker, color=color, label=f"{text}: both at the default lr")
        ax.plot(ms, tuned, marker=marker, color=color, ls="--", label=f"{text}: each at its best")
    ms = sorted(MARGINS)
    ax.plot(ms, [MARGINS[m] for m in ms], color="grey", ls=":", label="issue 15's margin")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("M (workers)")
    ax.set_ylabel("eval loss vs data-parallel (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_flags(p)
    p.set_defaults(eval_every=100_000, method="streaming")
    p.add_argument("--tokens-per-param", type=float, default=20.0, help="total budget (default %(default)s)")
    p.add_argument("--workers-list", default="2,4,8", help="M values on the plays (default %(default)s)")
    p.add_argument("--second-workers", default="2,4", help="M values on fortunes, '' for none (%(default)s)")
    p.add_argument("--dp-lrs", default="1.5e-3,5e-3,1.2e-2", help="data-parallel's lr grid (%(default)s)")
    p.add_argument(
        "--full-variants",
        default="1.5e-3,5e-3,1.2e-2:1.0:0",
        help="the full method's grid: LR or LR:OUTER_LR:OUTER_MOMENTUM (default %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 0.3 tokens per parameter, M = 2")
    p.add_argument("--fresh", action="store_true", help="ignore the runs kept in OUT/runs.jsonl")
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
        args.tokens_per_param, args.workers_list, args.second_workers = 0.3, "2", "2"
        args.dp_lrs, args.full_variants = str(args.lr), str(args.lr)
        args.out = str(Path(args.out) / "quick")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_file = out / "runs.jsonl"
    if args.fresh and cache_file.exists():
        cache_file.unlink()
    cache = {}
    if cache_file.exists():
        kept = [json.loads(line) for line in cache_file.read_text().splitlines() if line.strip()]
        cache = {r["key"]: r for r in kept}
    model = build_model(args.model, args.seed, args.block_size)
    params = sum(q.numel() for q in model.parameters())
    block = model_block_size(model, args.block_size)
    default_lr, defaults = args.lr, (args.outer_lr, args.outer_momentum)
    try:
        dp_lrs = sorted({float(x) for x in args.dp_lrs.split(",")} | {default_lr})
        variants = {parse_variant(v, *defaults) for v in args.full_variants.split(",")}
        variants |= {(default_lr, *defaults)}
        texts: list[tuple[str, str | None, list[int]]] = [
            ("plays", None, [int(x) for x in args.workers_list.split(",") if x])
        ]
        if args.second_workers:
            second = str(fortunes_text(out / "runs"))  # runs/ is not kept in git: the text is Debian's
            texts.append(("fortunes", second, [int(x) for x in args.second_workers.split(",")]))
    except ValueError as e:
        print(f"quality_long.py: error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    total = sum(len(ms) for _, _, ms in texts) * (len(dp_lrs) + len(variants))
    done, rows = 0, []
    for text, data, ms in texts:
        args.data = data
        for m in ms:
            args.steps = steps_for(args.tokens_per_param, params, m, args.batch_size, block)
            print(f"=== {text}, M={m}: {args.steps} steps per worker ({time.time() - t0:.0f}s)", flush=True)
            runs: dict = {}
            tag = f"{args.model}-{args.tokens_per_param:g}tpp-seed{args.seed}-{text}-M{m}"
            for lr in dp_lrs:
                done += 1
                print(f"  [{done}/{total}] data-parallel, lr {lr:g}", flush=True)
                runs[("dp", lr, None, None)] = run_one(
                    args, cache, cache_file, f"{tag}-dp-lr{lr:g}", m, "dp", lr=lr
                )
            for lr, olr, mom in sorted(variants):
                done += 1
                print(f"  [{done}/{total}] full, lr {lr:g}, outer {olr:g}/{mom:g}", flush=True)
                runs[("full", lr, olr, mom)] = run_one(
                    args,
                    cache,
                    cache_file,
                    f"{tag}-full-lr{lr:g}-olr{olr:g}-mom{mom:g}",
                    m,
                    "full",
                    lr=lr,
                    outer_lr=olr,
                    outer_momentum=mom,
                )
            rows.append(rows_for(text, m, runs, (default_lr, *defaults)))
    head = (
        f"{args.model} GPT ({params:,} parameters), {args.tokens_per_param:g} tokens per parameter "
        f"({round(args.tokens_per_param * params):,} tokens in all), batch {args.batch_size} x {block} per "
        f"worker-step, seed {args.seed}, H={args.sync_every}, default inner lr {default_lr:g}, outer "
        f"{defaults[0]:g}/{defaults[1]:g}; DP lrs {', '.join(f'{x:g}' for x in dp_lrs)}; full variants "
        f"{', '.join(f'{a:g}:{b:g}:{c:g}' for a, b, c in sorted(variants))}"
    )
    md = table(rows)
    print("\n" + head + "\n\n" + md)
    (out / "results.md").write_text(head + "\n\n" + md + "\n")
    (out / "results.json").write_text(json.dumps({"settings": head, "rows": rows}, indent=2) + "\n")
    title = f"{args.model}, {args.tokens_per_param:g} tokens per parameter, equal tokens per M"
    png = plot(rows, out / "quality-long.png", title)
    print(f"\n{time.time() - t0:.0f}s; wrote {out}/results.md, results.json" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
