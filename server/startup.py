"""What a shard starts from, read once at start-up: `build_shard(config)` makes the running Shard (or, with
`--init from-worker` and no checkpoint yet, the PendingShard that makes it from the first worker's upload).

The model comes from the same factory as the workers' (same seed, same initial values), its parameters then
from `init` (a saved state_dict) if given; or, with no model (`has_model` False), from the `init` file
alone (names, shapes, dtypes and values; the blocks from the file's fingerprint, else --blocks-path, else
detected from the names: common/statefile.py), so that the shard needs no model code; or from the first
worker's upload (server/edge/initialize.py); or, when the checkpoint directory holds a checkpoint of this
run (and not `fresh`), from it. What this module must not do: serve (server/main.py does).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from streamdiloco.common.codecs import warm_up
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import FragmentLayout, build_layout, flatten, fragment_params, slice_ranges
from streamdiloco.common.inithash import parse_init_hash
from streamdiloco.common.modelspec import build_model
from streamdiloco.common.statefile import read_init_file
from streamdiloco.server.config import FROM_WORKER, ShardConfig
from streamdiloco.server.edge.gates import Gates
from streamdiloco.server.edge.initialize import InitRefused, PendingShard, shard_fingerprint
from streamdiloco.server.edge.wiring import staged_budget
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.shard import Shard
from streamdiloco.server.storage.checkpoint import ShardCheckpoint, read_meta

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("streamdiloco.shard")


def build_shard(config: ShardConfig, gates: Gates | None = None) -> Shard | PendingShard:
    """The shard `config` describes (see the module's docstring); `gates`: the bounds on calls, if the
    process made them already (serve() does, before anything listens)."""
    gates = gates or Gates(config.limits)
    c = config
    if c.checkpoint_dir and not c.fresh and (Path(c.checkpoint_dir) / "meta.json").exists():
        # a checkpoint of another run (or shard) is refused before the model is built: at once, one line
        read_meta(Path(c.checkpoint_dir), c.shard, c.num_shards, c.sync)
    saved = Path(c.checkpoint_dir or "") / "meta.json"
    resuming = bool(c.checkpoint_dir) and not c.fresh and saved.exists()
    # started from a file once: the checkpoint has the layout and the values, and the file may be gone
    gone = not c.has_model and c.init not in (None, FROM_WORKER) and resuming and not Path(c.init).exists()
    if gone:
        log.info(
            "shard %d: --init %s is gone: the layout comes from checkpoint %s", c.shard, c.init, saved.parent
        )
    if c.init == FROM_WORKER or gone:
        if not resuming:
            return PendingShard(
                c,
                gates,
                lambda layout, initial, fp, init_hash: _start(c, gates, layout, initial, fp, init_hash),
            )
        return _restart_without_model(c, gates, saved)
    if not c.has_model:
        assert c.init is not None  # ShardConfig checks it
        layout, initial, learned = layout_from_file(c.init, c.sync, c.model.blocks_path, c.shard)
        # the file's model config if its fingerprint has one; none known (a plain state_dict): not checked
        fingerprint = model_fingerprint(layout, c.sync, c.model.seed, learned.get("model_config", {}))
        if "model_config" not in learned:
            del fingerprint["model_config"]
        return _start(c, gates, layout, initial, {**learned, **fingerprint})
    m = c.model
    model = build_model(m.model, m.seed, m.block_size)
    if c.init:
        load_initial(model, c.init)
    layout = build_layout(
        model, c.sync.num_fragments, c.sync.fragment_pattern, m.blocks_path, m.fragment_groups
    )
    initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
    return _start(c, gates, layout, initial, model_fingerprint(layout, c.sync, m.seed))


def _restart_without_model(config: ShardConfig, gates: Gates, saved: Path) -> Shard:
    """A shard restarted that took its model from the first worker (or from a file now gone): the layout
    as the checkpoint keeps it, the values from the checkpoint."""
    import torch

    try:
        layout, fingerprint = shard_fingerprint(
            json.loads(saved.read_text()).get("fingerprint") or {}, config.sync
        )
    except (InitRefused, ValueError, AttributeError) as e:
        raise ValueError(
            f"checkpoint {config.checkpoint_dir}: its fingerprint does not give a layout ({e})"
        ) from None
    shard = _start(config, gates, layout, [torch.zeros(f.numel) for f in layout.fragments], fingerprint)
    expect = config.init_expect
    if expect is not None and shard.init_hash != parse_init_hash(expect):
        held = shard.init_hash[:16] or "unknown"
        raise ValueError(
            f"checkpoint {config.checkpoint_dir} started from init hash {held}..., not the --init-expect "
            f"{expect[:16]}...: start again with --fresh, or without --init-expect"
        )
    return shard


def _start(
    config: ShardConfig,
    gates: Gates,
    layout: FragmentLayout,
    initial: list,
    fingerprint: dict,
    first_hash: str = "",
) -> Shard:
    """The running shard from a layout and its starting values, resumed from its checkpoint where there is
    one; `first_hash`: the init hash of the first worker's upload, written to the checkpoint at once (a
    restart then needs the uploader no more)."""
    c, first = config, bool(first_hash)
    rule = c.rule
    ranges = [slice_ranges(f.numel, c.num_shards)[c.shard] for f in layout.fragments]
    state = ShardState(
        c.shard, c.num_shards, layout, c.sync, initial, c.model.seed,
        rule.min_workers, rule.round_timeout, c.robust, rule.quorum, rule.round_grace,
        staged_budget(c.sync, ranges, c.limits),  # what pushes arriving may hold
    )  # fmt: skip
    checkpoint = ShardCheckpoint(c.checkpoint_dir, fingerprint, first_hash) if c.checkpoint_dir else None
    if checkpoint is not None and checkpoint.exists() and not c.fresh and not first:
        checkpoint.load(state)
        rounds = [state.round_of(f) for f in range(layout.num_fragments)]
        log.info("shard %d: resumed from checkpoint %s at rounds %s", c.shard, c.checkpoint_dir, rounds)
    elif checkpoint is not None:
        checkpoint.needs_initial()  # written before the shard takes workers (serve())
        if first:
            checkpoint.write_initial(state)
    warm_up(tuple({c.sync.uplink_codec, c.sync.downlink_codec}), c.sync.codec_block_size)  # not in round 1
    return Shard(c, state, fingerprint, checkpoint, gates, first_hash)


def layout_from_file(
    path: str, cfg: SyncConfig, blocks_path: str | None, shard: int = 0
) -> tuple[FragmentLayout, list, dict]:
    """The layout, the initial fragments and what else the fingerprint must hold (the file's own
    fingerprint's keys beyond the layout: the model's config, say), from a state dict file alone."""
    init = read_init_file(path, blocks_path)
    try:
        layout = init.layout(cfg.num_fragments, cfg.fragment_pattern)
    except ValueError as e:
        raise ValueError(f"--init {path}: {e}") from None
    log.info(
        "shard %d: --init %s: %d parameters, %s values; %s",
        shard,
        path,
        sum(len(f.entries) for f in layout.fragments),
        f"{layout.numel:,}",
        f"{sum(len(f.blocks) for f in layout.fragments)} blocks in {layout.blocks_path!r} ({init.source})"
        if cfg.num_fragments > 1
        else "one fragment",
    )
    return layout, init.initial(layout), init.opaque()


def load_initial(model: nn.Module, path: str) -> None:
    """Load a state_dict saved with torch.save(model.state_dict(), path); one-line errors."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"--init {path}: no such file") from None
    except Exception as e:  # torch raises many kinds for files that are not checkpoints
        raise ValueError(f"--init {path}: not a saved state_dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"--init {path}: holds a {type(state).__name__}, not a state_dict")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ValueError(f"--init {path} does not fit the model: {' '.join(first[1:2] or first)}") from None
