"""The worker process: `streamdiloco worker --servers HOST:PORT,...`.

Join every shard, fetch the masters (local = mirror = master), then train: AdamW inner steps, and after each
one the sync engine's hook, which pushes fragments in the background and merges their updates tau steps
later. Progress every --log-every steps; every --eval-every steps the eval loss of the global parameters
(the mirror), reported to the shards with the next pushes (their dashboards plot it); at the end the eval
loss once more, the mirror's hashes (compare them with the shards' /api/status) and a JSON summary.
Scalars also go to `ScalarLogger`s (worker/report.py): TensorBoard with --tensorboard DIR, or your own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import tensor_digest
from streamdiloco.common.fragments import fragment_params, parse_groups, unflatten_into
from streamdiloco.common.modelspec import build_model, model_block_size
from streamdiloco.common.tls import client_tls
from streamdiloco.common.wire import parse_target
from streamdiloco.worker.data import BatchStream, ByteDataset, eval_batches
from streamdiloco.worker.engine import StopRequested, SyncEngine
from streamdiloco.worker.group import GroupEngine, RankGroup, batch_slice, connect_group, group_from_env
from streamdiloco.worker.join import connect
from streamdiloco.worker.metrics import WorkerMetrics
from streamdiloco.worker.report import ScalarLogger, TensorBoardLogger
from streamdiloco.worker.train import (
    InnerConfig,
    check_model_output,
    evaluate,
    forward_backward,
    lr_at,
    make_inner_optimizer,
    optimizer_step,
    set_lr,
)
from streamdiloco.worker.transport import GrpcTransport

log = logging.getLogger("streamdiloco.worker")


@dataclass(frozen=True)
class WorkerConfig:
    servers: tuple[str, ...]
    name: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    rank: int | None = None  # seeds this worker's data stream; default: derived from the name
    steps: int = 600
    batch_size: int = 16
    model: str = "tiny"
    block_size: int | None = None
    data: str | None = None
    seed: int = 0
    device: str = "cpu"
    log_every: int = 20
    eval_batches: int = 8
    # steps between evaluations of the global parameters during training (reported to the shards' dashboards
    # and the loggers); 0: only at the start and the end. Each costs --eval-batches forward passes, on the
    # training thread between steps (the sync threads go on meanwhile)
    eval_every: int = 200
    tensorboard: str | None = None  # write TensorBoard scalars to this folder (needs the tensorboard package)
    token: str = ""
    join_timeout: float = 60.0
    summary: str | None = None  # write the summary JSON here
    save_global: str | None = None  # torch.save the final global fragments (the mirror) here
    checkpoint: str | None = None  # where this worker's checkpoint goes (default: checkpoints/<name>.pt)
    checkpoint_every: int = 100  # steps between checkpoints; 0: only when stopping
    resume: bool = False  # start from the checkpoint instead of joining as a new worker
    reconnect_timeout: float = 600.0  # give up on a shard unreachable this long
    # seconds to sleep after every step: makes this worker slow on purpose, or emulates a GPU step (the
    # sleep counts as compute time in the utilization)
    step_delay: float = 0.0
    # a worker of several ranks (torchrun): seconds a rank waits for the others at a collective before the
    # worker gives up. Rank 0 may be waiting that long for an update (a shard that restarts), so it is long;
    # a rank that dies is noticed at once (gloo) or by torchrun, which stops the others
    rank_timeout: float = 1800.0
    metrics_port: int | None = None  # serve Prometheus /metrics on this port (0: any free port)
    metrics_host: str = "127.0.0.1"
    auto_resume: bool = False  # resume if the checkpoint exists, else join as a new worker (restarts)
    tls_ca: str | None = None  # TLS to the shards, trusting this CA (PEM); None: plaintext (loopback)
    tls_cert: str | None = None  # mutual TLS: this worker's certificate and key (PEM)
    tls_key: str | None = None
    blocks_path: str | None = None  # the nn.ModuleList of blocks (default: the model's largest)
    fragments: str | None = None  # the user's groups of parameter names, "a,b;c,d" (common/fragments.py)
    sync: SyncConfig = field(default_factory=SyncConfig)
    # the fields of `sync` the user set; every other one is taken from the shard at Join (see connect());
    # None: those in which `sync` differs from SyncConfig()'s defaults
    sync_set: frozenset[str] | None = None
    inner: InnerConfig = field(default_factory=InnerConfig)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("--servers: give at least one shard as HOST:PORT")
        for target in self.servers:
            parse_target(target)  # one-line error for a malformed address
        for name in ("steps", "batch_size", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be 0 (start and end only) or more, got {self.eval_every}")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"--checkpoint-every must be 0 (only when stopping) or more, got {self.checkpoint_every}"
            )
        if not self.reconnect_timeout > 0:
            raise ValueError(f"--reconnect-timeout must be positive seconds, got {self.reconnect_timeout}")
        if not self.rank_timeout > 0:
            raise ValueError(f"--rank-timeout must be positive seconds, got {self.rank_timeout}")
        if not 0 <= self.step_delay < 3600:
            raise ValueError(f"--step-delay must be in [0, 3600) seconds, got {self.step_delay}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        client_tls(self.tls_ca, self.tls_cert, self.tls_key)  # one-line errors for missing or bad files
        if self.blocks_path and self.fragments:
            raise ValueError("give --blocks-path or --fragments, not both")
        if self.fragments:
            parse_groups(self.fragments)  # a one-line error for a bad --fragments, now

    @property
    def fragment_groups(self) -> tuple[tuple[str, ...], ...] | None:
        return parse_groups(self.fragments) if self.fragments else None

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.checkpoint) if self.checkpoint else Path("checkpoints") / f"{self.name}.pt"

    @property
    def data_rank(self) -> int:
        return self.rank if self.rank is not None else zlib.crc32(self.name.encode()) % 100_000


def mirror_digests(engine: SyncEngine) -> list[list[str]]:
    """Hash of each (fragment, shard slice) of the mirror: equal to the shards' master_hash when in sync."""
    return [
        [tensor_digest(engine.mirrors[f][lo:hi]) for lo, hi in engine.ranges[f]]
        for f in range(engine.layout.num_fragments)
    ]


