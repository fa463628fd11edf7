"""The `streamdiloco` command: subcommands, their flags, and one-line errors for bad configuration."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from streamdiloco import __version__
from streamdiloco.compare import add_compare_parser, add_simulate_parser
from streamdiloco.flags import add_own_flags, add_settings, add_token_file_flag

# The config file's sections that `launch` resolves and writes to OUT/run.toml for its shards and workers
LAUNCH_SECTIONS = ("model", "run", "sync", "inner", "server", "robust", "limits", "link", "worker", "pieces")
WORKER_SECTIONS = ("model", "run", "sync", "inner", "link", "worker", "pieces")


def _layout(args: argparse.Namespace):
    """(blocks_path, fragment groups) from the [model] settings; ValueError (one line) for bad ones."""
    model = args.settings.build("model")
    return model.blocks_path, model.fragment_groups


def _add_shard_flags(g) -> None:
    g.add_argument(
        "--token",
        default="",
        help="the simple mode: one secret shared by every worker (any holder may use any name); "
        "--workers-file binds each name to its own token",
    )
    g.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="--token, read from this file: not on the command line, where ps shows it",
    )
    g.add_argument(
        "--names-per-token",
        type=int,
        default=1,
        metavar="N",
        help="worker names the run token (--token) may hold sessions for at once on this shard (default "
        "1): the robust averaging counts names, so one token holder must not make up many; give N for N "
        "workers that share the token. Per-worker tokens and certificates bind one name each",
    )


def _add_server_security_flags(g) -> None:
    g.add_argument(
        "--tls-cert",
        default=None,
        metavar="PEM",
        help="this shard's certificate (`streamdiloco certs` makes server.pem): gRPC and HTTP over TLS",
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    g.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PEM",
        help="mutual TLS: every worker must show a certificate signed by this CA (ca.pem); its common "
        "name is the worker's name",
    )
    g.add_argument(
        "--workers-file",
        default=None,
        metavar="PATH",
        help="per-worker tokens: lines NAME SHA256-HEX (`streamdiloco certs` writes workers.txt); a token "
        "proves its name only. Re-read when it changes (or on SIGHUP): a worker removed or changed there "
        "is cut off at once",
    )
    g.add_argument(
        "--read-token",
        default="",
        help="/api/*, /metrics and the dashboard need it (Authorization: Bearer TOKEN, or ?token= for the "
        "page); /healthz and /readyz stay open",
    )
    g.add_argument("--read-token-file", default=None, metavar="PATH", help="--read-token, from a file")
    g.add_argument(
        "--http-host",
        default=None,
        help="where the HTTP port listens (default: --host; but 127.0.0.1 when --host is beyond loopback "
        "and no read token is given)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without TLS or without credentials (a private network only)",
    )


def _add_metrics_insecure_flag(g) -> None:
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow --metrics-host beyond loopback: plain HTTP, no token (a private network only)",
    )


def build_parser() -> argparse.ArgumentParser:
    """`streamdiloco`'s parser: one subcommand per command, each declared by its own function (the light
    modules only: a command imports what it runs when it runs)."""
    from streamdiloco.common.logs import ArgumentParser, add_log_flags
    from streamdiloco.credit_cmd import add_credits_parser
    from streamdiloco.data import add_data_parser
    from streamdiloco.export_flags import add_export_parser
    from streamdiloco.init_hash import add_init_hash_parser

    p = ArgumentParser(
        prog="streamdiloco",
        description="Streaming DiLoCo: train one model on GPUs joined only by the internet.",
    )
    p.add_argument("--version", action="version", version=f"streamdiloco {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in (
        add_simulate_parser,
        add_compare_parser,
        _add_server_parser,
        _add_worker_parser,
        _add_launch_parser,
        _add_config_parser,
        _add_certs_parser,
        _add_token_parser,
        add_init_hash_parser,
        add_export_parser,
        add_data_parser,
        add_credits_parser,
    ):
        add_parser(sub)
    # every command logs alike (each process its own way); a command under two names (an alias) once
    for command in {id(c): c for c in sub.choices.values()}.values():
        add_log_flags(command)
    return p


def _add_peers_flags(g) -> None:
    g.add_argument(
        "--peers",
        default="",
        metavar="URL,...",
        help="every shard's HTTP address (http(s)://HOST:PORT, comma-separated): the dashboard then shows "
        "the whole run (launch sets it)",
    )
    g.add_argument(
        "--peers-ca",
        default=None,
        metavar="PEM",
        help="the CA of the peers' HTTPS certificates (default: --tls-client-ca, the run's CA)",
    )


def _add_no_checkpoint(g) -> None:
    g.add_argument("--no-checkpoint", action="store_true", help="keep no checkpoint (a restart starts over)")


def _add_server_parser(sub: argparse._SubParsersAction) -> None:
    """`server`: one shard; its own flags, its security and the settings sections it reads."""
    sv = sub.add_parser(
        "server",
        help="run one shard of the outer-optimizer server",
        description="Run shard s of S: it owns slice s of every fragment, aggregates the workers' pushes, "
        "runs the outer Nesterov step and streams the quantized update back. Start one per shard with the "
        "same model as the workers (--model), or from the model's parameters alone (--init FILE: no model "
        "code on the shard), and the same Streaming DiLoCo settings (flags, or the same --config file): "
        "workers take these from the shard at Join unless they set them.",
    )
    from streamdiloco.server.config import ShardConfig

    g = sv.add_argument_group("shard")
    # the shard's own fields (server/config.py), in their order; --peers and --no-checkpoint feed others
    add_own_flags(g, ShardConfig, then={"ready_file": _add_peers_flags, "checkpoint_dir": _add_no_checkpoint})
    _add_shard_flags(g)
    _add_server_security_flags(sv.add_argument_group("security (needed beyond loopback: see README)"))
    add_settings(sv, ("model", "sync", "server", "robust", "limits", "link", "pieces"))
    sv.set_defaults(func=_cmd_server)


def _add_worker_parser(sub: argparse._SubParsersAction) -> None:
    """`worker`: its own flags, made from WorkerConfig's own fields (worker/config.py), and the settings
    sections it reads."""
    from streamdiloco.worker.config import WorkerConfig

    wk = sub.add_parser(
        "worker",
        help="train and sync with the shards",
        description="Join every shard, fetch the global parameters, then train; fragments are pushed in "
        "the background and their updates merged tau steps later.",
    )
    add_own_flags(
        wk.add_argument_group("worker"),
        WorkerConfig,
        then={"token": add_token_file_flag, "metrics_host": _add_metrics_insecure_flag},
    )
    add_settings(wk, WORKER_SECTIONS)
    wk.set_defaults(func=_cmd_worker)


def _add_launch_parser(sub: argparse._SubParsersAction) -> None:
    """`launch`: S shards and M workers on this machine, with every settings section."""
    la = sub.add_parser(
        "launch",
        help="run S shards and M workers as processes on this machine",
        description="Start S shard processes and M worker processes on loopback, show their progress, "
        "print a summary (eval loss of the global parameters, tokens, bytes, blocked time), and stop "
        "everything at the end or on Ctrl+C.",
    )
    g = la.add_argument_group("cluster")
    g.add_argument("--shards", type=int, default=2, help="S, shard processes (default %(default)s)")
    g.add_argument("--workers", type=int, default=2, help="M, worker processes (default %(default)s)")
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (default: this machine's cores / M; shards get 1)",
    )
    g.add_argument("--out", default="runs/launch", help="folder for logs and summary.json")
    g.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="shard s serves its dashboard, /metrics and /api/status on this port + s (default: free ports)",
    )
    g.add_argument(
        "--save-global",
        action="store_true",
        help="also save masters.pt, model.safetensors (as `export`) and each worker's mirror",
    )
    g.add_argument(
        "--tls",
        action="store_true",
        help="run as on the internet: make the run's credentials in OUT/certs (streamdiloco certs) and use "
        "mutual TLS, a token per worker and a read token for the shards' HTTP",
    )
    g.add_argument(
        "--print-config",
        action="store_true",
        help="print the run's settings as a config file (what launch writes to OUT/run.toml) and exit",
    )
    add_settings(
        la,
        LAUNCH_SECTIONS,
        titles={"robust": "the shards' defenses (as `server`)"},
        help_for={
            "min_workers": "contributions a round needs before it may close (default: all M workers)",
            "max_weight": "tokens one worker can process between two syncs of a fragment (default: "
            "batch x context x H of this run)",
        },
    )
    la.set_defaults(func=_cmd_launch)


def _add_config_parser(sub: argparse._SubParsersAction) -> None:
    """`config`: write the run's settings as a config file."""
    cf = sub.add_parser(
        "config",
        help="write a config file of the run's settings (the defaults, a --config file and flags)",
        description="Print (or write to --out) a complete config file: every setting of every section, "
        "each with its help as a comment, from the defaults, overridden by a --config file and then by the "
        "flags given here. Shards, workers and launch read it with --config FILE.",
    )
    cf.add_argument("--out", default=None, metavar="PATH", help="write the file here (default: print it)")
    cf.add_argument(
        "--print", action="store_true", help="print the file (the default when --out is not given)"
    )
    add_settings(cf, LAUNCH_SECTIONS)
    cf.set_defaults(func=_cmd_config)


