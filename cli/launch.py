"""`streamdiloco launch`: S shard processes and M worker processes on this machine (loopback), with their
output prefixed, a summary at the end, and every process stopped on exit or Ctrl+C. `make demo` runs it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from streamdiloco.common.logs import iso_time, json_logs, log_flags, setup_logging
from streamdiloco.common.ports import free_ports
from streamdiloco.settings import Settings

log = logging.getLogger("streamdiloco.launch")


def say(text: str) -> None:
    """Print, unless our stdout has gone away (`launch | head`): the children's logs keep everything."""
    try:
        print(text, flush=True)
    except OSError:
        pass


def echo_line(name: str, line: str, json_format: bool) -> str:
    """A child's line as launch shows it: `[name] line`, or with --log-format json the child's record with
    `"process": name` added (a line that is not a record, say a crash's, becomes one)."""
    if not json_format:
        return f"[{name}] {line}"
    text = line.rstrip("\n")
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        record = {
            "time": iso_time(time.time()),
            "level": "INFO",
            "logger": "streamdiloco.launch",
            "message": text,
        }
    return json.dumps({**record, "process": name}, ensure_ascii=False) + "\n"


class Cluster:
    """Child processes with prefixed output; stop() ends them all (SIGTERM, then SIGKILL)."""

    def __init__(self, out: Path, json_format: bool = False):
        self.out, self.json_format = out, json_format
        self.procs: dict[str, subprocess.Popen] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, argv: list[str], threads: int | None = None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if threads:  # torch's intra-op threads: processes sharing one machine must not oversubscribe it
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamdiloco", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.procs[name] = proc
        log = open(self.out / f"{name}.log", "w")  # noqa: SIM115 (closed by the pump thread)

        def pump() -> None:
            echo = True
            with log:
                for line in proc.stdout:  # type: ignore[union-attr]
                    log.write(line)
                    log.flush()
                    if echo:
                        try:
                            print(echo_line(name, line, self.json_format), end="", flush=True)
                        except (
                            OSError
                        ):  # our stdout went away (`launch | head`): keep the log, drain the pipe
                            echo = False

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        self.threads.append(t)
        return proc

    def stop(self, timeout: float = 20.0) -> None:
        """Workers first (they finish their step, hand in pushes on the wire and write a checkpoint), then
        shards (which write theirs)."""
        workers = [p for name, p in self.procs.items() if not name.startswith("shard")]
        shards = [p for name, p in self.procs.items() if name.startswith("shard")]
        for group in (workers, shards):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for t in self.threads:
            t.join(2)


