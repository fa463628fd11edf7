"""The worker process: `streamdiloco worker --servers HOST:PORT,...`.

Join every shard, fetch the masters (local = mirror = master), then train: AdamW inner steps, and after each
one the sync engine's hook, which pushes fragments in the background and merges their updates tau steps
later. Progress every --log-every steps; every --eval-every steps the eval loss of the global parameters
(the mirror), reported to the shards with the next pushes (their dashboards plot it); at the end the eval
loss once more, the mirror's hashes (compare them with the shards' /api/status) and a JSON summary.
Scalars also go to `ScalarLogger`s (worker/report.py), through the engine as for connect()'s users:
TensorBoard with --tensorboard DIR, W&B with --wandb-project NAME, or your own.

Read it top to bottom as nanoGPT's train.py: `run_worker` makes the context (`_run_worker`: the checkpoint
to resume, the model, the data, the optimizer, and a `Training` that holds them), joins (`_join`), runs the
one training loop (`_train`, on every rank of a torchrun group: the leading rank's `Lead` also keeps the
statistics, evaluates, logs and checkpoints), saves (`_finish`) and writes the summary, in one place.
The wire (worker/link.py, worker/transport.py) and the sync schedule (worker/engine.py) are not done here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamdiloco.common.fragments import fragment_params, unflatten_into
from streamdiloco.common.modelspec import build_model, check_vocab, model_block_size
from streamdiloco.common.tls import client_tls
from streamdiloco.worker.checkpoint import (
    checkpoint_state,
    mirror_digests,
    optimizer_digest,
    params_digest,
    resume_from,
    save_checkpoint,
)
from streamdiloco.worker.config import WorkerConfig
from streamdiloco.worker.data import eval_batches, load_tokens
from streamdiloco.worker.engine import StopRequested, SyncEngine
from streamdiloco.worker.group import GroupEngine, RankGroup, batch_slice, connect_group, group_from_env
from streamdiloco.worker.join import connect
from streamdiloco.worker.metrics import WorkerMetrics
from streamdiloco.worker.pieces import PieceStream, ShardPieces, TokenStream, make_stream, token_sha256
from streamdiloco.worker.report import ScalarLogger, TensorBoardLogger, WandbLogger
from streamdiloco.worker.train import (
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
    """Train as `cfg` says and return the summary (also written to cfg.summary); `loggers` get the worker's
    scalars too (with --tensorboard a TensorBoardLogger is added, with --wandb-project a WandbLogger).
    Started by torchrun (WORLD_SIZE > 1), the ranks are one worker (worker/group.py): rank 0 joins, syncs,
    logs and checkpoints; each rank trains on its slice of the worker's batch (size x --batch-size)."""
    t_start = time.perf_counter()
    group, device_name = group_from_env(cfg.run.device, cfg.worker.rank_timeout)
    try:
        summary = _run_worker(cfg, loggers, t_start, group, device_name)
    finally:
        if group is not None:
            with contextlib.suppress(Exception):  # a broken group: nothing more to say to the others
                torch.distributed.destroy_process_group()
    if cfg.summary:  # rank 0's, and beside it the other ranks': NAME.json.rank1, ...
        path = Path(cfg.summary if group is None or group.leads else f"{cfg.summary}.rank{group.rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
    return summary


class Lead:
    """What the worker's leading rank (rank 0 of a group, or the only one) keeps beside the training: the
    statistics the summary and checkpoint carry, the metrics and loggers, the evaluations of the global
    parameters and the progress lines. The other ranks of a group have none of it."""

    def __init__(
        self,
        cfg: WorkerConfig,
        val: list,
        resume: dict | None,
        metrics: WorkerMetrics,
        loggers: list[ScalarLogger],
        t_start: float,
    ) -> None:
        self.cfg, self.val, self.resume, self.metrics, self.loggers = cfg, val, resume, metrics, loggers
        self.t_start = t_start
        self.stats: dict[str, Any] = {
            "tokens": 0,
            "inner_steps": 0,
            "compute_seconds": 0.0,
            "train_seconds": 0.0,
            "eval_loss_start": None,
            **(resume["stats"] if resume is not None else {}),
        }
        self.recent: list[float] = []  # train losses since the last progress line
        self.first = 0  # the schedule step training starts at (a resumed worker's is later)
        self.inner_before = 0  # a resumed run's earlier inner steps
        self.t_train0 = 0.0  # when training started, less a resumed run's train seconds
        self._engine: SyncEngine | None = None
        self._transport: GrpcTransport | None = None
        self._eval_model: torch.nn.Module | None = None

    @property
    def engine(self) -> SyncEngine:
        assert self._engine is not None, "the worker has not joined"
        return self._engine

    @property
    def transport(self) -> GrpcTransport:
        assert self._transport is not None, "the worker has not joined"
        return self._transport

    def joined(self, engine: SyncEngine, stop: StopFlag, eval_start: float | None) -> None:
        transport = engine.transport
        assert isinstance(transport, GrpcTransport)
        self._engine, self._transport = engine, transport
        transport.on_push_answered(self.metrics.push_answer.observe)
        engine.on_merge(waited=self.metrics.merge_wait.observe)
        stop.on_stop = engine.request_stop
        self.metrics.engine, self.metrics.transport = engine, transport
        if self.resume is None:
            self.stats["eval_loss_start"] = eval_start
        if eval_start is not None:
            self.metrics.eval_loss = eval_start
            engine.report(eval_loss=eval_start)  # the eval curve's first point, at the joining step

    def start(self, t: Training) -> None:
        cfg, engine = self.cfg, self.engine
        self.first = engine.step_count
        self.inner_before = self.stats.get("inner_steps", 0)
        log.info(
            "%s: %s params in %d fragments over %d shards; H=%d tau=%d alpha=%g %s/%s; "
            "steps %d..%d of %s%d x %d tokens%s%s",
            cfg.name,
            f"{sum(p.numel() for p in t.model.parameters()):,}",
            engine.layout.num_fragments,
            self.transport.num_shards,
            engine.cfg.sync_every,  # the settings in force: this worker's, and the shard's for those it left
            engine.cfg.fragment_sync_delay,
            engine.cfg.fragment_update_alpha,
            engine.cfg.uplink_codec,
            engine.cfg.downlink_codec,
            self.first + 1,
            cfg.run.steps,
            f"{cfg.worker.grad_accum} x " if cfg.worker.grad_accum > 1 else "",
            cfg.run.batch_size,
            t.stream.block_size,
            ", bf16 autocast" if cfg.worker.precision == "bf16" else "",
            f" (resumed from {cfg.checkpoint_path})" if self.resume is not None else "",
        )
        self.t_train0 = time.perf_counter() - self.stats["train_seconds"]
        self.metrics.stats, self.metrics.step, self.metrics.phase = self.stats, self.first, "training"
        self.metrics.mark(self.stats["compute_seconds"])

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_train0

    def eval_global(self, t: Training, step: int) -> float:
        """The eval loss of the global parameters (the mirror, as of now), in a second model: the local
        parameters stay as they are. Reported to the shards with the next pushes, and to the loggers."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if self._eval_model is None:
            self._eval_model = build_model(cfg.model.model, cfg.model.seed, cfg.model.block_size).to(t.device)
        self._eval_model.load_state_dict(self.engine.global_state_dict())
        loss = evaluate(self._eval_model, self.val, t.device)
        seconds = time.perf_counter() - t0
        self.stats["eval_seconds"] = self.stats.get("eval_seconds", 0.0) + seconds
        self.engine.report(eval_loss=loss)
        self.metrics.eval_loss = loss
        log.info(
            "%s step %d/%d  eval loss %.4f (global params, %.2f s)",
            cfg.name,
            step,
            cfg.run.steps,
            loss,
            seconds,
            extra={"step": step, "steps": cfg.run.steps, "eval_loss": loss},
        )
        return loss

    def progress(self, step: int) -> None:
        """The progress line, every --log-every steps (the loggers get the engine's scalars: TrackedScalars);
        with --log-format json its figures are the record's fields too."""
        engine, el, loss = self.engine, self.elapsed(), sum(self.recent) / len(self.recent)
        fields = {
            "step": step,
            "steps": self.cfg.run.steps,
            "loss": loss,
            "tokens_per_second": self.stats["tokens"] / el,
            "blocked_seconds": engine.blocked_seconds,
            "bytes_sent": engine.bytes_sent,
            "bytes_received": engine.bytes_received,
        }
        log.info(
            "%s step %d/%d  loss %.3f  %s tok/s  blocked %.1fs (%d of %d merges waited)  "
            "sent %s B  received %s B",
            self.cfg.name,
            step,
            self.cfg.run.steps,
            loss,
            f"{self.stats['tokens'] / el:,.0f}",
            engine.blocked_seconds,
            engine.waits,
            engine.merges,
            f"{engine.bytes_sent:,}",
            f"{engine.bytes_received:,}",
            extra=fields,
        )
        self.recent.clear()

    def checkpoint(self, t: Training, train_seconds: float | None = None) -> None:
        cfg = self.cfg
        state = checkpoint_state(
            cfg,
            t.group.size if t.group is not None else 1,
            {**self.stats, "train_seconds": self.elapsed() if train_seconds is None else train_seconds},
            params=t.model.state_dict(),
            optimizer=t.opt.state_dict(),
            data=t.stream.state_dict(),
            engine=self.engine.state_dict(),
            links=self.transport.state_dict(),
        )
        save_checkpoint(cfg.checkpoint_path, state)

    def close(self) -> None:
        self.metrics.close()
        if self._engine is None:  # never joined: the engine that would close them was not made
            for logger in self.loggers:
                logger.close()


@dataclass
class Training:
    """One worker's training, as the loop reads it: the model and what trains it, its data, the stop flag,
    and the sync (`sync`: the engine, or the group's GroupEngine; stepped after every inner step). `lead`:
    the leading rank's part (None on the other ranks of a group)."""

    cfg: WorkerConfig
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    stream: TokenStream
    device: torch.device
    stop: StopFlag
    group: RankGroup | None
    lead: Lead | None
    trained: torch.nn.Module | None = None  # what forward/backward runs: the model, or DDP over the ranks
    sync: SyncEngine | GroupEngine | None = None

    @property
    def step_count(self) -> int:
        """The schedule's step: the engine's on the leading rank, rank 0's (as last told) on the others."""
        if self.lead is not None:
            return self.lead.engine.step_count
        assert self.sync is not None
        return self.sync.step_count


def _run_worker(
    cfg: WorkerConfig,
    loggers: Sequence[ScalarLogger],
    t_start: float,
    group: RankGroup | None,
    device_name: str,
) -> dict:
    # --- context: the settings, the checkpoint to resume, the model, the data
    leads = group is None or group.leads
    if group is not None:  # the default name is host-pid: every rank takes rank 0's (it seeds the data)
        cfg = dataclasses.replace(
            cfg, name=group.share(cfg.name), run=dataclasses.replace(cfg.run, device=device_name)
        )
        if not leads:
            logging.getLogger("streamdiloco").setLevel(logging.WARNING)  # rank 0 speaks for the worker
    device = torch.device(cfg.run.device)
    ranks = group.size if group is not None else 1
    resume = resume_from(cfg, group)
    model = build_model(cfg.model.model, cfg.model.seed, cfg.model.block_size)
    block = model_block_size(model, cfg.model.block_size)
    data = load_tokens(cfg.run.data, block)
    check_vocab(model, data.vocab_size, cfg.model.model, data.what)  # every id of the data is a token
    batch = cfg.run.batch_size * ranks  # the worker's batch, all its ranks' together: each trains its slice
    val = eval_batches(data.val, batch, block, cfg.run.eval_batches)
    # an inner step's batch: --grad-accum micro-batches of that (worker/train.py's forward_backward);
    # with --data-pieces shard 0 assigns the pieces of the train split (worker/pieces.py)
    stream = make_stream(
        data,
        batch * cfg.worker.grad_accum,
        block,
        name=cfg.name,
        seed=cfg.model.seed,
        rank=cfg.data_rank,
        pieces=cfg.pieces.data_pieces,
        ranks=ranks,
    )
    if resume is not None:
        model.load_state_dict(resume["params"])
        stream.load_state_dict(resume["data"])
    model.to(device)
    if leads:
        x, y = val[0]
        check_model_output(model, x.to(device), y.to(device), cfg.model.model)  # before any shard hears of us
    # made now, not after joining: building AdamW the first time takes about a second, which a joiner
    # must not spend while the others already wait for its first push
    opt = make_inner_optimizer(model, cfg.inner)
    lead = None
    if leads:
        loggers = list(loggers)
        if cfg.worker.tensorboard:
            loggers.append(TensorBoardLogger(cfg.worker.tensorboard))
        if cfg.worker.wandb_project:
            loggers.append(
                WandbLogger(cfg.worker.wandb_project, cfg.wandb_run_name or cfg.name, _tracked(cfg))
            )
        lead = Lead(
            cfg,
            val,
            resume,
            WorkerMetrics(cfg.name, cfg.model.model, str(device), cfg.run.steps),
            loggers,
            t_start,
        )
    t = Training(cfg, model, opt, stream, device, StopFlag(), group, lead)
    with contextlib.ExitStack() as stack:  # whatever happens: the sessions closed, the signals restored
        if lead is not None:
            stack.callback(lead.close)
            if cfg.metrics_port is not None:
                lead.metrics.serve(cfg.metrics_port, cfg.metrics_host)
        t.stop.install()
        stack.callback(t.stop.restore)
        # --- join: every shard's masters, or rank 0's word in a group
        if not _join(t, resume, val):
            return {"worker": cfg.name, **_rank_of(t), "stopped_at_step": None, "steps": cfg.run.steps}
        assert t.sync is not None
        stack.callback(t.sync.close)
        # --- the loop, then save
        stopped = _train(t)
        return _finish(t, stopped)
    raise AssertionError("unreachable")  # for mypy: the with block returns


def _tracked(cfg: WorkerConfig) -> dict:
    """The settings an experiment tracker records with the run (no token, no paths of this machine)."""
    sections = {s: dataclasses.asdict(getattr(cfg, s)) for s in ("model", "run", "sync", "inner")}
    return {"worker": cfg.name, "servers": list(cfg.servers), **sections}


def _rank_of(t: Training) -> dict:
    return {"group_rank": t.group.rank} if t.group is not None and t.lead is None else {}


def _join(t: Training, resume: dict | None, val: list) -> bool:
    """Join every shard (rank 0) or follow rank 0's joining (the other ranks); set t.sync and t.trained and
    share rank 0's resumed optimizer and data with every rank. False: stopped while joining."""
    cfg, lead, group = t.cfg, t.lead, t.group
    if lead is not None:
        log.info("%s: joining %d shard(s): %s", cfg.name, len(cfg.servers), ", ".join(cfg.servers))
    eval_start: list[float] = []
    try:
        if lead is None:
            assert group is not None
            t.sync = connect_group(t.model, list(cfg.servers), cfg.sync, process_group=group.pg)
        else:
            t.sync = (connect if group is None else connect_group)(
                t.model,
                list(cfg.servers),
                cfg.sync,
                total_steps=cfg.run.steps,
                name=cfg.name,
                token=cfg.token,
                tls=client_tls(cfg.tls_ca, cfg.tls_cert, cfg.tls_key),
                seed=cfg.model.seed,
                rank=cfg.data_rank,
                join_timeout=cfg.worker.join_timeout,
                reconnect_timeout=cfg.worker.reconnect_timeout,
                link=cfg.link,
                resume=resume,
                interrupt=t.stop.event,
                # the global params as fetched
                prepare=lambda: eval_start.append(evaluate(t.model, val, t.device)),
                blocks_path=cfg.model.blocks_path,
                fragments=cfg.model.fragment_groups,
                sync_set=cfg.sync_set,
                loggers=lead.loggers,  # the engine feeds them (worker/report.py TrackedScalars)
                log_every=cfg.worker.log_every,
            )
    except StopRequested:  # stopped while it joined: nothing trained, nothing to save
        if lead is not None:
            lead.metrics.phase = "stopped"
            log.info("%s: stopped before training started", cfg.name)
        return False
    start = _share_start(group, resume) if group is not None else resume
    if lead is not None:
        engine = t.sync.engine if isinstance(t.sync, GroupEngine) else t.sync  # rank 0 syncs for every rank
        assert engine is not None
        lead.joined(engine, t.stop, eval_start[0] if eval_start else None)
        # what set-up made (torch, the model, the data) stays: out of the collector's sight, so that a full
        # collection does not hold the GIL, which the sync threads need, for a tenth of a second mid-run
        gc.collect()
        gc.freeze()
    if start is not None:
        t.opt.load_state_dict(start["optimizer"])
        if lead is None:  # rank 0 loaded its own before joining
            t.stream.load_state_dict(start["data"])
    t.trained = _ddp(t.model, group, t.device) if group is not None else t.model
    if isinstance(t.stream, PieceStream) and lead is not None:  # shard 0's ledger, over the link to it
        train = t.stream.data
        t.stream.start(
            ShardPieces(lead.transport.links[0].conn, len(train), t.stream.sha256 or token_sha256(train)),
            t.stop.event,
        )
    return True


def _share_start(group: RankGroup, resume: dict | None) -> dict | None:
    """Rank 0's resumed optimizer and data stream, to every rank (the checkpoint is rank 0's file)."""
    return group.share(None if resume is None else {"optimizer": resume["optimizer"], "data": resume["data"]})


def _ddp(model: torch.nn.Module, group: RankGroup, device: torch.device) -> torch.nn.Module:
    """The model as the ranks train it: DDP averages the gradients over the group in backward()."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    with group.guard("start-up"):  # DDP's constructor checks the ranks' models against each other
        return DistributedDataParallel(model, device_ids=ids, process_group=group.pg)


def _train(t: Training) -> bool:
    """The training loop, on every rank: inner steps, each followed by the sync's step; the leading rank
    also keeps the statistics, evaluates, logs and checkpoints. Returns whether it stopped early."""
    cfg, lead, group, stop = t.cfg, t.lead, t.group, t.stop
    sync, trained = t.sync, t.trained
    assert sync is not None and trained is not None
    ge = sync if isinstance(sync, GroupEngine) else None
    stopped = False
    if lead is not None:
        lead.start(t)
        try:
            lead.engine.finish_step()  # a step's syncs that a stop interrupted, before the checkpoint
        except StopRequested:
            stopped = True
    step = t.step_count
    while step < cfg.run.steps and not stopped:
        if stop.event.is_set() and ge is None:  # a group stops together, after the step (GroupEngine.step)
            stopped = True
            break
        t0 = time.perf_counter()
        set_lr(t.opt, lr_at(step, cfg.run.steps, cfg.inner))
        try:
            x, y = t.stream.next()
        except StopRequested:  # waiting for a piece of the data (--data-pieces)
            stopped = True
            break
        xs, ys = batch_slice(x, group), batch_slice(y, group)  # this rank's part of the worker's batch
        with group.guard(f"step {step + 1}") if group is not None else contextlib.nullcontext():
            loss = forward_backward(
                trained, xs.to(t.device), ys.to(t.device), cfg.worker.grad_accum, cfg.worker.precision
            )
            optimizer_step(t.model, t.opt, cfg.inner)
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
        before = step
        if lead is not None:
            stats = lead.stats
            stats["compute_seconds"] += time.perf_counter() - t0
            stats["tokens"] += x.numel()
            stats["inner_steps"] = stats.get("inner_steps", 0) + 1
            lead.recent.append(loss)
            # `step` counts the schedule's steps: one per inner step, or with --sync-schedule adaptive one
            # per engine.per_tick inner steps (a faster site does more of them: common/pace.py)
            if lead.engine.cfg.sync_schedule != "adaptive":
                step += 1
            lead.metrics.step, lead.metrics.loss = step, loss
            lead.metrics.mark(stats["compute_seconds"])
        try:
            t_sync = time.perf_counter()
            if ge is not None:
                ge.step(tokens=xs.numel(), loss=loss, stop=stop.event.is_set())
            else:
                assert isinstance(sync, SyncEngine)
                sync.step(tokens=x.numel(), loss=loss)
            # the final sync: every fragment once more, all waited for (once a run)
            if lead is not None and lead.engine.step_count == cfg.run.steps:
                lead.stats["final_sync_seconds"] = time.perf_counter() - t_sync
        except StopRequested:  # waiting for an update: the rest of the step's syncs go in the checkpoint
            stopped = True
        step = t.step_count  # rank 0's schedule step (with --sync-schedule adaptive, not every inner step)
        if lead is not None:
            lead.metrics.step = step
        if cfg.worker.step_delay:  # an emulated accelerator step: counted as compute (the GPU would be busy)
            t_delay = time.perf_counter()
            time.sleep(cfg.worker.step_delay)
            if lead is not None:
                lead.stats["compute_seconds"] += time.perf_counter() - t_delay
        if lead is None:
            continue
        lead.engine.report(compute_utilization=lead.stats["compute_seconds"] / lead.elapsed())
        if step == before:  # an inner step within a schedule step: the schedule's chores wait for its end
            continue
        if (
            cfg.worker.eval_every
            and step % cfg.worker.eval_every == 0
            and step < cfg.run.steps
            and not stopped
        ):
            lead.eval_global(t, step)
        if step % cfg.worker.log_every == 0 or step == cfg.run.steps:
            lead.progress(step)
        every = cfg.worker.checkpoint_every
        if every and step % every == 0 and step < cfg.run.steps and not stopped:
            lead.checkpoint(t)
    return stopped


def _finish(t: Training, stopped: bool) -> dict:
    """After the loop: the last syncs, the checkpoint, the final evaluation; the summary to return."""
    cfg, lead, sync = t.cfg, t.lead, t.sync
    assert sync is not None
    if lead is None:  # another rank of a group: its parameters and optimizer, to compare with rank 0's
        if not stopped:
            sync.drain()
        return {
            "worker": cfg.name,
            **_rank_of(t),
            "stopped_at_step": t.step_count if stopped else None,
            "params_hash": params_digest(t.model),  # equal on every rank: they hold rank 0's parameters
            "optimizer_hash": optimizer_digest(t.opt),  # equal on every rank: the same gradients every step
        }
    engine, transport, stats = lead.engine, lead.transport, lead.stats
    train_seconds = lead.elapsed()
    path = cfg.checkpoint_path
    pieces = t.stream if isinstance(t.stream, PieceStream) else None
    if pieces is not None:  # the last batch was trained: its finished pieces are reported (not if stopped)
        if not stopped and not pieces.finish():
            log.warning("%s: shard 0 did not answer the last pieces' done report", cfg.name)
        pieces.close()
    if stopped:
        lead.metrics.phase = "stopped"
        answered = transport.flush(timeout=10.0)  # pushes on the wire: let the shards take them
        lead.checkpoint(t, train_seconds)
        log.info(
            "%s: stopped at step %d of %d%s; checkpoint in %s: continue with --resume --name %s",
            cfg.name,
            engine.step_count,
            cfg.run.steps,
            "" if answered else " (some pushes unanswered: they are sent again on resume)",
            path,
            cfg.name,
        )
        return {
            "worker": cfg.name,
            "stopped_at_step": engine.step_count,
            "steps": cfg.run.steps,
            "checkpoint": str(path),
        }
    sync.drain()  # only does something with --no-final-sync
    lead.checkpoint(t, train_seconds)  # the finished state: --resume then has nothing left to do
    # the global parameters: after the final sync every fragment's mirror equals the masters
    eval_model = build_model(cfg.model.model, cfg.model.seed, cfg.model.block_size).to(t.device)
    for frag, vec in zip(engine.layout.fragments, engine.mirrors, strict=True):
        unflatten_into(vec, fragment_params(eval_model, frag))
    eval_loss = evaluate(eval_model, lead.val, t.device)
    lead.metrics.eval_loss, lead.metrics.phase = eval_loss, "finished"
    engine.report(eval_loss=eval_loss)  # to the loggers (no push carries it any more)
    digests = mirror_digests(engine)
    for f, hs in enumerate(digests):
        log.info(
            "%s mirror fragment %d: %s", cfg.name, f, " ".join(f"shard{s}={h}" for s, h in enumerate(hs))
        )
    msg_out, msg_in = transport.message_bytes
    tokens, compute = stats["tokens"], stats["compute_seconds"]
    ge = sync if isinstance(sync, GroupEngine) else None
    summary = {
        "worker": cfg.name,
        "rank": cfg.data_rank,
        "steps": cfg.run.steps,
        "first_step": lead.first,
        "resumed": lead.resume is not None,
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
        "wall_seconds": time.perf_counter() - lead.t_start,
        "mirror_hashes": digests,
        "late_refusals": sum(r.reason == "late" for link in transport.links for r in link.refusals),
        "reconnects": transport.reconnects,
        "pushes_resent": transport.resent,
        "merges": engine.merges,
        "merges_that_waited": engine.waits,
        "skips": engine.skips,  # times it fell whole rounds behind and went on from the run's step
        "skipped_steps": engine.skipped_steps,
        "merges_later_than_tau": engine.late_merges,  # adaptive merges whose update came after t + tau
        # the schedule steps were `steps`; inner steps may be more with --sync-schedule adaptive (pace.py)
        "inner_steps": stats["inner_steps"],
        "inner_steps_per_tick": (stats["inner_steps"] - lead.inner_before)
        / max(1, cfg.run.steps - lead.first),
        "step_seconds": engine.pacer.step_seconds,  # median seconds per inner step (adaptive schedule only)
        "mean_merge_delay_steps": engine.merge_delay_steps / engine.merges if engine.merges else 0.0,
        "params_hash": params_digest(t.model),  # the local parameters: every rank of a group has the same
        "optimizer_hash": optimizer_digest(t.opt),
        "ranks": ge.size if ge is not None else 1,  # torchrun's ranks, trained as this one worker
        "group_broadcast_bytes": ge.broadcast_bytes if ge is not None else 0,  # merged parameters, in-site
        "group_seconds": ge.group_seconds if ge is not None else 0.0,  # rank 0 in the group's collectives
    }
    if pieces is not None:  # --data-pieces: the pieces it trained to the end, as shard 0's ledger took them
        summary["data"] = pieces.summary()
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
    if cfg.save_global:
        torch.save([m.clone() for m in engine.mirrors], cfg.save_global)
    return summary
