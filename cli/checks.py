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
import dataclasses
from pathlib import Path
from typing import Any

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


def check_server(args: argparse.Namespace) -> Any:
    """A shard's flags and settings as its ShardConfig (server/config.py), checked before anything is
    imported that needs torch or listens."""
    from streamdiloco.server.config import ShardConfig

    sections = check_sections(args)
    if "model" in args.settings.given["model"] or not args.init:  # the shard builds the model
        check_model(args)
    args.token = read_token_file(args)
    tls, auth, workers_file, http_host = server_security(args)
    checkpoint_dir = (
        None
        if args.no_checkpoint
        else args.checkpoint_dir or f"checkpoints/shard-{args.shard}-of-{args.num_shards}"
    )
    return ShardConfig(
        **{
            name: sections[name] for name in ("model", "sync", "server", "robust", "limits", "link", "pieces")
        },
        shard=args.shard,
        num_shards=args.num_shards,
        # with --init (a file, or from-worker) and no --model given: no model code on the shard
        has_model="model" in args.settings.given["model"] or not args.init,
        init=args.init,
        init_expect=args.init_expect,
        init_timeout=args.init_timeout,
        init_min_rate=args.init_min_rate,
        checkpoint_dir=checkpoint_dir,
        fresh=args.fresh,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        http_host=http_host,
        ready_file=args.ready_file,
        tls=tls,
        peers=_peers(args, auth),
        auth=auth,
        workers_file=workers_file,
    )


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


def check_worker(args: argparse.Namespace) -> Any:
    """A worker's flags and settings as its WorkerConfig (worker/config.py: it checks the shards' addresses,
    the metrics port and the TLS files), before torch is imported: the settings sections (but [sync], which
    the shard completes at Join: only what was given is kept), --model, the token, what --resume needs,
    --data."""
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.flags import own_values
    from streamdiloco.worker.config import WorkerConfig

    sections = check_sections(args, tuple(s for s in args.sections if s != "sync"))
    check_model(args)
    if args.metrics_port is not None:
        check_metrics_host(args.metrics_host, args.insecure)
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
    own = {**own_values(WorkerConfig, args), "token": read_token_file(args)}  # --servers, --name, ...
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(SyncConfig) if f.name in args.sync_set}
    return WorkerConfig(**own, sync=SyncConfig.given(given), sync_set=frozenset(args.sync_set), **sections)