def _wait_ready(cluster: Cluster, files: list[Path], timeout: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                last = _last_line(cluster.out / f"{name}.log")
                raise RuntimeError(
                    f"{name} exited with status {proc.returncode} before it was ready"
                    + (f": {last}" if last else "")
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"shards not ready after {timeout:.0f}s")
        time.sleep(0.1)
    return [json.loads(f.read_text()) for f in files]


def _last_line(path: Path) -> str:
    """The last line a child wrote (its one-line error, when it failed to start)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def write_targets(path: Path, shards: list[int], workers: list[int]) -> None:
    """Prometheus file_sd targets for this cluster: `file_sd_configs: [{files: [PATH]}]` scrapes it."""
    groups = [
        {"targets": [f"127.0.0.1:{p}" for p in shards], "labels": {"role": "shard"}},
        {"targets": [f"127.0.0.1:{p}" for p in workers], "labels": {"role": "worker"}},
    ]
    path.write_text(json.dumps(groups, indent=2))


def http_json(url: str, timeout: float = 10.0, ca: Path | None = None, token: str | None = None) -> dict:
    """GET a JSON page; over HTTPS trusting `ca`, with the read token if given."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
        return json.loads(r.read())


def run_max_weight(args: argparse.Namespace) -> float:
    """--max-weight for the shards: the tokens a worker of this run trains on between two syncs of a
    fragment (batch x context x H); 0 (unknown) for a model whose context length launch cannot tell."""
    from streamdiloco.worker.model import PRESETS

    block = args.block_size or (PRESETS[args.model].block_size if args.model in PRESETS else 0)
    return float(args.batch_size * block * args.sync_every)


class Credentials:
    """`launch --tls`: a fresh set of the run's credentials in OUT/certs (`streamdiloco certs`), and the
    flags that hand them to shards and workers: mutual TLS, a token per worker, a read token."""

    def __init__(self, folder: Path, workers: int):
        from streamdiloco.certs import make_certs

        if folder.exists():
            shutil.rmtree(folder)  # a new run, new credentials
        make_certs(folder, None, [f"worker-{m}" for m in range(workers)])
        self.folder, self.ca = folder, folder / "ca.pem"
        self.read_token = (folder / "read.token").read_text().strip()

    def shard_flags(self) -> list[str]:
        f = self.folder
        return [
            *("--tls-cert", str(f / "server.pem"), "--tls-key", str(f / "server.key")),
            *("--tls-client-ca", str(self.ca), "--workers-file", str(f / "workers.txt")),
            *("--read-token-file", str(f / "read.token")),
        ]

    def worker_files(self, m: int) -> tuple[Path, Path, Path]:
        """Worker m's certificate, key and token file."""
        w = self.folder / "workers" / f"worker-{m}"
        return w.with_suffix(".pem"), w.with_suffix(".key"), w.with_suffix(".token")

    def worker_flags(self, m: int) -> list[str]:
        cert, key, token = self.worker_files(m)
        return [
            "--tls-ca",
            str(self.ca),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--token-file",
            str(token),
        ]


def run_settings(args: argparse.Namespace) -> Settings:
    """The run's settings as launch hands them to every shard and worker (OUT/run.toml): the user's
    (flags > --config file > defaults), with what launch knows of its own cluster where the user left it
    unset: rounds wait for all M workers, --max-weight is a worker's tokens between two syncs, the shards
    trust the workers' reported speeds (--trust-speed), and they take as many sessions from this machine's one
    address as it runs workers."""
    settings: Settings = args.settings
    v, given = settings.values, settings.given
    if not v["server"]["min_workers"]:  # 0, as before: all of them
        v["server"]["min_workers"] = args.workers
    if "min_workers" not in given["server"]:
        v["server"]["min_workers"] = args.workers
    limits = v["limits"]
    if "max_sessions_per_peer" not in given["limits"]:  # every worker comes from this machine's address
        limits["max_sessions_per_peer"] = max(limits["max_sessions_per_peer"], args.workers)
    if "max_sessions" not in given["limits"]:
        limits["max_sessions"] = max(limits["max_sessions"], args.workers)
    if v["server"]["min_workers"] > args.workers:
        raise ValueError(
            f"--min-workers {v['server']['min_workers']} is more than --workers {args.workers}: "
            "rounds would never close"
        )
    settings.build("server")  # one-line errors before any process starts (and before torch is imported)
    if not v["robust"]["max_weight"]:  # the shards can know exactly what a worker of this run may report
        v["robust"]["max_weight"] = run_max_weight(args)
    if "trust_speed" not in given["robust"]:  # one operator's own workers: their reported speeds are believed
        v["robust"]["trust_speed"] = True
    for section in v:
        settings.build(section)
    return settings


def run_launch(args: argparse.Namespace) -> int:
    """The command: S shards, then M workers, watched until the workers end; then the summary."""
    settings = run_settings(args)
    if args.print_config:
        print(settings.to_toml(comments=True), end="")
        return 0
    out = Path(args.out)
    run_toml = _prepare_out(args, out, settings)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    # launch's own lines on stdout with its children's, in their format; the children log as launch does
    setup_logging(args.log_level, args.log_format, stream="stdout")
    creds = Credentials(out / "certs", args.workers) if args.tls else None
    scheme = "https" if creds else "http"
    cluster = Cluster(out, json_format=args.log_format == "json")
    t0 = time.monotonic()

    def on_term(signum, frame) -> None:  # `kill` or a closed terminal: stop the children as Ctrl+C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    try:
        try:
            ports = _start_shards(cluster, args, run_toml, creds)
        except RuntimeError as e:
            log.error("%s; stopping everything; see %s/*.log", e, out)
            return 1
        targets = [f"127.0.0.1:{p['grpc_port']}" for p in ports]
        metrics_ports = free_ports(args.workers)
        write_targets(out / "prometheus-targets.json", [p["http_port"] for p in ports], metrics_ports)
        page = f"/?token={creds.read_token}" if creds else "/"
        log.info(
            f"{args.shards} shards up at {', '.join(targets)}"
            + (f" (mutual TLS, credentials in {creds.folder})" if creds else "")
            + "; dashboards: "
            + ", ".join(f"{scheme}://127.0.0.1:{p['http_port']}{page}" for p in ports)
            + f"; Prometheus targets in {out / 'prometheus-targets.json'}"
        )
        workers = [
            cluster.start(
                f"worker-{m}", _worker_argv(args, m, run_toml, targets, metrics_ports[m], creds), threads
            )
            for m in range(args.workers)
        ]
        if not _watch(cluster, workers, out):
            return 1
        statuses = [
            http_json(
                f"{scheme}://127.0.0.1:{p['http_port']}/api/status",
                ca=creds.ca if creds else None,
                token=creds.read_token if creds else None,
            )
            for p in ports
        ]
        if args.save_global:
            _save_global(out, targets, creds)
        return _report(out, args.workers, statuses, time.monotonic() - t0)
    except KeyboardInterrupt:
        log.warning("interrupted: stopping every process")
        return 130
    finally:
        cluster.stop()


def _prepare_out(args: argparse.Namespace, out: Path, settings: Settings) -> Path:
    """OUT made ready (no ready file of an earlier run), its run.toml written (returned: the one source of
    the run's settings for every child), and --http-port checked, before any process starts."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.ready"):
        old.unlink()
    run_toml = out / "run.toml"
    run_toml.write_text(settings.to_toml(comments=True))
    if args.http_port and not 0 < args.http_port <= 65536 - args.shards:
        raise ValueError(
            f"--http-port {args.http_port}: shard ports {args.http_port}.. must be at most 65535"
        )
    if args.http_port:  # said now, by the flag, rather than by a shard that exits
        from streamdiloco.common.ports import bind_error, probe

        for port in range(args.http_port, args.http_port + args.shards):
            if (taken := probe("127.0.0.1", port)) is not None:
                raise bind_error("--http-port", "127.0.0.1", port, taken, "another run", args.http_port)
    return run_toml


def _start_shards(
    cluster: Cluster, args: argparse.Namespace, run_toml: Path, creds: Credentials | None
) -> list[dict]:
    """Start the S shards and wait until each serves: their ready files (the ports they bound).
    RuntimeError when one exits or does not come up."""
    out = run_toml.parent
    scheme = "https" if creds else "http"
    ready = [out / f"shard{s}.ready" for s in range(args.shards)]
    # known before the shards start: each one's dashboard shows them all (--peers)
    http_ports = (
        [args.http_port + s for s in range(args.shards)] if args.http_port else free_ports(args.shards)
    )
    peers = ",".join(f"{scheme}://127.0.0.1:{p}" for p in http_ports)
    for s in range(args.shards):
        cluster.start(
            f"shard{s}",
            ["server", "--config", str(run_toml), "--shard", str(s), "--num-shards", str(args.shards)]
            + ["--host", "127.0.0.1", "--port", "0", "--http-port", str(http_ports[s]), "--peers", peers]
            + ["--ready-file", str(ready[s]), *log_flags(args.log_level, args.log_format)]
            + ["--checkpoint-dir", str(out / f"shard{s}-checkpoint"), "--fresh"]
            + (creds.shard_flags() if creds else []),
            threads=1,  # a shard's arithmetic is small next to a worker's
        )
    return _wait_ready(cluster, ready)


def _worker_argv(
    args: argparse.Namespace,
    m: int,
    run_toml: Path,
    targets: list[str],
    metrics_port: int,
    creds: Credentials | None,
) -> list[str]:
    """Worker m's command line: the run's config, the shards, its name, files and credentials."""
    out = run_toml.parent
    argv = ["worker", "--config", str(run_toml), "--servers", ",".join(targets)]
    argv += ["--name", f"worker-{m}", "--rank", str(m), *log_flags(args.log_level, args.log_format)]
    argv += ["--metrics-port", str(metrics_port)]
    argv += ["--summary", str(out / f"worker-{m}.json")]
    argv += ["--checkpoint", str(out / f"worker-{m}.pt")]
    if args.save_global:
        argv += ["--save-global", str(out / f"worker-{m}-global.pt")]
    if creds:
        argv += creds.worker_flags(m)
    return argv


def _watch(cluster: Cluster, workers: list[subprocess.Popen], out: Path) -> bool:
    """Wait for the workers to end; False (said in the log) as soon as a worker fails or a shard stops
    (the others would wait for it for ever: rounds need every worker), or when a worker ended badly."""
    while any(w.poll() is None for w in workers):
        failed = [f"worker-{m}" for m, w in enumerate(workers) if w.poll() not in (None, 0)]
        failed += [
            name for name, p in cluster.procs.items() if name.startswith("shard") and p.poll() is not None
        ]
        if failed:
            log.error("%s stopped; stopping everything; see %s/*.log", ", ".join(failed), out)
            return False
        time.sleep(0.2)
    codes = [w.returncode for w in workers]
    if any(codes):
        log.error("a worker failed (exit statuses %s); see %s/*.log", codes, out)
        return False
    return True


def _save_global(out: Path, targets: list[str], creds: Credentials | None) -> None:
    """--save-global: the shards' masters (masters.pt) and the model (model.safetensors, as `export`)."""
    import torch

    from streamdiloco.common.globalmodel import from_servers, write_safetensors
    from streamdiloco.common.tls import ClientTLS

    token, tls = "", None
    if creds:  # worker-0's credentials: Fetch needs a worker's
        cert, key, token_file = creds.worker_files(0)
        token, tls = token_file.read_text().strip(), ClientTLS(str(creds.ca), str(cert), str(key))
    # checked as `streamdiloco export` checks a live run: one run, each fragment's slices of one round
    global_model = from_servers(targets, token, tls)
    torch.save(global_model.vectors, out / "masters.pt")
    write_safetensors(global_model.tensors(), out / "model.safetensors", global_model.metadata())


def _report(out: Path, workers: int, statuses: list[dict], wall: float) -> int:
    """summary.json and the summary (a table, or one record with --log-format json); 0 when every
    worker's mirror equals the shards' masters."""
    summary = summarize(
        [json.loads((out / f"worker-{m}.json").read_text()) for m in range(workers)], statuses, wall
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if json_logs():  # one record: a collector parses it; the table is for people
        log.info("summary", extra={"summary": summary})
    else:
        say(format_summary(summary))
    log.info("wrote %s and the processes' logs in %s", out / "summary.json", out)
    return 0 if summary["mirrors_match_masters"] else 1


def summarize(workers: list[dict], statuses: list[dict], wall: float) -> dict:
    masters = [
        [st["fragments"][f]["master_hash"] for st in statuses] for f in range(len(statuses[0]["fragments"]))
    ]
    return {
        "wall_seconds": wall,
        "workers": workers,
        "global_eval_loss_start": workers[0]["eval_loss_start"],
        "global_eval_loss": workers[0]["eval_loss"],
        "tokens": sum(w["tokens"] for w in workers),
        "master_hashes": masters,
        "mirrors_match_masters": all(w["mirror_hashes"] == masters for w in workers),
        "shards": [
            {
                k: st[k]
                for k in (
                    "shard",
                    "rounds_closed",
                    "pushes_accepted",
                    "pushes_refused",
                    "bytes",
                    "round_seconds",
                )
            }
            for st in statuses
        ],
    }


def format_summary(s: dict) -> str:
    lines = [
        "",
        f"Summary: {len(s['workers'])} workers, {len(s['shards'])} shards, {s['wall_seconds']:.0f}s wall",
        f"  eval loss of the global parameters: {s['global_eval_loss_start']:.4f} at the start, "
        f"{s['global_eval_loss']:.4f} at the end",
        f"  tokens trained: {s['tokens']:,}",
        "",
        f"  {'worker':<10} {'eval loss':>9} {'tokens':>11} {'sent B':>12} {'received B':>12} "
        f"{'blocked s':>9} {'waited':>7} {'compute':>8}",
    ]
    for w in s["workers"]:
        lines.append(
            f"  {w['worker']:<10} {w['eval_loss']:>9.4f} {w['tokens']:>11,} {w['bytes_sent']:>12,} "
            f"{w['bytes_received']:>12,} {w['blocked_seconds']:>9.2f} "
            f"{w['merges_that_waited']:>3}/{w['merges']:<3} {100 * w['compute_utilization']:>7.0f}%"
        )
    for sh in s["shards"]:
        b = sh["bytes"]
        lines.append(
            f"  shard {sh['shard']}: {sh['rounds_closed']} rounds closed, {sh['pushes_accepted']} pushes, "
            f"{b['codec_in']:,} B in ({b['message_bytes_in']:,} B of messages), {b['codec_out']:,} B out "
            f"({b['message_bytes_out']:,} B of messages)"
        )
        rs = sh["round_seconds"]
        if rs["rounds"]:
            lines.append(
                f"           rounds open from the first whole push to the close: median {rs['median']:.3f}s, "
                f"max {rs['max']:.3f}s (of the last {rs['rounds']})"
            )
    lines.append(
        "  (waited: merges whose update had not arrived when the worker needed it, mostly because a round "
        "waits for the workers it expects (or a quorum of them and a grace); compute: share of the "
        "training time spent in forward, backward and optimizer steps)"
    )
    ok = "yes, bit for bit" if s["mirrors_match_masters"] else "NO"
    lines.append(f"  every worker's mirror equals the shards' masters: {ok}")
    return "\n".join(lines)
