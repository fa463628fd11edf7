"""The shard process: `streamdiloco server`. gRPC (grpc.aio) for workers, HTTP (FastAPI on uvicorn) for
health, metrics, status and the dashboard page, both on one event loop. HTTP comes up first, so that
/healthz answers while the model and the checkpoint load (/readyz says when they have). SIGINT/SIGTERM
stop it cleanly; SIGHUP re-reads the workers file (server/trust/auth.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import resource
import signal
from collections.abc import Callable

import grpc

from streamdiloco.common.atomic import atomic_write_text
from streamdiloco.common.ports import bind_error, probe
from streamdiloco.common.wire import make_server
from streamdiloco.server.config import FROM_WORKER, ShardConfig
from streamdiloco.server.edge.initialize import PendingShard
from streamdiloco.server.edge.slots import receive_limit
from streamdiloco.server.http import Holder, HttpServer
from streamdiloco.server.shard import Shard
from streamdiloco.server.trust.bounds import grpc_options
from streamdiloco.server.trust.fds import connection_caps
from streamdiloco.server.trust.throttle import throttle_library_logs

log = logging.getLogger("streamdiloco.shard")


async def serve(
    source: Shard | PendingShard | Callable[[], Shard | PendingShard],
    config: ShardConfig | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set), listening where `config` says (default: the shard's own
    config; port 0 picks a free port, the ready file gets the ports). `source` may be a function that
    builds the shard (loads the model and the checkpoint): HTTP then answers /healthz while it runs, in a
    thread. A PendingShard (--init from-worker) serves gRPC until the first worker's upload has made the
    running shard. The limits, the link settings (common/keepalive.py), TLS, the read token and the peers
    (the dashboard's run view) are the config's."""
    stop = stop or asyncio.Event()
    if config is None:
        assert not callable(source), "give serve() the config of the shard its function builds"
        config = source.config
    _, http_connections = connection_caps(config.limits)  # before anything listens: a limit too low fails now
    throttle_library_logs()
    holder = Holder()  # the running shard once gRPC serves it
    _on_signals(holder, stop)
    http = await HttpServer.start(config, holder, http_connections)
    try:
        if config.port and (taken := probe(config.host, config.port)) is not None:  # now, not after loading
            raise bind_error("--port", config.host, config.port, taken, "another shard")
        built = await _build(source, stop, http) if callable(source) else source
        if built is None:  # stopped while loading: no gRPC, no checkpoint written
            holder.to("stopping")
            return
        # what start-up made (torch, the model, the codecs' kernels: about a million objects) stays: out of
        # the collector's sight, so that a full collection does not hold the GIL for a tenth of a second
        gc.collect()
        gc.freeze()
        # gRPC's cap from what the process holds now that the model and the checkpoint are loaded
        connections = (connection_caps(config.limits)[0], http_connections if http.bound is not None else 0)
        await _serve_grpc(built, holder, config, http.bound, stop, connections)
    except BaseException:
        if holder.phase == "loading":
            holder.to("failed")
        raise
    finally:
        await http.stop()


def _on_signals(holder: Holder, stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM stop the shard (a second one while it loads: at once); SIGHUP re-reads the workers
    file. Not in a thread other than the main one (tests)."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if holder.phase == "loading" and stop.is_set():  # a second signal while loading: nothing to save
            os._exit(130)
        if holder.phase == "loading":
            log.info("stopping once the model has loaded (a second signal stops now)")
        stop.set()

    def on_hangup() -> None:  # a new workers file at once (else within a second)
        if holder.shard is not None:
            holder.shard.reload_credentials(force=True)

    for sig, handler in ((signal.SIGINT, on_signal), (signal.SIGTERM, on_signal), (signal.SIGHUP, on_hangup)):
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


async def _build(
    build: Callable[[], Shard | PendingShard], stop: asyncio.Event, http: HttpServer
) -> Shard | PendingShard | None:
    """The shard from `build`, on a thread while HTTP answers; None if stopped meanwhile."""
    slow = asyncio.get_running_loop().call_later(  # said only when it takes a while: a bad flag's error stays
        2.0,  # one line
        log.info,
        "loading the model and the checkpoint%s",
        f"; health on {http.base}:{http.bound}/healthz" if http.bound else "",
    )
    try:
        built = await asyncio.to_thread(build)
    finally:
        slow.cancel()
    return None if stop.is_set() else built


def _write_ready(ready_file: str | None, grpc_port: int, http_port: int | None, shard: int) -> None:
    if ready_file:
        ports = {"grpc_port": grpc_port, "http_port": http_port, "shard": shard}
        atomic_write_text(ready_file, json.dumps(ports))


async def _serve_grpc(
    source: Shard | PendingShard,
    holder: Holder,
    config: ShardConfig,
    http_bound: int | None,
    stop: asyncio.Event,
    connections: tuple[int, int],
) -> None:
    limits, host = config.limits, config.host
    # Sessions and Fetches are counted (and refused) by the gates, calls waiting for their request by the
    # gates' interceptor; past this many calls at once (room for all of those and 64 Joins or Pieces being
    # answered) gRPC refuses more
    server = make_server(
        grpc_options(limits, config.link, connections[0], receive_limit(source.push_bytes)),
        2 * limits.max_sessions + limits.max_waiting_calls + 64,
        [source.gates.waiting],
    )
    source.attach(server)
    bound = _add_port(server, config)
    written = False

    async def waiting() -> None:  # the pending shard listens, and waits for the first worker's upload
        nonlocal written
        await server.start()
        holder.to("waiting for the first worker's parameters", awaiting_first=True)
        log.info(
            "shard %d/%d: gRPC on %s:%d; waiting for the first worker's model and parameters (--init %s)",
            config.shard, config.num_shards, host, bound, FROM_WORKER,
        )  # fmt: skip
        _write_ready(config.ready_file, bound, http_bound, config.shard)  # after the line: a reader sees it
        written = True

    try:
        shard = await source.started(stop, waiting)  # the running shard: its starting state checkpointed
    except BaseException:
        await server.stop(grace=None)
        raise
    if shard is None:  # stopped before any worker came: nothing to save
        holder.to("stopping")
        await server.stop(grace=1.0)
        return
    if not written:
        await server.start()
    holder.to("serving", shard)
    _log_serving(shard, config, bound, http_bound, connections)
    if not written:
        _write_ready(config.ready_file, bound, http_bound, config.shard)
    try:
        await shard.run(stop)
    finally:
        log.info("shard %d stopping", config.shard)
        holder.to("stopping")
        await server.stop(grace=1.0)
        await shard.finish()


def _add_port(server: grpc.aio.Server, config: ShardConfig) -> int:
    """Listen on the config's host and port (TLS where it says); the port bound."""
    host, port = config.host, config.port
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if config.tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, config.tls.grpc_credentials())
    except RuntimeError:  # grpc's way of saying the address is in use or not ours
        bound = 0
    if bound == 0:
        raise bind_error("--port", host, port, probe(host, port), "another shard")
    return bound


def _log_serving(
    shard: Shard, config: ShardConfig, bound: int, http_bound: int | None, connections: tuple[int, int]
) -> None:
    st, auth, tls, limits = shard.state, config.auth, config.tls, config.limits
    http_base = f"{'https' if tls else 'http'}://{config.http_host or config.host}"
    log.info(
        "shard %d/%d: gRPC%s on %s:%d%s; %d fragments, %s values in this shard's slices; workers need %s",
        st.shard,
        st.num_shards,
        " (mutual TLS)" if tls and tls.mutual else " (TLS)" if tls else "",
        config.host,
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
