"""`streamdiloco export`: the run's global model (the shards' masters, not any worker's α-mixed local
parameters) as one safetensors file, from the shards' checkpoint directories or from a live run (Fetch).

No model code is needed: the names, shapes and dtypes of the parameters come from the run's model
fingerprint (in each checkpoint's meta.json; on the first chunk of a Fetch that asks to `describe`), and the
fragments' flat vectors are cut back into them with the same slice math the shards use. The file holds each
parameter once, under its `named_parameters()` name (a tied weight once, as the fingerprint lists it:
safetensors refuses two names for one storage), and metadata a shard can start from (`server --init`):

    streamdiloco.fingerprint   the run's model fingerprint (JSON)
    streamdiloco.rounds        per fragment, the open round of the exported master (it holds rounds < it);
                               a list per shard when they differ (--mixed-rounds)

With `--model SPEC` the tensors are loaded into that model (strictly: names, shapes and dtypes must be the
run's), and the file holds its whole state_dict: the buffers too (they are not synced: the model's own),
tied names once (`safetensors.torch.load_model` fills the others); a `transformers` model is also written
as a `save_pretrained` folder (`--hf-out`). In the library, a worker has `engine.global_state_dict()`.

Nothing is written unless everything checks: a missing shard, checkpoints of two runs, a damaged file (its
hash, as the shard's own loading checks it) or a refused Fetch is a one-line error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamdiloco.common.fragments import Fragment, FragmentLayout, ParamEntry, slice_ranges

if TYPE_CHECKING:
    from streamdiloco.common.tls import ClientTLS

FINGERPRINT_KEY = "streamdiloco.fingerprint"  # `server --init` reads the run's layout from it: keep the name
ROUNDS_KEY = "streamdiloco.rounds"
MAX_FINGERPRINT_BYTES = 4 << 20  # as the shard's Join: names and shapes are kilobytes, not megabytes
MAX_DIMS = 16
MAX_VALUES = 1 << 40  # values in one parameter or the whole model: a bound on what a fingerprint may claim

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class GlobalModel:
    """The run's global model as flat fragment vectors (fp32), the fingerprint that names their values, and
    the round of each fragment's master (one per shard when the shards differ)."""

    fingerprint: dict
    layout: FragmentLayout
    vectors: list[torch.Tensor]
    rounds: list[int | list[int]]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Each parameter under its name, in its own dtype: contiguous copies (no two share storage)."""
        out = {}
        for fragment, vec in zip(self.layout.fragments, self.vectors, strict=True):
            for e in fragment.entries:
                value = vec[e.offset : e.offset + e.numel].view(e.shape)
                out[e.name] = value.to(_dtype(e.dtype, e.name), copy=True)
        return out

    def metadata(self) -> dict[str, str]:
        # "format": "pt" is what transformers' loaders look for in a safetensors file's metadata
        return {
            "format": "pt",
            FINGERPRINT_KEY: json.dumps(self.fingerprint, sort_keys=True),
            ROUNDS_KEY: json.dumps(self.rounds),
        }


def _dtype(name: str, param: str, where: str = "the fingerprint") -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where} gives parameter {param[:80]!r} the dtype {name[:40]!r}, not a float dtype")
    return dtype


def layout_from_fingerprint(fp: object, where: str = "the fingerprint") -> FragmentLayout:
    """The run's fragment layout (names, shapes, dtypes, offsets) from its model fingerprint alone; a
    ValueError (one line, prefixed with `where`) when the fingerprint is not one: it may come off the
    network."""
    if not isinstance(fp, dict):
        raise ValueError(f"{where} is not a model fingerprint (a JSON object)")
    params, fragments = fp.get("params"), fp.get("fragments")
    if not isinstance(params, list) or not isinstance(fragments, list) or not fragments:
        raise ValueError(f"{where} lacks its lists of parameters and fragments")
    by_name: dict[str, tuple[tuple[int, ...], str]] = {}
    total = 0
    for p in params:
        ok = isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[2], str)
        shape = p[1] if ok else None
        if not ok or not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ValueError(f"{where} lists a parameter that is not [name, shape, dtype]: {str(p)[:80]}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_VALUES for d in shape):
            raise ValueError(f"{where} gives parameter {p[0][:80]!r} the shape {str(shape)[:80]}")
        if p[0] in by_name:
            raise ValueError(f"{where} lists parameter {p[0][:80]!r} twice")
        _dtype(p[2], p[0], where)
        by_name[p[0]] = (tuple(shape), p[2])
        total += math.prod(shape)
        if total > MAX_VALUES:
            raise ValueError(f"{where} claims more than {MAX_VALUES:,} values")
    out, listed = [], []
    for i, f in enumerate(fragments):
        if not (
            isinstance(f, list)
            and len(f) == 2
            and isinstance(f[0], list)
            and all(isinstance(b, int) for b in f[0])
            and isinstance(f[1], list)
            and all(isinstance(n, str) for n in f[1])
        ):
            raise ValueError(f"{where}: fragment {i} is not [blocks, names]")
        entries, off = [], 0
        for name in f[1]:
            if name not in by_name:
                raise ValueError(f"{where}: fragment {i} names {name[:80]!r}, which is not a parameter")
            shape, dtype = by_name[name]
            entries.append(ParamEntry(name, shape, off, math.prod(shape), dtype))
            off += math.prod(shape)
        listed += f[1]
        out.append(Fragment(i, tuple(entries), tuple(f[0])))
    if listed != list(by_name):  # the fingerprint lists the parameters fragment by fragment, each once
        raise ValueError(f"{where}: its fragments do not list the parameters in order, each once")
    blocks_path, pattern = fp.get("blocks_path", ""), fp.get("fragment_pattern", "strided")
    if not isinstance(blocks_path, str) or not isinstance(pattern, str):
        raise ValueError(f"{where}: blocks_path and fragment_pattern must be strings")
    return FragmentLayout(tuple(out), blocks_path, pattern)


def _empty(numel: int, what: str) -> torch.Tensor:
    """An fp32 vector for `what`; a one-line error when this machine cannot hold it."""
    try:
        return torch.empty(numel, dtype=torch.float32)
    except RuntimeError as e:  # the size comes from a fingerprint: say so rather than print a traceback
        raise ValueError(f"cannot hold {what} ({numel:,} values) in memory: {str(e)[:120]}") from None


def _size(values: int) -> str:
    return f"{values * 4 / 1e6:,.1f} MB"


def agree_rounds(
    per_shard: list[list[int]], mixed_ok: bool, where: Callable[[int], str]
) -> list[int | list[int]]:
    """Each fragment's round, from every shard's: one number when they agree; else a ValueError naming the
    rounds (or, with `mixed_ok`, the list of them)."""
    out: list[int | list[int]] = []
    for f, rounds in enumerate(zip(*per_shard, strict=True)):
        if len(set(rounds)) == 1:
            out.append(rounds[0])
            continue
        if not mixed_ok:
            at = ", ".join(f"{r} on shard {s} ({where(s)})" for s, r in enumerate(rounds))
            raise ValueError(
                f"the shards hold different rounds of fragment {f}: {at}; the round closed on some shards "
                "only (one stopped, or is behind): export anyway with --mixed-rounds (each slice as of its "
                "own shard's round)"
            )
        out.append(list(rounds))
    return out


# --- from the shards' checkpoint directories -------------------------------------------------------------
def _read_meta(directory: Path) -> dict:
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{directory} is not a shard's checkpoint: it has no meta.json") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory}: cannot read meta.json ({e})") from None
    if not isinstance(meta, dict) or not all(
        k in meta for k in ("shard", "num_shards", "config", "fingerprint")
    ):
        raise ValueError(f"{directory}: meta.json is not a shard checkpoint's")
    s, n = meta["shard"], meta["num_shards"]
    if not (isinstance(s, int) and isinstance(n, int) and 0 <= s < n):
        raise ValueError(f"{directory}: meta.json names shard {s!r} of {n!r}")
    return meta


def from_checkpoints(
    directories: list[str | Path], mixed_rounds: bool = False, progress: Progress = _quiet
) -> GlobalModel:
    """The global model from every shard's checkpoint directory (in any order): each is loaded and checked
    as the shard itself loads it on a restart (hashes, finite values, the rounds logged since replayed) and
    its slices put in place. ValueError (one line) when they are not one whole run."""
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.common.fingerprint import fingerprint_diff
    from streamdiloco.server.checkpoint import ShardCheckpoint
    from streamdiloco.server.shard import ShardState

    dirs = [Path(d) for d in directories]
    if not dirs:
        raise ValueError("--checkpoints: give every shard's checkpoint directory, comma-separated")
    metas = [_read_meta(d) for d in dirs]
    first, num_shards = dirs[0], metas[0]["num_shards"]
    for d, meta in zip(dirs[1:], metas[1:], strict=True):  # one run: the same shards, settings and model
        if meta["num_shards"] != num_shards:
            raise ValueError(
                f"{first} is from a run of {num_shards} shards, {d} of {meta['num_shards']}: give the "
                "checkpoints of one run"
            )
        if meta["config"] != metas[0]["config"]:
            cfg0, cfg1 = metas[0]["config"], meta["config"]
            keys = sorted(k for k in set(cfg0) | set(cfg1) if cfg0.get(k) != cfg1.get(k))
            raise ValueError(
                f"{first} and {d} are from different runs: other sync settings ({', '.join(keys)})"
            )
        if (
            diff := fingerprint_diff(meta["fingerprint"], metas[0]["fingerprint"], str(d), str(first))
        ) is not None:
            raise ValueError(f"{first} and {d} are from different runs: {diff}")
    where: dict[int, Path] = {}
    for d, meta in zip(dirs, metas, strict=True):
        if meta["shard"] in where:
            raise ValueError(f"{where[meta['shard']]} and {d} are both shard {meta['shard']}: give each once")
        where[meta["shard"]] = d
    if missing := sorted(set(range(num_shards)) - set(where)):
        raise ValueError(
            f"shard {missing[0]} of {num_shards} is missing ({len(where)} of {num_shards} given): "
            "--checkpoints needs every shard's directory"
        )
    fp = metas[0]["fingerprint"]
    layout = layout_from_fingerprint(fp, f"{first}'s fingerprint")
    try:
        cfg = SyncConfig.from_dict(metas[0]["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{first}: meta.json's sync settings do not check ({e})") from None
    vectors = [_empty(f.numel, f"fragment {f.index}") for f in layout.fragments]
    rounds: list[list[int]] = []
    for s in range(num_shards):
        # no initial values: every slice comes from the checkpoint (a zero-stride view costs no memory)
        initial = [torch.zeros(1).expand(f.numel) for f in layout.fragments]
        state = ShardState(s, num_shards, layout, cfg, initial)
        ShardCheckpoint(where[s], fp).load(state)  # hashes, finite values, the logged rounds replayed
        for f, (lo, hi) in enumerate(state.ranges):
            vectors[f][lo:hi] = state.master(f)
        rounds.append([state.round_of(f) for f in range(layout.num_fragments)])
        done = sum(hi - lo for lo, hi in state.ranges)
        progress(f"shard {s} of {num_shards}: {where[s]}, {_size(done)}, rounds {rounds[-1]}")
        del state
    return GlobalModel(fp, layout, vectors, agree_rounds(rounds, mixed_rounds, lambda s: str(where[s])))


# --- from a live run (Fetch) -----------------------------------------------------------------------------
class _ShardFetch:
    """Fetches from one shard, listed at place `shard` of `num_shards` in --servers."""

    def __init__(
        self, target: str, shard: int, num_shards: int, token: str, tls: ClientTLS | None, timeout: float
    ):
        self.target, self.shard, self.num_shards = target, shard, num_shards
        self.token, self.tls, self.timeout = token, tls, timeout
        self.fingerprint: dict | None = None  # as the shard described its run

    def _described(self, m) -> FragmentLayout:
        """The run's layout from the stream's first chunk; ValueError unless the shard is the one listed."""
        if not m.fingerprint_json:
            raise ValueError(
                f"the shard at {self.target} does not say which run it serves (an older streamdiloco?): "
                "export from its checkpoint directory instead"
            )
        if (m.shard, m.num_shards) != (self.shard, self.num_shards):
            raise ValueError(
                f"--servers lists the shard at {self.target} in place {self.shard} of {self.num_shards}, "
                f"but it is shard {m.shard} of {m.num_shards}: list every shard, in order"
            )
        if len(m.fingerprint_json) > MAX_FINGERPRINT_BYTES:
            raise ValueError(
                f"the shard at {self.target} sent a fingerprint of over {MAX_FINGERPRINT_BYTES:,} bytes"
            )
        try:
            self.fingerprint = json.loads(m.fingerprint_json)
        except ValueError as e:
            raise ValueError(
                f"the shard at {self.target} sent a fingerprint that is not JSON ({e})"
            ) from None
        return layout_from_fingerprint(self.fingerprint, f"the fingerprint of the shard at {self.target}")

    def fetch(
        self, layout: FragmentLayout | None = None, fragment: int | None = None, progress: Progress = _quiet
    ) -> tuple[FragmentLayout, list[torch.Tensor], list[int]]:
        """The shard's slice of every fragment (or of `fragment`) and their rounds; without a `layout`, the
        shard is asked to describe its run first (`self.fingerprint`). Every chunk is checked (order,
        offsets, lengths, one round per fragment, finite values: common/fetch.py)."""
        import grpc

        from streamdiloco.common.fetch import FetchError, fetch_slices
        from streamdiloco.common.wire import make_channel, parse_target
        from streamdiloco.protos import streamdiloco_pb2 as pb
        from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

        described: list[FragmentLayout] = []

        def sizes_of(layout: FragmentLayout, fragments: list[int]) -> dict[int, int]:
            ranges = [slice_ranges(layout.fragments[f].numel, self.num_shards)[self.shard] for f in fragments]
            return {f: hi - lo for f, (lo, hi) in zip(fragments, ranges, strict=True)}

        def describe(m: pb.MasterChunk) -> dict[int, int]:
            described.append(self._described(m))
            return sizes_of(described[0], list(range(described[0].num_fragments)))

        received, last_said = [0], [time.monotonic()]

        def on_chunk(m: pb.MasterChunk) -> None:
            received[0] += len(m.values) // 4
            if time.monotonic() - last_said[0] > 2.0:
                progress(f"shard {self.shard} at {self.target}: {_size(received[0])} received")
                last_said[0] = time.monotonic()

        wanted = None
        if layout is not None:
            wanted = sizes_of(layout, list(range(layout.num_fragments)) if fragment is None else [fragment])
        try:
            with make_channel(parse_target(self.target), self.tls) as channel:
                got = fetch_slices(
                    pb_grpc.ShardStub(channel),
                    wanted,
                    where=f"the shard at {self.target}",
                    describe=describe if layout is None else None,
                    token=self.token,
                    timeout=self.timeout,
                    on_chunk=on_chunk,
                )
        except FetchError as e:
            if e.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise ValueError(
                    f"the shard at {self.target} refused the credentials ({e.details}): Fetch needs a "
                    "worker's (--token or --token-file, and --tls-* as the workers)"
                ) from None
            raise
        layout = layout or described[0]
        return layout, list(got.slices.values()), list(got.rounds.values())


def from_servers(
    targets: list[str],
    token: str = "",
    tls: ClientTLS | None = None,
    timeout: float = 120.0,
    settle: float = 30.0,
    mixed_rounds: bool = False,
    progress: Progress = _quiet,
) -> GlobalModel:
    """The global model from a live run: every shard, listed in order (shard s at targets[s]), Fetched with
    a worker's credentials. A fragment whose round closed on one shard and not yet on another is fetched
    again from the shards behind, for up to `settle` seconds, so that every slice is of the same round."""
    if not targets:
        raise ValueError("--servers: give every shard as HOST:PORT, comma-separated, in shard order")
    shards = [_ShardFetch(t, s, len(targets), token, tls, timeout) for s, t in enumerate(targets)]
    layout: FragmentLayout | None = None
    per_shard: list[list[torch.Tensor]] = []
    rounds: list[list[int]] = []
    for sh in shards:
        got, slices, rs = sh.fetch(progress=progress)
        first = shards[0]
        if layout is None:
            layout = got
        elif sh.fingerprint != first.fingerprint:
            from streamdiloco.common.fingerprint import fingerprint_diff

            them = f"shard at {first.target}"
            diff = fingerprint_diff(
                sh.fingerprint or {}, first.fingerprint or {}, f"shard at {sh.target}", them
            )
            raise ValueError(f"the shards at {first.target} and {sh.target} serve different runs: {diff}")
        per_shard.append(slices)
        rounds.append(rs)
        size = _size(sum(x.numel() for x in slices))
        progress(f"shard {sh.shard} of {len(targets)} at {sh.target}: {size}, rounds {rs}")
    assert layout is not None and shards[0].fingerprint is not None
    deadline = time.monotonic() + settle
    for f in range(layout.num_fragments):
        while len({rs[f] for rs in rounds}) > 1 and time.monotonic() < deadline:
            top = max(rs[f] for rs in rounds)  # a round closing: fetch it again where it has not closed yet
            for s, sh in enumerate(shards):
                if rounds[s][f] < top:
                    _, [per_shard[s][f]], [rounds[s][f]] = sh.fetch(layout, f)
            if len({rs[f] for rs in rounds}) > 1:
                time.sleep(0.2)
    vectors = [torch.cat([per_shard[s][f] for s in range(len(shards))]) for f in range(layout.num_fragments)]
    fp = shards[0].fingerprint
    return GlobalModel(fp, layout, vectors, agree_rounds(rounds, mixed_rounds, lambda s: targets[s]))


def fetch_masters(
    targets: list[str], token: str = "", timeout: float = 60.0, tls: ClientTLS | None = None
) -> list[torch.Tensor]:
    """The run's global parameters, fragment by fragment, read from the live shards listed in shard order
    (no Join: Fetch is read-only), every chunk checked as export checks it; the rounds may differ between
    shards (no waiting for a closing round). For tools, tests and benchmarks; workers fetch through their
    links."""
    return from_servers(targets, token, tls, timeout, settle=0.0, mixed_rounds=True).vectors


# --- writing -----------------------------------------------------------------------------------------------
def load_into_model(model: torch.nn.Module, gm: GlobalModel, spec: str) -> None:
    """Set the model's parameters to the global ones; ValueError (one line) unless the model's parameters
    are the run's: the same names, shapes and dtypes."""
    params = dict(model.named_parameters())
    ours = {e.name: e for f in gm.layout.fragments for e in f.entries}
    if missing := sorted(set(ours) - set(params)):
        raise ValueError(
            f"--model {spec} does not fit the run: it lacks parameter {missing[0]!r} ({len(missing)} missing)"
        )
    if extra := sorted(set(params) - set(ours)):
        raise ValueError(
            f"--model {spec} does not fit the run: it has parameter {extra[0]!r}, which the run has not"
        )
    for name, e in ours.items():
        p = params[name]
        dtype = str(p.dtype).removeprefix("torch.")
        if tuple(p.shape) != e.shape or dtype != e.dtype:
            raise ValueError(
                f"--model {spec} does not fit the run: {name} is {list(p.shape)} {dtype} there, "
                f"{list(e.shape)} {e.dtype} in the run"
            )
    with torch.no_grad():  # straight from the flat vectors (copy_ rounds to the dtype as .to() does)
        for fragment, vec in zip(gm.layout.fragments, gm.vectors, strict=True):
            for e in fragment.entries:
                params[e.name].copy_(vec[e.offset : e.offset + e.numel].view(e.shape))


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with a tied tensor once, under its named_parameters() name (the fingerprint's):
    contiguous CPU copies, as safetensors takes them. `safetensors.torch.load_model` fills the other names."""
    params = {id(p): name for name, p in model.named_parameters()}
    out, seen = {}, set()
    for key, t in model.state_dict(keep_vars=True).items():
        name = params.get(id(t), key)
        if name in seen:
            continue
        seen.add(name)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """Write the file beside its final place and rename it there: a failure leaves no half file."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def export(args: argparse.Namespace, progress: Progress = print) -> int:
    """The command: gather, check, then write (nothing is written before everything has checked)."""
    from streamdiloco.common.tls import client_tls, read_secret

    if args.hf_out and not args.model:
        raise ValueError("--hf-out needs --model (a transformers model's factory, to save_pretrained)")
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a directory: give the file to write (model.safetensors)")
    model, pretrained = None, None  # pretrained: the model again, once it is known to be a transformers one
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
        progress(f"wrote {args.hf_out} (save_pretrained: load it with from_pretrained)")
    return 0


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """The `export` subcommand, under `streamdiloco`'s subparsers."""
    ex = sub.add_parser(
        "export",
        help="write the run's global model as a safetensors file (from checkpoints or a live run)",
        description="Write the run's global model (the shards' masters) as one safetensors file, from every "
        "shard's checkpoint directory or from the running shards (Fetch, with a worker's credentials). No "
        "model code is needed: names, shapes and dtypes come from the run's fingerprint, which the file's "
        f"metadata keeps ({FINGERPRINT_KEY}, with the rounds in {ROUNDS_KEY}) so that a shard can start from "
        "it. Each parameter is written once under its named_parameters() name (tied weights once); with "
        "--model the file holds the model's whole state_dict, buffers too.",
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
        help="load the tensors into this model (a preset or module.path:factory, as the workers') and write "
        "its whole state_dict: buffers too; checked strictly against the run's parameters",
    )
    g.add_argument("--seed", type=int, default=0, help="the seed --model's factory is built with (buffers)")
    g.add_argument("--block-size", type=int, default=None, help="--model's context length (a preset's)")
    g.add_argument(
        "--hf-out",
        default=None,
        metavar="DIR",
        help="also save_pretrained the --model (a transformers PreTrainedModel) into this folder",
    )
    g = ex.add_argument_group("a live run (--servers): a worker's credentials")
    g.add_argument("--token", default="", help="a worker's token, or the run's shared one")
    from streamdiloco.cli import _add_worker_security_flags

    _add_worker_security_flags(g)
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
    return export(args, progress=lambda line: print(line, file=sys.stderr, flush=True))
