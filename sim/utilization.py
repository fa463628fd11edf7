"""Compute utilization (compute time / wall time) of a Streaming DiLoCo run, predicted from its links.

What it is for: to answer "how fast a link do my workers need?" before renting one, and to check the paper's
compute-utilization table (Douillard et al. 2025, Table 4) against a model we can read. It simulates
events, not training: no tensors, no network.

Two models are run from here.

**The event model** (`RunModel`, `simulate`, `needed_bandwidth`, sim/eventmodel.py) is this project's
system: M workers, each with its own link each way, the codecs' real sizes, the schedule of
common/schedule.py, two merge policies (its docstring says how).

**The planner** (sim/plan.py: `plan_codecs`, the `plan` command) runs one model with several pairs of
codecs and gives, for each, the bytes per parameter per outer step and the link each way a target
utilization needs.

**The paper's recipe** for its Table 4 is the simpler model of sim/table4.py; `table4` below reproduces the
table with it.

Run `python -m streamdiloco.sim.utilization --help` for the command line: `table4`, `need`, `predict`,
`plan`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from streamdiloco.common.codecspec import CODEC_HELP, canonical_codec
from streamdiloco.sim.eventmodel import (
    POLICIES,
    RunModel,
    fragment_values_for,
    needed_bandwidth,
    simulate,
)
from streamdiloco.sim.plan import (
    PLAN_CODECS,
    _fmt_bytes,
    fmt_bps,
    format_plan,
    parse_codecs,
    plan_codecs,
)
from streamdiloco.sim.table4 import format_table4, reproduce_table4

# --- the command line ---------------------------------------------------------------------------------------

_UNITS = {"kbit": 1e3, "Mbit": 1e6, "Gbit": 1e9}


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _codec(text: str) -> str:
    """A codec flag's value: any name the run takes (topk64_4096, `topk`...), refused in one line."""
    try:
        return canonical_codec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _links(text: str) -> list[tuple[float, float]]:
    """`UP[/DOWN],...` in Mbit/s (one number: the same each way) -> [(up, down)] in bit/s."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if item:
            try:
                rates = [float(x) * 1e6 for x in item.split("/")]
            except ValueError:
                rates = []
            if len(rates) not in (1, 2) or not all(r > 0 for r in rates):
                raise argparse.ArgumentTypeError(f"expected UP[/DOWN] Mbit/s, comma-separated, got {item!r}")
            out.append((rates[0], rates[-1]))
    return out


def _add_model_args(p: argparse.ArgumentParser, codecs: bool = True) -> None:
    size = p.add_argument_group("model size (one of --fragment-values, --model, --params)")
    size.add_argument(
        "--fragment-values", type=_floats, help="values in each fragment, comma-separated (P = count)"
    )
    size.add_argument(
        "--model", help="a built-in preset (tiny, small, ...) or module:factory: its real layout"
    )
    size.add_argument("--params", type=float, help="parameters of the model (e.g. 1e9)")
    size.add_argument(
        "--layers", type=int, default=0, help="transformer blocks (with --params; 0: equal fragments)"
    )
    size.add_argument(
        "--embedding-params", type=float, default=0, help="with --layers: parameters outside the blocks"
    )
    run = p.add_argument_group("run")
    run.add_argument("--P", type=int, default=5, help="num_fragments (default 5)")
    run.add_argument("--H", type=int, default=30, help="sync_every (default 30)")
    run.add_argument("--tau", type=int, default=1, help="fragment_sync_delay (default 1)")
    run.add_argument("--step-time", type=float, required=True, help="seconds of compute per inner step")
    run.add_argument("--jitter", type=float, default=0.0, help="relative spread of step times (default 0)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--workers", type=int, default=2, help="M (default 2)")
    run.add_argument(
        "--steps", type=int, default=0, help="inner steps of the run, all counted (default: steady state)"
    )
    run.add_argument(
        "--final-sync", action="store_true", help="with --steps: include the last step's sync of all"
    )
    link = p.add_argument_group("link and shard")
    link.add_argument("--latency", type=float, default=0.0, help="one-way seconds (default 0)")
    if codecs:
        link.add_argument(
            "--codec", type=_codec, default="e3m0", metavar="CODEC", help=f"both ways: {CODEC_HELP}"
        )
        link.add_argument("--uplink-codec", type=_codec, metavar="CODEC", help="overrides --codec up")
        link.add_argument("--downlink-codec", type=_codec, metavar="CODEC", help="overrides --codec down")
    link.add_argument(
        "--block-size", type=int, default=128, help="values per scale or codebook, not top-k's (default 128)"
    )
    link.add_argument(
        "--round-fixed", type=float, default=0.001, help="shard seconds per round (default 0.001)"
    )
    link.add_argument(
        "--round-per-value", type=float, default=4e-9, help="shard seconds per value (default 4e-9)"
    )
    link.add_argument("--shards", type=int, default=1, help="shards sharing the processing (default 1)")


def _model_from_args(a: argparse.Namespace, policy: str) -> RunModel:
    given = [x for x in ("fragment_values", "model", "params") if getattr(a, x) is not None]
    if len(given) != 1:
        raise ValueError("give the model's size by exactly one of --fragment-values, --model, --params")
    if a.fragment_values is not None:
        values = tuple(int(v) for v in a.fragment_values)
    elif a.model is not None:
        from streamdiloco.common.fragments import build_layout
        from streamdiloco.common.modelspec import build_model

        values = tuple(f.numel for f in build_layout(build_model(a.model), a.P).fragments)
    else:
        values = fragment_values_for(a.params, a.P, a.layers, a.embedding_params)
    codec: str = getattr(a, "codec", "e3m0")
    return RunModel(
        fragment_values=values,
        step_time=a.step_time,
        sync_every=a.H,
        fragment_sync_delay=a.tau,
        policy=policy,
        workers=a.workers,
        latency=a.latency,
        uplink_codec=getattr(a, "uplink_codec", None) or codec,  # `plan` has no codec flags: its rows
        downlink_codec=getattr(a, "downlink_codec", None) or codec,
        codec_block_size=a.block_size,
        round_fixed_s=a.round_fixed,
        round_per_value_s=a.round_per_value,
        num_shards=a.shards,
        steps=a.steps,
        final_sync=a.final_sync,
        step_jitter=a.jitter,
        seed=a.seed,
    )


def _describe(m: RunModel, codecs: bool = True) -> str:
    pushes = ", ".join(_fmt_bytes(m.push_bytes(f)) for f in range(m.num_fragments))
    updates = ", ".join(_fmt_bytes(m.update_bytes(f)) for f in range(m.num_fragments))
    sizes = f"pushes of {pushes} ({m.uplink_codec}), updates of {updates} ({m.downlink_codec}); "
    return (
        f"{sum(m.fragment_values):,} values in {m.num_fragments} fragments, "
        + (sizes if codecs else "")
        + f"H={m.sync_every}, tau={m.fragment_sync_delay}, M={m.workers}, step {m.step_time} s, "
        f"latency {m.latency * 1e3:g} ms one way; "
        + (f"a run of {m.steps} steps" if m.steps else "steady state")
        + (" with the final sync" if m.final_sync else "")
    )


def _policies(choice: str) -> tuple[str, ...]:
    return POLICIES if choice == "both" else (choice,)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m streamdiloco.sim.utilization",
        description="Predict Streaming DiLoCo's compute utilization from the link, or the link from a target "
        "utilization; and check the paper's Table 4.",
        epilog="Examples:\n"
        "  table4\n"
        "  need --params 1e9 --layers 24 --step-time 0.1 --latency 0.05 --tau 1 --policy adaptive \\\n"
        "       --H 30 --P 5 --shards 2\n"
        "  predict --model tiny --P 5 --H 30 --step-time 0.17 --latency 0.025 --bandwidths 0.25,1,4,16,64\n"
        "  plan --params 1e9 --step-time 1 --H 100 --latency 0.05 --at 10/100,20/100",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t4 = sub.add_parser("table4", help="the paper's Table 4 next to ours under its recipe (markdown)")
    t4.add_argument(
        "--dp-buckets",
        default=None,
        help="data-parallel buckets: a number (default 128, the recipe's) or 'layers'",
    )
    need = sub.add_parser("need", help="bandwidth (each way) needed for target utilizations")
    _add_model_args(need)
    need.add_argument(
        "--policy", choices=(*POLICIES, "both"), default="both", help="merge policy (default both)"
    )
    need.add_argument(
        "--targets", type=_floats, default=[50, 80, 90, 95, 99], help="percent, default 50,80,90,95,99"
    )
    pred = sub.add_parser("predict", help="utilization at given bandwidths (each way), as a table")
    _add_model_args(pred)
    pred.add_argument(
        "--policy", choices=(*POLICIES, "both"), default="both", help="merge policy (default both)"
    )
    pred.add_argument("--bandwidths", type=_floats, required=True, help="comma-separated, in --unit")
    pred.add_argument("--unit", choices=tuple(_UNITS), default="Mbit", help="per second (default Mbit)")
    plan = sub.add_parser(
        "plan",
        help="per pair of codecs: bytes per parameter, traffic, and the link each way a target utilization "
        "needs (markdown)",
    )
    _add_model_args(plan, codecs=False)
    plan.add_argument(
        "--codecs",
        default=",".join(PLAN_CODECS),
        metavar="UP[/DOWN][@BLOCK],...",
        help=f"the rows: codec names ({CODEC_HELP}), up/down, @ a block size "
        f"(default {','.join(PLAN_CODECS)})",
    )
    plan.add_argument(
        "--policy", choices=POLICIES, default="adaptive", help="merge policy (default adaptive)"
    )
    plan.add_argument("--target", type=float, default=90, help="utilization in percent (default 90)")
    plan.add_argument(
        "--at",
        type=_links,
        default=[],
        metavar="UP[/DOWN],...",
        help="links to show the utilization on, Mbit/s",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    try:
        _run(a)
    except ValueError as e:
        parser.error(str(e))
    return 0


def _run(a: argparse.Namespace) -> None:
    """One command's output; ValueError on settings that do not go together."""
    if a.command == "table4":
        dpb = a.dp_buckets
        if dpb not in (None, "layers"):
            if not dpb.isdigit() or int(dpb) < 1:
                raise ValueError(f"--dp-buckets takes a number of buckets or 'layers', got {dpb!r}")
            dpb = int(dpb)
        print(format_table4(reproduce_table4(dp_buckets=dpb)))
        return
    if a.command == "plan":
        if not 0 < a.target < 100:
            raise ValueError(f"--target is a utilization in percent, in (0, 100), got {a.target:g}")
        rows = [parse_codecs(c, a.block_size) for c in a.codecs.split(",") if c.strip()]
        base = _model_from_args(a, a.policy)
        print(_describe(base, codecs=False) + f"; {a.policy} merges")
        print(format_plan(plan_codecs(base, rows, a.target / 100, a.at), a.target / 100, a.at))
        return
    models = {p: _model_from_args(a, p) for p in _policies(a.policy)}
    print(_describe(next(iter(models.values()))))
    caps = ", ".join(f"{p} {simulate(m).utilization:.1%}" for p, m in models.items())
    print(f"at unlimited bandwidth (latency and the shard's processing alone): {caps}\n")
    if a.command == "need":
        print("| utilization | " + " | ".join(f"{p} tau={a.tau}" for p in models) + " |")
        print("|---|" + "---|" * len(models))
        for t in a.targets:
            need_bps = [fmt_bps(needed_bandwidth(m, t / 100, rel_tol=0.01)) for m in models.values()]
            print(f"| {t:g} % | " + " | ".join(need_bps) + " |")
        return
    print(f"| {a.unit}/s each way | " + " | ".join(f"{p} tau={a.tau}" for p in models) + " |")
    print("|---|" + "---|" * len(models))
    for b in a.bandwidths:
        bps = b * _UNITS[a.unit]
        utils = [simulate(replace(m, uplink_bps=bps, downlink_bps=bps)).utilization for m in models.values()]
        print(f"| {b:g} | " + " | ".join(f"{100 * u:.1f} %" for u in utils) + " |")


if __name__ == "__main__":
    sys.exit(main())
