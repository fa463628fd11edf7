"""The `streamdiloco` command: subcommands, their flags, and one-line errors for bad configuration."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from streamdiloco import __version__

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
SETUP_LABELS = {
    "dp": "Data-parallel",
    "diloco": "DiLoCo (P=1, τ=0, fp32)",
    "streaming": "Streaming (strided, τ=0, fp32)",
    "overlap": "+ overlap (τ=1, α=0.5)",
    "full": "+ E3M0 up and down",
    "full-sr": "+ E3M0, stochastic rounding",
}


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    from streamdiloco.common.codecs import CODECS
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.worker.model import PRESETS
    from streamdiloco.worker.train import InnerConfig

    s, i = SyncConfig(), InnerConfig()
    g = p.add_argument_group("run")
    g.add_argument("--workers", type=int, default=2, help="M, the number of workers (default %(default)s)")
    g.add_argument("--steps", type=int, default=600, help="inner steps per worker (default %(default)s)")
    g.add_argument(
        "--batch-size", type=int, default=16, help="sequences per worker per step (default %(default)s)"
    )
    g.add_argument(
        "--model", default="tiny", choices=list(PRESETS), help="built-in GPT size (default %(default)s)"
    )
    g.add_argument(
        "--block-size", type=int, default=None, help="context length in bytes (default: the preset's)"
    )
    g.add_argument(
        "--data", default=None, metavar="PATH", help="a text file to train on (default: built-in plays)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed for init, data streams and rounding (default 0)")
    g.add_argument(
        "--shards", type=int, default=1, dest="num_shards", help="S, shards each fragment is cut into"
    )
    g.add_argument(
        "--eval-every", type=int, default=100, help="steps between evaluations (default %(default)s)"
    )
    g.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    g.add_argument("--device", default="cpu", help="torch device for training: cpu, cuda, cuda:1 ...")
    g = p.add_argument_group("Streaming DiLoCo")
    g.add_argument(
        "--sync-every", type=int, default=s.sync_every, help="H, steps between syncs of a fragment"
    )
    g.add_argument(
        "--num-fragments", type=int, default=s.num_fragments, help="P, block fragments (+1 for the rest)"
    )
    g.add_argument("--fragment-pattern", default=s.fragment_pattern, choices=["strided", "sequential"])
    g.add_argument(
        "--fragment-sync-delay", type=int, default=s.fragment_sync_delay, help="tau, steps of overlap"
    )
    g.add_argument(
        "--fragment-update-alpha",
        type=float,
        default=s.fragment_update_alpha,
        help="alpha, weight of the local parameters at the merge",
    )
    g.add_argument("--uplink-codec", default=s.uplink_codec, help=f"one of {', '.join(CODECS)}")
    g.add_argument("--downlink-codec", default=s.downlink_codec, help=f"one of {', '.join(CODECS)}")
    g.add_argument("--codec-block-size", type=int, default=s.codec_block_size, help="values per scale")
    g.add_argument("--uplink-rounding", default=s.uplink_rounding, help="nearest or stochastic")
    g.add_argument("--downlink-rounding", default=s.downlink_rounding, help="nearest or stochastic")
    g.add_argument("--outer-lr", type=float, default=s.outer_lr, help="outer Nesterov learning rate")
    g.add_argument("--outer-momentum", type=float, default=s.outer_momentum)
    g.add_argument(
        "--no-final-sync",
        dest="final_sync",
        action="store_false",
        help="do not sync every fragment at the last step",
    )
    g = p.add_argument_group("inner optimizer (AdamW)")
    g.add_argument("--lr", type=float, default=i.lr, help="peak learning rate (default %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=i.warmup_steps)
    g.add_argument(
        "--min-lr-ratio", type=float, default=i.min_lr_ratio, help="cosine floor, as a fraction of --lr"
    )
    g.add_argument("--weight-decay", type=float, default=i.weight_decay)
    g.add_argument("--grad-clip", type=float, default=i.grad_clip, help="gradient-norm clip, 0 disables")


def sim_config(args: argparse.Namespace | dict, **overrides):
    """A validated SimConfig from parsed flags (and setup overrides). Raises ValueError."""
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.sim.simulator import SimConfig
    from streamdiloco.worker.train import InnerConfig

    v = {**(vars(args) if isinstance(args, argparse.Namespace) else args), **overrides}
    pick = lambda cls: {f.name: v[f.name] for f in dataclasses.fields(cls) if f.name in v}  # noqa: E731
    inner = InnerConfig(**{**pick(InnerConfig)})
    sync = SyncConfig(**pick(SyncConfig))
    top = {k: x for k, x in pick(SimConfig).items() if k not in ("sync", "inner")}
    return SimConfig(**top, sync=sync, inner=inner)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from streamdiloco.sim.simulator import simulate, write_json

    cfg = sim_config(args)
    _check_data(cfg.data)
    result = simulate(cfg)
    print(
        f"eval loss {result['eval_loss']:.4f} | tokens {result['tokens']:,} | "
        f"sent/worker {result['bytes_sent_per_worker']:,} B | received/worker "
        f"{result['bytes_received_per_worker']:,} B | peak sync {result['peak_sync_bytes']:,} B | "
        f"{result['wall_seconds']:.0f}s"
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


def _cmd_compare(args: argparse.Namespace) -> int:
    import json

    from streamdiloco.sim.report import comparison_rows, format_table, plot_curves

    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if unknown := [s for s in setups if s not in SETUPS]:
        raise ValueError(f"unknown setup {unknown[0]!r}: choose from {', '.join(SETUPS)}")
    workers = [int(m) for m in str(args.workers_list).split(",")]
    for name in setups:  # validate every setup before spending minutes on the first
        for m in workers:
            sim_config(args, workers=m, **SETUPS[name])
    _check_data(args.data)
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


def _check_data(path: str | None) -> None:
    if path is not None:
        from streamdiloco.worker.data import load_text

        load_text(path)  # raises a one-line ValueError for a missing or empty file


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamdiloco",
        description="Streaming DiLoCo: train one model on GPUs joined only by the internet.",
    )
    p.add_argument("--version", action="version", version=f"streamdiloco {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    _add_sim_flags(sp)
    sp.add_argument("--json", default=None, metavar="PATH", help="write the final figures to this JSON file")
    sp.set_defaults(func=_cmd_simulate)

    cp = sub.add_parser(
        "compare",
        help="run several setups side by side; print a table, save a plot",
        description="Run named setups at equal tokens and seed; print a table of eval loss and "
        "traffic against data-parallel, and save a plot of eval loss vs tokens.",
    )
    cp.add_argument("--setups", default="dp,full", help=f"comma-separated, from: {', '.join(SETUPS)}")
    _add_sim_flags(cp)
    cp.set_defaults(method="streaming")
    cp.add_argument("--workers-list", default=None, help="comma-separated M values (default: --workers)")
    cp.add_argument("--out", default="runs/compare", help="folder for results.md, results.json, loss.png")
    cp.set_defaults(func=_cmd_compare)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "workers_list", "unset") is None:
        args.workers_list = str(args.workers)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"streamdiloco: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("streamdiloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
