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
one training loop (`_train`, on every rank of a torchrun group: an inner step, the sync's step, and on the
leading rank one call to `Lead.after_step`, which keeps the statistics (`TrainStats`), evaluates, logs and
checkpoints), saves (`_finish`) and writes the summary (`Lead.summary`, from the statistics and the
engine's counters), in one place. The wire (worker/link.py, worker/transport.py) and the sync schedule
(worker/engine.py) are not done here.
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
from streamdiloco.worker.engine import StopRequested, SyncCounters, SyncEngine
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
        self._on_stop: Callable[[], None] | None = None  # the engine's request_stop: a waiting merge gives up

    def calls(self, on_stop: Callable[[], None]) -> None:
        """Call `on_stop` at the first signal (the engine's request_stop: a merge that waits gives up)."""
        self._on_stop = on_stop

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
        if self._on_stop is not None:
            self._on_stop()
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


@dataclass
class TrainStats:
    """What the training loop measures on the leading rank beside the engine's counters (the tokens and
    inner steps trained are the engine's: SyncCounters). A checkpoint keeps them as its "stats", with the
    engine's tokens and inner steps under the keys they always had there; the summary is built from them
    and the counters (Lead.summary)."""

    compute_seconds: float = 0.0  # in forward, backward and the optimizer step (and --step-delay's sleeps)
    train_seconds: float = 0.0  # training time before this process (a resumed run's; a checkpoint's: to it)
    eval_loss_start: float | None = None  # the global parameters' when this worker joined the run
    eval_seconds: float | None = None  # in --eval-every's evaluations, within train_seconds (None: none yet)
    final_sync_seconds: float | None = None  # in the last step's sync, within train_seconds (None: not yet)

    @classmethod
    def load(cls, state: dict | None) -> TrainStats:
        """A checkpoint's stats (None: a new worker's)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (state or {}).items() if k in names})

    def state_dict(self, counters: SyncCounters, train_seconds: float) -> dict[str, Any]:
        """The checkpoint's "stats" at `train_seconds` of training; the evaluations' and the final sync's
        seconds once there are some (as the stats always had them)."""
        state = {"tokens": counters.tokens, "inner_steps": counters.inner_steps, **dataclasses.asdict(self)}
        state["train_seconds"] = train_seconds
        return {k: v for k, v in state.items() if v is not None or k == "eval_loss_start"}


@dataclass(frozen=True)
class InnerStep:
    """One inner step and its sync as the loop saw them, for the leading rank's chores (Lead.after_step)."""

    before: int  # the schedule step it started at
    step: int  # the schedule step after its sync (the same within a schedule step: --sync-schedule adaptive)
    loss: float
    compute_seconds: float  # forward, backward and the optimizer step (and --step-delay's sleep)
    sync_seconds: float  # the sync's step after it
    stopped: bool  # a stop request ended it, at the sync (the step's other syncs go in the checkpoint)


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
        self.stats = TrainStats.load(resume["stats"] if resume is not None else None)
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
        stop.calls(engine.request_stop)
        self.metrics.joined(engine, transport)
        if self.resume is None:
            self.stats.eval_loss_start = eval_start
        else:  # a checkpoint from before the engine counted tokens and inner steps has them in its stats only
            counted = self.resume["engine"]["counters"]
            old = {k: v for k, v in self.resume["stats"].items() if k in ("tokens", "inner_steps")}
            engine.counters.load_state_dict({k: v for k, v in old.items() if k not in counted})
        if eval_start is not None:
            self.metrics.evaluated(eval_start)
            engine.report(eval_loss=eval_start)  # the eval curve's first point, at the joining step

    def start(self, t: Training) -> bool:
        """Training starts: the line that says how, the metrics, and the syncs of a resumed step that a
        stop interrupted (before any checkpoint). True: a stop interrupted them again."""
        cfg, engine = self.cfg, self.engine
        self.first = engine.step_count
        self.inner_before = engine.counters.inner_steps
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
        self.t_train0 = time.perf_counter() - self.stats.train_seconds
        self.metrics.training(self.stats, self.first)
        self.metrics.mark(self.stats.compute_seconds)
        try:
            engine.finish_step()  # a step's syncs that a stop interrupted, before the checkpoint
        except StopRequested:
            return True
        return False

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
        self.stats.eval_seconds = (self.stats.eval_seconds or 0.0) + seconds
        self.engine.report(eval_loss=loss)
        self.metrics.evaluated(loss)
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
        counts, el, loss = self.engine.counters, self.elapsed(), sum(self.recent) / len(self.recent)
        fields = {
            "step": step,
            "steps": self.cfg.run.steps,
            "loss": loss,
            "tokens_per_second": counts.tokens / el,
            "blocked_seconds": counts.blocked_seconds,
            "bytes_sent": counts.bytes_sent,
            "bytes_received": counts.bytes_received,
        }
        log.info(
            "%s step %d/%d  loss %.3f  %s tok/s  blocked %.1fs (%d of %d merges waited)  "
            "sent %s B  received %s B",
            self.cfg.name,
            step,
            self.cfg.run.steps,
            loss,
            f"{counts.tokens / el:,.0f}",
            counts.blocked_seconds,
            counts.waits,
            counts.merges,
            f"{counts.bytes_sent:,}",
            f"{counts.bytes_received:,}",
            extra=fields,
        )
        self.recent.clear()

    def after_step(self, t: Training, done: InnerStep) -> None:
        """The leading rank's chores after every inner step and its sync: the statistics and metrics, the
        compute utilization for the shards; and once a schedule step ends, the evaluation, the progress line
        and the checkpoint when they are due."""
        cfg, stats, step = self.cfg, self.stats, done.step
        stats.compute_seconds += done.compute_seconds
        if not done.stopped and self.engine.step_count == cfg.run.steps:
            stats.final_sync_seconds = done.sync_seconds  # every fragment once more, all waited for (once)
        self.recent.append(done.loss)
        self.metrics.stepped(step, done.loss)
        self.metrics.mark(stats.compute_seconds)
        self.engine.report(compute_utilization=stats.compute_seconds / self.elapsed())
        if (
            step == done.before
        ):  # an inner step within a schedule step: the schedule's chores wait for its end
            return
        due = step < cfg.run.steps and not done.stopped  # not after the last step: _finish does those
        if cfg.worker.eval_every and step % cfg.worker.eval_every == 0 and due:
            self.eval_global(t, step)
        if step % cfg.worker.log_every == 0 or step == cfg.run.steps:
            self.progress(step)
        if cfg.worker.checkpoint_every and step % cfg.worker.checkpoint_every == 0 and due:
            self.checkpoint(t)

    def stopped(self, t: Training, train_seconds: float) -> dict:
        """Stopped early: the pushes on the wire let through, the checkpoint; the short summary."""
        cfg, engine = self.cfg, self.engine
        self.metrics.to("stopped")
        answered = self.transport.flush(timeout=10.0)  # pushes on the wire: let the shards take them
        self.checkpoint(t, train_seconds)
        log.info(
            "%s: stopped at step %d of %d%s; checkpoint in %s: continue with --resume --name %s",
            cfg.name,
            engine.step_count,
            cfg.run.steps,
            "" if answered else " (some pushes unanswered: they are sent again on resume)",
            cfg.checkpoint_path,
            cfg.name,
        )
        return {
            "worker": cfg.name,
            "stopped_at_step": engine.step_count,
            "steps": cfg.run.steps,
            "checkpoint": str(cfg.checkpoint_path),
        }

    def final_eval(self, t: Training) -> float:
        """The eval loss of the global parameters at the end (after the final sync every fragment's mirror
        equals the masters), to the metrics and the loggers; the mirror's hashes in the log."""
        cfg, engine = self.cfg, self.engine
        eval_model = build_model(cfg.model.model, cfg.model.seed, cfg.model.block_size).to(t.device)
        for frag, vec in zip(engine.layout.fragments, engine.mirrors, strict=True):
            unflatten_into(vec, fragment_params(eval_model, frag))
        eval_loss = evaluate(eval_model, self.val, t.device)
        self.metrics.evaluated(eval_loss)
        self.metrics.to("finished")
        engine.report(eval_loss=eval_loss)  # to the loggers (no push carries it any more)
        return eval_loss

    def summary(self, t: Training, eval_loss: float, train_seconds: float, digests: list[list[str]]) -> dict:
        """The finished worker's summary: the run's figures from the statistics, the engine's counters and
        the transport's, and the state's hashes."""
        cfg, stats, counts, transport = self.cfg, self.stats, self.engine.counters, self.transport
        msg_out, msg_in = transport.message_bytes
        ge = t.sync if isinstance(t.sync, GroupEngine) else None
        return {
            "worker": cfg.name,
            "rank": cfg.data_rank,
            "steps": cfg.run.steps,
            "first_step": self.first,
            "resumed": self.resume is not None,
            "tokens": counts.tokens,
            "eval_loss_start": stats.eval_loss_start,
            "eval_loss": eval_loss,
            "bytes_sent": counts.bytes_sent,
            "bytes_received": counts.bytes_received,
            "message_bytes_sent": msg_out,  # protobuf messages, without gRPC/HTTP/2 framing
            "message_bytes_received": msg_in,  # including the Fetch of the masters
            "pushes": counts.pushes,
            "blocked_seconds": counts.blocked_seconds,
            "compute_seconds": stats.compute_seconds,
            "eval_seconds": stats.eval_seconds or 0.0,  # --eval-every's evaluations, in train_seconds
            "train_seconds": train_seconds,
            "compute_utilization": stats.compute_seconds / train_seconds if train_seconds > 0 else 0.0,
            "final_sync_seconds": stats.final_sync_seconds or 0.0,  # the last step's sync, in train_seconds
            "wall_seconds": time.perf_counter() - self.t_start,
            "mirror_hashes": digests,
            "late_refusals": sum(r.reason == "late" for link in transport.links for r in link.refusals),
            "reconnects": transport.reconnects,
            "pushes_resent": transport.resent,
            "merges": counts.merges,
            "merges_that_waited": counts.waits,
            "skips": counts.skips,  # times it fell whole rounds behind and went on from the run's step
            "skipped_steps": counts.skipped_steps,
            "merges_later_than_tau": counts.late_merges,  # adaptive merges whose update came after t + tau
            # the schedule steps were `steps`; inner steps may be more with --sync-schedule adaptive (pace.py)
            "inner_steps": counts.inner_steps,
            "inner_steps_per_tick": (counts.inner_steps - self.inner_before)
            / max(1, cfg.run.steps - self.first),
            "step_seconds": self.engine.pacer.step_seconds,  # median seconds per inner step (adaptive only)
            "mean_merge_delay_steps": counts.merge_delay_steps / counts.merges if counts.merges else 0.0,
            "params_hash": params_digest(t.model),  # the local parameters: every rank of a group has the same
            "optimizer_hash": optimizer_digest(t.opt),
            "ranks": ge.size if ge is not None else 1,  # torchrun's ranks, trained as this one worker
            "group_broadcast_bytes": ge.broadcast_bytes
            if ge is not None
            else 0,  # merged parameters, in-site
            "group_seconds": ge.group_seconds if ge is not None else 0.0,  # rank 0 in the group's collectives
        }

    def checkpoint(self, t: Training, train_seconds: float | None = None) -> None:
        cfg = self.cfg
        state = checkpoint_state(
            cfg,
            t.group.size if t.group is not None else 1,
            self.stats.state_dict(
                self.engine.counters, self.elapsed() if train_seconds is None else train_seconds
            ),
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

    def joined(self, sync: SyncEngine | GroupEngine, trained: torch.nn.Module) -> None:
        self.sync, self.trained = sync, trained

    @property
    def synced(self) -> SyncEngine | GroupEngine:
        assert self.sync is not None, "the worker has not joined"
        return self.sync

    @property
    def step_count(self) -> int:
        """The schedule's step: the engine's on the leading rank, rank 0's (as last told) on the others."""
        if self.lead is not None:
            return self.lead.engine.step_count
        return self.synced.step_count

    def inner_step(self, xs: torch.Tensor, ys: torch.Tensor, step: int) -> float:
        """Forward, backward and the inner optimizer's step on this rank's part of the worker's batch (a
        group's ranks together: DDP averages their gradients); returns the loss."""
        cfg, group = self.cfg, self.group
        assert self.trained is not None, "the worker has not joined"
        with group.guard(f"step {step + 1}") if group is not None else contextlib.nullcontext():
            loss = forward_backward(
                self.trained,
                xs.to(self.device),
                ys.to(self.device),
                cfg.worker.grad_accum,
                cfg.worker.precision,
            )
            optimizer_step(self.model, self.opt, cfg.inner)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss

    def sync_step(self, tokens: int, loss: float) -> bool:
        """The sync's hook after an inner step: the engine's, or the group's on every rank (which stops
        together once a rank was asked to). True: stopped (while it waited for an update, or the group)."""
        try:
            if isinstance(self.sync, GroupEngine):
                self.sync.step(tokens=tokens, loss=loss, stop=self.stop.event.is_set())
            else:
                self.synced.step(tokens=tokens, loss=loss)
        except StopRequested:  # the rest of the step's syncs go in the checkpoint
            return True
        return False


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
        stack.callback(t.synced.close)
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
    """Join every shard (rank 0) or follow rank 0's joining (the other ranks); give `t` its sync and what it
    trains (t.joined), and share rank 0's resumed optimizer and data with every rank. False: stopped while
    joining."""
    cfg, lead, group = t.cfg, t.lead, t.group
    if lead is not None:
        log.info("%s: joining %d shard(s): %s", cfg.name, len(cfg.servers), ", ".join(cfg.servers))
    eval_start: list[float] = []
    sync: SyncEngine | GroupEngine
    try:
        if lead is None:
            assert group is not None
            sync = connect_group(t.model, list(cfg.servers), cfg.sync, process_group=group.pg)
        else:
            sync = (connect if group is None else connect_group)(
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
            lead.metrics.to("stopped")
            log.info("%s: stopped before training started", cfg.name)
        return False
    start = _share_start(group, resume) if group is not None else resume
    if lead is not None:
        engine = sync.engine if isinstance(sync, GroupEngine) else sync  # rank 0 syncs for every rank
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
    t.joined(sync, _ddp(t.model, group, t.device) if group is not None else t.model)
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
    """The training loop, on every rank: inner steps, each followed by the sync's step; after each, the
    leading rank's chores (Lead.after_step: statistics, evaluation, progress, checkpoints). Returns whether
    it stopped early."""
    cfg, lead = t.cfg, t.lead
    stopped = lead.start(t) if lead is not None else False
    step = t.step_count
    while step < cfg.run.steps and not stopped:
        if t.stop.event.is_set() and t.group is None:  # a group stops together, after the step (sync_step)
            return True
        t0 = time.perf_counter()
        set_lr(t.opt, lr_at(step, cfg.run.steps, cfg.inner))
        try:
            x, y = t.stream.next()
        except StopRequested:  # waiting for a piece of the data (--data-pieces)
            return True
        xs, ys = batch_slice(x, t.group), batch_slice(y, t.group)  # this rank's part of the worker's batch
        loss = t.inner_step(xs, ys, step)
        compute = time.perf_counter() - t0
        t_sync = time.perf_counter()
        stopped = t.sync_step(xs.numel(), loss)
        sync_seconds = time.perf_counter() - t_sync
        if cfg.worker.step_delay:  # an emulated accelerator step: counted as compute (the GPU would be busy)
            t_delay = time.perf_counter()
            time.sleep(cfg.worker.step_delay)
            compute += time.perf_counter() - t_delay
        # `step` counts the schedule's steps (rank 0's): one per inner step, or with --sync-schedule adaptive
        # one per engine.per_tick inner steps (a faster site does more of them: common/pace.py)
        before, step = step, t.step_count
        if lead is not None:
            lead.after_step(t, InnerStep(before, step, loss, compute, sync_seconds, stopped))
    return stopped


def _finish(t: Training, stopped: bool) -> dict:
    """After the loop: the last syncs, the checkpoint, the final evaluation; the summary to return."""
    cfg, lead = t.cfg, t.lead
    if lead is None:  # another rank of a group: its parameters and optimizer, to compare with rank 0's
        if not stopped:
            t.synced.drain()
        return {
            "worker": cfg.name,
            **_rank_of(t),
            "stopped_at_step": t.step_count if stopped else None,
            "params_hash": params_digest(t.model),  # equal on every rank: they hold rank 0's parameters
            "optimizer_hash": optimizer_digest(t.opt),  # equal on every rank: the same gradients every step
        }
    engine, train_seconds = lead.engine, lead.elapsed()
    pieces = t.stream if isinstance(t.stream, PieceStream) else None
    if pieces is not None:  # the last batch was trained: its finished pieces are reported (not if stopped)
        if not stopped and not pieces.finish():
            log.warning("%s: shard 0 did not answer the last pieces' done report", cfg.name)
        pieces.close()
    if stopped:
        return lead.stopped(t, train_seconds)
    t.synced.drain()  # only does something with --no-final-sync
    lead.checkpoint(t, train_seconds)  # the finished state: --resume then has nothing left to do
    eval_loss = lead.final_eval(t)
    digests = mirror_digests(engine)
    for f, hs in enumerate(digests):
        log.info(
            "%s mirror fragment %d: %s", cfg.name, f, " ".join(f"shard{s}={h}" for s, h in enumerate(hs))
        )
    summary = lead.summary(t, eval_loss, train_seconds, digests)
    if pieces is not None:  # --data-pieces: the pieces it trained to the end, as shard 0's ledger took them
        summary["data"] = pieces.summary()
    counts = engine.counters
    log.info(
        "%s done: eval loss %.4f (global params), %s tokens, sent %s B, received %s B, blocked %.2fs, "
        "compute %.0f%% of %.0fs",
        cfg.name,
        eval_loss,
        f"{counts.tokens:,}",
        f"{counts.bytes_sent:,}",
        f"{counts.bytes_received:,}",
        counts.blocked_seconds,
        100 * summary["compute_utilization"],
        train_seconds,
    )
    if cfg.save_global:
        torch.save([m.clone() for m in engine.mirrors], cfg.save_global)
    return summary