def _add_certs_parser(sub: argparse._SubParsersAction) -> None:
    """`certs`: a run's credentials."""
    ce = sub.add_parser(
        "certs",
        help="make a run's CA, server and worker certificates, worker tokens and read token",
        description="Make a run's credentials in a folder, with Python's cryptography: ca.pem/ca.key (the "
        "run's own CA), server.pem/server.key (for every shard; --server-names are the names and addresses "
        "workers dial, plus localhost, 127.0.0.1 and ::1), workers/NAME.pem/.key/.token (one client "
        "certificate and token per worker), workers.txt (NAME SHA256-HEX lines for the shards' "
        "--workers-file) and read.token (for --read-token-file). Secrets are written readable by their "
        "owner only. Run it again with new --workers to add workers: the CA and the rest are kept.",
    )
    ce.add_argument("--out", required=True, metavar="DIR", help="the folder (created if missing)")
    ce.add_argument(
        "--server-names",
        default=None,
        help="comma-separated host names and IP addresses of the shards, as workers dial them (given again, "
        "the server certificate is remade)",
    )
    ce.add_argument("--workers", default="", help="comma-separated worker names (letters, digits, . _ -)")
    ce.add_argument("--days", type=int, default=365, help="certificates' validity (default %(default)s days)")
    ce.set_defaults(func=_cmd_certs)


