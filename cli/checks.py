"""What each subcommand checks before it imports torch: its flags, its settings sections, the TLS and
credential files, ports and paths, each with the one-line ValueError that main() prints (exit 2).

A bad invocation so answers in well under a second, where importing torch alone took seconds. This module
and what it imports must stay torch-free (tests/test_help.py checks it): the settings' dataclasses, the
shard's TLS and credential plan (server/trust/auth.py), the model spec (its factory, or an hf: config file),
the text file. What needs the model or the network (the blocks a fragment count needs, whether an hf: config
is a causal LM, a checkpoint's contents) is checked later, where the command runs.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.modelspec import check_spec


def check_sections(args: argparse.Namespace, sections: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every settings section of the command (or `sections`), built: each dataclass's checks, now."""
    return {s: args.settings.build(s) for s in (sections or args.sections)}


def check_data(path: str | None) -> None:
    """--data: a missing or empty file, or a prepared folder whose manifest or files do not hold, is a
    one-line error (a prepared folder's hash is checked by `streamdiloco data check`, not at every start)."""
    if path is None:
        return
    from streamdiloco.common.prepared import PreparedData, PreparedDataError, looks_prepared

    if looks_prepared(path):
        try:
            PreparedData.open(path)
        except PreparedDataError as e:
            raise ValueError(f"--data {path}: {e}") from None
        return
    from streamdiloco.worker.text import load_text

    load_text(path)


def check_model(args: argparse.Namespace) -> None:
    """--model: a built-in preset, a module.path:factory that imports and names a callable, or hf:PATH whose
    config reads (common/modelspec.py's check_spec)."""
    check_spec(args.model)


def read_token_file(args: argparse.Namespace) -> str:
    """--token or --token-file (not both): the token."""
    if not args.token_file:
        return args.token
    from streamdiloco.common.tls import read_secret

    if args.token:
        raise ValueError("give --token or --token-file, not both")
    return read_secret(args.token_file, "--token-file")


@dataclass(frozen=True)
class ServerPlan:
    """A shard's flags, checked: what `server` hands to build_service and serve."""

    cfg: SyncConfig
    robust: Any  # server/rounds/robust.py's RobustConfig
    limits: Any  # server/trust/bounds.py's Limits
    link: Any  # common/keepalive.py's LinkSettings
    tls: Any  # common/tls.py's ServerTLS, or None
    auth: Any  # server/trust/auth.py's Auth
    workers_file: Any  # server/trust/auth.py's WorkersFile, or None
    http_host: str
    peers: Any  # server/observe/run_view.py's Peers


def check_server(args: argparse.Namespace) -> ServerPlan:
    """A shard's flags and settings, checked before anything is imported that needs torch or listens."""
    sections = check_sections(args)
    if not 0 <= args.shard < args.num_shards:
        raise ValueError(f"shard index {args.shard} is outside [0, {args.num_shards - 1}]")
    if args.min_workers < 1:
        raise ValueError(f"--min-workers must be at least 1, got {args.min_workers}")
    for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
        if not 0 <= port <= 65535:
            raise ValueError(f"{flag} must be 0..65535, got {port}")
    if "model" in args.settings.given["model"] or not args.init:  # the shard builds the model
        check_model(args)
    check_init_flags(args)
    args.token = read_token_file(args)
    tls, auth, workers_file, http_host = server_security(args)
    peers = _peers(args, auth)
    return ServerPlan(
        sections["sync"],
        sections["robust"],
        sections["limits"],
        sections["link"],
        tls,
        auth,
        workers_file,
        http_host,
        peers,
    )


def check_init_flags(args: argparse.Namespace) -> None:
    """--init-expect (an init hash: 64 hex digits) and --init-timeout go with --init from-worker."""
    if args.init_expect is not None:
        if args.init != "from-worker":
            raise ValueError("--init-expect pins the first worker's upload: it goes with --init from-worker")
        if not re.fullmatch(r"[0-9a-fA-F]{64}", args.init_expect.strip()):
            raise ValueError(
                "--init-expect takes an init hash, 64 hex digits (`streamdiloco init-hash` prints it), "
                f"got {args.init_expect[:80]!r}"
            )
    if not 0 < args.init_timeout < float("inf"):
        raise ValueError(f"--init-timeout must be a positive number of seconds, got {args.init_timeout}")


