"""The worker process: `streamdiloco worker --servers HOST:PORT,...`.

Join every shard, fetch the masters (local = mirror = master), then train: AdamW inner steps, and after each
one the sync engine's hook, which pushes fragments in the background and merges their updates tau steps
later. Progress every --log-every steps; at the end the eval loss of the global parameters (the mirror),
the mirror's hashes (compare them with the shards' /api/status) and a JSON summary.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import tensor_digest
from streamdiloco.common.fragments import fragment_params, unflatten_into
from streamdiloco.common.modelspec import build_model, model_block_size
from streamdiloco.common.wire import parse_target
from streamdiloco.worker.client import GrpcTransport, connect
from streamdiloco.worker.data import BatchStream, ByteDataset, eval_batches
from streamdiloco.worker.engine import SyncEngine
from streamdiloco.worker.train import (
    InnerConfig,
    evaluate,
    forward_backward,
    lr_at,
    make_inner_optimizer,
    optimizer_step,
    set_lr,
)

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
    token: str = ""
    join_timeout: float = 60.0
    summary: str | None = None  # write the summary JSON here
    save_global: str | None = None  # torch.save the final global fragments (the mirror) here
    sync: SyncConfig = field(default_factory=SyncConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("--servers: give at least one shard as HOST:PORT")
        for target in self.servers:
            parse_target(target)  # one-line error for a malformed address
        for name in ("steps", "batch_size", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")

    @property
    def data_rank(self) -> int:
        return self.rank if self.rank is not None else zlib.crc32(self.name.encode()) % 100_000


def mirror_digests(engine: SyncEngine) -> list[list[str]]:
    """Hash of each (fragment, shard slice) of the mirror: equal to the shards' master_hash when in sync."""
    return [
        [tensor_digest(engine.mirrors[f][lo:hi]) for lo, hi in engine.ranges[f]]
        for f in range(engine.layout.num_fragments)
    ]


def run_worker(cfg: WorkerConfig) -> dict:
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    model = build_model(cfg.model, cfg.seed, cfg.block_size)
    block = model_block_size(model, cfg.block_size)
    data = ByteDataset.load(cfg.data, block)
    val = eval_batches(data.val, cfg.batch_size, block, cfg.eval_batches)
    stream = BatchStream(data.train, cfg.batch_size, block, cfg.seed, cfg.data_rank)

    log.info("%s: joining %d shard(s): %s", cfg.name, len(cfg.servers), ", ".join(cfg.servers))
    model.to(device)
    engine = connect(
        model,
        list(cfg.servers),
        cfg.sync,
        total_steps=cfg.steps,
        name=cfg.name,
        token=cfg.token,
        seed=cfg.seed,
        rank=cfg.data_rank,
        join_timeout=cfg.join_timeout,
    )
    transport = engine.transport
    assert isinstance(transport, GrpcTransport)
    try:
        eval_start = evaluate(model, val, device)  # the global parameters as fetched
        opt = make_inner_optimizer(model, cfg.inner)
        log.info(
            "%s: %s params in %d fragments over %d shards; H=%d tau=%d alpha=%g %s/%s; "
            "%d steps of %d x %d bytes",
            cfg.name,
            f"{sum(p.numel() for p in model.parameters()):,}",
            engine.layout.num_fragments,
            transport.num_shards,
            cfg.sync.sync_every,
            cfg.sync.fragment_sync_delay,
            cfg.sync.fragment_update_alpha,
            cfg.sync.uplink_codec,
            cfg.sync.downlink_codec,
            cfg.steps,
            cfg.batch_size,
            block,
        )
        t_train0 = time.perf_counter()
        compute = 0.0
        tokens = 0
        recent: list[float] = []
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            set_lr(opt, lr_at(step, cfg.steps, cfg.inner))
            x, y = stream.next()
            loss = forward_backward(model, x.to(device), y.to(device))
            optimizer_step(model, opt, cfg.inner)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            compute += time.perf_counter() - t0
            tokens += x.numel()
            recent.append(loss)
            engine.step(tokens=x.numel(), loss=loss)
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                el = time.perf_counter() - t_train0
                log.info(
                    "%s step %d/%d  loss %.3f  %s tok/s  blocked %.1fs (%d of %d merges waited)  "
                    "sent %s B  received %s B",
                    cfg.name,
                    step + 1,
                    cfg.steps,
                    sum(recent) / len(recent),
                    f"{tokens / el:,.0f}",
                    engine.blocked_seconds,
                    engine.waits,
                    engine.merges,
                    f"{engine.bytes_sent:,}",
                    f"{engine.bytes_received:,}",
                )
                recent.clear()
        train_seconds = time.perf_counter() - t_train0
        engine.drain()  # only does something with --no-final-sync
        # the global parameters: after the final sync every fragment's mirror equals the masters
        eval_model = build_model(cfg.model, cfg.seed, cfg.block_size).to(device)
        for frag, vec in zip(engine.layout.fragments, engine.mirrors, strict=True):
            unflatten_into(vec, fragment_params(eval_model, frag))
        eval_loss = evaluate(eval_model, val, device)
        digests = mirror_digests(engine)
        for f, hs in enumerate(digests):
            log.info(
                "%s mirror fragment %d: %s", cfg.name, f, " ".join(f"shard{s}={h}" for s, h in enumerate(hs))
            )
        msg_out, msg_in = transport.message_bytes
        summary = {
            "worker": cfg.name,
            "rank": cfg.data_rank,
            "steps": cfg.steps,
            "tokens": tokens,
            "eval_loss_start": eval_start,
            "eval_loss": eval_loss,
            "bytes_sent": engine.bytes_sent,
            "bytes_received": engine.bytes_received,
            "message_bytes_sent": msg_out,  # protobuf messages, without gRPC/HTTP/2 framing
            "message_bytes_received": msg_in,  # including the Fetch of the masters
            "pushes": engine.pushes,
            "blocked_seconds": engine.blocked_seconds,
            "compute_seconds": compute,
            "train_seconds": train_seconds,
            "compute_utilization": compute / train_seconds if train_seconds > 0 else 0.0,
            "wall_seconds": time.perf_counter() - t_start,
            "mirror_hashes": digests,
            "late_refusals": sum(r.reason == "late" for link in transport.links for r in link.refusals),
            "merges": engine.merges,
            "merges_that_waited": engine.waits,
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
    finally:
        engine.close()
