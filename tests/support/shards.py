"""A shard as the tests build it: the keywords they give (the model spec, its index, the round policy, the
credentials, ...) made into a ShardConfig (server/config.py) and built as `streamdiloco server` builds it
(server/startup.py's build_shard). It must not grow tests of its own nor import a test file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from streamdiloco.common.config import ModelSettings, PieceSettings, ShardSettings, SyncConfig
from streamdiloco.server.config import INIT_TIMEOUT, ShardConfig
from streamdiloco.server.edge.initialize import PendingShard
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.shard import Shard
from streamdiloco.server.startup import build_shard
from streamdiloco.server.trust.auth import Auth, WorkersFile
from streamdiloco.server.trust.bounds import Limits


def shard_config(
    cfg: SyncConfig,
    model_spec: str | None,
    shard: int = 0,
    num_shards: int = 1,
    seed: int = 0,
    block_size: int | None = None,
    min_workers: int = 1,
    round_timeout: float = 120.0,
    token: str = "",
    chunk_bytes: int = 1 << 20,
    init: str | None = None,
    checkpoint_dir: str | None = None,
    fresh: bool = False,
    robust: RobustConfig | None = None,
    auth: Auth | None = None,
    workers_file: WorkersFile | None = None,
    limits: Limits | None = None,
    blocks_path: str | None = None,
    fragments: Sequence[Sequence[str]] | None = None,
    piece_tokens: int = 1 << 20,
    init_expect: str | None = None,
    init_timeout: float = INIT_TIMEOUT,
    quorum: float = 0.5,
    round_grace: float = 1.0,
) -> ShardConfig:
    """A ShardConfig from the tests' keywords; `model_spec` None: no model code (an --init file, or
    from-worker); `fragments`: groups of names (--fragments)."""
    groups = ";".join(",".join(g) for g in fragments) if fragments is not None else None
    model = ModelSettings(model_spec or "tiny", block_size, seed, blocks_path, groups)
    rounds = ShardSettings(min_workers, round_timeout, quorum, round_grace, chunk_bytes)
    return ShardConfig(
        model=model,
        sync=cfg,
        server=rounds,
        robust=robust or RobustConfig(),
        limits=limits or Limits(),
        pieces=replace(PieceSettings(), piece_tokens=piece_tokens),
        shard=shard,
        num_shards=num_shards,
        has_model=model_spec is not None,
        init=init,
        init_expect=init_expect,
        init_timeout=init_timeout,
        checkpoint_dir=checkpoint_dir,
        fresh=fresh,
        auth=auth if auth is not None else Auth(token=token),
        workers_file=workers_file,
    )


def shard_of(cfg: SyncConfig, model_spec: str | None, *args, **kw) -> Shard | PendingShard:
    """The shard `shard_config(cfg, model_spec, ...)` describes, built."""
    return build_shard(shard_config(cfg, model_spec, *args, **kw))
