"""The model fingerprint: what a worker and a shard must agree on before they exchange fragments.

Parameter names, shapes and dtypes, the fragment layout, the codecs, H and P. `fingerprint_diff` names the
first difference in words a user can act on.
"""

from __future__ import annotations

import hashlib
import json

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import FragmentLayout


def model_fingerprint(layout: FragmentLayout, cfg: SyncConfig) -> dict:
    return {
        "params": [[e.name, list(e.shape), e.dtype] for f in layout.fragments for e in f.entries],
        "fragments": [[list(f.blocks), list(f.names)] for f in layout.fragments],
        "blocks_path": layout.blocks_path,
        "sync_every": cfg.sync_every,
        "num_fragments": cfg.num_fragments,
        "fragment_pattern": cfg.fragment_pattern,
        "uplink_codec": cfg.uplink_codec,
        "downlink_codec": cfg.downlink_codec,
        "codec_block_size": cfg.codec_block_size,
    }


def fingerprint_digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_diff(ours: dict, theirs: dict, us: str = "worker", them: str = "server") -> str | None:
    """None when equal, else one sentence naming the first difference."""
    if ours == theirs:
        return None
    for key in (
        "sync_every",
        "num_fragments",
        "fragment_pattern",
        "uplink_codec",
        "downlink_codec",
        "codec_block_size",
        "blocks_path",
    ):
        if ours.get(key) != theirs.get(key):
            return (
                f"model fingerprint differs from the {them}'s: {key} is {ours.get(key)!r} on the {us}, "
                f"{theirs.get(key)!r} on the {them}"
            )
    a = {p[0]: p for p in ours.get("params", [])}
    b = {p[0]: p for p in theirs.get("params", [])}
    nblocks_a = sum(len(f[0]) for f in ours.get("fragments", []))
    nblocks_b = sum(len(f[0]) for f in theirs.get("fragments", []))
    if nblocks_a != nblocks_b:
        return f"model fingerprint differs from the {them}'s: {us} has {nblocks_a} blocks, {them} {nblocks_b}"
    if missing := sorted(set(b) - set(a)):
        return (
            f"model fingerprint differs from the {them}'s: the {us} lacks parameter {missing[0]!r} "
            f"({len(missing)} missing)"
        )
    if extra := sorted(set(a) - set(b)):
        return (
            f"model fingerprint differs from the {them}'s: the {us} has extra parameter {extra[0]!r} "
            f"({len(extra)} extra)"
        )
    for name, pa in a.items():
        pb = b[name]
        if pa[1] != pb[1]:
            return (
                f"model fingerprint differs from the {them}'s: {name} has shape {pa[1]} on the {us}, "
                f"{pb[1]} on the {them}"
            )
        if pa[2] != pb[2]:
            return (
                f"model fingerprint differs from the {them}'s: {name} has dtype {pa[2]} on the {us}, "
                f"{pb[2]} on the {them}"
            )
    for key in sorted(set(ours) | set(theirs)):  # keys a shard learned with a layout (the model's config...)
        if key not in ("params", "fragments") and ours.get(key) != theirs.get(key):
            a, b = repr(ours.get(key))[:200], repr(theirs.get(key))[:200]
            return f"model fingerprint differs from the {them}'s: {key} is {a} on the {us}, {b} on the {them}"
    return (
        f"model fingerprint differs from the {them}'s: the parameters are grouped into fragments differently"
    )


def tensor_digest(x) -> str:
    """A short hash of a tensor's fp32 bytes: shards publish it for each master slice, workers log it for
    each mirror slice, and equal hashes mean bit-equal parameters."""
    data = x.detach().to(device="cpu").contiguous().float().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
