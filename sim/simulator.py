"""The in-process simulator: M workers and the shards' aggregation in one process, plus a data-parallel
baseline, built from the same pieces as the distributed system (worker.engine.SyncEngine, server.shard.
ShardState, worker.train), not from a second copy of the algorithm.

Workers run in lock-step, each driving its engine as a worker process does (`engine.step()` after every
inner step), without a sync thread: every worker trains through its schedule step, whose sends (and the
merges whose rounds have closed) its engine does at once; then each finishes its step (`finish_step()`) with
the merges that waited for the later workers' pushes (tau = 0, the final sync), so a round has all its
pushes before anyone needs its update.

Sites of unequal speed (`step_seconds`, one per worker: the emulated seconds of its inner step): the
schedule's steps stay in lock-step, and with sync_schedule "adaptive" each engine paces itself as a
worker's does (common/pace.py), told its emulated step time and the slowest one as the run's pace. The
simulated wall time of a schedule step is the slowest worker's time for its inner steps of that step, so
two runs compare at equal wall time at equal schedule steps; each worker's compute utilization is its
compute over that time.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from streamdiloco.common.codecs import Encoded
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import (
    FragmentLayout,
    build_layout,
    flatten,
    fragment_params,
    unflatten_into,
)
from streamdiloco.common.modelspec import build_model, model_block_size
from streamdiloco.common.pace import pace_seconds
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.sim.config import SimConfig
from streamdiloco.worker.data import BatchStream, ByteDataset, eval_batches
from streamdiloco.worker.engine import SyncEngine
from streamdiloco.worker.train import (
    evaluate,
    forward_backward,
    lr_at,
    make_inner_optimizer,
    optimizer_step,
    set_lr,
)


class InProcessCluster:
    """The shards' logic for M in-process workers: a round closes once every member has pushed."""

    def __init__(
        self,
        layout: FragmentLayout,
        cfg: SyncConfig,
        initial: list[torch.Tensor],
        num_shards: int,
        members: list[str],
        seed: int,
        robust: RobustConfig | None = None,
        pace: float = 0.0,
    ):
        self.shards = [
            ShardState(s, num_shards, layout, cfg, initial, seed, robust=robust) for s in range(num_shards)
        ]
        self.members = set(members)
        self.updates: dict[tuple[int, int], Future] = {}  # each round's update, one Encoded per shard
        self.round_losses: list[tuple[int, int, float]] = []
        self.pace_seconds = pace  # what the shards answer pushes with: the slowest member's step time

    def push(
        self,
        worker: str,
        fragment: int,
        round: int,
        slices: list[Encoded],
        weight: float,
        loss: float | None,
        step_seconds: float | None = None,
    ) -> None:
        for shard, enc in zip(self.shards, slices, strict=True):  # the step time as a worker's header says it
            shard.push(worker, fragment, round, enc, weight, loss, step_seconds=step_seconds)
        if self.shards[0].contributors(fragment) == self.members:
            closed = [shard.close_round(fragment) for shard in self.shards]
            if closed[0].mean_loss is not None:
                self.round_losses.append((fragment, round, closed[0].mean_loss))
            self.update(fragment, round).set_result([c.update for c in closed])  # workers' merges go on

    def update(self, fragment: int, round: int) -> Future:
        """The round's update (one Encoded per shard), once every worker has pushed."""
        return self.updates.setdefault((fragment, round), Future())

    def master(self, fragment: int) -> torch.Tensor:
        return torch.cat([s.master(fragment) for s in self.shards])


class InProcessTransport:
    """A worker's worker.engine.Transport to the in-process cluster."""

    def __init__(self, cluster: InProcessCluster, worker: str, step_seconds: float | None = None):
        self.cluster, self.worker, self.num_shards = cluster, worker, len(cluster.shards)
        self.step_seconds = step_seconds  # its emulated step time, reported with its pushes (None: not timed)

    @property
    def pace_seconds(self) -> float:
        return self.cluster.pace_seconds

    def push(
        self, fragment: int, round: int, slices: list[Encoded], weight: float, loss: float | None
    ) -> None:
        self.cluster.push(self.worker, fragment, round, slices, weight, loss, self.step_seconds)

    def update(self, fragment: int, round: int) -> Future:
        return self.cluster.update(fragment, round)

    def skip_to(self, next_rounds: Callable[[], list[int]]) -> tuple[int, list[int]] | None:
        return None  # lock-step: a worker never falls behind

    def close(self) -> None:
        pass  # no sessions


