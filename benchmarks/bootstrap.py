"""The first worker's upload of the starting parameters to a shard started with `--init from-worker` (issue
37): what a trickling uploader gets for its bytes, and what an honest upload over a slow home link takes.

The shard holds its only upload slot at a pace (server/edge/initialize.py's `Pace`): values within
--init-timeout seconds of the last ones, and, once the first --init-timeout seconds have passed, an average
of --init-min-rate bytes of values a second. Two measurements of that rule:

trickle  A shard process on loopback and an uploader of our own that sends the first message (a real
         fingerprint and init hash of --model) and then --values values every --every seconds, fragment by
         fragment, never the last chunk, for at most --limit seconds (its call's deadline). Reported: how
         long the shard held the slot (from its own log lines: the upload's start to its refusal), when and
         how the call ended on the client's side, the bytes of values it cost, and what the rule says (the
         shard's `Pace` run over the same messages). At the defaults (one value every 29 s, just inside
         --init-timeout 30) the slot is lost once the first 30 s have passed; `--every 1 --values 4000
         --model tiny` trickles 16,000 bytes a second, just below the 16,384 floor.
upload   An honest `streamdiloco worker` uploads --model's parameters over --rate Mbit/s each way (the WAN
         benchmark's testbed, benchmarks/wan/: tbf on both ends of the worker's link behind a modem queue of
         --queue-ms, its delaying proxy for round trips of twice --delay-ms) to a shard at the given
         --init-timeout and --init-min-rate. Reported: the upload's bytes, seconds and rate from the shard's
         log lines, the longest the rule lets an upload of that size hold the slot, and the margin between
         the two. The worker is stopped once the shard has the parameters. Needs root, iproute2 and nftables
         (scripts/system-deps.sh wan); every namespace it makes is removed at the end, on an error and on
         Ctrl+C, and leftovers of a killed run of this benchmark are removed at the start.

    python -m benchmarks.bootstrap trickle                 # one value every 29 s: about 35 s
    python -m benchmarks.bootstrap trickle --every 1 --values 4000 --model tiny
    python -m benchmarks.bootstrap upload --model small    # root; about 4 minutes at 1 Mbit/s

Writes results.json, results.md and run.log under --out (default benchmarks/results/bootstrap/MODE).
Everything it starts runs in a scratch folder of its own, and every process is stopped when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks.harness import (
    RESULTS,
    ROOT,
    Procs,
    Session,
    loadavg,
    netns,
    say,
    sd,
    start_shards,
    wait_files,
)
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.common.inithash import init_hash
from streamdiloco.common.wire import values_to_bytes
from streamdiloco.protos import streamdiloco_pb2 as pb
from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc
from streamdiloco.server.config import INIT_MIN_RATE, INIT_TIMEOUT
from streamdiloco.server.edge.initialize import Pace
from streamdiloco.worker.model import build_gpt

UPLOADER = "trickler"  # the trickle's worker name, as the shard's log lines say it
PROGRESS = 5.0  # seconds between progress lines
BEGAN = "is sending the starting parameters"  # the shard's log line when an upload takes the slot
TOOK = "took the layout"  # ... when it has the parameters
SIZE = re.compile(r"\(([\d,]+) bytes for this shard\)")


def count(n: int, noun: str) -> str:
    """'1 value', '2 values'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


# --- the shard's log lines --------------------------------------------------------------------------------
def stamp(line: str) -> float:
    """A shard log line's time (its first field, ISO 8601), as a Unix time."""
    return datetime.fromisoformat(line.split()[0]).timestamp()


def first_line(log: Path, words: str) -> str | None:
    """The first line of `log` that holds `words`, or None."""
    if not log.exists():
        return None
    return next((x for x in log.read_text(errors="replace").splitlines() if words in x), None)


def declared_bytes(line: str) -> int:
    """The bytes of values an upload declared, from the shard's BEGAN line."""
    m = SIZE.search(line)
    if m is None:
        raise ValueError(f"no size in the shard's line: {line!r}")
    return int(m[1].replace(",", ""))


