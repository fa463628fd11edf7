"""What TLS costs on the wire: a shard process served plaintext and one served with mutual TLS (credentials
from `streamdiloco certs`), both on loopback; from this process, the time of a Join (a new connection
each: handshake included, and on one open channel) and the throughput of a Fetch of every master slice.

    python -m benchmarks.tls [--model tiny] [--repeats 5] [--out benchmarks/results/tls]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Session, say, start_shards


def measure(target: str, model: str, repeats: int, tls, token: str) -> dict:
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.common.fingerprint import model_fingerprint
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.common.modelspec import build_model
    from streamdiloco.common.wire import PROTOCOL, auth_metadata, make_channel
    from streamdiloco.export import fetch_masters
    from streamdiloco.protos import streamdiloco_pb2 as pb
    from streamdiloco.protos import streamdiloco_pb2_grpc as pb_grpc

    cfg = SyncConfig()
    fp = json.dumps(model_fingerprint(build_layout(build_model(model, 0, None), cfg.num_fragments), cfg))
    request = pb.JoinRequest(worker="w0", fingerprint_json=fp, protocol=PROTOCOL)
    cold, warm = [], []
    for _ in range(repeats):  # a new channel each time: TCP and TLS handshakes included
        with make_channel(target, tls) as ch:
            t0 = time.perf_counter()
            pb_grpc.ShardStub(ch).Join(
                request, metadata=auth_metadata(token), timeout=30, wait_for_ready=True
            )
            cold.append(time.perf_counter() - t0)
    with make_channel(target, tls) as ch:
        stub = pb_grpc.ShardStub(ch)
        stub.Join(request, metadata=auth_metadata(token), timeout=30, wait_for_ready=True)
        for _ in range(repeats):
            t0 = time.perf_counter()
            stub.Join(request, metadata=auth_metadata(token), timeout=30)
            warm.append(time.perf_counter() - t0)
    fetch, nbytes = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        masters = fetch_masters([target], token, tls=tls)
        fetch.append(time.perf_counter() - t0)
        nbytes = sum(m.numel() * 4 for m in masters)
    return {
        "join_new_connection_ms": 1e3 * statistics.median(cold),
        "join_open_channel_ms": 1e3 * statistics.median(warm),
        "fetch_bytes": nbytes,
        "fetch_seconds": statistics.median(fetch),
        "fetch_mb_per_s": nbytes / statistics.median(fetch) / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/tls")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]  # other work on the machine moves these numbers: said beside them
    with Session("tls", argv, Path(args.out)) as s:
        results = {}
        for label, (flags, tls) in setups(s.tmp / "certs").items():
            tag = label.split(",")[0].replace(" ", "-")
            flags = ["--model", args.model, *flags]
            [(_, proc, ports)] = start_shards(s.procs, s.tmp, tag, 1, flags, checkpoint=False, timeout=120)
            target = f"127.0.0.1:{ports['grpc_port']}"
            try:
                results[label] = measure(target, args.model, args.repeats, tls, token(s.tmp / "certs"))
            finally:
                s.procs.stop(proc, timeout=30)
            say(f"{label} {json.dumps(results[label])}")
        s.results.update(model=args.model, load_average=load, results=results)
    md = [
        f"TLS cost on loopback, model {args.model}, median of {args.repeats}; load average {load:.1f} when "
        "it started.",
        "",
        "| setup | Join, new connection (ms) | Join, open channel (ms) | Fetch of all masters (MB/s) |",
        "|---|---:|---:|---:|",
    ]
    for label, r in s.results.get("results", {}).items():
        md.append(
            f"| {label} | {r['join_new_connection_ms']:.1f} | {r['join_open_channel_ms']:.1f} | "
            f"{r['fetch_mb_per_s']:.0f} ({r['fetch_bytes'] / 1e6:.1f} MB) |"
        )
    return s.finish(md)


def token(certs: Path) -> str:
    """Worker w0's token, as `setups` made it."""
    return (certs / "workers" / "w0.token").read_text().strip()


def setups(certs: Path) -> dict[str, tuple[list[str], Any]]:
    """The two setups measured, by label: the shard's flags and the worker's TLS (None: plaintext); makes
    the certificates (and w0's token) in `certs`."""
    from streamdiloco.certs import make_certs
    from streamdiloco.common.tls import ClientTLS

    make_certs(certs, None, ["w0"])
    return {
        "plaintext, run token": (["--token", token(certs)], None),
        "mutual TLS, worker token": (
            [
                *("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")),
                *("--tls-client-ca", str(certs / "ca.pem"), "--workers-file", str(certs / "workers.txt")),
            ],
            ClientTLS(
                str(certs / "ca.pem"),
                str(certs / "workers" / "w0.pem"),
                str(certs / "workers" / "w0.key"),
            ),
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