def params_digest(model: torch.nn.Module) -> str:
    """Hash of the model's (local) parameters, all of them in order: equal on every rank of a group worker."""
    return tensor_digest(torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()]))


def optimizer_digest(opt: torch.optim.Optimizer) -> str:
    """Hash of the inner optimizer's state tensors (AdamW's moments): equal on a group worker's ranks only
    if every step's averaged gradients were (no broadcast ever makes them equal)."""
    tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    flat = [t.detach().reshape(-1).float().cpu() for t in tensors]
    return tensor_digest(torch.cat(flat) if flat else torch.zeros(0))


CHECKPOINT_FORMAT = 2  # 2: the engine keeps the rounds its mirror holds (links no longer do)


def _checkpoint_key(cfg: WorkerConfig, ranks: int = 1) -> dict:
    """What must be the same for a checkpoint to be resumed by this configuration. The batch is the
    worker's, all its ranks' together: 2 ranks of --batch-size 8 may resume 1 rank's of 16, and back."""
    return {
        "model": cfg.model,
        "block_size": cfg.block_size,
        "seed": cfg.seed,
        "steps": cfg.steps,
        "batch_size": cfg.batch_size * ranks,
        "data": cfg.data,
        "blocks_path": cfg.blocks_path,
        "fragments": cfg.fragments,
        "sync": cfg.sync.to_dict(),
    }


def _read_checkpoint(path: Path, flag: str = "--resume") -> dict:
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(
            f"{flag}: no checkpoint at {path} (give the --name the worker had, or --checkpoint PATH)"
        ) from None
    except Exception as e:  # torch raises many kinds for damaged files
        raise ValueError(f"{flag}: {path} is not a worker checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{flag}: {path} is not a worker checkpoint of format {CHECKPOINT_FORMAT}")
    return ck


def checkpoint_name(path: str, flag: str = "--resume") -> str:
    """The worker name a checkpoint was written under."""
    return str(_read_checkpoint(Path(path), flag)["name"])


