"""The shard process: `streamdiloco server`. gRPC (grpc.aio) for workers, HTTP (FastAPI on uvicorn) for
status, both on one event loop. SIGINT/SIGTERM stop it cleanly."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Query

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.modelspec import build_model
from streamdiloco.common.wire import make_server
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.checkpoint import ShardCheckpoint
from streamdiloco.server.service import HISTORY, ShardService
from streamdiloco.server.shard import ShardState

log = logging.getLogger("streamdiloco.shard")


def build_service(
    cfg: SyncConfig,
    model_spec: str,
    shard: int,
    num_shards: int,
    seed: int = 0,
    block_size: int | None = None,
    min_workers: int = 1,
    round_timeout: float = 120.0,
    token: str = "",
    chunk_bytes: int = 1 << 20,
    init: str | None = None,
    checkpoint_dir: str | None = None,
    fresh: bool = False,
) -> ShardService:
    """The shard's state, from the same model factory as the workers (same seed, same initial values),
    with its parameters then taken from `init` (a saved state_dict) if given; or, when `checkpoint_dir`
    holds a checkpoint of this run (and not `fresh`), restored from it."""
    if not 0 < chunk_bytes <= 16 << 20:
        raise ValueError(f"--chunk-bytes must be positive and at most 16 MiB, got {chunk_bytes}")
    if not math.isfinite(round_timeout):
        raise ValueError(f"--round-timeout must be a finite number of seconds, got {round_timeout}")
    model = build_model(model_spec, seed, block_size)
    if init:
        load_initial(model, init)
    layout = build_layout(model, cfg.num_fragments, cfg.fragment_pattern)
    initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
    state = ShardState(shard, num_shards, layout, cfg, initial, seed, min_workers, round_timeout)
    fingerprint = model_fingerprint(layout, cfg)
    checkpoint = ShardCheckpoint(checkpoint_dir, fingerprint) if checkpoint_dir else None
    if checkpoint is not None and checkpoint.exists() and not fresh:
        checkpoint.load(state)
        log.info(
            "shard %d: resumed from checkpoint %s at rounds %s",
            shard,
            checkpoint_dir,
            [state.round_of(f) for f in range(layout.num_fragments)],
        )
    elif checkpoint is not None:
        checkpoint.pending_initial = True  # serve() writes the starting state before taking workers
    return ShardService(state, fingerprint, token=token, chunk_bytes=chunk_bytes, checkpoint=checkpoint)


def load_initial(model, path: str) -> None:
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


def make_app(service: ShardService) -> FastAPI:
    app = FastAPI(title=f"streamdiloco shard {service.state.shard}", docs_url=None, redoc_url=None)

    # async handlers run on the event loop that owns the shard's state: a consistent snapshot, no locks
    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/api/status")
    async def status(
        rounds: int = Query(20, ge=0, le=HISTORY, description="recent closed rounds to list"),
    ) -> dict:
        return service.status(rounds)

    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # now, not when uvicorn's task first runs: the ready file may be read at once
    return sock


async def serve(
    service: ShardService,
    host: str = "127.0.0.1",
    port: int = 0,
    http_port: int | None = 0,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set). Port 0 picks a free port; `ready_file` gets the ports."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    server = make_server()
    pb_grpc.add_ShardServicer_to_server(service, server)
    try:
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    except RuntimeError:  # grpc's way of saying the address is in use or not ours
        bound = 0
    if bound == 0:
        raise OSError(
            f"cannot listen for gRPC on {host}:{port}: the port is in use or the address is not local"
        )
    ckpt = service.checkpoint
    if ckpt is not None and ckpt.pending_initial:  # a new run: its starting state and meta.json
        if not ckpt.save_all(service.state):
            raise OSError(f"cannot write the checkpoint to {ckpt.dir}: {ckpt.last_error}")
        ckpt.pending_initial = False
    await server.start()
    http_task, http, http_bound = None, None, None
    if http_port is not None:
        sock = _bind(host, http_port)
        http_bound = sock.getsockname()[1]
        config = uvicorn.Config(make_app(service), log_level="warning", lifespan="off")
        http = uvicorn.Server(config)
        http_task = asyncio.create_task(
            http._serve(sockets=[sock])
        )  # uvicorn's serve() minus its signal capture
    tick = asyncio.create_task(service.tick())
    service.on_fatal = stop.set
    st = service.state
    log.info(
        "shard %d/%d: gRPC on %s:%d%s; %d fragments, %s values in this shard's slices",
        st.shard,
        st.num_shards,
        host,
        bound,
        f", status on http://{host}:{http_bound}/api/status" if http_bound else "",
        st.layout.num_fragments,
        f"{sum(hi - lo for lo, hi in st.ranges):,}",
    )
    if ready_file:
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps({"grpc_port": bound, "http_port": http_bound, "shard": st.shard}))
        tmp.replace(ready_file)
    try:
        await stop.wait()
    finally:
        log.info("shard %d stopping", st.shard)
        service.stopping = True  # sessions end now: that must not close rounds with partial pushes
        tick.cancel()
        await server.stop(grace=1.0)
        if http is not None and http_task is not None:
            http.should_exit = True
            await http_task
        if service.fatal:
            raise OSError(service.fatal)
        if service.checkpoint is not None and service.checkpoint.save_all(st):
            log.info("shard %d: checkpoint written to %s", st.shard, service.checkpoint.dir)
