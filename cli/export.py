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
as a `save_pretrained` folder (`--hf-out`), with its tokenizer (`--tokenizer`: a tokenizer.json, or the
prepared data's) as tokenizer.json and tokenizer_config.json, so that `AutoTokenizer.from_pretrained` loads
it too. In the library, a worker has `engine.global_state_dict()`.

Nothing is written unless everything checks: a missing shard, checkpoints of two runs, a damaged file (its
hash, as the shard's own loading checks it), a refused Fetch or a tokenizer that is not one (or has more ids
than the model) is a one-line error.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamdiloco.common.atomic import atomic_save
from streamdiloco.common.fingerprint import layout_from_fingerprint
from streamdiloco.common.fragments import FragmentLayout, slice_ranges

if TYPE_CHECKING:
    from streamdiloco.common.tls import ClientTLS

FINGERPRINT_KEY = "streamdiloco.fingerprint"  # `server --init` reads the run's layout from it: keep the name
ROUNDS_KEY = "streamdiloco.rounds"
MAX_FINGERPRINT_BYTES = 4 << 20  # as the shard's Join: names and shapes are kilobytes, not megabytes

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
    from streamdiloco.server.rounds.state import ShardState
    from streamdiloco.server.storage.checkpoint import ShardCheckpoint

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
    atomic_save(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


# --- the tokenizer, beside the model (--tokenizer with --hf-out) -------------------------------------------
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # any tokenizers JSON, whatever the model's type


@dataclass(frozen=True)
class ExportTokenizer:
    """--tokenizer, read and checked: its tokenizers JSON as it is, and its end-of-text token (also BOS and
    UNK, as GPT-2's <|endoftext|> is) when known: the prepared data's EOS, else a usual name it has."""

    json_bytes: bytes
    eos: str | None

    def write(self, folder: str | Path, model: torch.nn.Module) -> None:
        """tokenizer.json and a tokenizer_config.json in `folder`, for AutoTokenizer.from_pretrained."""
        from streamdiloco.common.atomic import atomic_write_bytes, atomic_write_text

        config: dict[str, object] = {"tokenizer_class": TOKENIZER_CLASS}
        if self.eos is not None:
            config |= {"bos_token": self.eos, "eos_token": self.eos, "unk_token": self.eos}
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(positions, int) and not isinstance(positions, bool):
            config["model_max_length"] = positions
        atomic_write_bytes(Path(folder) / "tokenizer.json", self.json_bytes)
        atomic_write_text(Path(folder) / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


def read_tokenizer(path: str, model: torch.nn.Module, spec: str) -> ExportTokenizer:
    """--tokenizer PATH: a tokenizer.json, a prepared data folder (its tokenizer, EOS from its manifest) or a
    folder holding a tokenizer.json; ValueError (one line) unless it parses and the model takes every id."""
    from streamdiloco.common.modelspec import check_vocab
    from streamdiloco.common.prepared import PreparedData, PreparedDataError, looks_prepared
    from streamdiloco.prepare import EOS_CANDIDATES, tokenizer_vocab_size

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs tokenizers: pip install 'streamdiloco[data]'") from None
    where, eos_id = Path(path), None
    if looks_prepared(where):
        try:
            prepared = PreparedData.open(where)
        except PreparedDataError as e:
            raise ValueError(f"--tokenizer {path}: {e}") from None
        file, eos_id = prepared.tokenizer_path, prepared.eos_id
    else:
        file = where / "tokenizer.json" if where.is_dir() else where
    if not file.is_file():
        what = "no tokenizer.json in that folder" if where.is_dir() else "no such file"
        raise ValueError(f"--tokenizer {path}: {what}: give a tokenizer.json or the prepared data folder")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"--tokenizer {file}: not a tokenizers JSON file ({first})") from None
    check_vocab(model, tokenizer_vocab_size(tok), spec, f"the tokenizer {file}")
    if eos_id is not None:
        eos = tok.id_to_token(eos_id)
        if eos is None:
            raise ValueError(f"--tokenizer {path}: the manifest's EOS id {eos_id} is not a token of {file}")
    else:
        eos = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    return ExportTokenizer(file.read_bytes(), eos)


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
