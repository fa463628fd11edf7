"""The `data` subcommand's flags: `streamdiloco data prepare` (text and JSON Lines into a prepared,
tokenized folder) and `streamdiloco data check` (open one, verify it, say what it holds). Nothing here but
argparse declarations and the hand-off, so that `--help` imports neither torch nor tokenizers: the commands
import worker/prepare.py and common/prepared.py when they run."""

from __future__ import annotations

import argparse
import sys


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    """The `data` subcommand, under `streamdiloco`'s subparsers."""
    data = sub.add_parser(
        "data",
        help="prepare a corpus into tokens (data prepare), check a prepared folder (data check)",
        description="Prepared, tokenized data: a folder with tokens.bin (the documents' token ids, each "
        "followed by EOS), documents.bin (their offsets), tokenizer.json and manifest.json. Workers train "
        "on it with --data DIR.",
    )
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = dsub.add_parser(
        "prepare",
        help="tokenize text files, JSON Lines files or folders of them into a prepared folder",
        description="Tokenize INPUTs into the folder --out, streaming (bounded memory, any corpus size). "
        "A named .jsonl/.ndjson/.json file is JSON Lines (one document a line, its 'text' field); any other "
        "named file is one UTF-8 text document; a folder gives its .txt, .text, .md, .rst (text) and "
        ".jsonl, .ndjson (JSON Lines) files, recursively, sorted by path. Each document is followed by "
        "the EOS token. The last documents (about --val-fraction of the tokens) are the validation split. "
        "Nothing is downloaded: the tokenizer is local or trained here. Nothing is left at --out on an "
        "error.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text or JSON Lines files, or folders of them")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, or empty)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a Hugging Face tokenizer.json, or a folder saved with save_pretrained that holds one",
    )
    tok.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE of VOCAB ids on the inputs (EOS <|endoftext|> is id 0)",
    )
    p.add_argument(
        "--eos",
        metavar="TOKEN",
        help="the end-of-text token (default: the folder's tokenizer_config.json eos_token, else the first "
        "of <|endoftext|>, </s>, <|end_of_text|>, <eos>, <|eos|> the tokenizer has)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="the model's vocabulary: every id must be below it (default: the folder's config.json "
        "vocab_size, else the tokenizer's)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.005,
        metavar="F",
        help="the share of tokens kept for validation, whole last documents (default %(default)s; 0: none)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=1024,
        metavar="N",
        help="the context length you will train with: the validation split gets at least N+1 tokens where "
        "the data allows (default %(default)s)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON Lines field that holds the text (default %(default)s)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it is a prepared folder already")
    p.set_defaults(func=_cmd_prepare)
    c = dsub.add_parser(
        "check",
        help="verify a prepared folder (manifest, sizes, sha256, ids) and say what it holds",
        description="Open DIR as a worker would, then read it all: the manifest's fields, the files' sizes, "
        "tokens.bin's and tokenizer.json's sha256, every id below the vocabulary, every document ending "
        "with EOS. Prints one line; a fault is an error (exit 2).",
    )
    c.add_argument("dir", metavar="DIR", help="the prepared folder")
    c.set_defaults(func=_cmd_check)


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Prepare (worker/prepare.py), then print the summary."""
    from streamdiloco.worker.prepare import prepare, summary

    m = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        train_vocab=args.train_tokenizer,
        eos=args.eos,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        block_size=args.block_size,
        text_field=args.text_field,
        force=args.force,
        progress=sys.stderr,
    )
    print(summary(args.out, m))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from streamdiloco.common.prepared import PreparedData

    d = PreparedData.open(args.dir, verify=True)
    m = d.manifest
    print(
        f"{args.dir}: ok, {m['tokens']:,} tokens of {m['dtype']} in {m['documents']:,} documents (vocabulary "
        f"{m['vocab_size']:,}, EOS {m['eos_id']}), train {m['train_tokens']:,}, validation "
        f"{m['tokens'] - m['train_tokens']:,}; sha256 {m['sha256']}; tokenizer {m['tokenizer']['source']}"
    )
    return 0