# --- trickle ------------------------------------------------------------------------------------------------
@dataclass
class Starting:
    """A model's starting parameters, as an uploader sends them: fingerprint, init hash, values."""

    fingerprint: str
    init_hash: str
    digests: list[bytes]
    vectors: list[torch.Tensor]

    @property
    def total_bytes(self) -> int:
        return 4 * sum(v.numel() for v in self.vectors)


def starting(model: str, cfg: SyncConfig) -> Starting:
    """--model's starting parameters (seed 0) in `cfg`'s fragments, for a single shard."""
    torch.manual_seed(0)
    net = build_gpt(model)
    layout = build_layout(net, cfg.num_fragments)
    vectors = [flatten(fragment_params(net, f)) for f in layout.fragments]
    digest, digests = init_hash(layout, vectors, 1)
    return Starting(json.dumps(model_fingerprint(layout, cfg)), digest, digests, vectors)


def rule_hold(pace: Pace, every: float, message_bytes: int, total_bytes: int) -> float:
    """Seconds the shard's rule lets a trickle hold the slot: its first message at 0, then `message_bytes`
    of values every `every` s until `total_bytes` are sent (the last chunk never), each taken while it
    comes before the upload is due (`Pace.due`, as the shard computes it)."""
    last = 0.0
    received, k = 0, 1
    while True:
        due = pace.due(0.0, last, received)
        if received >= total_bytes or k * every >= due:
            return due
        received, last, k = min(total_bytes, received + message_bytes), k * every, k + 1


@dataclass
class Trickled:
    """What the trickle sent so far (written by gRPC's thread, read for the progress lines)."""

    messages: int = 0
    value_bytes: int = 0
    exhausted: bool = False  # every value sent but the last chunk's: the call waits, sending nothing


def trickle_messages(
    up: Starting, every: float, values: int, stop: threading.Event, sent: Trickled
) -> Iterator[pb.InitChunk]:
    """The trickle's messages: the first (fingerprint and hashes), then `values` values of each fragment in
    order every `every` s, until `stop`; never the last chunk."""
    yield pb.InitChunk(
        worker=UPLOADER, fingerprint_json=up.fingerprint, init_hash=up.init_hash, slice_hashes=up.digests
    )
    for f, vec in enumerate(up.vectors):
        for i in range(0, vec.numel(), values):
            if stop.wait(every):
                return
            chunk = values_to_bytes(vec[i : i + values])
            sent.messages, sent.value_bytes = sent.messages + 1, sent.value_bytes + len(chunk)
            yield pb.InitChunk(fragment=f, offset=i, values=chunk)
    sent.exhausted = True
    stop.wait()


def trickle_call(port: int, up: Starting, args: argparse.Namespace) -> dict[str, Any]:
    """Run one trickle against the shard on `port` until its call ends (or --limit): how it ended, when."""
    stop, sent = threading.Event(), Trickled()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    messages = trickle_messages(up, args.every, args.values, stop, sent)
    t0 = time.monotonic()
    call = pb_grpc.ShardStub(channel).Initialize.future(messages, timeout=args.limit)
    code, details = "OK", ""
    try:
        while True:
            try:
                call.result(timeout=PROGRESS)
                break
            except grpc.FutureTimeoutError:
                say(
                    f"[trickle] {time.monotonic() - t0:5.1f} s: {count(sent.messages, 'message')}, "
                    f"{sent.value_bytes:,} bytes of values sent"
                    f"{' (all but the last chunk: waiting)' if sent.exhausted else ''}; the call is open"
                )
    except grpc.RpcError as e:
        code, details = e.code().name, e.details() or ""
    finally:
        stop.set()
        channel.close()
    ended = time.monotonic() - t0
    say(f"[trickle] the call ended after {ended:.1f} s (client's side): {code}: {details}")
    return {"client_seconds": ended, "client_status": code, "details": details, **asdict(sent)}