def _load_globals(model: nn.Module, layout: FragmentLayout, vectors: list[torch.Tensor]) -> None:
    for frag, vec in zip(layout.fragments, vectors, strict=True):
        unflatten_into(vec, fragment_params(model, frag))


def simulate(cfg: SimConfig, log: Callable[[str], None] | None = print) -> dict:
    """Run one simulated training; returns the final figures (also what --json writes)."""
    device = torch.device(cfg.run.device)
    model = build_model(cfg.model.model, cfg.model.seed, cfg.model.block_size).to(device)
    block = model_block_size(model, cfg.model.block_size)
    data = ByteDataset.load(cfg.run.data, block)
    val = eval_batches(data.val, cfg.run.batch_size, block, cfg.run.eval_batches)
    streams = [
        BatchStream(data.train, cfg.run.batch_size, block, cfg.model.seed, rank)
        for rank in range(cfg.workers)
    ]
    nparams = sum(p.numel() for p in model.parameters())
    tokens_per_step = cfg.workers * cfg.run.batch_size * block
    curve: list[dict] = []
    t_start = time.perf_counter()

    def report(
        step: int,
        eval_model: nn.Module,
        train_loss: float,
        tokens: int | None = None,
        wall: float | None = None,
    ) -> None:
        loss = evaluate(eval_model, val, device)
        point: dict[str, float | int] = {
            "step": step,
            "tokens": step * tokens_per_step if tokens is None else tokens,
            "eval_loss": loss,
            "train_loss": train_loss,
        }
        if wall is not None:  # unequal speeds: the emulated wall time so far
            point["wall_seconds"] = wall
        curve.append(point)
        if log:
            el = time.perf_counter() - t_start
            eta = el / step * (cfg.run.steps - step) if step else 0.0
            steps = cfg.run.steps
            log(
                f"[{cfg.method} M={cfg.workers}] step {step:5d}/{steps}  tokens {point['tokens']:>10,}"
                f"  train {train_loss:6.3f}  eval {loss:6.3f}  {el:6.0f}s elapsed, ~{eta:.0f}s left"
            )

    if cfg.method == "dp":
        result = _run_dp(cfg, model, streams, report)
    else:
        result = _run_streaming(cfg, model, streams, report)
    result.update(
        method=cfg.method,
        workers=cfg.workers,
        steps=cfg.run.steps,
        params=nparams,
        tokens=curve[-1]["tokens"],
        eval_loss=curve[-1]["eval_loss"],
        curve=curve,
        wall_seconds=time.perf_counter() - t_start,
        config=_jsonable(cfg),
    )
    return result


