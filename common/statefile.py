"""A model's parameters without its code: what a shard needs of a model is the names, shapes and dtypes of
its parameters in the model's order, which of them belong to which block, and their initial values. This
module reads them from a state dict file (safetensors, or a torch.save'd state_dict) and builds the
FragmentLayout from that description, equal to build_layout's on the model itself: so a shard can start
from a file (`server --init model.safetensors`) and never import the user's model.

Where the block structure comes from, first found first: the file's own fingerprint (metadata key
"streamdiloco.fingerprint", written by `streamdiloco export`), the --blocks-path flag, or the names
themselves (the `prefix.<int>.` pattern with the most blocks, then the most values, as find_block_list
picks the largest nn.ModuleList).

A state_dict is not named_parameters(): it has every name of a tied parameter (named_parameters() yields it
once, under its first name) and the buffers. Tied names share storage in a torch.save'd file and are kept
once, under the first name; integer buffers are left out. A safetensors file keeps neither sharing nor the
model's order (its tensors are sorted by name), so one without the fingerprint is refused with what to do.

Pure but for reading the file: no networking.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from streamdiloco.common.fingerprint import read_params
from streamdiloco.common.fragments import Fragment, FragmentLayout, ParamEntry, assign_blocks

FINGERPRINT_KEY = "streamdiloco.fingerprint"
# the fingerprint's keys that the layout and the sync config make; any other key (the run's seed, the
# model's architectural hyperparameters) is the model's own data, kept as it is and compared at Join
LAYOUT_KEYS = frozenset({"params", "fragments", "blocks_path"})

_INDEX = re.compile(r"0|[1-9][0-9]*")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the fingerprint lists it: its name, shape and dtype ("float32", "bfloat16", ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def detect_blocks(params: Sequence[ParamSpec]) -> tuple[str, int] | None:
    """The dotted prefix of the model's blocks and how many there are, from the names alone: of every
    `prefix.<int>.rest` in the names, the prefix with the most blocks (highest index + 1), then the most
    values. None when no name has that pattern."""
    found: dict[str, list[int]] = {}  # prefix -> [blocks, values]
    for p in params:
        parts = p.name.split(".")
        for j in range(1, len(parts) - 1):  # an index with something after it: a module in a list
            if _INDEX.fullmatch(parts[j]):
                entry = found.setdefault(".".join(parts[:j]), [0, 0])
                entry[0] = max(entry[0], int(parts[j]) + 1)
                entry[1] += p.numel
    if not found:
        return None
    prefix = max(found, key=lambda k: (found[k][0], found[k][1]))
    return prefix, found[prefix][0]


def _block_of(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)
    return int(head[0]) if len(head) == 2 and _INDEX.fullmatch(head[0]) else None


def layout_from_description(
    params: Sequence[ParamSpec],
    num_fragments: int,
    pattern: str = "strided",
    blocks_path: str | None = None,
    num_blocks: int | None = None,
) -> FragmentLayout:
    """build_layout without the model: `params` in the model's order (named_parameters', tied weights
    once), `blocks_path` the ModuleList of blocks (None: detected from the names), `num_blocks` its length
    (None: the highest index among the names, plus one). Equal to build_layout(model, ...) for the model the
    description was taken from."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")
    if len({p.name for p in params}) != len(params):
        dup = next(p.name for i, p in enumerate(params) if p.name in {q.name for q in params[:i]})
        raise ValueError(f"parameter {dup!r} is listed twice")
    if num_fragments == 1:
        return FragmentLayout((_fragment(0, params, ()),), blocks_path or "", pattern)
    if blocks_path is None:
        detected = detect_blocks(params)
        if detected is None:
            raise ValueError(
                "no parameter name has the pattern prefix.<int>. of a list of blocks to split into "
                "fragments: name the list with --blocks-path, or use --num-fragments 1"
            )
        blocks_path, counted = detected
    else:
        counted = max((b + 1 for p in params if (b := _block_of(p.name, blocks_path)) is not None), default=0)
        if not counted:
            raise ValueError(
                f"blocks_path {blocks_path!r} names no blocks: no parameter is named {blocks_path}.<int>.*"
            )
    if num_blocks is None:
        num_blocks = counted
    elif num_blocks < counted:
        raise ValueError(f"{num_blocks} blocks in {blocks_path!r}, but a parameter of block {counted - 1}")
    num_block_fragments = num_fragments - 1
    groups = assign_blocks(num_blocks, num_block_fragments, pattern)
    frag_of_block = {b: p for p, bl in enumerate(groups) for b in bl}
    members: list[list[ParamSpec]] = [[] for _ in range(num_fragments)]
    for p in params:
        b = _block_of(p.name, blocks_path)
        members[num_block_fragments if b is None else frag_of_block[b]].append(p)
    fragments = tuple(
        _fragment(i, group, tuple(groups[i]) if i < num_block_fragments else ())
        for i, group in enumerate(members)
    )
    return FragmentLayout(fragments, blocks_path, pattern)


