"""`streamdiloco export`: the run's global model (the shards' masters, not any worker's α-mixed local
parameters) as one safetensors file, from the shards' checkpoint directories (server/storage/export.py's
`from_checkpoints`) or from a live run (common/globalmodel.py's `from_servers`: Fetch).

No model code is needed: the names, shapes and dtypes of the parameters come from the run's model
fingerprint, and the file holds each parameter once, with metadata a shard can start from (`server --init`;
common/globalmodel.py says which). With `--model SPEC` the tensors are loaded into that model (strictly:
names, shapes and dtypes must be the run's), and the file holds its whole state_dict: the buffers too (they
are not synced: the model's own), tied names once (`safetensors.torch.load_model` fills the others); a
`transformers` model is also written as a `save_pretrained` folder (`--hf-out`), with its tokenizer
(`--tokenizer`: a tokenizer.json, or the prepared data's; common/tokenizer.py) as tokenizer.json and
tokenizer_config.json, so that `AutoTokenizer.from_pretrained` loads it too. In the library, a worker has
`engine.global_state_dict()`.

Nothing is written unless everything checks: a missing shard, checkpoints of two runs, a damaged file (its
hash, as the shard's own loading checks it), a refused Fetch or a tokenizer that is not one (or has more ids
than the model) is a one-line error.

This module is the command only. The library it runs lives in the package (import it from there):
common/globalmodel.py, server/storage/export.py and common/tokenizer.py. Its names are also importable from
here, as `streamdiloco.export.X`, for scripts written against earlier versions; nothing in server/, worker/
or common/ imports this module.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from streamdiloco.common.fingerprint import layout_from_fingerprint
from streamdiloco.common.globalmodel import (
    ROUNDS_KEY,
    GlobalModel,
    Progress,
    agree_rounds,
    fetch_masters,
    from_servers,
    load_into_model,
    model_tensors,
    write_safetensors,
)
from streamdiloco.common.statefile import FINGERPRINT_KEY
from streamdiloco.common.tokenizer import ExportTokenizer, read_tokenizer
from streamdiloco.server.storage.export import from_checkpoints

__all__ = [  # the library's names, as earlier versions had them here
    "FINGERPRINT_KEY",
    "ROUNDS_KEY",
    "ExportTokenizer",
    "GlobalModel",
    "agree_rounds",
    "export",
    "fetch_masters",
    "from_checkpoints",
    "from_servers",
    "layout_from_fingerprint",
    "load_into_model",
    "model_tensors",
    "read_tokenizer",
    "write_safetensors",
]


def export(args: argparse.Namespace, progress: Progress = print) -> int:
    """The command: gather, check, then write (nothing is written before everything has checked)."""
    from streamdiloco.common.tls import client_tls, read_secret

    if args.hf_out and not args.model:
        raise ValueError("--hf-out needs --model (hf:PATH, or a transformers model's factory)")
    if args.tokenizer and not args.hf_out:
        raise ValueError("--tokenizer needs --hf-out: the folder it is written into, beside the model")
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a directory: give the file to write (model.safetensors)")
    model, pretrained = None, None  # pretrained: the model again, once it is known to be a transformers one
    tokenizer: ExportTokenizer | None = None
    if args.model:  # built first: a wrong spec fails before a long fetch
        from streamdiloco.common.modelspec import build_model

        model = build_model(args.model, args.seed, args.block_size)
        if args.hf_out:
            try:
                from transformers import PreTrainedModel
            except ImportError:
                raise ValueError("--hf-out needs transformers (pip install transformers)") from None
            if not isinstance(model, PreTrainedModel):
                raise ValueError(
                    f"--hf-out needs a transformers model: --model {args.model} builds "
                    f"a {type(model).__name__}"
                )
            pretrained = model
            if args.tokenizer:  # checked now: nothing is fetched or written for a wrong one
                tokenizer = read_tokenizer(args.tokenizer, model, args.model)
    if args.checkpoints:
        dirs = [d.strip() for d in args.checkpoints.split(",") if d.strip()]
        gm = from_checkpoints(dirs, args.mixed_rounds, progress)
    else:
        token = args.token
        if args.token_file:
            if args.token:
                raise ValueError("give --token or --token-file, not both")
            token = read_secret(args.token_file, "--token-file")
        if not args.timeout > 0 or not args.settle >= 0:
            raise ValueError("--timeout must be positive and --settle at least 0 seconds")
        tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key)
        targets = [t.strip() for t in args.servers.split(",") if t.strip()]
        gm = from_servers(targets, token, tls, args.timeout, args.settle, args.mixed_rounds, progress)
    metadata = gm.metadata()
    if model is not None:
        load_into_model(model, gm, args.model)
        tensors = model_tensors(model)
    else:
        tensors = gm.tensors()
    gm.vectors.clear()  # the tensors are copies: the flat vectors go before the file is written
    values = sum(t.numel() for t in tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    progress(f"writing {args.out}: {len(tensors)} tensors, {values:,} values, {nbytes / 1e6:,.1f} MB")
    write_safetensors(tensors, args.out, metadata)
    progress(f"wrote {args.out} (rounds {gm.rounds})")
    if pretrained is not None:
        pretrained.save_pretrained(args.hf_out)
        if tokenizer is not None:
            tokenizer.write(args.hf_out, pretrained)
        with_tokenizer = " and AutoTokenizer.from_pretrained" if tokenizer is not None else ""
        progress(f"wrote {args.hf_out} (save_pretrained: load it with from_pretrained{with_tokenizer})")
    return 0
