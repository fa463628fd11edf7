"""The WAN benchmark's command line (`python -m benchmarks.wan`, see the package's docstring): its flags and
their --quick defaults, the sweep over rates and delays on one testbed in a harness Session, results.md;
`pings` and `combine` (report.py) and the processes in the namespaces (`_ROLE`, linkproxy.py) by their first
argument.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchmarks.wan
from benchmarks.harness import Session, netns, say
from benchmarks.wan.linkproxy import run_role
from benchmarks.wan.report import TABLE_NOTE, checks_table, combine, pings, plot, results_table
from benchmarks.wan.sweep import Sweep
from benchmarks.wan.testbed import DC_ADDR, QUEUE, Testbed

DEFAULT_RATES = "0.25,0.5,1,2,4,8,16,64,256,unlimited"
QUICK_RATES = "1,unlimited"


def parse_rates(text: str) -> list[float | None]:
    """--rates: Mbit/s, comma-separated; "unlimited" (None) for no shaping."""
    out: list[float | None] = []
    for x in text.split(","):
        x = x.strip().lower()
        if not x:
            continue
        if x in ("unlimited", "inf", "none"):
            out.append(None)
            continue
        v = float(x)
        if not v > 0:
            raise ValueError(f"--rates: a rate must be positive Mbit/s or 'unlimited', got {x!r}")
        out.append(v)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.wan",
        description=benchmarks.wan.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _sweep_flags(p.add_argument_group("sweep"))
    _training_flags(p.add_argument_group("training (both systems)"))
    _run_flags(p)
    return p


def _sweep_flags(g: argparse._ArgumentGroup) -> None:
    """The points and their checks."""
    g.add_argument(
        "--rates",
        default=None,
        help=f"Mbit/s each way, comma-separated, 'unlimited': no shaping (default {DEFAULT_RATES})",
    )
    g.add_argument("--delays", default=None, help="one-way delay, ms, comma-separated (default 25,100)")
    g.add_argument(
        "--systems", default="sdl,ddp", help="sdl (streamdiloco), ddp, or both (default %(default)s)"
    )
    g.add_argument(
        "--quick", action="store_true", help=f"rates {QUICK_RATES}, 25 ms, 60 steps, short time bounds"
    )
    g.add_argument(
        "--check-only", action="store_true", help="set up each point and self-check it; no training"
    )
    g.add_argument("--workers", type=int, default=2, help="worker namespaces (and DDP ranks) (default 2)")
    g.add_argument(
        "--queue-ms",
        type=float,
        default=QUEUE * 1e3,
        help="what each link's queue holds, in ms at its rate (default %(default)g; a home modem's: 1000 or "
        "more, which delays everything behind a transfer)",
    )
    g.add_argument(
        "--check-seconds",
        type=float,
        default=2.0,
        help="length of the self-check's bulk transfers (default 2)",
    )
    g.add_argument(
        "--ref-steps", type=int, default=None, help="steps of the no-communication reference (default 40)"
    )
    g.add_argument(
        "--max-wait",
        type=float,
        default=60.0,
        help="seconds to wait, before each point's reference, for other processes to leave the CPUs "
        "(default 60; 0: do not wait)",
    )


def _training_flags(t: argparse._ArgumentGroup) -> None:
    """What both systems train alike."""
    t.add_argument("--steps", type=int, default=None, help="inner steps per worker (default 300; --quick 60)")
    t.add_argument("--batch-size", type=int, default=16, help="sequences per worker per step (default 16)")
    t.add_argument("--model", default="tiny", help="built-in preset or module.path:factory (default tiny)")
    t.add_argument("--block-size", type=int, default=None, help="context length (default: the preset's)")
    t.add_argument("--seed", type=int, default=0, help="seed for init and data streams (default 0)")
    t.add_argument("--data", default=None, metavar="PATH", help="a text file (default: the built-in plays)")
    t.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end (default 8)")
    t.add_argument(
        "--train-flags",
        default="",
        help="more flags for the workers and the DDP ranks alike: the inner optimizer's, e.g. '--lr 1e-3'",
    )


def _run_flags(p: argparse.ArgumentParser) -> None:
    """streamdiloco's own flags, the time bounds, the output."""
    s = p.add_argument_group("streamdiloco")
    s.add_argument("--sync-every", type=int, default=30, help="H (default %(default)s)")
    s.add_argument("--num-fragments", type=int, default=5, help="P (default %(default)s)")
    s.add_argument(
        "--sdl-flags",
        default="",
        help="more Streaming DiLoCo flags for the shard and the workers, e.g. '--fragment-sync-delay 3' "
        "(one flag alone: --sdl-flags=--no-final-sync)",
    )
    s.add_argument("--worker-flags", default="", help="more flags for the workers only")
    s.add_argument(
        "--server-flags", default="", help="more flags for the shard only, e.g. '--round-timeout 300'"
    )
    b = p.add_argument_group("time bounds")
    b.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a streamdiloco run may take (default 1200; quick 300)",
    )
    b.add_argument(
        "--ddp-timeout",
        type=float,
        default=None,
        help="seconds a DDP run may take, start-up included (default 300; quick 90): low bandwidth stops it",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", default="benchmarks/results/wan", help="output folder (default %(default)s)")
    o.add_argument("--keep", action="store_true", help="keep the processes' logs (in a temp folder)")


def settle(
    p: argparse.ArgumentParser, a: argparse.Namespace
) -> tuple[list[float | None], list[float], list[str]]:
    """The defaults that depend on --quick, into `a`; the rates, delays and systems. Exits with the
    parser's error on a bad flag, or when the testbed cannot be made here (root, ip, tc, nft)."""
    q = a.quick
    a.steps = a.steps or (60 if q else 300)
    a.ref_steps = a.ref_steps or (20 if q else 40)
    a.timeout = a.timeout or (300.0 if q else 1200.0)
    a.ddp_timeout = a.ddp_timeout or (90.0 if q else 300.0)
    try:
        rates = parse_rates(a.rates or (QUICK_RATES if q else DEFAULT_RATES))
        delays = [float(x) for x in (a.delays or ("25" if q else "25,100")).split(",") if x.strip()]
    except ValueError as e:
        p.error(str(e))
    systems = [x.strip() for x in a.systems.split(",") if x.strip()]
    if not set(systems) <= {"sdl", "ddp"} or not systems:
        p.error(f"--systems: choose from sdl, ddp; got {a.systems!r}")
    if not 0 < a.queue_ms <= 60_000:
        p.error(f"--queue-ms must be in (0, 60000], got {a.queue_ms:g}")
    if a.workers < 1 or a.steps < 1 or a.ref_steps < 4:
        p.error("--workers and --steps must be at least 1, --ref-steps at least 4")
    if why := netns.missing(("ip", "tc", "nft")):
        p.error(f"the testbed makes network namespaces: {why}")
    return rates, delays, systems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):
        return run_role(argv)
    if argv and argv[0] == "pings":  # no network: ping answer times from kept logs with gRPC's ping trace
        return pings([Path(x) for x in argv[1:]])
    if argv and argv[0] == "combine":  # no network: tables and a plot from earlier runs' results.json
        if len(argv) < 3:
            print("usage: python -m benchmarks.wan combine OUT DIR [DIR ...]", file=sys.stderr)
            return 2
        return combine([Path(d) for d in argv[2:]], Path(argv[1]))
    p = build_parser()
    a = p.parse_args(argv)
    rates, delays, systems = settle(p, a)
    out = Path(a.out)
    with Session("wan", argv, out, keep=a.keep, report_errors=True, hangup=True) as s:
        s.cleanup(Testbed.remove_all)
        s.results |= {"settings": dict(vars(a)), "points": [], "runs": []}
        if gone := Testbed.remove_all():
            say(f"removed the leftovers of an earlier run: {', '.join(gone)}")
        bed = Testbed(a.workers)
        bed.create()
        say(
            f"testbed: shard in {bed.dc} ({DC_ADDR}), workers in {', '.join(bed.ns)} "
            f"({', '.join(bed.addr)}), bridge in {bed.hub}; {len(rates) * len(delays)} points x {systems}, "
            f"{a.steps} steps"
        )
        sweep = Sweep(a, bed, s.procs, s.tmp)
        runs = [] if a.check_only else systems
        total = len(rates) * len(delays) * len(runs)
        for delay_ms in delays:
            for rate in rates:
                sweep.point(rate, delay_ms, runs, total, s.results, out / "results.json")
    runs = s.results["runs"]
    png = plot(runs, out / "utilization.png", a.workers) if runs else None
    if runs:
        say("\n" + results_table(runs))
    return s.finish(results_md(a, s.results), title="WAN testbed results", echo=False, partial=True,
                    extra=f", {png.name}" if png else "")  # fmt: skip


def results_md(a: argparse.Namespace, results: dict) -> list[str]:
    """results.md's body (below the harness's head): the settings, the runs and their note, the checks."""
    flags = "".join(
        f"; {name} `{v}`"
        for name, v in (
            ("shard and workers", a.sdl_flags),
            ("workers", a.worker_flags),
            ("shard", a.server_flags),
            ("workers and DDP ranks", a.train_flags),
        )
        if v
    )
    return [
        f"{a.workers} workers, model {a.model}, batch {a.batch_size}, {a.steps} steps; streamdiloco H="
        f"{a.sync_every}, P={a.num_fragments}{flags}. Time bounds: streamdiloco {a.timeout:g} s, "
        f"DDP {a.ddp_timeout:g} s.",
        "",
        "## Runs",
        "",
        results_table(results["runs"]),
        "",
        TABLE_NOTE,
        "",
        "## Self-checks (per point, before its runs)",
        "",
        checks_table(results["points"]),
        "",
    ]
