"""Fragment layout: which parameters belong to which fragment, and each fragment's flat fp32 layout.

A run has P fragments (num_fragments), each on the wire at its own offset. With P >= 2, the model's
transformer blocks (its largest nn.ModuleList, or the one the user names: blocks_path) are split into P - 1
block fragments, strided by default (block i -> fragment i mod (P-1)) or sequential (consecutive blocks), and
every other parameter (embeddings, final norm, head) forms the last fragment, numbered P - 1, as the paper
gives the embeddings a fragment of their own. With P = 1 the whole model is one fragment: plain DiLoCo.
Each fragment has a fixed layout of (name, shape, offset) entries, so it can be read and written as one
contiguous fp32 vector. A user may instead group the parameters by name (fragments=, `group_layout`): for
models whose parameters sync best in another grouping, or that have no list of blocks.

Pure: no I/O, no networking. Shared by the worker, the shard and the simulator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from streamdiloco.common.modelconfig import model_config_of


@dataclass(frozen=True)
class ParamEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # start in the fragment's flat vector
    numel: int
    dtype: str  # the parameter's own dtype; the flat vector is always fp32


@dataclass(frozen=True)
class Fragment:
    index: int
    entries: tuple[ParamEntry, ...]
    blocks: tuple[int, ...]  # block indices in this fragment (empty for the non-block fragment)

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


@dataclass(frozen=True)
class FragmentLayout:
    fragments: tuple[Fragment, ...]
    blocks_path: str  # dotted name of the ModuleList holding the blocks
    pattern: str
    # the user's own grouping (fragments=, --fragments): each group's name prefixes; None for blocks
    groups: tuple[tuple[str, ...], ...] | None = None
    # the model's architectural hyperparameters, which shapes cannot show (common/modelconfig.py): they
    # go into the model fingerprint with the layout
    model_config: dict = field(default_factory=dict, compare=False)

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    def describe(self) -> list[dict]:
        """Plain data, for the model fingerprint and for logs."""
        return [
            {
                "index": f.index,
                "blocks": list(f.blocks),
                "numel": f.numel,
                "params": [[e.name, list(e.shape), e.offset, e.dtype] for e in f.entries],
            }
            for f in self.fragments
        ]


def find_block_list(model: nn.Module) -> str:
    """The dotted name of the model's largest nn.ModuleList (most entries, then most parameters)."""
    best, best_key = None, (-1, -1)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            key = (len(mod), sum(p.numel() for p in mod.parameters()))
            if key > best_key:
                best, best_key = name, key
    if best is None:
        raise ValueError(
            "the model has no nn.ModuleList of blocks to split into fragments: name one with blocks_path=... "
            "(--blocks-path), group the parameters yourself with fragments=... (--fragments), or use "
            "num_fragments=1"
        )
    return best


def assign_blocks(num_blocks: int, num_fragments: int, pattern: str) -> list[list[int]]:
    """Block indices of each of the P block fragments."""
    if num_blocks < num_fragments:
        raise ValueError(
            f"{num_fragments} block fragments need at least as many blocks, the model has {num_blocks}: "
            f"use num_fragments <= {num_blocks + 1}"
        )
    if pattern == "strided":
        return [list(range(p, num_blocks, num_fragments)) for p in range(num_fragments)]
    if pattern == "sequential":
        base, extra = divmod(num_blocks, num_fragments)
        out, start = [], 0
        for p in range(num_fragments):
            size = base + (1 if p < extra else 0)
            out.append(list(range(start, start + size)))
            start += size
        return out
    raise ValueError(f"unknown fragment pattern {pattern!r}: choose strided or sequential")


def _fragment(index: int, named: Sequence[tuple[str, torch.Tensor]], blocks: tuple[int, ...]) -> Fragment:
    entries, off = [], 0
    for name, p in named:
        entries.append(ParamEntry(name, tuple(p.shape), off, p.numel(), str(p.dtype).removeprefix("torch.")))
        off += p.numel()
    return Fragment(index, tuple(entries), blocks)