def load_checkpoint(cfg: WorkerConfig, ranks: int = 1) -> dict:
    """Read and check this worker's checkpoint; ValueError (one line) if it cannot be resumed."""
    path = cfg.checkpoint_path
    flag = "--resume" if cfg.resume else "--auto-resume"
    ck = _read_checkpoint(path, flag)
    want = _checkpoint_key(cfg, ranks)
    key = dict(ck["key"])
    if isinstance(key.get("sync"), dict):  # written before a sync field existed: it had its default then
        key["sync"] = {**SyncConfig().to_dict(), **key["sync"]}
    changed = sorted(k for k in want if key.get(k) != want[k])
    if changed:
        raise ValueError(
            f"{flag}: {path} was written with other settings ({', '.join(changed)}): "
            "resume with the same flags, or remove the checkpoint to start this worker anew"
        )
    return ck


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save, atomically: a crash while writing leaves the previous checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StopFlag:
    """SIGTERM / SIGINT: the first asks the worker to stop at the end of its step (or while it waits for an
    update) and write its checkpoint; a second one stops it at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.previous: dict = {}
        self.on_stop: Callable[[], None] | None = None  # the engine's request_stop: a waiting merge gives up

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only (a worker run from a test's thread)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()
        if self.on_stop is not None:
            self.on_stop()
        log.warning(
            "%s: stopping after this step (send it again to stop at once)", signal.Signals(signum).name
        )


def run_worker(cfg: WorkerConfig, loggers: Sequence[ScalarLogger] = ()) -> dict:
    """Train as `cfg` says; `loggers` get the worker's scalars too (with --tensorboard, a TensorBoardLogger
    is added). Started by torchrun (WORLD_SIZE > 1), the ranks are one worker (worker/group.py): rank 0 joins,
    syncs, logs and checkpoints; each rank trains on its slice of the worker's batch (size x --batch-size)."""
    t_start = time.perf_counter()
    group, device_name = group_from_env(cfg.device, cfg.rank_timeout)
    try:
        return _run_worker(cfg, loggers, t_start, group, device_name)
    finally:
        if group is not None:
            with contextlib.suppress(Exception):  # a broken group: nothing more to say to the others
                torch.distributed.destroy_process_group()


def _run_worker(
    cfg: WorkerConfig,
    loggers: Sequence[ScalarLogger],
    t_start: float,
    group: RankGroup | None,
    device_name: str,
) -> dict:
    ranks = group.size if group is not None else 1
    leads = group is None or group.leads
    if group is not None:  # the default name is host-pid: every rank takes rank 0's (it seeds the data)
        cfg = dataclasses.replace(cfg, name=group.share(cfg.name), device=device_name)
        if not leads:
            logging.getLogger("streamdiloco").setLevel(logging.WARNING)  # rank 0 speaks for the worker
    device = torch.device(cfg.device)
    resuming = cfg.resume or (cfg.auto_resume and cfg.checkpoint_path.exists())
    if group is not None:  # the checkpoint is rank 0's (other nodes may not see its file)
        resuming = group.share(resuming)
    if cfg.auto_resume and not cfg.resume:
        log.info(
            "%s: %s",
            cfg.name,
            f"resuming from {cfg.checkpoint_path}"
            if resuming
            else f"no checkpoint at {cfg.checkpoint_path} yet",
        )
    resume = load_checkpoint(cfg, ranks) if resuming and leads else None
    if resume is not None and resume["name"] != cfg.name:
        raise ValueError(
            f"{'--resume' if cfg.resume else '--auto-resume'}: {cfg.checkpoint_path} belongs to worker "
            f"{resume['name']!r}, not {cfg.name!r}"
        )
    model = build_model(cfg.model, cfg.seed, cfg.block_size)
    block = model_block_size(model, cfg.block_size)
    data = ByteDataset.load(cfg.data, block)
    val = eval_batches(data.val, cfg.batch_size * ranks, block, cfg.eval_batches)  # the worker's batch
    # the worker's batch, all its ranks' together: each trains on its slice (batch_slice)
    stream = BatchStream(data.train, cfg.batch_size * ranks, block, cfg.seed, cfg.data_rank)
    if group is not None and not leads:
        return _follow(cfg, group, model, stream, device)
    loggers = list(loggers)
    if cfg.tensorboard:
        loggers.append(TensorBoardLogger(cfg.tensorboard))
    metrics = WorkerMetrics(cfg.name, cfg.model, str(device), cfg.steps)
    try:
        if cfg.metrics_port is not None:
            metrics.serve(cfg.metrics_port, cfg.metrics_host)
        return _run(cfg, t_start, device, resume, model, block, data, val, stream, metrics, loggers, group)
    finally:
        metrics.close()
        for logger in loggers:
            logger.close()