def trickle(s: Session, args: argparse.Namespace) -> dict[str, Any]:
    """The trickle part: a shard process, one trickle against it; its figures."""
    cfg = SyncConfig()
    up = starting(args.model, cfg)
    pace = Pace(args.init_timeout, args.init_min_rate)
    rule = rule_hold(pace, args.every, 4 * args.values, up.total_bytes)
    say(
        f"[trickle] {args.model}: {up.total_bytes:,} bytes of values; {count(args.values, 'value')} every "
        f"{args.every:g} s ({4 * args.values / args.every:,.1f} bytes a second); the rule lets it hold the "
        f"slot {rule:.1f} s"
    )
    flags = ["--init", "from-worker", "--sync-every", str(cfg.sync_every)]
    flags += ["--num-fragments", str(cfg.num_fragments)]
    flags += ["--init-timeout", f"{args.init_timeout:g}", "--init-min-rate", f"{args.init_min_rate:g}"]
    (name, p, ports), *_ = start_shards(s.procs, s.tmp, "bootstrap", 1, flags)
    say(f"[trickle] the shard serves on port {ports['grpc_port']}: trickling (at most {args.limit:g} s)")
    try:
        ended = trickle_call(ports["grpc_port"], up, args)
    finally:
        s.procs.stop(p, timeout=30)
    log = s.tmp / f"{name}.log"
    began, refused = first_line(log, BEGAN), first_line(log, f"refused {UPLOADER}")
    # the client's own deadline also ends the call (the shard then logs "ended before its last chunk"): the
    # slot was held to the end, not taken back
    by_deadline = ended["client_seconds"] >= args.limit - 0.5
    held = stamp(refused) - stamp(began) if began and refused and not by_deadline else None
    return {
        "model": args.model,
        "every": args.every,
        "values": args.values,
        "limit": args.limit,
        "init_timeout": args.init_timeout,
        "init_min_rate": args.init_min_rate,
        "declared_bytes": declared_bytes(began) if began else up.total_bytes,
        "rule_seconds": rule,
        "held_seconds": held,
        "refusal": refused.split(": ", 2)[-1] if refused and not by_deadline else None,
        "ended_by": "the client's --limit" if by_deadline else "the shard",
        **ended,
    }


def trickle_table(r: dict[str, Any]) -> list[str]:
    held = "to the end" if r["held_seconds"] is None else f"{r['held_seconds']:.2f}"
    bound = r["init_timeout"] + r["declared_bytes"] / r["init_min_rate"]
    return [
        "| model | trickle | bytes of values sent | the rule says s | the shard held the slot s "
        "| the call ended after s | status (ended by) |",
        "|---|---|---|---|---|---|---|",
        f"| {r['model']} | {count(r['values'], 'value')} every {r['every']:g} s | {r['value_bytes']:,} | "
        f"{r['rule_seconds']:.2f} | {held} | {r['client_seconds']:.1f} | "
        f"{r['client_status']} ({r['ended_by']}) |",
        "",
        f"--init-timeout {r['init_timeout']:g} s, --init-min-rate {r['init_min_rate']:g} bytes a second: an "
        f"upload of this model ({r['declared_bytes']:,} bytes) holds the slot at most {bound:.0f} s. The "
        f"shard said: {r['refusal'] or '(no refusal before the call ended)'}",
    ]


# --- upload: an honest worker over a slow link ------------------------------------------------------------
def start_link(s: Session, args: argparse.Namespace, prefix: str) -> Any:
    """The testbed of one worker under `prefix`, shaped, with the worker's delaying proxy running."""
    from benchmarks import wan
    from benchmarks.wan import PROXY_PORT, in_ns, proxy_limit, wan_py

    s.cleanup(lambda: wan.Testbed.remove_all(prefix))
    if gone := wan.Testbed.remove_all(prefix):
        say(f"[upload] removed the leftovers of an earlier run: {', '.join(gone)}")
    bed = wan.Testbed(1, prefix=prefix)
    bed.create()
    bed.shape(args.rate, args.queue_ms / 1e3)
    delay = args.delay_ms / 1e3
    ready = s.tmp / "proxy.ready"
    argv = wan_py("_proxy", "--port", str(PROXY_PORT), "--delay", str(delay))
    argv += ["--limit", str(proxy_limit(delay, args.rate)), "--ready", str(ready)]
    proxy = s.procs.start("proxy", in_ns(bed.ns[0], *argv))
    wait_files(s.procs, [ready], [("proxy", proxy)], timeout=120)
    say(
        f"[upload] testbed: shard in {bed.dc}, worker in {bed.ns[0]}; {args.rate:g} Mbit/s each way, "
        f"a {args.queue_ms:g} ms queue, {2 * args.delay_ms:g} ms round trips"
    )
    return bed