def build_layout(
    model: nn.Module,
    num_fragments: int,
    pattern: str = "strided",
    blocks_path: str | None = None,
    user_groups: Sequence[Sequence[str]] | None = None,
) -> FragmentLayout:
    """Split the model's parameters into P fragments: P-1 of blocks and one of everything else (P >= 2),
    or a single fragment of the whole model (P = 1); or, with `user_groups`, as the user grouped them (see
    group_layout)."""
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")
    if user_groups is not None:
        if blocks_path:
            raise ValueError("give blocks_path or fragments, not both: fragments name every group")
        return group_layout(model, user_groups, num_fragments)
    # named_parameters() yields each shared (tied) parameter once, under its first name
    params = list(model.named_parameters())
    if num_fragments == 1:
        return FragmentLayout(
            (_fragment(0, params, ()),), blocks_path or "", pattern, model_config=model_config_of(model)
        )
    path = blocks_path or find_block_list(model)
    try:
        blocks = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"blocks_path {path!r} names no submodule of the model") from None
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"blocks_path {path!r} is a {type(blocks).__name__}, not an nn.ModuleList")
    num_block_fragments = num_fragments - 1
    groups = assign_blocks(len(blocks), num_block_fragments, pattern)
    frag_of_block = {b: p for p, bl in enumerate(groups) for b in bl}
    frag_of_param = {
        f"{path}.{i}.{pname}": frag_of_block[i]
        for i, block in enumerate(blocks)
        for pname, _ in block.named_parameters()
    }
    members: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(num_fragments)]
    for name, p in params:
        members[frag_of_param.get(name, num_block_fragments)].append((name, p))
    fragments = tuple(
        _fragment(i, group, tuple(groups[i]) if i < num_block_fragments else ())
        for i, group in enumerate(members)
    )
    return FragmentLayout(fragments, path, pattern, model_config=model_config_of(model))


def group_layout(model: nn.Module, groups: Sequence[Sequence[str]], num_fragments: int) -> FragmentLayout:
    """The user's fragments: group i holds every parameter whose name is one of its names or starts with
    one of them and a dot (a module's name takes all its parameters); where names of two groups both match,
    the longer one wins ("blocks" and "blocks.0": blocks.0 goes with the second). Parameters that no group
    names form one more fragment, the last (as the embeddings do by default). The fingerprint carries the
    groups, so a shard with another grouping refuses the worker by saying so."""
    names = tuple(tuple(str(n) for n in g) for g in groups)
    if not names or any(not g for g in names):
        raise ValueError("fragments: give a list of groups, each a non-empty list of names")
    seen: dict[str, int] = {}
    for i, group in enumerate(names):
        for prefix in group:
            if seen.setdefault(prefix, i) != i:
                raise ValueError(
                    f"fragments: {prefix!r} is in group {seen[prefix]} and group {i}: name it once"
                )
    params = list(model.named_parameters())
    owner: list[int] = []  # each parameter's group; len(names): no group names it
    for name, _ in params:
        best, best_len = len(names), -1
        for i, group in enumerate(names):
            for prefix in group:
                if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                    best, best_len = i, len(prefix)
        owner.append(best)
    for i, group in enumerate(names):
        for prefix in group:
            if not any(n == prefix or n.startswith(prefix + ".") for n, _ in params):
                raise ValueError(f"fragments: {prefix!r} (group {i}) names no parameter or module")
        if i not in owner:
            raise ValueError(f"fragments: group {i} {list(group)} gets no parameter (longer names elsewhere)")
    made = len(names) + (1 if len(names) in owner else 0)
    if made != num_fragments:
        rest = " and the parameters they do not name" if made > len(names) else ""
        raise ValueError(
            f"fragments: {len(names)} groups{rest} make "
            f"{made} fragments, but num_fragments is {num_fragments}: set num_fragments (--num-fragments) to "
            f"{made}"
        )
    members = [[(n, p) for (n, p), o in zip(params, owner, strict=True) if o == g] for g in range(made)]
    return FragmentLayout(
        tuple(_fragment(i, group, ()) for i, group in enumerate(members)),
        "",
        "custom",
        groups=names,
        model_config=model_config_of(model),
    )


def fragment_params(model: nn.Module, fragment: Fragment) -> list[torch.Tensor]:
    """The model's parameter tensors of one fragment, in layout order."""
    named = dict(model.named_parameters())
    return [named[e.name] for e in fragment.entries]


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One contiguous fp32 vector on the CPU (a copy)."""
    parts = [t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors]
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten_into(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Write a flat vector back into tensors (any device and dtype), in order."""
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off : off + n].view_as(t))
            off += n
    if off != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} values, the tensors {off}")


def slice_ranges(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """S contiguous, near-equal [start, end) slices of a fragment's flat vector; shard s owns slice s."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    base, extra = divmod(numel, num_shards)
    out, start = [], 0
    for s in range(num_shards):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out
