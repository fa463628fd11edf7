"""The shard process: `streamdiloco server`. gRPC (grpc.aio) for workers, HTTP (FastAPI on uvicorn) for
health, metrics, status and the dashboard page, both on one event loop. HTTP comes up first, so that
/healthz answers while the model and the checkpoint load (/readyz says when they have). SIGINT/SIGTERM
stop it cleanly; SIGHUP re-reads the workers file (server/trust/auth.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import resource
import signal
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from streamdiloco.common.atomic import atomic_write_text
from streamdiloco.common.codecs import get_codec, warm_up
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import FragmentLayout, build_layout, flatten, fragment_params
from streamdiloco.common.inithash import parse_init_hash
from streamdiloco.common.keepalive import LinkSettings
from streamdiloco.common.modelspec import build_model
from streamdiloco.common.ports import bind_error, probe
from streamdiloco.common.statefile import read_init_file
from streamdiloco.common.tls import ServerTLS
from streamdiloco.common.wire import make_server
from streamdiloco.server.edge.initialize import INIT_TIMEOUT, InitRefused, PendingShard, shard_fingerprint
from streamdiloco.server.edge.service import ShardService, add_to_server
from streamdiloco.server.edge.slots import WaitingCalls, receive_limit
from streamdiloco.server.observe.dashboard import HISTORY
from streamdiloco.server.observe.metrics import loading_metrics
from streamdiloco.server.observe.run_view import Peers, RunView
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.storage.checkpoint import ShardCheckpoint
from streamdiloco.server.storage.credits import MAX_IDENTITIES, STATUS_ROWS
from streamdiloco.server.trust.auth import Auth, WorkersFile
from streamdiloco.server.trust.bounds import (
    BoundedH11,
    HttpListener,
    Limits,
    Throttled,
    connection_caps,
    grpc_options,
    throttle_library_logs,
)

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("streamdiloco.shard")


FROM_WORKER = "from-worker"  # --init from-worker: the first worker's layout and parameters
MAX_CHUNK_BYTES = 16 << 20  # --chunk-bytes at most


def build_service(
    cfg: SyncConfig,
    model_spec: str | None,
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
) -> ShardService | PendingShard:
    """The shard's state, from the same model factory as the workers (same seed, same initial values),
    with its parameters then taken from `init` (a saved state_dict) if given; or, with no `model_spec`,
    from the `init` file alone (names, shapes, dtypes and values; the blocks from the file's fingerprint,
    else `blocks_path`, else detected from the names: common/statefile.py), so that the shard needs no
    model code; or, with `init` "from-worker" and no model, a PendingShard that takes the layout and the
    values from the first worker's upload (server/edge/initialize.py); or, when `checkpoint_dir` holds a
    checkpoint of this run (and not `fresh`), restored from it. `robust`: the defenses against workers'
    pushes (default: RobustConfig()'s, which are on). `blocks_path`, `fragments`: the layout, as the
    workers give it to connect() (--blocks-path, --fragments). `piece_tokens`: the pieces of shard 0's data
    ledger (--piece-tokens). `init_expect`, `init_timeout`: the pending shard's pinned init hash and its
    upload's deadline (--init-expect, --init-timeout: server/edge/initialize.py)."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"--chunk-bytes must be positive and at most 16 MiB, got {chunk_bytes}")
    if not math.isfinite(round_timeout):
        raise ValueError(f"--round-timeout must be a finite number of seconds, got {round_timeout}")
    if init_expect is not None and init != FROM_WORKER:
        raise ValueError("--init-expect pins the first worker's upload: it goes with --init from-worker")
    if checkpoint_dir and not fresh and (Path(checkpoint_dir) / "meta.json").exists():
        # a checkpoint of another run (or shard) is refused before the model is built: at once, one line
        ShardCheckpoint(checkpoint_dir, {}).check_meta(shard, num_shards, cfg)

    def finish(
        layout: FragmentLayout, initial: list, fingerprint: dict, first: bool = False, init_hash: str = ""
    ) -> ShardService:
        """The service from a layout and its starting values; `first`: the first worker's upload (whose init
        hash is `init_hash`), written to the checkpoint at once (a restart then needs the uploader no
        more)."""
        rounds = (min_workers, round_timeout, robust, quorum, round_grace)
        state = ShardState(shard, num_shards, layout, cfg, initial, seed, *rounds)
        checkpoint = ShardCheckpoint(checkpoint_dir, fingerprint) if checkpoint_dir else None
        if checkpoint is not None and first:
            checkpoint.init_hash = init_hash
        if checkpoint is not None and checkpoint.exists() and not fresh and not first:
            checkpoint.load(state)
            log.info(
                "shard %d: resumed from checkpoint %s at rounds %s",
                shard,
                checkpoint_dir,
                [state.round_of(f) for f in range(layout.num_fragments)],
            )
        elif checkpoint is not None:
            checkpoint.pending_initial = True  # serve() writes the starting state before taking workers
            if first:
                if not checkpoint.save_all(state):
                    raise OSError(f"cannot write the checkpoint to {checkpoint.dir}: {checkpoint.last_error}")
                checkpoint.pending_initial = False
        warm_up(tuple({cfg.uplink_codec, cfg.downlink_codec}), cfg.codec_block_size)  # not in round 1
        service = ShardService(
            state,
            fingerprint,
            token=token,
            chunk_bytes=chunk_bytes,
            checkpoint=checkpoint,
            auth=auth,
            workers_file=workers_file,
            limits=limits,
            piece_tokens=piece_tokens,
        )
        # --init from-worker: the run's init hash, reported at Join (a restart: as the checkpoint keeps it)
        service.init_hash = init_hash or (checkpoint.init_hash if checkpoint is not None else "") or ""
        return service

    saved = Path(checkpoint_dir or "") / "meta.json"
    resuming = bool(checkpoint_dir) and not fresh and saved.exists()
    # started from a file once: the checkpoint has the layout and the values, and the file may be gone
    gone = (
        model_spec is None
        and init is not None
        and init != FROM_WORKER
        and resuming
        and not Path(init).exists()
    )
    if gone:
        log.info(
            "shard %d: --init %s is gone: the layout comes from checkpoint %s", shard, init, checkpoint_dir
        )
    if init == FROM_WORKER or gone:
        if not gone and (model_spec is not None or blocks_path is not None):
            raise ValueError("--init from-worker takes the model from the first worker: leave out --model")
        if not resuming:
            return PendingShard(
                cfg,
                shard,
                num_shards,
                auth if auth is not None else Auth(token=token),
                limits or Limits(),
                lambda layout, initial, fp, init_hash: finish(layout, initial, fp, True, init_hash),
                init_expect,
                init_timeout,
            )
        try:  # restarted: the layout the first worker gave, as the checkpoint keeps it
            layout, fingerprint = shard_fingerprint(
                json.loads(saved.read_text()).get("fingerprint") or {}, cfg
            )
        except (InitRefused, ValueError, AttributeError) as e:
            raise ValueError(
                f"checkpoint {checkpoint_dir}: its fingerprint does not give a layout ({e})"
            ) from None
        import torch

        service = finish(layout, [torch.zeros(f.numel) for f in layout.fragments], fingerprint)
        if init_expect is not None and service.init_hash != parse_init_hash(init_expect):
            held = service.init_hash[:16] or "unknown"
            raise ValueError(
                f"checkpoint {checkpoint_dir} started from init hash {held}..., not the --init-expect "
                f"{init_expect[:16]}...: start again with --fresh, or without --init-expect"
            )
        return service
    if model_spec is None:
        if not init:
            raise ValueError("give the model (--model), its parameters (--init FILE) or --init from-worker")
        layout, initial, learned = layout_from_file(init, cfg, blocks_path, shard)
        if fragments is not None:
            raise ValueError("--fragments needs the model (--model): a file's layout is its blocks'")
        # the file's model config if its fingerprint has one; none known (a plain state_dict): not checked
        fingerprint = model_fingerprint(layout, cfg, seed, learned.get("model_config", {}))
        if "model_config" not in learned:
            del fingerprint["model_config"]
        return finish(layout, initial, {**learned, **fingerprint})
    model = build_model(model_spec, seed, block_size)
    if init:
        load_initial(model, init)
    layout = build_layout(model, cfg.num_fragments, cfg.fragment_pattern, blocks_path, fragments)
    initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
    return finish(layout, initial, model_fingerprint(layout, cfg, seed))


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


STATIC = Path(__file__).parent / "static"


class Holder:
    """The shard's service once it is built; `phase` says where the process is: loading, serving,
    stopping, failed."""

    def __init__(self, service: ShardService | None = None):
        self.service = service
        self.phase = "serving" if service is not None else "loading"
        self.awaiting_first = False  # --init from-worker: gRPC takes the first worker's parameters


OPEN_PATHS = ("/healthz", "/readyz")  # for health checks and load balancers: no token, nothing to read


def make_app(source: ShardService | Holder, auth: Auth | None = None, peers: Peers | None = None) -> FastAPI:
    """The shard's HTTP app. With a read token in `auth`, everything but /healthz, /readyz and the page's
    static files (the chart library) needs it: `Authorization: Bearer TOKEN`, or `?token=TOKEN` for the
    page (which sends it on as the header). `peers`: the run's other shards, for /api/run (default: this
    shard alone)."""
    holder = source if isinstance(source, Holder) else Holder(source)
    run_view = RunView(
        peers or Peers(()),
        lambda: holder.service.status(0, False, 0) if holder.service is not None else None,
    )
    app = FastAPI(title="streamdiloco shard", docs_url=None, redoc_url=None)

    if auth is not None and auth.read_token:
        reader = auth

        @app.middleware("http")
        async def need_read_token(request: Request, call_next):
            path = request.url.path
            if path in OPEN_PATHS or path.startswith("/static/"):
                return await call_next(request)
            query = request.query_params.get("token") if path == "/" else None
            if not reader.read_allowed(request.headers.get("authorization"), query):
                return JSONResponse(
                    {"detail": "this needs the shard's read token (Authorization: Bearer TOKEN)"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return await call_next(request)

    def not_yet() -> JSONResponse:
        return JSONResponse({"detail": f"the shard is {holder.phase}"}, status_code=503)

    # async handlers run on the event loop that owns the shard's state: a consistent snapshot, no locks;
    # what takes long (hashing masters) goes to the shard's compute threads
    @app.get("/healthz")
    async def healthz() -> dict:
        """The process is up and its event loop answers (also while it loads)."""
        return {"ok": True, "phase": holder.phase}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """200 once the model and the checkpoint are loaded and workers can join (with --init from-worker:
        once the first worker can send its parameters); 503 before and while stopping."""
        ready = (holder.service is not None and holder.service.ready) or holder.awaiting_first
        return JSONResponse({"ready": ready, "phase": holder.phase}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = holder.service.metrics.render() if holder.service is not None else loading_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/status")
    async def status(
        rounds: int = Query(20, ge=0, le=HISTORY, description="recent closed rounds to list"),
        hashes: bool = Query(True, description="each fragment's master hash (a hash of its slice)"),
        credits: int = Query(
            STATUS_ROWS, ge=0, le=MAX_IDENTITIES, description="rows of the contribution ledger to list"
        ),
    ):
        if holder.service is None:
            return not_yet()
        if hashes:
            await holder.service.hash_masters()
        # a JSONResponse as it is: FastAPI's jsonable_encoder would walk every value (5x json.dumps' time)
        return JSONResponse(holder.service.status(rounds, hashes, credits))

    @app.get("/api/series")
    async def series(
        since: float = Query(
            0.0, ge=0.0, allow_inf_nan=False, description="only points after this Unix time"
        ),
    ):
        return JSONResponse(holder.service.series(since)) if holder.service is not None else not_yet()

    @app.get("/api/run")
    async def run() -> JSONResponse:
        """Every shard of the run (from --peers): each one's rounds, pushes, bytes and round times, up or
        down, and the run's totals."""
        return JSONResponse(await run_view.get())

    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # now, not when uvicorn's task first runs: the ready file may be read at once
    return sock


async def serve(
    service: ShardService | PendingShard | Callable[[], ShardService | PendingShard],
    host: str = "127.0.0.1",
    port: int = 0,
    http_port: int | None = 0,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
    http_host: str | None = None,
    tls: ServerTLS | None = None,
    auth: Auth | None = None,
    limits: Limits | None = None,
    peers: Peers | None = None,
    link: LinkSettings | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set). Port 0 picks a free port; `ready_file` gets the ports.
    `service` may be a function that builds it (loads the model and the checkpoint): HTTP then answers
    /healthz while it runs, in a thread. A PendingShard (--init from-worker) serves gRPC until the first
    worker's upload has made the service. `http_host`: where HTTP listens (default `host`); `tls`: gRPC and
    HTTP over TLS; `auth`: the read token for HTTP (the service has its own for gRPC). `limits`: the bounds
    on what clients may hold (else the service's, or the defaults); `link`: the liveness bound and receive
    window of every gRPC connection (common/keepalive.py). `peers`: the run's shards, for the dashboard's run
    view."""
    stop = stop or asyncio.Event()
    if limits is None:
        limits = service.limits if isinstance(service, ShardService | PendingShard) else Limits()
    _, http_connections = connection_caps(limits)  # before anything listens: a limit too low fails now
    throttle_library_logs()
    loop = asyncio.get_running_loop()
    holder = Holder(service if isinstance(service, ShardService) else None)
    pending = service if isinstance(service, PendingShard) else None

    def on_signal() -> None:
        if holder.phase == "loading" and stop.is_set():  # a second signal while loading: nothing to save
            os._exit(130)
        if holder.phase == "loading":
            log.info("stopping once the model has loaded (a second signal stops now)")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass

    def on_hangup() -> None:  # a new workers file at once (else within a second)
        if holder.service is not None:
            holder.service.reload_credentials(force=True)

    try:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    except (NotImplementedError, RuntimeError):
        pass
    if auth is None and holder.service is not None:
        auth = holder.service.auth
    http_task, http, http_bound, listener = None, None, None, None
    http_host = http_host or host
    if http_port is not None:
        try:
            sock = _bind(http_host, http_port)
        except OSError as e:
            raise bind_error("--http-port", http_host, http_port, e, "another shard") from None
        http_bound = sock.getsockname()[1]
        config = uvicorn.Config(
            make_app(holder, auth, peers),
            log_level="warning",
            log_config=None,  # uvicorn's lines go through the process's logging (dated, text or JSON)
            lifespan="off",
            http=BoundedH11,
            ssl_certfile=tls.cert if tls else None,
            ssl_keyfile=tls.key if tls else None,
        )
        config.load()
        http = uvicorn.Server(config)
        # uvicorn's serve() minus its signal capture and its accept loop: connections come from `listener`
        http_task = asyncio.create_task(http._serve(sockets=[]))
        state = http.server_state
        listener = HttpListener(
            sock,
            lambda: BoundedH11(config=config, server_state=state, app_state={}),  # config.http_protocol_class
            limits,
            http_connections,
            Throttled(log),
            ssl=config.ssl,
        )
        listener.start()

    async def stop_http() -> None:
        if listener is not None:
            listener.close()
        if http is not None and http_task is not None:
            http.should_exit = True
            await http_task

    scheme = "https" if tls else "http"
    if port and (taken := probe(host, port)) is not None:  # now, not after the model has loaded
        await stop_http()
        raise bind_error("--port", host, port, taken, "another shard")
    if holder.service is None and pending is None:  # a function that builds it
        slow = loop.call_later(  # said only when it takes a while: a bad flag's error stays one line
            2.0,
            log.info,
            "loading the model and the checkpoint%s",
            f"; health on {scheme}://{http_host}:{http_bound}/healthz" if http_bound else "",
        )
        try:
            built = await asyncio.to_thread(service)  # type: ignore[arg-type]
            if isinstance(built, PendingShard):
                pending = built
            else:
                holder.service = built
        except BaseException:
            holder.phase = "failed"
            await stop_http()
            raise
        finally:
            slow.cancel()
        if stop.is_set():  # stopped while loading: no gRPC, no checkpoint written
            holder.phase = "stopping"
            await stop_http()
            return
    if pending is not None:
        holder.phase = "waiting for the first worker's parameters"
    # what start-up made (torch, the model, the codecs' kernels: about a million objects) stays: out of the
    # collector's sight, so that a full collection does not hold the GIL for a tenth of a second mid-round
    gc.collect()
    gc.freeze()
    try:
        # gRPC's cap from what the process holds now that the model and the checkpoint are loaded
        connections = (connection_caps(limits)[0], http_connections if http_port is not None else 0)
        await _serve_grpc(
            holder.service or pending,  # type: ignore[arg-type]
            holder,
            host,
            port,
            http_bound,
            ready_file,
            stop,
            connections,
            tls,
            f"{scheme}://{http_host}",
            link or LinkSettings(),
        )
    finally:
        await stop_http()


def _write_ready(ready_file: str | None, grpc_port: int, http_port: int | None, shard: int) -> None:
    if ready_file:
        ports = {"grpc_port": grpc_port, "http_port": http_port, "shard": shard}
        atomic_write_text(ready_file, json.dumps(ports))


async def _serve_grpc(
    service: ShardService | PendingShard,
    holder: Holder,
    host: str,
    port: int,
    http_bound: int | None,
    ready_file: str | None,
    stop: asyncio.Event,
    connections: tuple[int, int],
    tls: ServerTLS | None,
    http_base: str,
    link: LinkSettings,
) -> None:
    limits = service.limits
    # Sessions and Fetches are counted (and refused) by the service, calls waiting for their request by
    # `waiting`; past this many calls at once (room for all of those and 64 Joins or Pieces being answered)
    # gRPC refuses more
    waiting = WaitingCalls(limits, service.refused if isinstance(service, ShardService) else None)
    if isinstance(service, ShardService):
        service.waiting_calls = waiting
        up = get_codec(service.state.cfg.uplink_codec)
        push_bytes = up.encoded_nbytes(service.up_chunk, service.state.cfg.codec_block_size)
    else:  # the pending shard's service is not built yet: the largest chunk a --chunk-bytes may give
        push_bytes = 2 * MAX_CHUNK_BYTES
    server = make_server(
        grpc_options(limits, link, connections[0], receive_limit(push_bytes)),
        2 * limits.max_sessions + limits.max_waiting_calls + 64,
        [waiting],
    )
    pending = service if isinstance(service, PendingShard) else None
    if isinstance(service, PendingShard):  # the pending shard's methods, then the service's
        server.add_generic_rpc_handlers((service.dispatch,))
        service.ready = asyncio.get_running_loop().create_future()
    else:
        add_to_server(service, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.grpc_credentials())
    except RuntimeError:  # grpc's way of saying the address is in use or not ours
        bound = 0
    if bound == 0:
        raise bind_error("--port", host, port, probe(host, port), "another shard")
    ckpt = service.checkpoint if isinstance(service, ShardService) else None
    if ckpt is not None and ckpt.pending_initial:  # a new run's starting state (or an old format's, hashed)
        assert isinstance(service, ShardService)
        if not ckpt.save_all(service.state):
            raise OSError(f"cannot write the checkpoint to {ckpt.dir}: {ckpt.last_error}")
        ckpt.pending_initial = False
    await server.start()
    if pending is not None and pending.ready is not None:
        _write_ready(ready_file, bound, http_bound, pending.shard)
        log.info(
            "shard %d/%d: gRPC on %s:%d; waiting for the first worker's model and parameters (--init %s)",
            pending.shard,
            pending.num_shards,
            host,
            bound,
            FROM_WORKER,
        )
        stopped = asyncio.ensure_future(stop.wait())
        holder.awaiting_first = True
        await asyncio.wait({pending.ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        holder.awaiting_first = False
        if not pending.ready.done():  # stopped before any worker came: nothing to save
            holder.phase = "stopping"
            await server.stop(grace=1.0)
            return
        stopped.cancel()
        holder.service = pending.ready.result()
        service = holder.service
        ready_file = None  # written already
    assert isinstance(service, ShardService)
    if service.waiting_calls is None:  # built from the first worker's upload: it counts from now on
        service.refused.update(waiting.refused)
        waiting.refused, service.waiting_calls = service.refused, waiting
    service.serving = True
    holder.phase = "serving"
    tick = asyncio.create_task(service.tick())
    service.rounds.on_fatal = stop.set
    st = service.state
    auth = service.auth
    log.info(
        "shard %d/%d: gRPC%s on %s:%d%s; %d fragments, %s values in this shard's slices; workers need %s",
        st.shard,
        st.num_shards,
        " (mutual TLS)" if tls and tls.mutual else " (TLS)" if tls else "",
        host,
        bound,
        f", dashboard on {http_base}:{http_bound}/" if http_bound else "",
        st.layout.num_fragments,
        f"{sum(hi - lo for lo, hi in st.ranges):,}",
        " and ".join(
            what
            for what, on in (
                ("their own token", auth.workers is not None),
                ("a client certificate", auth.certificates),
                ("the run token", bool(auth.token)),
            )
            if on
        )
        or "no credential",
    )
    log.info(
        "open-file limit %d: at most %d gRPC and %d HTTP connections, %d sessions (%d per address), Hello "
        "within %g s, %d calls waiting for their request (%d per address) within %g s",
        resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        *connections,
        limits.max_sessions,
        limits.max_sessions_per_peer,
        limits.hello_timeout,
        limits.max_waiting_calls,
        limits.max_waiting_calls_per_peer,
        limits.request_timeout,
    )
    _write_ready(ready_file, bound, http_bound, st.shard)
    try:
        await stop.wait()
    finally:
        log.info("shard %d stopping", st.shard)
        service.rounds.stopping = True  # sessions end now: that must not close rounds with partial pushes
        holder.phase = "stopping"
        tick.cancel()
        await server.stop(grace=1.0)
        await service.rounds.drain()  # jobs still out give their fragments back: the checkpoint is whole
        if service.rounds.fatal:
            raise OSError(service.rounds.fatal)
        if service.checkpoint is not None and service.checkpoint.save_all(st):
            log.info("shard %d: checkpoint written to %s", st.shard, service.checkpoint.dir)