def wait_upload(procs: Procs, bed: Any, shard_log: Path, worker: Any, timeout: float) -> None:
    """Until the shard has the parameters (or the worker exits, or `timeout`), a progress line every 10 s."""
    t0 = time.monotonic()
    said = t0
    while first_line(shard_log, TOOK) is None and worker.poll() is None:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(
                f"no upload after {timeout:g} s:\n{procs.tail('shard')}\n{procs.tail('worker')}"
            )
        if time.monotonic() - said >= 10:
            said = time.monotonic()
            up = bed.counters(0)["tx"]
            say(f"[upload] {said - t0:5.0f} s: {up:,} bytes up through the worker's link")
        time.sleep(0.5)


def upload(s: Session, args: argparse.Namespace) -> dict[str, Any]:
    """The upload part: the testbed, the shard, one worker; the upload's figures from the shard's log."""
    from benchmarks.wan import DC_ADDR, SHARD_PORT, in_ns

    bed = start_link(s, args, f"sdlboot{os.getpid() % 100_000}-")
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    ready = s.tmp / "shard.ready"
    argv = sd("server", "--host", DC_ADDR, "--port", str(SHARD_PORT), "--http-port", "0", "--insecure")
    argv += ["--init", "from-worker", "--checkpoint-dir", str(s.tmp / "shard-checkpoint"), "--fresh"]
    argv += ["--init-timeout", f"{args.init_timeout:g}", "--init-min-rate", f"{args.init_min_rate:g}"]
    shard = s.procs.start("shard", in_ns(bed.dc, *argv, "--ready-file", str(ready)), env_extra=env)
    wait_files(s.procs, [ready], [("shard", shard)], timeout=180)
    argv = sd("worker", "--servers", f"{DC_ADDR}:{SHARD_PORT}", "--name", "home", "--model", args.model)
    argv += ["--steps", "1", "--eval-every", "0", "--checkpoint-every", "0"]
    argv += ["--checkpoint", str(s.tmp / "worker.pt")]
    t0 = time.time()
    worker = s.procs.start("worker", in_ns(bed.ns[0], *argv), env_extra=env)
    say(f"[upload] the shard serves; the worker ({args.model}) is starting")
    shard_log = s.tmp / "shard.log"
    wait_upload(s.procs, bed, shard_log, worker, args.timeout)
    began, took = first_line(shard_log, BEGAN), first_line(shard_log, TOOK)
    if began is None or took is None:
        raise RuntimeError(
            f"the worker exited ({worker.returncode}) before the shard had the parameters:\n"
            f"{s.procs.tail('shard')}\n{s.procs.tail('worker')}"
        )
    s.procs.stop(worker)
    size, seconds = declared_bytes(began), stamp(took) - stamp(began)
    bound = args.init_timeout + size / args.init_min_rate
    say(f"[upload] {size:,} bytes in {seconds:.1f} s")
    return {
        "model": args.model,
        "rate_mbit": args.rate,
        "queue_ms": args.queue_ms,
        "round_trip_ms": 2 * args.delay_ms,
        "init_timeout": args.init_timeout,
        "init_min_rate": args.init_min_rate,
        "bytes": size,
        "upload_seconds": seconds,
        "bytes_per_second": size / seconds,
        "rule_bound_seconds": bound,
        "margin": bound / seconds,
        "worker_start_to_upload_seconds": stamp(began) - t0,
    }


