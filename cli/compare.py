"""`streamdiloco simulate` and `streamdiloco compare`: the in-process simulator from the command line, and
the named setups (data-parallel, DiLoCo, Streaming DiLoCo and its steps) that `compare` and the quality
benchmarks run side by side. It builds SimConfigs from flags and prints and writes results; it must not
simulate anything itself (sim/ does) nor hold another command's flags (cli/cli.py builds the parser from
`add_simulate_parser` and `add_compare_parser`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from streamdiloco.flags import add_settings

# Setups that `compare` and the quality benchmark run; each is a set of overrides on the flags' values.
SETUPS: dict[str, dict] = {
    "dp": {"method": "dp"},
    # tau = 0 with alpha = 0: the local parameters are replaced by the global ones, as in DiLoCo
    "diloco": {
        "num_fragments": 1,
        "fragment_sync_delay": 0,
        "fragment_update_alpha": 0.0,
        "uplink_codec": "fp32",
        "downlink_codec": "fp32",
    },
    "streaming": {
        "fragment_sync_delay": 0,
        "fragment_update_alpha": 0.0,
        "uplink_codec": "fp32",
        "downlink_codec": "fp32",
    },
    "overlap": {
        "fragment_sync_delay": 1,
        "fragment_update_alpha": 0.5,
        "uplink_codec": "fp32",
        "downlink_codec": "fp32",
    },
    "full": {
        "fragment_sync_delay": 1,
        "fragment_update_alpha": 0.5,
        "uplink_codec": "e3m0",
        "downlink_codec": "e3m0",
    },
    "full-sr": {
        "fragment_sync_delay": 1,
        "fragment_update_alpha": 0.5,
        "uplink_codec": "e3m0",
        "downlink_codec": "e3m0",
        "uplink_rounding": "stochastic",
        "downlink_rounding": "stochastic",
    },
}
# The shards' defenses (server/rounds/robust.py) on the full method: off, and the two robust aggregators
_FULL = SETUPS["full"]
SETUPS["full-plain"] = {**_FULL, "weight_cap": 0.0, "clip_norm": 0.0}
SETUPS["full-trimmed"] = {**_FULL, "aggregator": "trimmed"}
SETUPS["full-cclip"] = {**_FULL, "aggregator": "centered-clip"}
# Below four bits (the uplink's error feedback on, at its default for these codecs): 2-bit sq2 both ways, at
# blocks of 128 and 1024 values; top-k 64 of 4,096 up (sq2 down) with SparseLoCo's step and with Nesterov
SETUPS["full-sq2"] = {**_FULL, "uplink_codec": "sq2", "downlink_codec": "sq2"}
SETUPS["full-sq2-1024"] = {**SETUPS["full-sq2"], "codec_block_size": 1024}
SETUPS["full-topk"] = {
    **_FULL,
    "uplink_codec": "topk64_4096",
    "downlink_codec": "sq2",
    "outer_variant": "sparseloco",
}
SETUPS["full-topk-nesterov"] = {**_FULL, "uplink_codec": "topk64_4096", "downlink_codec": "sq2"}
SETUPS["full-topk256"] = {**SETUPS["full-topk"], "uplink_codec": "topk256_4096"}
SETUPS["full-topk1024"] = {**SETUPS["full-topk"], "uplink_codec": "topk1024_4096"}
SETUPS["full-topk256-nesterov"] = {**SETUPS["full-topk-nesterov"], "uplink_codec": "topk256_4096"}
SETUPS["full-topk1024-nesterov"] = {**SETUPS["full-topk-nesterov"], "uplink_codec": "topk1024_4096"}
SETUPS["full-topk-h10"] = {**SETUPS["full-topk"], "sync_every": 10}  # more rounds at the same tokens
SETUPS["full-topk-nesterov-h10"] = {**SETUPS["full-topk-nesterov"], "sync_every": 10}
SETUPS["full-topk-a0"] = {**SETUPS["full-topk"], "fragment_update_alpha": 0.0}
SETUPS["full-topk-nesterov-a0"] = {**SETUPS["full-topk-nesterov"], "fragment_update_alpha": 0.0}
SETUPS["full-topk-both"] = {
    **SETUPS["full-topk-nesterov"],
    "downlink_codec": "topk64_4096",
}  # a WAN at 0.1 Mbit/s
SETUP_LABELS = {
    "dp": "Data-parallel",
    "diloco": "DiLoCo (P=1, τ=0, fp32)",
    "streaming": "Streaming (strided, τ=0, fp32)",
    "overlap": "+ overlap (τ=1, α=0.5)",
    "full": "+ E3M0 up and down",
    "full-sr": "+ E3M0, stochastic rounding",
    "full-plain": "+ E3M0, no defenses (plain mean)",
    "full-trimmed": "+ E3M0, trimmed mean",
    "full-cclip": "+ E3M0, centered clipping",
    "full-sq2": "+ sq2 up and down (block 128)",
    "full-sq2-1024": "+ sq2 up and down (block 1024)",
    "full-topk": "+ top-k 1.56 % up, sq2 down, SparseLoCo step",
    "full-topk-nesterov": "+ top-k 1.56 % up, sq2 down, Nesterov",
    "full-topk256": "+ top-k 6.25 % up, sq2 down, SparseLoCo step",
    "full-topk1024": "+ top-k 25 % up, sq2 down, SparseLoCo step",
    "full-topk256-nesterov": "+ top-k 6.25 % up, sq2 down, Nesterov",
    "full-topk1024-nesterov": "+ top-k 25 % up, sq2 down, Nesterov",
    "full-topk-h10": "+ top-k 1.56 % up, sq2 down, SparseLoCo step, H = 10",
    "full-topk-nesterov-h10": "+ top-k 1.56 % up, sq2 down, Nesterov, H = 10",
    "full-topk-a0": "+ top-k 1.56 % up, sq2 down, SparseLoCo step, α = 0",
    "full-topk-nesterov-a0": "+ top-k 1.56 % up, sq2 down, Nesterov, α = 0",
    "full-topk-both": "+ top-k 1.56 % up and down, Nesterov",
}


def _seconds_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give seconds separated by commas, like 0.5,1.0: got {text!r}"
        ) from None


def add_sim_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation")
    g.add_argument("--workers", type=int, default=2, help="M, the number of workers (default %(default)s)")
    g.add_argument(
        "--shards", type=int, default=1, dest="num_shards", help="S, shards each fragment is cut into"
    )
    g.add_argument(
        "--eval-every", type=int, default=100, help="steps between evaluations (default %(default)s)"
    )
    g.add_argument(
        "--step-seconds",
        type=_seconds_list,
        default=(),
        metavar="S,S,...",
        help="sites of unequal speed: each worker's emulated seconds per inner step (e.g. 0.5,1.0 with "
        "--sync-schedule adaptive or fixed); the results then have the emulated wall time (default: equal)",
    )
    add_settings(
        p,
        ("model", "run", "sync", "inner", "robust"),
        titles={"robust": "the simulated shards' defenses (as `server`)"},
    )


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    """The `simulate` subcommand, under `streamdiloco`'s subparsers."""
    sp = sub.add_parser(
        "simulate",
        help="run M workers and the server's aggregation in one process",
        description="Run M workers and the server's aggregation in one process "
        "(--method dp: the data-parallel baseline).",
    )
    sp.add_argument(
        "--method",
        default="streaming",
        choices=["streaming", "dp"],
        help="streaming (Streaming DiLoCo; P=1, tau=0 is DiLoCo) or dp (data-parallel)",
    )
    add_sim_flags(sp)
    sp.add_argument("--json", default=None, metavar="PATH", help="write the final figures to this JSON file")
    sp.set_defaults(func=cmd_simulate)


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """The `compare` subcommand, under `streamdiloco`'s subparsers."""
    cp = sub.add_parser(
        "compare",
        help="run several setups side by side; print a table, save a plot",
        description="Run named setups at equal tokens and seed; print a table of eval loss and "
        "traffic against data-parallel, and save a plot of eval loss vs tokens.",
    )
    cp.add_argument("--setups", default="dp,full", help=f"comma-separated, from: {', '.join(SETUPS)}")
    add_sim_flags(cp)
    cp.set_defaults(method="streaming")
    cp.add_argument("--workers-list", default=None, help="comma-separated M values (default: --workers)")
    cp.add_argument("--out", default="runs/compare", help="folder for results.md, results.json, loss.png")
    cp.set_defaults(func=cmd_compare)


