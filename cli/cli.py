"""The `streamdiloco` command: subcommands, their flags, and one-line errors for bad configuration."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from streamdiloco import __version__
from streamdiloco.compare import SETUPS, add_sim_flags, cmd_compare, cmd_simulate

# The config file's sections that `launch` resolves and writes to OUT/run.toml for its shards and workers
LAUNCH_SECTIONS = ("model", "run", "sync", "inner", "server", "robust", "limits", "link", "worker", "pieces")
WORKER_SECTIONS = ("model", "run", "sync", "inner", "link", "worker", "pieces")

# Each section of the config file (cli/settings.py) as a group of flags in --help
_TITLES = {
    "model": "model (the same on shards and workers)",
    "run": "run",
    "sync": "Streaming DiLoCo (shards and workers must agree)",
    "inner": "inner optimizer (AdamW)",
    "server": "rounds (every shard of a run alike)",
    "robust": "defenses against workers' pushes (on by default)",
    "limits": "limits: what clients may make the shard hold",
    "link": "liveness and flow control (each end's own: shards and workers)",
    "worker": "worker (every worker of a run alike)",
    "pieces": "run-wide data assignment (shard 0's ledger of pieces)",
}


def _add_settings(
    p: argparse.ArgumentParser,
    sections: tuple[str, ...],
    titles: dict[str, str] | None = None,
    help_for: dict[str, str] | None = None,
) -> None:
    """--config and one group of flags per section (each field of its dataclass, cli/settings.py); main()
    resolves them (command line > config file > default) before the command runs."""
    from streamdiloco.settings import add_flags, section_classes

    p.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help="read the run's settings from this file (sections "
        + ", ".join(f"[{s}]" for s in sections)
        + "; `streamdiloco config` writes one); flags given here override it",
    )
    classes = section_classes()
    for section in sections:
        title = (titles or {}).get(section) or _TITLES[section]
        add_flags(p.add_argument_group(f"{title} [{section}]"), classes[section], help_for=help_for)
    p.set_defaults(sections=sections)


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


def _add_worker_security_flags(g) -> None:
    g.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="read the token from this file (workers/NAME.token): not on the command line, where ps shows it",
    )
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="connect over TLS, trusting the run's CA (ca.pem) for the shards' certificates",
    )
    g.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="mutual TLS: this worker's certificate (NAME.pem)"
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="mutual TLS: its private key (NAME.key)")


def _pick(cls, v: dict) -> dict:
    return {f.name: v[f.name] for f in dataclasses.fields(cls) if f.name in v}


def build_parser() -> argparse.ArgumentParser:
    from streamdiloco.common.logs import ArgumentParser

    p = ArgumentParser(
        prog="streamdiloco",
        description="Streaming DiLoCo: train one model on GPUs joined only by the internet.",
    )
    p.add_argument("--version", action="version", version=f"streamdiloco {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sp = sub.add_parser(
        "simulate",
        help="run M workers and the server's aggregation in one process",
        description="Run M workers and the server's aggregation in one process "
        "(--method dp: the data-parallel baseline).",
    )
    sp.add_argument(
        "--method",
        default="streaming",
        choices=["streaming", "dp"],
        help="streaming (Streaming DiLoCo; P=1, tau=0 is DiLoCo) or dp (data-parallel)",
    )
    add_sim_flags(sp)
    sp.add_argument("--json", default=None, metavar="PATH", help="write the final figures to this JSON file")
    sp.set_defaults(func=cmd_simulate)

    cp = sub.add_parser(
        "compare",
        help="run several setups side by side; print a table, save a plot",
        description="Run named setups at equal tokens and seed; print a table of eval loss and "
        "traffic against data-parallel, and save a plot of eval loss vs tokens.",
    )
    cp.add_argument("--setups", default="dp,full", help=f"comma-separated, from: {', '.join(SETUPS)}")
    add_sim_flags(cp)
    cp.set_defaults(method="streaming")
    cp.add_argument("--workers-list", default=None, help="comma-separated M values (default: --workers)")
    cp.add_argument("--out", default="runs/compare", help="folder for results.md, results.json, loss.png")
    cp.set_defaults(func=cmd_compare)

    sv = sub.add_parser(
        "server",
        help="run one shard of the outer-optimizer server",
        description="Run shard s of S: it owns slice s of every fragment, aggregates the workers' pushes, "
        "runs the outer Nesterov step and streams the quantized update back. Start one per shard with the "
        "same model as the workers (--model), or from the model's parameters alone (--init FILE: no model "
        "code on the shard), and the same Streaming DiLoCo settings (flags, or the same --config file): "
        "workers take these from the shard at Join unless they set them.",
    )
    g = sv.add_argument_group("shard")
    g.add_argument("--shard", type=int, default=0, help="this shard's index s (default 0)")
    g.add_argument("--num-shards", type=int, default=1, help="S, the number of shards (default 1)")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all; default %(default)s)"
    )
    g.add_argument(
        "--port", type=int, default=7070, help="gRPC port, 0 picks a free one (default %(default)s)"
    )
    g.add_argument("--http-port", type=int, default=8080, help="HTTP status port (default %(default)s)")
    g.add_argument("--ready-file", default=None, help="write the bound ports here (JSON) once serving")
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
    g.add_argument(
        "--init",
        default=None,
        metavar="PATH",
        help="start from these parameters: a state_dict saved with torch.save(model.state_dict(), PATH), or "
        "a safetensors file from `streamdiloco export`. Without --model the file is the model: names, "
        "shapes, dtypes and values come from it, the blocks from its fingerprint, --blocks-path or the "
        "names (the log says which). `--init from-worker`: no model and no file: the first worker to join "
        "sends its layout and parameters (written to the checkpoint at once; every later worker must match)",
    )
    g.add_argument(
        "--init-expect",
        default=None,
        metavar="SHA256",
        help="with --init from-worker: take only an upload of these starting parameters, named by their init "
        "hash (64 hex digits: `streamdiloco init-hash` prints it for a model and seed); any other is refused",
    )
    g.add_argument(
        "--init-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --init from-worker: an upload that sends no values for this long is refused and frees "
        "the only upload slot (default %(default)s)",
    )
    g.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="written every round and on shutdown; a shard started again resumes from it "
        "(default: checkpoints/shard-S-of-N)",
    )
    g.add_argument("--no-checkpoint", action="store_true", help="keep no checkpoint (a restart starts over)")
    g.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run even if --checkpoint-dir holds one (replaces it)",
    )
    _add_shard_flags(g)
    _add_server_security_flags(sv.add_argument_group("security (needed beyond loopback: see README)"))
    _add_settings(sv, ("model", "sync", "server", "robust", "limits", "link", "pieces"))
    sv.set_defaults(func=_cmd_server)

    wk = sub.add_parser(
        "worker",
        help="train and sync with the shards",
        description="Join every shard, fetch the global parameters, then train; fragments are pushed in "
        "the background and their updates merged tau steps later.",
    )
    g = wk.add_argument_group("worker")
    g.add_argument("--servers", required=True, help="every shard as HOST:PORT, comma-separated")
    g.add_argument("--name", default=None, help="a unique name for this worker (default: host-pid)")
    g.add_argument("--rank", type=int, default=None, help="seeds the data stream (default: from the name)")
    g.add_argument("--token", default="", help="this worker's token, or the run's shared one (--token-file)")
    _add_worker_security_flags(g)
    g.add_argument("--summary", default=None, metavar="PATH", help="write the final figures (JSON) here")
    g.add_argument("--save-global", default=None, metavar="PATH", help="torch.save the global fragments here")
    g.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="this worker's checkpoint (default: checkpoints/NAME.pt), written every --checkpoint-every "
        "steps and when it stops",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint (with the same --name, or --checkpoint PATH)",
    )
    g.add_argument(
        "--auto-resume",
        action="store_true",
        help="resume if the checkpoint exists, else join as a new worker (for restart policies)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port at /metrics (default: none; 0 picks a free port)",
    )
    g.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for --metrics-port (0.0.0.0: every interface, with --insecure: the metrics are served "
        "without TLS or a token)",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow --metrics-host beyond loopback: plain HTTP, no token (a private network only)",
    )
    g.add_argument(
        "--wandb-run-name",
        default=None,
        metavar="NAME",
        help="with --wandb-project: this worker's W&B run name (default: its --name)",
    )
    _add_settings(wk, WORKER_SECTIONS)
    wk.set_defaults(func=_cmd_worker)

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
    _add_settings(
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
    _add_settings(cf, LAUNCH_SECTIONS)
    cf.set_defaults(func=_cmd_config)

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

    from streamdiloco.init_hash import add_init_hash_parser

    add_init_hash_parser(sub, _add_settings)

    from streamdiloco.export_flags import add_export_parser

    add_export_parser(sub)
    from streamdiloco.data import add_data_parser

    add_data_parser(sub)
    from streamdiloco.credit_cmd import add_ledger_parser

    add_ledger_parser(sub)

    from streamdiloco.common.logs import add_log_flags

    for command in sub.choices.values():  # every command logs alike (each process its own way)
        add_log_flags(command)
    return p


def _cmd_server(args: argparse.Namespace) -> int:
    from streamdiloco.checks import check_server

    plan = check_server(args)  # one-line errors before torch is imported and anything listens
    blocks_path, fragments = _layout(args)
    checkpoint_dir = (
        None
        if args.no_checkpoint
        else args.checkpoint_dir or f"checkpoints/shard-{args.shard}-of-{args.num_shards}"
    )
    from streamdiloco.server.storage.dirlock import lock_directory

    # held until this process ends: a second shard on the directory (--fresh or not) refuses, naming this one
    lock = lock_directory(checkpoint_dir) if checkpoint_dir else None

    import asyncio

    from streamdiloco.server.main import build_service, serve

    def build():  # in serve()'s thread, while HTTP already answers /healthz
        return build_service(
            plan.cfg,
            # with --init (a file, or from-worker) and no --model given: no model code on the shard
            args.model if "model" in args.settings.given["model"] or not args.init else None,
            args.shard,
            args.num_shards,
            seed=args.seed,
            block_size=args.block_size,
            min_workers=args.min_workers,
            round_timeout=args.round_timeout,
            quorum=args.quorum,
            round_grace=args.round_grace,
            token=args.token,
            chunk_bytes=args.chunk_bytes,
            init=args.init,
            checkpoint_dir=checkpoint_dir,
            fresh=args.fresh,
            robust=plan.robust,
            auth=plan.auth,
            workers_file=plan.workers_file,
            limits=plan.limits,
            blocks_path=blocks_path,
            fragments=fragments,
            piece_tokens=args.piece_tokens,
            init_expect=args.init_expect,
            init_timeout=args.init_timeout,
        )

    asyncio.run(
        serve(
            build,
            args.host,
            args.port,
            args.http_port,
            args.ready_file,
            http_host=plan.http_host,
            tls=plan.tls,
            auth=plan.auth,
            limits=plan.limits,
            link=plan.link,
            peers=plan.peers,
        )
    )
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
    from streamdiloco.checks import check_worker, read_token_file
    from streamdiloco.common.logs import error_line

    servers = check_worker(args)  # one-line errors before torch is imported

    from streamdiloco.worker.connection import SyncError
    from streamdiloco.worker.group import GroupError
    from streamdiloco.worker.run import WorkerConfig, run_worker

    v = vars(args)
    # WorkerConfig's fields beside its sections: this process's own
    top = {
        k: x for k, x in _pick(WorkerConfig, v).items() if k not in (*WORKER_SECTIONS, "servers", "sync_set")
    }
    if top.get("name") is None:
        if args.resume or (args.auto_resume and Path(args.checkpoint).exists()):
            from streamdiloco.worker.checkpoint import checkpoint_name

            flag = "--resume" if args.resume else "--auto-resume"
            top["name"] = checkpoint_name(args.checkpoint, flag)  # the name it was written under
        else:
            top.pop("name", None)
    top["token"] = read_token_file(args)
    from streamdiloco.common.config import SyncConfig

    # the [sync] settings given by flag or --config file; the rest: the shard's
    given = {k: x for k, x in _pick(SyncConfig, v).items() if k in args.sync_set}
    cfg = WorkerConfig(
        servers=servers,
        **top,
        sync=SyncConfig.given(given),
        sync_set=frozenset(args.sync_set),
        **{s: args.settings.build(s) for s in WORKER_SECTIONS if s != "sync"},
    )
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
