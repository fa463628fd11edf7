"""The wire benchmark's command line (`python -m benchmarks.wire`, see the package's docstring): its flags
and their --quick defaults, then the parts asked for, in order, in one harness Session; the processes of
part (b) (`_ROLE ...`) go to clients.py. What each part measures and reports is in its own module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchmarks.wire
from benchmarks.harness import Session
from benchmarks.wire.clients import run_role
from benchmarks.wire.demo import part_c, report_c
from benchmarks.wire.framing import part_a, report_a
from benchmarks.wire.ingest import Ingest
from benchmarks.wire.ingest_report import report_b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.wire",
        description=benchmarks.wire.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--parts", default="a,b,c", help="which parts to run, comma-separated (default %(default)s)"
    )
    p.add_argument("--quick", action="store_true", help="smaller models and fewer rounds and steps (~7 min)")
    p.add_argument("--out", default="benchmarks/results/wire", help="output folder (default %(default)s)")
    p.add_argument("--a-models", default=None, help="(a) models, comma-separated (default tiny,small)")
    p.add_argument("--b-model", default=None, help="(b) model whose fragment 0 is pushed (default medium)")
    p.add_argument("--b-clients", type=int, default=8, help="(b) concurrent clients (default 8)")
    p.add_argument(
        "--b-shards", default="1,2", help="(b) shard counts for the gRPC runs (default %(default)s)"
    )
    p.add_argument(
        "--no-pipeline",
        dest="b_pipeline",
        action="store_false",
        help="(b) skip the gRPC runs with 2 fragments in flight (pushes during the other's close)",
    )
    p.add_argument("--b-rounds", type=int, default=None, help="(b) rounds per repeat (default 3)")
    p.add_argument(
        "--b-repeats", type=int, default=None, help="(b) repeats; the median is reported (default 3)"
    )
    p.add_argument("--no-profile", dest="b_profile", action="store_false", help="(b) skip the cProfile pass")
    p.add_argument("--c-steps", type=int, default=None, help="(c) steps of the demo cluster (default 400)")
    p.add_argument("--c-log-every", type=int, default=50, help="(c) as make demo (default %(default)s)")
    p.add_argument(
        "--no-reference", dest="c_reference", action="store_false", help="(c) skip the H=steps run"
    )
    p.add_argument(
        "--no-threads",
        dest="c_threads",
        action="store_false",
        help="(c) skip the runs with every worker on all the cores",
    )
    p.add_argument(
        "--max-wait",
        type=float,
        default=120.0,
        help="seconds to wait, before each timed run, for other processes to leave the CPUs (default 120)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the processes' logs (and profile) in a temp folder"
    )
    return p


def settle(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[set[str], list[str]]:
    """The defaults that depend on --quick, into `args`; the parts to run and part (a)'s models. Exits
    with the parser's error on a bad flag."""
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if parts - {"a", "b", "c"}:
        p.error(f"--parts: choose from a, b, c; got {args.parts!r}")
    q = args.quick
    a_models = (args.a_models or ("tiny" if q else "tiny,small")).split(",")
    args.b_model = args.b_model or ("small" if q else "medium")
    args.b_rounds = args.b_rounds or (2 if q else 3)
    try:
        args.b_shards = [int(x) for x in args.b_shards.split(",") if x.strip()]
    except ValueError:
        p.error(f"--b-shards: comma-separated shard counts, got {args.b_shards!r}")
    if not args.b_shards or min(args.b_shards) < 1:
        p.error(f"--b-shards: shard counts of at least 1, got {args.b_shards}")
    args.b_repeats = args.b_repeats or (2 if q else 3)
    args.b_tcp_modes = ["discard", "decode", "full"]
    args.c_steps = args.c_steps or (60 if q else 400)
    if q:
        args.b_profile = args.c_reference = args.c_threads = False
    return parts, a_models


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):
        return run_role(argv)
    p = build_parser()
    args = p.parse_args(argv)
    parts, a_models = settle(p, args)
    md: list[str] = []
    with Session("wire", argv, Path(args.out), keep=args.keep, report_errors=True) as s:
        if "a" in parts:
            s.results["a"] = part_a(a_models, args.quick, s.procs, s.tmp, args.max_wait)
            md += report_a(s.results["a"])
        if "b" in parts:
            s.results["b"] = Ingest(args, s.procs, s.tmp).run()
            md += report_b(s.results["b"], args.b_shards)
        if "c" in parts:
            s.results["c"] = part_c(args, s.procs, s.tmp)
            md += report_c(s.results["c"], args.c_steps)
    return s.finish(md, title="Wire benchmark results", echo=False, partial=True)