def sim_config(args: argparse.Namespace | dict, **overrides):
    """A validated SimConfig from parsed flags (and setup overrides). Raises ValueError."""
    from streamdiloco.common.config import compose
    from streamdiloco.sim.config import SimConfig

    v = {**(vars(args) if isinstance(args, argparse.Namespace) else args), **overrides}
    return compose(SimConfig, v, strict=False)


def cmd_simulate(args: argparse.Namespace) -> int:
    from streamdiloco.checks import check_data, check_model

    cfg = sim_config(args)  # one-line errors before torch is imported
    check_model(args)
    check_data(cfg.run.data)
    from streamdiloco.sim.simulator import simulate, write_json

    result = simulate(cfg)
    print(
        f"eval loss {result['eval_loss']:.4f} | tokens {result['tokens']:,} | "
        f"sent/worker {result['bytes_sent_per_worker']:,} B | received/worker "
        f"{result['bytes_received_per_worker']:,} B | peak sync {result['peak_sync_bytes']:,} B | "
        f"{result['wall_seconds']:.0f}s"
    )
    if cfg.step_seconds and "compute_utilization" in result:  # sites of unequal speed
        util = " / ".join(f"{u:.2f}" for u in result["compute_utilization"])
        print(
            f"emulated wall time {result['curve'][-1]['wall_seconds']:g} s | compute utilization per worker "
            f"{util} | inner steps {result['inner_steps']}"
        )
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def run_setups(args, setups: list[str], workers: list[int]) -> list[tuple[str, dict]]:
    """Run each named setup for each M; returns (label, result) pairs."""
    from streamdiloco.sim.simulator import simulate

    results = []
    for m in workers:
        for name in setups:
            cfg = sim_config(args, workers=m, **SETUPS[name])
            print(f"--- {SETUP_LABELS[name]}, M={m}", flush=True)
            results.append((SETUP_LABELS[name], simulate(cfg)))
    return results


def cmd_compare(args: argparse.Namespace) -> int:
    from streamdiloco.checks import check_data, check_model

    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if unknown := [s for s in setups if s not in SETUPS]:
        raise ValueError(f"unknown setup {unknown[0]!r}: choose from {', '.join(SETUPS)}")
    workers = [int(m) for m in str(args.workers_list).split(",")]
    for name in setups:  # validate every setup before spending minutes on the first (and importing torch)
        for m in workers:
            sim_config(args, workers=m, **SETUPS[name])
    check_model(args)
    check_data(args.data)
    import json

    from streamdiloco.sim.report import comparison_rows, format_table, plot_curves

    results = run_setups(args, setups, workers)
    rows = comparison_rows(results)
    print()
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(format_table(rows, markdown=True) + "\n")
    (out / "results.json").write_text(
        json.dumps(
            [{"label": lbl, **{k: v for k, v in r.items() if k != "global_params"}} for lbl, r in results],
            indent=2,
        )
    )
    png = plot_curves(results, out / "loss.png")
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'} and the plot {png}")
    return 0