def _run(
    cfg, t_start, device, resume, model, block, data, val, stream, metrics: WorkerMetrics, loggers, group=None
) -> dict:
    stop = StopFlag()
    stop.install()

    log.info("%s: joining %d shard(s): %s", cfg.name, len(cfg.servers), ", ".join(cfg.servers))
    if resume is not None:
        model.load_state_dict(resume["params"])
        stream.load_state_dict(resume["data"])
    model.to(device)
    x, y = val[0]
    check_model_output(model, x.to(device), y.to(device), cfg.model)  # before any shard hears of us
    # made now, not after joining: building AdamW the first time takes about a second, which a joiner
    # must not spend while the others already wait for its first push
    opt = make_inner_optimizer(model, cfg.inner)
    eval_start: list[float] = []
    ge: GroupEngine | None = None
    try:
        joined = (connect if group is None else connect_group)(
            model,
            list(cfg.servers),
            cfg.sync,
            total_steps=cfg.steps,
            name=cfg.name,
            token=cfg.token,
            tls=client_tls(cfg.tls_ca, cfg.tls_cert, cfg.tls_key),
            seed=cfg.seed,
            rank=cfg.data_rank,
            join_timeout=cfg.join_timeout,
            reconnect_timeout=cfg.reconnect_timeout,
            resume=resume,
            interrupt=stop.event,
            prepare=lambda: eval_start.append(evaluate(model, val, device)),  # the global params as fetched
            blocks_path=cfg.blocks_path,
            fragments=cfg.fragment_groups,
            sync_set=cfg.sync_set,
        )
        if isinstance(joined, GroupEngine):  # rank 0 of a group: it syncs for every rank
            ge = joined
            assert ge.engine is not None
            engine = ge.engine
        else:
            engine = joined
    except StopRequested:  # stopped while it joined: nothing trained, nothing to save
        stop.restore()
        metrics.phase = "stopped"
        log.info("%s: stopped before training started", cfg.name)
        return {"worker": cfg.name, "stopped_at_step": None, "steps": cfg.steps}
    except BaseException:
        stop.restore()
        raise
    try:  # from here on, whatever happens, the sessions are closed (their threads would keep us alive)
        if ge is not None:
            _share_start(ge.group, resume)
        transport = engine.transport
        assert isinstance(transport, GrpcTransport)
        transport.on_push_answered(metrics.push_answer.observe)
        engine.on_merge_wait = metrics.merge_wait.observe
        stop.on_stop = engine.request_stop
        metrics.engine, metrics.transport = engine, transport
        # what set-up made (torch, the model, the data) stays: out of the collector's sight, so that a full
        # collection does not hold the GIL, which the sync threads need, for a tenth of a second mid-run
        gc.collect()
        gc.freeze()
        if eval_start:
            metrics.eval_loss = eval_start[0]
            engine.report(eval_loss=eval_start[0])  # the eval curve's first point, at the joining step
        return _train(
            cfg,
            model,
            opt,
            engine,
            transport,
            stream,
            val,
            device,
            stop,
            resume,
            t_start,
            eval_start,
            metrics,
            loggers,
            ge,
        )
    finally:
        engine.close()
        stop.restore()


def _share_start(group: RankGroup, resume: dict | None) -> dict | None:
    """Rank 0's resumed optimizer and data stream, to every rank (the checkpoint is rank 0's file)."""
    return group.share(None if resume is None else {"optimizer": resume["optimizer"], "data": resume["data"]})