def upload_table(r: dict[str, Any]) -> list[str]:
    return [
        "| model | link | bytes for the shard | upload s | bytes/s | Mbit/s | the rule allows s | margin "
        "| worker start to upload s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['model']} | {r['rate_mbit']:g} Mbit/s, {r['round_trip_ms']:g} ms RTT, "
        f"{r['queue_ms']:g} ms queue | {r['bytes']:,} | {r['upload_seconds']:.1f} | "
        f"{r['bytes_per_second']:,.0f} | {8 * r['bytes_per_second'] / 1e6:.3f} | "
        f"{r['rule_bound_seconds']:.0f} | {r['margin']:.1f}x | "
        f"{r['worker_start_to_upload_seconds']:.1f} |",
        "",
        f"The rule allows --init-timeout {r['init_timeout']:g} s + the bytes / --init-min-rate "
        f"{r['init_min_rate']:g}; the margin is how many times the upload's own time that is.",
    ]


# --- the command line ---------------------------------------------------------------------------------------
def positive(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number, got {text}")
    return value


def mode_doc(mode: str) -> str:
    """The module docstring's paragraph on MODE, for its --help."""
    lines = __doc__.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(f"{mode} "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 9))
    return "\n".join(x.removeprefix(mode).strip() for x in lines[start:end])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bootstrap",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="mode", required=True, metavar="MODE")
    t = sub.add_parser(
        "trickle",
        help="a trickling uploader against a shard on loopback (about 35 s)",
        description=mode_doc("trickle"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--every", type=positive, default=29.0, help="seconds between value messages (29)")
    t.add_argument("--values", type=int, default=1, help="values (4 bytes each) in a message (1)")
    t.add_argument("--limit", type=positive, default=150.0, help="the call's deadline, seconds (150)")
    t.add_argument("--model", default="nano", choices=["nano", "tiny", "small"], help="whose values (nano)")
    u = sub.add_parser(
        "upload",
        help="an honest worker's upload over a shaped link (root; minutes)",
        description=mode_doc("upload"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    u.add_argument("--model", default="small", choices=["tiny", "small"], help="the worker's model (small)")
    u.add_argument("--rate", type=positive, default=1.0, help="Mbit/s each way (1)")
    u.add_argument("--delay-ms", type=float, default=25.0, help="one way's delay, ms: RTT twice it (25)")
    u.add_argument("--queue-ms", type=positive, default=1000.0, help="ms of the rate the modem queues (1000)")
    u.add_argument("--timeout", type=positive, default=1800.0, help="seconds to wait for the upload (1800)")
    for p, mode in ((t, "trickle"), (u, "upload")):
        p.add_argument(
            "--init-timeout",
            type=positive,
            default=INIT_TIMEOUT,
            help="the shard's --init-timeout, seconds (%(default)g, its default)",
        )
        p.add_argument(
            "--init-min-rate",
            type=positive,
            default=INIT_MIN_RATE,
            help="the shard's --init-min-rate, bytes of values a second (%(default)g, its default)",
        )
        p.add_argument("--keep", action="store_true", help="keep the processes' logs (a scratch folder)")
        out = RESULTS / "bootstrap" / mode
        p.add_argument("--out", type=Path, default=out, help=f"results folder ({out.relative_to(ROOT)})")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.mode == "trickle" and args.values < 1:
        parser().error("--values must be at least 1")
    if args.mode == "upload" and (why := netns.missing(("ip", "tc", "nft"))):
        print(f"upload: {why}", file=sys.stderr)
        return 2
    md: list[str] = []
    held: float | None = None
    with Session("bootstrap", argv, args.out, keep=args.keep, report_errors=True) as s:
        say(f"load average {loadavg()}")
        result = trickle(s, args) if args.mode == "trickle" else upload(s, args)
        s.results.update(mode=args.mode, **result)
        table = trickle_table(result) if args.mode == "trickle" else upload_table(result)
        md = [f"Command: `{s.command}`", "", *table]
        held = result.get("held_seconds")
    # a trickle that kept the slot until its deadline: the rule did not hold (status 1)
    return s.finish(md, status=1 if args.mode == "trickle" and held is None else 0)


if __name__ == "__main__":
    sys.exit(main())