def _fragment(index: int, params: Sequence[ParamSpec], blocks: tuple[int, ...]) -> Fragment:
    entries, off = [], 0
    for p in params:
        entries.append(ParamEntry(p.name, p.shape, off, p.numel, p.dtype))
        off += p.numel
    return Fragment(index, tuple(entries), blocks)


def params_from_fingerprint(fp: dict) -> tuple[list[ParamSpec], str, int]:
    """A fingerprint's parameters (in its order, checked by the one strict reader: read_params), its
    blocks_path and its number of blocks (0 when the run had one fragment); ValueError (one line) for one
    that is not a fingerprint's shape."""
    params = [ParamSpec(*p) for p in read_params(fp, "not a model fingerprint: it")]
    try:
        num_blocks = sum(len(blocks) for blocks, _ in fp["fragments"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a model fingerprint: its fragments list {type(e).__name__}: {e}") from None
    blocks_path = fp.get("blocks_path") or ""
    if not isinstance(blocks_path, str):
        raise ValueError("not a model fingerprint: its blocks_path is not a string")
    return params, blocks_path, num_blocks


def opaque_keys(fp: dict) -> dict:
    """What a fingerprint says besides the layout and the sync settings (say, the model's architectural
    hyperparameters, the run's seed): the shard keeps it in its own fingerprint, and workers must match."""
    from streamdiloco.common.config import SyncConfig

    sync = set(SyncConfig.__dataclass_fields__)
    return {k: v for k, v in fp.items() if k not in LAYOUT_KEYS and k not in sync}


@dataclass
class InitFile:
    """A state dict file, read: its parameters in the model's order with their values, where its block
    structure came from, and the fingerprint it carries (None if none)."""

    params: list[ParamSpec]
    values: dict[str, torch.Tensor]
    blocks_path: str | None  # None: detect from the names
    num_blocks: int | None
    fingerprint: dict | None
    source: str  # where the block structure comes from, in words (for the log)
    # whether `params` is the model's order over all parameters; a fingerprint of several fragments lists
    # them fragment by fragment, which keeps the order within the blocks and within the rest, not between
    whole_order: bool = True

    def layout(self, num_fragments: int, pattern: str) -> FragmentLayout:
        if num_fragments == 1 and not self.whole_order:
            raise ValueError(
                "the file's fingerprint is of a run with several fragments, which does not keep the order "
                "of the model's blocks among its other parameters that one fragment needs: use "
                "--num-fragments 2 or more, or a torch.save'd state_dict"
            )
        return layout_from_description(self.params, num_fragments, pattern, self.blocks_path, self.num_blocks)

    def initial(self, layout: FragmentLayout) -> list[torch.Tensor]:
        """Each fragment's flat fp32 vector."""
        out = []
        for f in layout.fragments:
            parts = [self.values[e.name].detach().reshape(-1).to(torch.float32) for e in f.entries]
            out.append(torch.cat(parts) if parts else torch.zeros(0))
        return out

    def opaque(self) -> dict:
        """The file's fingerprint's keys beyond the layout and the sync settings (opaque_keys)."""
        return opaque_keys(self.fingerprint or {})


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with its header's length (8 bytes, little-endian) and the header's '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return int.from_bytes(head[:8], "little") < path.stat().st_size


def read_init_file(path: str, blocks_path: str | None = None, flag: str = "--init") -> InitFile:
    """Read a safetensors file or a torch.save'd state_dict; ValueError (one line, naming `flag`) when it
    is missing, not a state dict, holds non-finite values, or (safetensors) carries no fingerprint."""
    p = Path(path)
    where = f"{flag} {path}"
    if not p.is_file():
        raise ValueError(f"{where}: no such file")
    if _is_safetensors(p):
        values, fingerprint = _read_safetensors(p, where)
        if fingerprint is None:
            raise ValueError(
                f"{where}: a safetensors file keeps neither the model's parameter order nor its tied "
                f"weights, and this one has no {FINGERPRINT_KEY!r} metadata: write it with `streamdiloco "
                "export`, or save torch.save(model.state_dict(), 'model.pt') and give --init model.pt"
            )
    else:
        values, fingerprint = _read_torch(p, where), None
    if fingerprint is not None:
        try:
            params, fp_path, fp_blocks = params_from_fingerprint(fingerprint)
        except ValueError as e:
            raise ValueError(f"{where}: its {FINGERPRINT_KEY!r} metadata is {e}") from None
        for spec in params:
            t = values.get(spec.name)
            if t is None:
                raise ValueError(f"{where}: its fingerprint lists {spec.name!r}, the file has no such tensor")
            if tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"{where}: {spec.name} has shape {list(t.shape)}, its fingerprint says {list(spec.shape)}"
                )
        if blocks_path is not None and fp_path and blocks_path != fp_path:
            raise ValueError(
                f"--blocks-path {blocks_path!r} differs from the file's fingerprint's {fp_path!r}: "
                "leave the flag out"
            )
        path_, blocks, source = (
            (fp_path, fp_blocks or None, "from the file's fingerprint")
            if fp_path
            else (blocks_path, None, "from --blocks-path" if blocks_path else "detected from the names")
        )
        whole = len(fingerprint["fragments"]) == 1
        if not whole and path_:  # the blocks' parameters in the model's order: by block, as listed within one
            blocks_first = sorted(
                (p for p in params if _block_of(p.name, path_) is not None),
                key=lambda p: _block_of(p.name, path_) or 0,
            )
            params = blocks_first + [p for p in params if _block_of(p.name, path_) is None]
        return InitFile(params, values, path_ or None, blocks, fingerprint, source, whole)
    params = [
        ParamSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in values.items()
    ]
    return InitFile(
        params,
        values,
        blocks_path,
        None,
        None,
        "from --blocks-path" if blocks_path else "detected from the names",
    )


def _read_safetensors(path: Path, where: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            values = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{where}: not a readable safetensors file ({e})") from None
    _check_values(values, where)
    raw = meta.get(FINGERPRINT_KEY)
    if raw is None:
        return values, None
    try:
        fingerprint = json.loads(raw)
        if not isinstance(fingerprint, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where}: its {FINGERPRINT_KEY!r} metadata is not JSON ({e})") from None
    return values, fingerprint


def _read_torch(path: Path, where: str) -> dict[str, torch.Tensor]:
    """A torch.save'd state_dict's floating-point tensors in its order, each tied (storage-sharing) tensor
    once, under its first name: named_parameters()'s order and names for a module's state_dict."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for files that are not checkpoints
        raise ValueError(f"{where}: not a saved state_dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{where}: holds a {type(state).__name__}, not a state_dict of named tensors")
    values = state_dict_params(state)
    if not values:
        raise ValueError(f"{where}: holds no floating-point tensors")
    _check_values(values, where)
    return values


def state_dict_params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a state_dict that stand for parameters, in its order: floating-point ones (integer
    buffers, such as counters and position ids, are never parameters), each tied tensor (one that shares
    its storage with an earlier one; on the meta device: the same tensor object) once, under its first
    name, as named_parameters() yields it."""
    values: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in state.items():
        if not t.is_floating_point():
            continue
        if t.is_meta:
            key: tuple = (id(t),)
        else:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:  # a tied weight's second name
            continue
        seen.add(key)
        values[name] = t
    return values


def _check_values(values: dict[str, torch.Tensor], where: str) -> None:
    for name, t in values.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{where}: {name} has {bad} values that are not finite")
