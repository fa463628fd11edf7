"""The shard's HTTP: health, readiness, Prometheus metrics, the status JSON, the dashboard's series and page,
and the run's view over every shard (FastAPI, on uvicorn's server without its accept loop: connections come
from server/trust/bounds.py's HttpListener, which bounds them). It is up before the model loads, so that
/healthz answers while the shard loads (`Holder` says which phase the process is in).

What it must not do: change the shard; the handlers run on the event loop that owns the shard's state, so
a reply is a consistent snapshot without locks.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from streamdiloco.common.ports import bind_error
from streamdiloco.server.config import ShardConfig
from streamdiloco.server.httpconn import BoundedH11, HttpListener
from streamdiloco.server.observe.dashboard import HISTORY
from streamdiloco.server.observe.metrics import loading_metrics
from streamdiloco.server.observe.run_view import Peers, RunView
from streamdiloco.server.shard import Shard
from streamdiloco.server.storage.credits import MAX_IDENTITIES, STATUS_ROWS
from streamdiloco.server.trust.auth import Auth
from streamdiloco.server.trust.throttle import Throttled

log = logging.getLogger("streamdiloco.shard")

STATIC = Path(__file__).parent / "static"


class Holder:
    """The running shard once it is built, for HTTP; `phase` says where the process is: loading, serving,
    stopping, failed; `awaiting_first`: --init from-worker, gRPC takes the first worker's parameters."""

    def __init__(self, shard: Shard | None = None):
        self.shard = shard
        self.phase = "serving" if shard is not None else "loading"
        self.awaiting_first = False

    def to(self, phase: str, shard: Shard | None = None, awaiting_first: bool = False) -> None:
        """The process has moved on to `phase` (with its running shard, once there is one)."""
        self.phase, self.awaiting_first = phase, awaiting_first
        self.shard = shard or self.shard


OPEN_PATHS = ("/healthz", "/readyz")  # for health checks and load balancers: no token, nothing to read


def make_app(source: Shard | Holder, auth: Auth | None = None, peers: Peers | None = None) -> FastAPI:
    """The shard's HTTP app. With a read token in `auth`, everything but /healthz, /readyz and the page's
    static files (the chart library) needs it: `Authorization: Bearer TOKEN`, or `?token=TOKEN` for the
    page (which sends it on as the header). `peers`: the run's other shards, for /api/run (default: this
    shard alone)."""
    holder = source if isinstance(source, Holder) else Holder(source)
    run_view = RunView(
        peers or Peers(()),
        lambda: holder.shard.view.status(0, False, 0) if holder.shard is not None else None,
    )
    app = FastAPI(title="streamdiloco shard", docs_url=None, redoc_url=None)

    if auth is not None and auth.read_token:
        _require_read_token(app, auth)

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
        ready = (holder.shard is not None and holder.shard.ready) or holder.awaiting_first
        return JSONResponse({"ready": ready, "phase": holder.phase}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = holder.shard.metrics.render() if holder.shard is not None else loading_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/status")
    async def status(
        rounds: int = Query(20, ge=0, le=HISTORY, description="recent closed rounds to list"),
        hashes: bool = Query(True, description="each fragment's master hash (a hash of its slice)"),
        credits: int = Query(
            STATUS_ROWS, ge=0, le=MAX_IDENTITIES, description="rows of the contribution credits to list"
        ),
    ):
        if holder.shard is None:
            return not_yet()
        if hashes:
            await holder.shard.view.hash_masters()
        # a JSONResponse as it is: FastAPI's jsonable_encoder would walk every value (5x json.dumps' time)
        return JSONResponse(holder.shard.view.status(rounds, hashes, credits))

    @app.get("/api/series")
    async def series(
        since: float = Query(
            0.0, ge=0.0, allow_inf_nan=False, description="only points after this Unix time"
        ),
    ):
        return JSONResponse(holder.shard.view.series(since)) if holder.shard is not None else not_yet()

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


def _require_read_token(app: FastAPI, auth: Auth) -> None:
    """Every path but /healthz, /readyz and the page's static files needs the read token: the header, or
    `?token=` for the page."""

    @app.middleware("http")
    async def need_read_token(request: Request, call_next):
        path = request.url.path
        if path in OPEN_PATHS or path.startswith("/static/"):
            return await call_next(request)
        query = request.query_params.get("token") if path == "/" else None
        if not auth.read_allowed(request.headers.get("authorization"), query):
            return JSONResponse(
                {"detail": "this needs the shard's read token (Authorization: Bearer TOKEN)"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await call_next(request)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # now, not when uvicorn's task first runs: the ready file may be read at once
    return sock


class HttpServer:
    """The shard's HTTP (make_app on uvicorn, without uvicorn's accept loop: connections come from an
    HttpListener that bounds them), up before the model loads."""

    def __init__(
        self, base: str, bound: int | None, server: uvicorn.Server | None = None, task=None, listener=None
    ):
        self.base, self.bound, self.server, self.task, self.listener = base, bound, server, task, listener

    @classmethod
    async def start(cls, config: ShardConfig, holder: Holder, connections: int) -> HttpServer:
        tls, host = config.tls, config.http_host or config.host
        base = f"{'https' if tls else 'http'}://{host}"
        if config.http_port is None:
            return cls(base, None)
        try:
            sock = _bind(host, config.http_port)
        except OSError as e:
            raise bind_error("--http-port", host, config.http_port, e, "another shard") from None
        uv = uvicorn.Config(
            make_app(holder, config.auth, config.peers),
            log_level="warning",
            log_config=None,  # uvicorn's lines go through the process's logging (dated, text or JSON)
            lifespan="off",
            http=BoundedH11,
            ssl_certfile=tls.cert if tls else None,
            ssl_keyfile=tls.key if tls else None,
        )
        uv.load()
        server = uvicorn.Server(uv)
        # uvicorn's serve() minus its signal capture and its accept loop: connections come from `listener`
        task = asyncio.create_task(server._serve(sockets=[]))
        state = server.server_state
        listener = HttpListener(
            sock,
            lambda: BoundedH11(config=uv, server_state=state, app_state={}),  # config.http_protocol_class
            config.limits,
            connections,
            Throttled(log),
            ssl=uv.ssl,
        )
        listener.start()
        return cls(base, sock.getsockname()[1], server, task, listener)

    async def stop(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await self.task
