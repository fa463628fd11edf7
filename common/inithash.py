"""The init hash: one sha256 (64 hex digits) that names a run's starting parameters, so that an operator can
pin them (`server --init from-worker --init-expect HASH`) and shards and workers can tell one start from
another (two shards that took two workers' uploads hold a mix).

It is a hash of hashes, because a shard sees only its own slices: each (fragment, shard) slice of the fp32
flat vectors (the bytes the wire carries: common/wire.py's values_to_bytes) has its own sha256, and the init
hash is the sha256 of the layout (every parameter's name, shape and dtype, fragment by fragment), the number
of shards and those slice hashes, in order. An uploader sends them all in its first message; a shard checks
that they give the init hash (and that it is the pinned one) before it takes any value, and that its slices
hash to theirs as the values come. So the hash depends on the model, its values, the fragment layout (P, the
pattern, the blocks) and S; `streamdiloco init-hash` prints it for a model and a run's settings.

Pure: no I/O, no network; it must not import server or worker.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import (
    FragmentLayout,
    build_layout,
    flatten,
    fragment_params,
    slice_ranges,
)
from streamdiloco.common.wire import values_to_bytes

VERSION = b"streamdiloco init hash v1\n"
HASH_CHARS = 64  # hex digits of an init hash
DIGEST_BYTES = 32  # bytes of a slice's sha256
_HEX = re.compile(r"[0-9a-f]{64}")
_PIECE = 1 << 20  # values hashed at a time (a copy of this many, not of the slice)


def parse_init_hash(text: str, where: str = "--init-expect") -> str:
    """An init hash as given (64 hex digits, either case), lowercased; ValueError (one line) otherwise."""
    h = text.strip().lower()
    if not _HEX.fullmatch(h):
        raise ValueError(
            f"{where} takes an init hash, 64 hex digits (`streamdiloco init-hash` prints it), "
            f"got {text[:80]!r}"
        )
    return h


def slice_digest(x: torch.Tensor) -> bytes:
    """The sha256 of a slice's fp32 values, as the wire carries them."""
    h = hashlib.sha256()
    for a in range(0, x.numel(), _PIECE):
        h.update(values_to_bytes(x[a : a + _PIECE]))
    return h.digest()


def slice_digests(vectors: Sequence[torch.Tensor], num_shards: int) -> list[bytes]:
    """Every (fragment, shard) slice's digest, fragment by fragment, shard by shard."""
    return [slice_digest(vec[lo:hi]) for vec in vectors for lo, hi in slice_ranges(vec.numel(), num_shards)]


def combine(layout: FragmentLayout, num_shards: int, digests: Sequence[bytes]) -> str:
    """The init hash from the layout, S and the slices' digests (P x S of them, as slice_digests orders)."""
    if len(digests) != layout.num_fragments * num_shards or any(len(d) != DIGEST_BYTES for d in digests):
        raise ValueError(
            f"an init hash takes {layout.num_fragments * num_shards} slice hashes of {DIGEST_BYTES} bytes "
            f"({layout.num_fragments} fragments x {num_shards} shards), got {len(digests)}"
        )
    params = [[[e.name, list(e.shape), e.dtype] for e in f.entries] for f in layout.fragments]
    head = json.dumps({"num_shards": num_shards, "fragments": params}, sort_keys=True, separators=(",", ":"))
    h = hashlib.sha256(VERSION)
    h.update(head.encode())
    for d in digests:
        h.update(d)
    return h.hexdigest()


def init_hash(
    layout: FragmentLayout, vectors: Sequence[torch.Tensor], num_shards: int
) -> tuple[str, list[bytes]]:
    """The init hash of these fragments' flat vectors on S shards, and the slices' digests it is made of."""
    digests = slice_digests(vectors, num_shards)
    return combine(layout, num_shards, digests), digests


def model_init_hash(
    model: torch.nn.Module,
    cfg: SyncConfig,
    num_shards: int,
    blocks_path: str | None = None,
    fragments: Sequence[Sequence[str]] | None = None,
) -> str:
    """The init hash of a model's parameters as they are now, with the run's fragment layout (P, the
    pattern, `blocks_path` or `fragments`, as the workers give them) on `num_shards` shards: what a worker
    with this model uploads (`streamdiloco init-hash`; pin it with the shards' --init-expect)."""
    layout = build_layout(model, cfg.num_fragments, cfg.fragment_pattern, blocks_path, fragments)
    return init_hash(layout, [flatten(fragment_params(model, f)) for f in layout.fragments], num_shards)[0]
