"""The `export` subcommand's flags, apart from export.py so that building the CLI's parser (every
`streamdiloco ... --help`) imports neither torch nor the export code: the command imports them when it runs.
Nothing here but argparse declarations and the hand-off."""

from __future__ import annotations

import argparse

from streamdiloco.flags import add_own_flags, add_token_file_flag
from streamdiloco.worker.config import WorkerConfig


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """The `export` subcommand, under `streamdiloco`'s subparsers."""
    ex = sub.add_parser(
        "export",
        help="write the run's global model as a safetensors file (from checkpoints or a live run)",
        description="Write the run's global model (the shards' masters) as one safetensors file, from every "
        "shard's checkpoint directory or from the running shards (Fetch, with a worker's credentials). No "
        "model code is needed: names, shapes and dtypes come from the run's fingerprint, which the file's "
        "metadata keeps (streamdiloco.fingerprint, with the rounds in streamdiloco.rounds) so that a shard "
        "can start from it. Each parameter is written once under its named_parameters() name (tied weights "
        "once); with --model the file holds the model's whole state_dict, buffers too.",
    )
    g = ex.add_argument_group("where the model is")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoints",
        metavar="DIR,DIR,...",
        help="every shard's checkpoint directory (--checkpoint-dir), comma-separated, in any order",
    )
    src.add_argument(
        "--servers",
        metavar="HOST:PORT,...",
        help="every shard of a live run, comma-separated, in shard order",
    )
    g.add_argument(
        "--mixed-rounds",
        action="store_true",
        help="export even when shards hold different rounds of a fragment (each slice as of its shard's)",
    )
    g = ex.add_argument_group("output")
    g.add_argument(
        "--out", required=True, metavar="PATH", help="the safetensors file to write (model.safetensors)"
    )
    g.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="load the tensors into this model (a preset, module.path:factory or hf:PATH, as the workers') "
        "and write "
        "its whole state_dict: buffers too; checked strictly against the run's parameters",
    )
    g.add_argument("--seed", type=int, default=0, help="the seed --model's factory is built with (buffers)")
    g.add_argument("--block-size", type=int, default=None, help="--model's context length (a preset's)")
    g.add_argument(
        "--hf-out",
        default=None,
        metavar="DIR",
        help="also save_pretrained the --model (hf:PATH, or a factory of a transformers PreTrainedModel) "
        "into this folder: AutoModelForCausalLM.from_pretrained(DIR) loads it",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="with --hf-out: write this tokenizer into DIR too (tokenizer.json, tokenizer_config.json), so "
        "that AutoTokenizer.from_pretrained(DIR) loads it: a tokenizer.json, or the prepared data folder "
        "(its tokenizer, its EOS as eos/bos/unk); checked first: it must parse and the model must take "
        "every id",
    )
    g = ex.add_argument_group("a live run (--servers): a worker's credentials")
    g.add_argument("--token", default="", help="a worker's token, or the run's shared one")
    add_token_file_flag(g)
    add_own_flags(g, WorkerConfig, only=("tls_ca", "tls_cert", "tls_key"))  # as the workers' flags
    g.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for each shard's Fetch (default %(default)s)"
    )
    g.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="seconds to wait for a round that closed on one shard to close on the others "
        "(default %(default)s)",
    )
    ex.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    import logging

    from streamdiloco.export import export

    # progress through the log: dated, and a record with --log-format json
    return export(args, progress=logging.getLogger("streamdiloco.export").info)