def _jsonable(cfg: SimConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


def _run_dp(cfg: SimConfig, model: nn.Module, streams: list[BatchStream], report) -> dict:
    """Data-parallel: every step, each worker's gradient is averaged (fp32 up, fp32 down)."""
    opt = make_inner_optimizer(model, cfg.inner)
    device = next(model.parameters()).device
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    report(0, model, float("nan"))
    for step in range(cfg.run.steps):
        set_lr(opt, lr_at(step, cfg.run.steps, cfg.inner))
        losses = [forward_backward(model, x.to(device), y.to(device)) for x, y in (s.next() for s in streams)]
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(cfg.workers)
        optimizer_step(model, opt, cfg.inner)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.run.steps:
            report(step + 1, model, sum(losses) / len(losses))
    return {
        "bytes_sent_per_worker": nbytes * cfg.run.steps,
        "bytes_received_per_worker": nbytes * cfg.run.steps,
        "peak_sync_bytes": nbytes,
        "blocked_seconds": 0.0,
    }


def _run_streaming(cfg: SimConfig, model: nn.Module, streams: list[BatchStream], report) -> dict:
    layout = build_layout(model, cfg.sync.num_fragments, cfg.sync.fragment_pattern)
    # the shards' masters live on the CPU, as in a shard process (the workers' mirrors are CPU fp32 too)
    initial = [flatten(fragment_params(model, f)).cpu() for f in layout.fragments]
    names = [f"worker-{m}" for m in range(cfg.workers)]
    # unequal speeds: the emulated step times; the engines pace themselves by them as workers do (adaptive)
    times = cfg.step_seconds or (1.0,) * cfg.workers
    cluster = InProcessCluster(
        layout, cfg.sync, initial, cfg.num_shards, names, cfg.model.seed, cfg.robust, pace_seconds(times)
    )
    replicas = [copy.deepcopy(model) for _ in range(cfg.workers)]
    opts = [make_inner_optimizer(r, cfg.inner) for r in replicas]
    engines = [
        SyncEngine(
            r,
            build_layout(r, cfg.sync.num_fragments, cfg.sync.fragment_pattern),
            cfg.sync,
            InProcessTransport(cluster, n, times[m] if cfg.step_seconds else None),
            total_steps=cfg.run.steps,
            seed=cfg.model.seed,
            rank=m,
            background=False,  # lock-step: each job is done when the driver says
        )
        for m, (r, n) in enumerate(zip(replicas, names, strict=True))
    ]
    device = next(model.parameters()).device
    eval_model = model  # holds the global parameters for evaluation only
    wall, compute = 0.0, [0.0] * cfg.workers
    timed = bool(cfg.step_seconds)
    report(0, eval_model, float("nan"), 0, 0.0 if timed else None)
    for step in range(cfg.run.steps):
        lr = lr_at(step, cfg.run.steps, cfg.inner)
        losses, tick_seconds = [], 0.0
        for m, (r, opt, stream, eng) in enumerate(zip(replicas, opts, streams, engines, strict=True)):
            inner = 0
            while eng.step_count == step:  # one inner step per schedule step, or per_tick of them (adaptive)
                set_lr(opt, lr)
                x, y = stream.next()
                loss = forward_backward(r, x.to(device), y.to(device))
                optimizer_step(r, opt, cfg.inner)
                losses.append(loss)
                inner += 1
                eng.step(tokens=x.numel(), loss=loss, seconds=times[m])
            compute[m] += inner * times[m]
            tick_seconds = max(tick_seconds, inner * times[m])
        wall += tick_seconds
        _finish_steps(engines)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.run.steps:
            _load_globals(eval_model, layout, [cluster.master(f) for f in range(layout.num_fragments)])
            tokens = sum(e.tokens for e in engines)
            report(step + 1, eval_model, sum(losses) / len(losses), tokens, wall if timed else None)
    for eng in engines:
        eng.drain()  # only does something without final_sync
    masters = [cluster.master(f) for f in range(layout.num_fragments)]
    mirrors_match = all(
        torch.equal(eng.mirrors[f], masters[f]) for eng in engines for f in range(layout.num_fragments)
    )
    return {
        "bytes_sent_per_worker": max(e.bytes_sent for e in engines),
        "bytes_received_per_worker": max(e.bytes_received for e in engines),
        "peak_sync_bytes": max(e.peak_push_bytes for e in engines),
        "blocked_seconds": max(e.blocked_seconds for e in engines),
        "rounds": sum(e.pushes for e in engines[:1]),
        "pushes_clipped": sum(s.pushes_clipped for s in cluster.shards),
        "weights_capped": sum(s.weights_capped for s in cluster.shards),
        "mirrors_match_masters": mirrors_match,
        "inner_steps": [e.inner_steps for e in engines],
        "compute_utilization": [c / wall for c in compute],  # of the emulated wall time (step_seconds)
        "global_params": masters,
    }


def _finish_steps(engines: list[SyncEngine]) -> None:
    """Lock-step: the merges each worker's step left for later (their rounds closed only once the workers
    after it had pushed: tau = 0, the final sync), worker by worker until every step is done."""
    while any(e.pending for e in engines):
        left = [len(e.pending) for e in engines]
        for e in engines:
            e.finish_step()
        if [len(e.pending) for e in engines] == left:
            raise RuntimeError("lock-step order broken: no worker can finish its step")


def write_json(result: dict, path: str | Path) -> None:
    out = {k: v for k, v in result.items() if k != "global_params"}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2))
