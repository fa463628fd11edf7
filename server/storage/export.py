"""The run's global model from the shards' checkpoint directories (`streamdiloco export --checkpoints`):
each directory is loaded and checked as the shard itself loads it on a restart (server/storage/checkpoint.py:
hashes, finite values, the logged rounds replayed) and its slices put in place, into a common/globalmodel.py
`GlobalModel`. It only reads: it must not write to a checkpoint directory, nor take a shard's directory lock.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import fingerprint_diff, layout_from_fingerprint
from streamdiloco.common.globalmodel import (
    GlobalModel,
    Progress,
    agree_rounds,
    empty_vector,
    quiet,
    size_text,
)
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.storage.checkpoint import ShardCheckpoint


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
    directories: list[str | Path], mixed_rounds: bool = False, progress: Progress = quiet
) -> GlobalModel:
    """The global model from every shard's checkpoint directory (in any order): each is loaded and checked
    as the shard itself loads it on a restart (hashes, finite values, the rounds logged since replayed) and
    its slices put in place. ValueError (one line) when they are not one whole run."""
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
    vectors = [empty_vector(f.numel, f"fragment {f.index}") for f in layout.fragments]
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
        progress(f"shard {s} of {num_shards}: {where[s]}, {size_text(done)}, rounds {rounds[-1]}")
        del state
    return GlobalModel(fp, layout, vectors, agree_rounds(rounds, mixed_rounds, lambda s: str(where[s])))