def _ddp(model: torch.nn.Module, group: RankGroup, device: torch.device) -> torch.nn.Module:
    """The model as the ranks train it: DDP averages the gradients over the group in backward()."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    with group.guard("start-up"):  # DDP's constructor checks the ranks' models against each other
        return DistributedDataParallel(model, device_ids=ids, process_group=group.pg)


def _follow(cfg: WorkerConfig, group: RankGroup, model: torch.nn.Module, stream: BatchStream, device) -> dict:
    """A rank other than 0 of a group worker: it trains on its slice of every batch, in step with rank 0,
    whose GroupEngine tells it after each step which fragments were merged and brings their parameters
    (worker/group.py). No network but the group's, no checkpoint, no logs beyond warnings."""
    stop = StopFlag()
    stop.install()
    try:
        model.to(device)
        opt = make_inner_optimizer(model, cfg.inner)
        try:
            ge = connect_group(model, list(cfg.servers), cfg.sync, process_group=group.pg)
        except StopRequested:
            return {"worker": cfg.name, "group_rank": group.rank, "stopped_at_step": None}
        start = _share_start(group, None)
        if start is not None:
            opt.load_state_dict(start["optimizer"])
            stream.load_state_dict(start["data"])
        ddp = _ddp(model, group, device)
        step, stopped = ge.step_count, False
        while step < cfg.steps and not stopped:
            set_lr(opt, lr_at(step, cfg.steps, cfg.inner))
            x, y = stream.next()
            x, y = batch_slice(x, group), batch_slice(y, group)
            with group.guard(f"step {step + 1}"):
                loss = forward_backward(ddp, x.to(device), y.to(device))
                optimizer_step(model, opt, cfg.inner)
            try:
                ge.step(tokens=x.numel(), loss=loss, stop=stop.event.is_set())
            except StopRequested:
                stopped = True
            step = ge.step_count  # rank 0's schedule step (with --sync-schedule adaptive, not every step)
            if cfg.step_delay:
                time.sleep(cfg.step_delay)
        if not stopped:
            ge.drain()
        summary = {
            "worker": cfg.name,
            "group_rank": group.rank,
            "stopped_at_step": step if stopped else None,
            "params_hash": params_digest(model),  # equal on every rank: they hold rank 0's parameters
            "optimizer_hash": optimizer_digest(opt),  # equal on every rank: the same gradients every step
        }
        if cfg.summary:  # beside rank 0's: NAME.json.rank1, ...
            Path(f"{cfg.summary}.rank{group.rank}").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        stop.restore()


