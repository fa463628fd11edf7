"""`streamdiloco init-hash`: print the init hash (common/inithash.py) of a model's starting parameters, built
as a worker builds them, for the shards' `--init-expect`. Its flags are argparse declarations and the run's
settings sections; torch is imported only when the command runs, so that `--help` stays light. It must not
start or reach any process."""

from __future__ import annotations

import argparse

from streamdiloco.flags import add_settings


def add_init_hash_parser(sub: argparse._SubParsersAction) -> None:
    """The `init-hash` subcommand, under `streamdiloco`'s subparsers."""
    ih = sub.add_parser(
        "init-hash",
        help="print the init hash of a model's starting parameters (for server --init-expect)",
        description="Build the model as a worker does (--model, --seed, --block-size, the fragment layout "
        "from the [sync] and [model] settings) and print the init hash of its starting parameters on "
        "--num-shards shards: what a worker with that model uploads to shards started with `--init "
        "from-worker`. Give it to every shard as --init-expect HASH, and they take no other start.",
    )
    ih.add_argument("--num-shards", type=int, default=1, help="S, the run's number of shards (default 1)")
    add_settings(ih, ("model", "sync"))
    ih.set_defaults(func=_cmd_init_hash)


def _cmd_init_hash(args: argparse.Namespace) -> int:
    from streamdiloco.checks import check_model, check_sections

    sections = check_sections(args, ("model", "sync"))  # one-line errors before torch is imported
    check_model(args)
    if args.num_shards < 1:
        raise ValueError(f"--num-shards must be at least 1, got {args.num_shards}")
    from streamdiloco.common.inithash import model_init_hash
    from streamdiloco.common.modelspec import build_model

    m = sections["model"]
    model = build_model(m.model, m.seed, m.block_size)
    print(model_init_hash(model, sections["sync"], args.num_shards, m.blocks_path, m.fragment_groups))
    return 0