def _add_token_parser(sub: argparse._SubParsersAction) -> None:
    """`token`: one worker's token."""
    tk = sub.add_parser(
        "token",
        help="make one worker's token and print its line for the workers file",
        description="Write a new random token for worker NAME to --out (readable by its owner only), print "
        "`NAME SHA256-HEX`: append that line to the shards' --workers-file (they re-read it) and give the "
        "token file to the worker (--token-file). To revoke a worker, delete its line.",
    )
    tk.add_argument("name", help="the worker's name")
    tk.add_argument(
        "--out", required=True, metavar="PATH", help="the token file to write (never overwritten)"
    )
    tk.set_defaults(func=_cmd_token)


def _cmd_server(args: argparse.Namespace) -> int:
    from streamdiloco.checks import check_server

    config = check_server(args)  # one-line errors before torch is imported and anything listens
    from streamdiloco.server.storage.dirlock import lock_directory

    # held until this process ends: a second shard on the directory (--fresh or not) refuses, naming this one
    lock = lock_directory(config.checkpoint_dir) if config.checkpoint_dir else None

    import asyncio

    from streamdiloco.server.main import serve
    from streamdiloco.server.startup import build_shard

    # built in serve()'s thread, while HTTP already answers /healthz
    asyncio.run(serve(lambda: build_shard(config), config))
    if lock is not None:
        lock.release()
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from streamdiloco.settings import config_file

    text = config_file(args.settings)  # raises a one-line ValueError for settings that would not start a run
    if args.out is None or args.print:
        print(text, end="")
    if args.out is not None:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    from streamdiloco.certs import make_certs

    names = [n.strip() for n in args.server_names.split(",") if n.strip()] if args.server_names else None
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    if not 1 <= args.days <= 3650:
        raise ValueError(f"--days must be 1..3650, got {args.days}")
    written = make_certs(args.out, names, workers, args.days)
    for path in written:
        print(path)
    print(
        f"shards: --tls-cert {args.out}/server.pem --tls-key {args.out}/server.key "
        f"--tls-client-ca {args.out}/ca.pem --workers-file {args.out}/workers.txt "
        f"--read-token-file {args.out}/read.token"
    )
    print(
        f"worker NAME: --name NAME --tls-ca {args.out}/ca.pem --tls-cert {args.out}/workers/NAME.pem "
        f"--tls-key {args.out}/workers/NAME.key --token-file {args.out}/workers/NAME.token"
    )
    return 0


def _cmd_token(args: argparse.Namespace) -> int:
    from streamdiloco.certs import make_token

    print(make_token(args.out, args.name))
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from streamdiloco.checks import check_worker
    from streamdiloco.common.logs import error_line

    cfg = check_worker(args)  # one-line errors before torch is imported
    if args.name is None and (args.resume or (args.auto_resume and Path(args.checkpoint).exists())):
        from streamdiloco.worker.checkpoint import checkpoint_name

        flag = "--resume" if args.resume else "--auto-resume"
        cfg = dataclasses.replace(cfg, name=checkpoint_name(args.checkpoint, flag))  # the name it had
    from streamdiloco.worker.connection import SyncError
    from streamdiloco.worker.group import GroupError
    from streamdiloco.worker.run import run_worker

    try:
        run_worker(cfg)
    except (SyncError, GroupError) as e:
        error_line(str(e))
        return 1
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from streamdiloco.checks import check_data, check_model, check_sections

    # one-line errors before torch is imported and any process starts; launch fills in the [server] and
    # [robust] settings it knows (run_settings) and checks them there
    check_sections(args, ("model", "run", "sync", "inner", "limits", "worker"))
    check_model(args)
    check_data(args.data)
    from streamdiloco.launch import run_launch

    return run_launch(args)


def main(argv: list[str] | None = None) -> int:
    from streamdiloco.common.logs import asked_format, error_line, json_logs, setup_logging

    if asked_format(sys.argv[1:] if argv is None else argv) == "json":
        setup_logging("info", "json")  # before parsing: argparse's errors are records too
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "workers_list", "unset") is None:
        args.workers_list = str(args.workers)
    try:
        setup_logging(args.log_level, args.log_format)
        if getattr(args, "sections", None):
            from streamdiloco.settings import resolve

            args.settings = resolve(args, args.sections, args.config)
        return args.func(args)
    except ValueError as e:
        error_line(str(e))
        return 2
    except OSError as e:  # a port in use, an unreadable file, ...
        error_line(str(e))
        return 1
    except KeyboardInterrupt:
        if json_logs():
            import logging

            logging.getLogger("streamdiloco").warning("interrupted")
        else:
            print("streamdiloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