def _train(
    cfg,
    model,
    opt,
    engine,
    transport,
    stream,
    val,
    device,
    stop: StopFlag,
    resume,
    t_start,
    eval_start,
    metrics,
    loggers: list[ScalarLogger],
    ge: GroupEngine | None = None,
) -> dict:
    group = ge.group if ge is not None else None
    trained = _ddp(model, group, device) if group is not None else model  # what forward/backward runs
    stats: dict[str, Any] = {
        "tokens": 0,
        "inner_steps": 0,
        "compute_seconds": 0.0,
        "train_seconds": 0.0,
        "eval_loss_start": None,
    }
    if resume is not None:
        stats.update(resume["stats"])
    else:
        stats["eval_loss_start"] = eval_start[0]
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
    first = engine.step_count
    inner_before = stats.get("inner_steps", 0)  # a resumed run's earlier inner steps (its stats)
    log.info(
        "%s: %s params in %d fragments over %d shards; H=%d tau=%d alpha=%g %s/%s; "
        "steps %d..%d of %d x %d bytes%s",
        cfg.name,
        f"{sum(p.numel() for p in model.parameters()):,}",
        engine.layout.num_fragments,
        transport.num_shards,
        engine.cfg.sync_every,  # the settings in force: this worker's, and the shard's for those it left
        engine.cfg.fragment_sync_delay,
        engine.cfg.fragment_update_alpha,
        engine.cfg.uplink_codec,
        engine.cfg.downlink_codec,
        first + 1,
        cfg.steps,
        cfg.batch_size,
        stream.block_size,
        f" (resumed from {cfg.checkpoint_path})" if resume is not None else "",
    )
    path = cfg.checkpoint_path

    def checkpoint(train_seconds: float) -> None:
        state = {
            "format": CHECKPOINT_FORMAT,
            "name": cfg.name,
            "rank": cfg.data_rank,
            "key": _checkpoint_key(cfg, ge.size if ge is not None else 1),
            "params": model.state_dict(),
            "optimizer": opt.state_dict(),
            "data": stream.state_dict(),
            "engine": engine.state_dict(),
            "links": transport.state_dict(),
            "stats": {**stats, "train_seconds": train_seconds},
        }
        save_checkpoint(path, state)

    def log_scalars(scalars: dict[str, float]) -> None:
        for logger in loggers:
            logger.log_scalars(engine.step_count, scalars)

    eval_model = None

    def eval_global() -> float:
        """The eval loss of the global parameters (the mirror, as of now), in a second model: the local
        parameters stay as they are. Reported to the shards with the next pushes, and to the loggers."""
        nonlocal eval_model
        t0 = time.perf_counter()
        if eval_model is None:
            eval_model = build_model(cfg.model, cfg.seed, cfg.block_size).to(device)
        eval_model.load_state_dict(engine.global_state_dict())
        loss = evaluate(eval_model, val, device)
        seconds = time.perf_counter() - t0
        stats["eval_seconds"] = stats.get("eval_seconds", 0.0) + seconds
        engine.report(eval_loss=loss)
        metrics.eval_loss = loss
        log.info(
            "%s step %d/%d  eval loss %.4f (global params, %.2f s)", cfg.name, step, cfg.steps, loss, seconds
        )
        log_scalars({"eval/loss": loss})
        return loss

    if eval_start and resume is None:
        log_scalars({"eval/loss": eval_start[0]})
    t_train0 = time.perf_counter() - stats["train_seconds"]
    metrics.stats, metrics.step, metrics.phase = stats, first, "training"
    metrics.mark(stats["compute_seconds"])
    recent: list[float] = []
    stopped = False
    step = first
    try:
        engine.finish_step()  # a step's syncs that a stop interrupted, before the checkpoint was written
    except StopRequested:
        stopped = True
    while step < cfg.steps and not stopped:
        if stop.event.is_set() and ge is None:  # a group stops together, after the step (GroupEngine.step)
            stopped = True
            break
        t0 = time.perf_counter()
        set_lr(opt, lr_at(step, cfg.steps, cfg.inner))
        x, y = stream.next()
        xs, ys = batch_slice(x, group), batch_slice(y, group)  # this rank's part of the worker's batch
        with group.guard(f"step {step + 1}") if group is not None else contextlib.nullcontext():
            loss = forward_backward(trained, xs.to(device), ys.to(device))
            optimizer_step(model, opt, cfg.inner)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats["compute_seconds"] += time.perf_counter() - t0
        stats["tokens"] += x.numel()
        stats["inner_steps"] = stats.get("inner_steps", 0) + 1
        recent.append(loss)
        # `step` counts the schedule's steps: one per inner step, or with --sync-schedule adaptive one per
        # engine.per_tick inner steps (a faster site does more of them: common/pace.py)
        before = step
        if engine.cfg.sync_schedule != "adaptive":
            step += 1
        metrics.step, metrics.loss = step, loss
        metrics.mark(stats["compute_seconds"])
        try:
            t_sync = time.perf_counter()
            if ge is not None:
                ge.step(tokens=xs.numel(), loss=loss, stop=stop.event.is_set())
            else:
                engine.step(tokens=x.numel(), loss=loss)
            # the final sync: every fragment once more, all waited for (once a run)
            if engine.step_count == cfg.steps:
                stats["final_sync_seconds"] = time.perf_counter() - t_sync
        except StopRequested:  # waiting for an update: the rest of the step's syncs go in the checkpoint
            stopped = True
        step = metrics.step = engine.step_count
        if cfg.step_delay:  # an emulated accelerator step: counted as compute (the GPU would be busy)
            t_delay = time.perf_counter()
            time.sleep(cfg.step_delay)
            stats["compute_seconds"] += time.perf_counter() - t_delay
        el = time.perf_counter() - t_train0
        engine.report(compute_utilization=stats["compute_seconds"] / el)
        if step == before:  # an inner step within a schedule step: the schedule's chores wait for its end
            continue
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and not stopped:
            eval_global()
        if step % cfg.log_every == 0 or step == cfg.steps:
            log_scalars(
                {
                    "train/loss": sum(recent) / len(recent),
                    "perf/tokens_per_second": stats["tokens"] / el,
                    "perf/compute_utilization": stats["compute_seconds"] / el,
                    "sync/blocked_seconds": engine.blocked_seconds,
                    "sync/bytes_sent": engine.bytes_sent,
                    "sync/bytes_received": engine.bytes_received,
                }
            )
            log.info(
                "%s step %d/%d  loss %.3f  %s tok/s  blocked %.1fs (%d of %d merges waited)  "
                "sent %s B  received %s B",
                cfg.name,
                step,
                cfg.steps,
                sum(recent) / len(recent),
                f"{stats['tokens'] / el:,.0f}",
                engine.blocked_seconds,
                engine.waits,
                engine.merges,
                f"{engine.bytes_sent:,}",
                f"{engine.bytes_received:,}",
            )
            recent.clear()
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps and not stopped:
            checkpoint(time.perf_counter() - t_train0)
    train_seconds = time.perf_counter() - t_train0
    if stopped:
        metrics.phase = "stopped"
        answered = transport.flush(timeout=10.0)  # pushes on the wire: let the shards take them
        checkpoint(train_seconds)
        log.info(
            "%s: stopped at step %d of %d%s; checkpoint in %s: continue with --resume --name %s",
            cfg.name,
            engine.step_count,
            cfg.steps,
            "" if answered else " (some pushes unanswered: they are sent again on resume)",
            path,
            cfg.name,
        )
        summary = {
            "worker": cfg.name,
            "stopped_at_step": engine.step_count,
            "steps": cfg.steps,
            "checkpoint": str(path),
        }
        if cfg.summary:
            Path(cfg.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.summary).write_text(json.dumps(summary, indent=2))
        return summary
    (ge or engine).drain()  # only does something with --no-final-sync
    checkpoint(train_seconds)  # the finished state: --resume then has nothing left to do
    # the global parameters: after the final sync every fragment's mirror equals the masters
    eval_model = build_model(cfg.model, cfg.seed, cfg.block_size).to(device)
    for frag, vec in zip(engine.layout.fragments, engine.mirrors, strict=True):
        unflatten_into(vec, fragment_params(eval_model, frag))
    eval_loss = evaluate(eval_model, val, device)
    metrics.eval_loss, metrics.phase = eval_loss, "finished"
    log_scalars({"eval/loss": eval_loss})
    digests = mirror_digests(engine)
    for f, hs in enumerate(digests):
        log.info(
            "%s mirror fragment %d: %s", cfg.name, f, " ".join(f"shard{s}={h}" for s, h in enumerate(hs))
        )
    msg_out, msg_in = transport.message_bytes
    tokens, compute = stats["tokens"], stats["compute_seconds"]
    summary = {
        "worker": cfg.name,
        "rank": cfg.data_rank,
        "steps": cfg.steps,
        "first_step": first,
        "resumed": resume is not None,
        "tokens": tokens,
        "eval_loss_start": stats["eval_loss_start"],
        "eval_loss": eval_loss,
        "bytes_sent": engine.bytes_sent,
        "bytes_received": engine.bytes_received,
        "message_bytes_sent": msg_out,  # protobuf messages, without gRPC/HTTP/2 framing
        "message_bytes_received": msg_in,  # including the Fetch of the masters
        "pushes": engine.pushes,
        "blocked_seconds": engine.blocked_seconds,
        "compute_seconds": compute,
        "eval_seconds": stats.get("eval_seconds", 0.0),  # --eval-every's evaluations, in train_seconds
        "train_seconds": train_seconds,
        "compute_utilization": compute / train_seconds if train_seconds > 0 else 0.0,
        "final_sync_seconds": stats.get("final_sync_seconds", 0.0),  # the last step's sync, in train_seconds
        "wall_seconds": time.perf_counter() - t_start,
        "mirror_hashes": digests,
        "late_refusals": sum(r.reason == "late" for link in transport.links for r in link.refusals),
        "reconnects": transport.reconnects,
        "pushes_resent": transport.resent,
        "merges": engine.merges,
        "merges_that_waited": engine.waits,
        "merges_later_than_tau": engine.late_merges,  # adaptive merges whose update came after t + tau
        # the schedule steps were `steps`; inner steps may be more with --sync-schedule adaptive (pace.py)
        "inner_steps": stats["inner_steps"],
        "inner_steps_per_tick": (stats["inner_steps"] - inner_before) / max(1, cfg.steps - first),
        "step_seconds": engine.step_seconds,  # median seconds per inner step (adaptive schedule only)
        "mean_merge_delay_steps": engine.merge_delay_steps / engine.merges if engine.merges else 0.0,
        "params_hash": params_digest(model),  # the local parameters: every rank of a group has the same
        "optimizer_hash": optimizer_digest(opt),
        "ranks": ge.size if ge is not None else 1,  # torchrun's ranks, trained as this one worker
        "group_broadcast_bytes": ge.broadcast_bytes if ge is not None else 0,  # merged parameters, in-site
        "group_seconds": ge.group_seconds if ge is not None else 0.0,  # rank 0 in the group's collectives
    }
    log.info(
        "%s done: eval loss %.4f (global params), %s tokens, sent %s B, received %s B, blocked %.2fs, "
        "compute %.0f%% of %.0fs",
        cfg.name,
        eval_loss,
        f"{tokens:,}",
        f"{engine.bytes_sent:,}",
        f"{engine.bytes_received:,}",
        engine.blocked_seconds,
        100 * summary["compute_utilization"],
        train_seconds,
    )
    if cfg.summary:
        Path(cfg.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.summary).write_text(json.dumps(summary, indent=2))
    if cfg.save_global:
        torch.save([m.clone() for m in engine.mirrors], cfg.save_global)
    return summary
