"""Joining a run from your own loop: `connect()` probes every shard, takes the run's settings where the worker
gave none, gives a shard without parameters this worker's (worker/bootstrap.py), opens the links
(worker/transport.py), sets the model to the run's global parameters and returns the SyncEngine.

It must not keep anything of its own once it returns: the engine and its transport own the run from there.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from streamdiloco.common.codecs import warm_up
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import (
    FragmentLayout,
    build_layout,
    flatten,
    fragment_params,
    slice_ranges,
    unflatten_into,
)
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.tls import ClientTLS
from streamdiloco.worker.bootstrap import ShardInfo, check_one_start, give_parameters, probe_shard
from streamdiloco.worker.engine import SyncEngine
from streamdiloco.worker.report import ScalarLogger
from streamdiloco.worker.session import SyncError
from streamdiloco.worker.transport import GrpcTransport

__all__ = ["JoinOptions", "SyncError", "chosen_sync_fields", "connect"]

log = logging.getLogger("streamdiloco.worker")

SYNC_FIELDS = frozenset(SyncConfig.__dataclass_fields__)
# the settings a worker that takes them from the shard says it took (the others follow them, or are the
# shard's own: the outer optimizer)
ADOPTED_LOG = (
    "sync_every",
    "num_fragments",
    "fragment_pattern",
    "fragment_sync_delay",
    "fragment_update_alpha",
    "uplink_codec",
    "downlink_codec",
    "codec_block_size",
)


@dataclass(frozen=True)
class JoinOptions:
    """How connect() joins a run and stays in it (each field is also a keyword of connect())."""

    total_steps: int | None = None  # the run's last step: the engine syncs every fragment there (final_sync)
    name: str | None = None  # this worker's name (default: host-pid)
    token: str = ""  # the run's token, or this worker's
    seed: int = 0  # the model's seed, as the shards' (the fingerprint carries it)
    rank: int = 0  # the worker's data rank (its batches' seed)
    join_timeout: float = 60.0  # seconds to wait for each shard to answer (--join-timeout)
    reconnect_timeout: float = 600.0  # seconds a broken session may take to come back before the run fails
    link: LinkSettings = field(default_factory=LinkSettings)  # liveness bound, receive window ([link])
    resume: dict | None = None  # a worker checkpoint's dict (worker/run.py): continue from it
    interrupt: threading.Event | None = None  # set: the engine stops at its next step (StopRequested)
    prepare: Callable[[], None] | None = None  # called once the model holds the global parameters
    tls: ClientTLS | None = None  # connect over TLS (common/tls.py)
    blocks_path: str | None = None  # the nn.ModuleList of the model's blocks (default: its largest)
    fragments: Sequence[Sequence[str]] | None = None  # parameter groups, one fragment each
    sync_set: frozenset[str] | None = None  # the SyncConfig fields this worker sets (see connect())
    # experiment trackers (worker/report.py: WandbLogger, TensorBoardLogger or your own ScalarLogger): the
    # engine gives them its scalars every `log_every` schedule steps and each eval loss, and closes them
    loggers: Sequence[ScalarLogger] = ()
    log_every: int = 20


def chosen_sync_fields(sync: SyncConfig | None, sync_set: frozenset[str] | None) -> frozenset[str]:
    """The SyncConfig fields a worker set itself (the rest it takes from the shard): `sync_set` as given
    (every name must be a field), or, when None, the fields in which `sync` differs from SyncConfig()'s
    defaults (none when there is no `sync`)."""
    if sync_set is not None:
        if unknown := sorted(set(sync_set) - SYNC_FIELDS):
            raise ValueError(f"sync_set names {unknown[0]!r}, which is not a SyncConfig field")
        return frozenset(sync_set)
    if sync is None:
        return frozenset()
    default = SyncConfig()
    return frozenset(f for f in SYNC_FIELDS if getattr(sync, f) != getattr(default, f))


def connect(
    model: torch.nn.Module,
    servers: list[str] | str,
    sync: SyncConfig | None = None,
    options: JoinOptions | None = None,
    **kwargs: Any,
) -> SyncEngine:
    """Join a run around your own model and loop. Joins every shard (the model's fingerprint must match
    theirs), sets the model's parameters to the run's global ones, and returns the SyncEngine: call its
    `step(tokens, loss)` right after every `inner_optimizer.step()`, and `close()` at the end.

    A run in progress is joined too: the engine then starts counting at the run's current step
    (`engine.step_count`), so that its sends line up with the other workers'; take part from there.
    The Streaming DiLoCo settings (H, P, the fragment pattern, tau, alpha, the codecs, ...) are the shard's,
    except those this worker sets: the fields named in `sync_set`, with their values from `sync` (default
    for `sync_set`: the fields in which `sync` differs from SyncConfig(); pass frozenset() to take every
    setting from the shard, or every field's name to take none). One set here that the shards must agree
    on (H, P, the pattern, the codecs) and that differs from theirs is refused at Join with the difference;
    tau, alpha and the merge settings are this worker's own, the shard's only their default. The settings
    in force are `engine.cfg`; for settings that are valid only with the shard's (H=12 with its P=3),
    pass SyncConfig.given({"sync_every": 12}). A shard that has no parameters yet (server --init
    from-worker) gets this worker's. `total_steps` lets the engine sync every fragment at the last step
    (final_sync).
    Every keyword is a field of JoinOptions (pass `options=JoinOptions(...)` to keep them together).
    `resume` is a worker checkpoint's dict (see worker/run.py): the engine and the links continue from it,
    and the model keeps its parameters.
    `prepare()`, if given, is called once the model holds the global parameters and before any shard waits
    for this worker (say, to evaluate them): slow work there does not hold up the others. `tls`: connect
    over TLS (the run's CA; for mutual TLS this worker's certificate), see common/tls.py. `join_timeout`:
    seconds to wait for each shard to answer (the worker CLI's --join-timeout); while none does, a line says
    so every few seconds. `reconnect_timeout`: how long a broken session, or a Fetch that keeps breaking,
    may go without an answer before the run fails. `link=LinkSettings(liveness_timeout=30)`
    (streamdiloco.common.keepalive): how soon a shard that stopped answering is noticed, and the receive
    window (a link whose modem queues several seconds may need a longer bound).
    `loggers=[WandbLogger("my-project")]` (streamdiloco.worker.report; any object with
    `log_scalars(step, scalars)` and `close()`): the engine gives them train/loss, perf/tokens_per_second,
    sync/blocked_seconds, sync/bytes_sent, sync/bytes_received (and perf/compute_utilization once reported)
    every `log_every` schedule steps, eval/loss whenever `engine.report(eval_loss=...)` is called, and
    closes them in `engine.close()`: the same hook as `streamdiloco worker --wandb-project`'s.

    The fragments: by default the model's largest nn.ModuleList holds its blocks, split into P-1 fragments,
    and every other parameter makes the last one. `blocks_path="encoder.layers"` names the ModuleList (for a
    model with several, or whose largest list is not its blocks). `fragments=[["embed", "head"],
    ["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]` groups the parameters yourself: each group (names
    of parameters or of modules, whose parameters all go with it) syncs together as one fragment, and what
    no group names makes one more, the last; P (`sync.num_fragments`) must equal the fragments made. The
    shards must build the same layout: start them with the same --blocks-path or --fragments (the
    fingerprint carries the layout, and a shard with another refuses this worker by saying so)."""
    _refuse_wrapped(model)
    o = replace(options or JoinOptions(), **kwargs)  # a keyword that is no option: TypeError, as ever
    chosen = chosen_sync_fields(sync, o.sync_set)
    targets = [s.strip() for s in servers.split(",")] if isinstance(servers, str) else list(servers)
    name = o.name or f"{socket.gethostname()}-{os.getpid()}"
    infos = [probe_shard(t, name, o.token, o.join_timeout, o.tls) for t in targets]
    sync = _settings(sync, chosen, infos[0], targets[0], name)
    layout = build_layout(model, sync.num_fragments, sync.fragment_pattern, o.blocks_path, o.fragments)
    fingerprint = model_fingerprint(layout, sync, o.seed)
    if any(info.uninitialized for info in infos):  # server --init from-worker: ours, if we are the first
        vectors = [flatten(fragment_params(model, f)) for f in layout.fragments]
        give_parameters(targets, infos, name, layout, fingerprint, vectors, o.token, o.join_timeout, o.tls)
    else:
        check_one_start(targets, infos)  # shards that took two workers' uploads: no run to join
    warm_up(tuple({sync.uplink_codec, sync.downlink_codec}), sync.codec_block_size)  # not in round 1
    transport = _open_links(targets, name, fingerprint, o)
    try:
        return _start(model, layout, sync, transport, name, o)
    except BaseException:
        transport.close()
        raise


def _refuse_wrapped(model: torch.nn.Module) -> None:
    """ValueError for a model wrapped for several ranks (DDP, FSDP): those join with connect_group."""
    wrapper = type(model).__name__
    if wrapper in ("DistributedDataParallel", "FullyShardedDataParallel") or wrapper.startswith("FSDP"):
        raise ValueError(
            f"a {wrapper}-wrapped model is a worker of several ranks: call "
            "streamdiloco.worker.group.connect_group(model, servers, ...) on every rank instead of connect()"
        )


def _open_links(targets: list[str], name: str, fingerprint: dict, o: JoinOptions) -> GrpcTransport:
    """Join every shard and open a passive session with each; a resumed worker's links take back what its
    checkpoint held."""
    return GrpcTransport.open(
        targets,
        name,
        fingerprint,
        o.token,
        o.join_timeout,
        o.reconnect_timeout,
        link=o.link,
        states=None if o.resume is None else o.resume["links"],
        held=None if o.resume is None else o.resume["engine"]["mirror_rounds"],
        tls=o.tls,
    )


def _settings(
    sync: SyncConfig | None, chosen: frozenset[str], shard: ShardInfo, target: str, name: str
) -> SyncConfig:
    """The run's settings for this worker: its `chosen` ones, the shard's for the rest (logged)."""
    if chosen == SYNC_FIELDS:
        assert sync is not None
        return SyncConfig(
            **sync.to_dict()
        )  # checked as a whole (SyncConfig.given may have left it unchecked)
    sync = SyncConfig.adopted(sync or SyncConfig(), shard.config, chosen, f"the shard at {target}")
    if taken := [f for f in ADOPTED_LOG if f not in chosen]:
        said = ", ".join(f"{f}={getattr(sync, f)}" for f in taken)
        log.info("%s: from the shard at %s: %s", name, target, said)
    return sync


def _start(
    model: torch.nn.Module,
    layout: FragmentLayout,
    sync: SyncConfig,
    transport: GrpcTransport,
    name: str,
    o: JoinOptions,
) -> SyncEngine:
    """The engine over the open links: a new worker takes the run's parameters and starts where the run is;
    a resumed one continues from its checkpoint."""
    for link in transport.links:
        want = [slice_ranges(frag.numel, link.num_shards)[link.shard] for frag in layout.fragments]
        if [(lo, lo + n) for lo, n in link.slices] != want:
            raise SyncError(f"shard {link.shard} at {link.target} sent slices that do not fit this model")

    def set_params(vectors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for frag, vec in zip(layout.fragments, vectors, strict=True):
                unflatten_into(vec, fragment_params(model, frag))

    start = 0
    if o.resume is None:
        start = transport.join_run(set_params, o.prepare)
        if o.total_steps is not None and start >= o.total_steps:
            raise SyncError(
                f"the run is at step {start}, past total_steps={o.total_steps}: nothing left to do"
            )
    engine = SyncEngine(
        model,
        layout,
        sync,
        transport,
        total_steps=o.total_steps,
        seed=o.seed,
        rank=o.rank,
        start_step=start,
        interrupt=o.interrupt,
        loggers=o.loggers,
        log_every=o.log_every,
    )
    if o.resume is not None:
        engine.load_state_dict(o.resume["engine"])
        # before resume(): the pushes it sends again report the resumed step, not 0
        transport.report_progress(engine.progress)
        transport.resume(engine.next_rounds)
        log.info("%s resumes at step %d", name, engine.step_count)
        return engine
    engine.set_mirror_rounds(transport.installed)
    transport.report_progress(engine.progress)
    transport.follow(engine.next_rounds)
    if start:
        log.info("%s joins the run in progress at step %d", name, start)
        engine.catch_up(transport.first_rounds(layout.num_fragments))
    return engine