def server_security(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """(TLS, Auth, workers file, HTTP host) from a shard's flags; ValueError (one line) for a setup that
    must not start: see server/trust/auth.py's listen_plan."""
    from streamdiloco.common.tls import ServerTLS, read_secret
    from streamdiloco.server.trust.auth import Auth, WorkersFile, listen_plan

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together (the shard's certificate and its key)")
    if args.tls_client_ca and args.tls_cert is None:
        raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    if args.read_token and args.read_token_file:
        raise ValueError("give --read-token or --read-token-file, not both")
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    workers_file = WorkersFile(args.workers_file) if args.workers_file else None
    read_token = args.read_token
    if args.read_token_file:
        read_token = read_secret(args.read_token_file, "--read-token-file")
    auth = Auth(
        token=args.token,
        workers=workers_file.load() if workers_file else None,
        certificates=tls is not None and tls.mutual,
        read_token=read_token,
        names_per_token=args.names_per_token,
    )
    http_host = listen_plan(args.host, args.http_host, tls is not None, auth, args.insecure)
    return tls, auth, workers_file, http_host


def _peers(args: argparse.Namespace, auth: Any) -> Any:
    """The run's shards for the dashboard's run view (--peers), read with this shard's read token."""
    from streamdiloco.common.tls import read_pem
    from streamdiloco.server.observe.run_view import Peers, check_peers, parse_peers

    ca = args.peers_ca or args.tls_client_ca
    if args.peers_ca:
        read_pem(args.peers_ca, "--peers-ca", "certificate")
    urls = parse_peers(args.peers)
    check_peers(urls, auth.read_token, args.insecure)
    return Peers(urls, auth.read_token, ca)


def check_metrics_host(host: str, insecure: bool) -> None:
    """A worker's metrics serve plain HTTP without a token: beyond loopback only when the user says
    --insecure (a private network, or a container network that Prometheus scrapes), as a shard's HTTP."""
    from streamdiloco.common.tls import is_loopback

    if not is_loopback(host) and not insecure:
        raise ValueError(
            f"refusing to serve metrics on --metrics-host {host}: a worker's /metrics has neither TLS nor a "
            "token; keep it on 127.0.0.1 (scrape through a tunnel), or say --insecure on a private network"
        )


def check_worker(args: argparse.Namespace) -> tuple[str, ...]:
    """A worker's flags and settings (but [sync], which the shard completes at Join), checked: the shards'
    addresses (returned), the settings sections, --model, the TLS files, the token, what --resume needs,
    --data."""
    from streamdiloco.common.ports import parse_target
    from streamdiloco.common.tls import client_tls

    servers = tuple(s.strip() for s in args.servers.split(",") if s.strip())
    if not servers:
        raise ValueError("--servers: give at least one shard as HOST:PORT")
    for target in servers:
        parse_target(target)
    sections = check_sections(args, tuple(s for s in args.sections if s != "sync"))
    check_model(args)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if args.metrics_port is not None:
        check_metrics_host(args.metrics_host, args.insecure)
    client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    if args.token_file:
        read_token_file(args)
    if args.name is None and (args.resume or args.auto_resume) and not args.checkpoint:
        # the default name (host-pid) changes from one start to the next
        flag = "--resume" if args.resume else "--auto-resume"
        raise ValueError(f"{flag} needs the worker's --name (or its --checkpoint PATH)")
    if args.resume:
        path = Path(args.checkpoint) if args.checkpoint else Path("checkpoints") / f"{args.name}.pt"
        if not path.exists():
            raise ValueError(
                f"--resume: no checkpoint at {path} (give the --name the worker had, or --checkpoint PATH)"
            )
    check_data(sections["run"].data)
    return servers
